"""TEST-ONLY: Kubernetes resource quantities (``"500m"``, ``"2.5"``, ``"1Gi"``, ``"1G"``, ``"128974848"``,
``"1e3"``) as exact numbers, for the stand-in's scheduler."""

from __future__ import annotations

import re
from fractions import Fraction

#: Suffix -> multiplier: binary SI (Ki = 1024) and decimal SI (k = 1000, m = 1/1000), as the API reads them.
_SUFFIXES = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    **{
        suffix: Fraction(2 ** (10 * power))
        for power, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)
    },
}
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:[eE](?P<exponent>[+-]?\d+)|(?P<suffix>[KMGTPE]i|[numkMGTPE])?)$"
)


def parse_quantity(quantity: str | int | float) -> Fraction:
    """The exact value of a Kubernetes quantity (cpu in cores, memory in bytes): a decimal number with an
    optional binary-SI suffix (``Ki`` .. ``Ei``), decimal-SI suffix (``n u m k M G T P E``) or exponent
    (``e3``). A JSON number is read as its decimal text. ValueError for anything else."""
    text = str(quantity).strip()
    m = _QUANTITY.match(text)
    if m is None:
        raise ValueError(f"quantities must match the regular expression of a Kubernetes quantity: {text!r}")
    value = Fraction(m["number"])
    if m["exponent"] is not None:
        return value * Fraction(10) ** int(m["exponent"])
    return value * _SUFFIXES[m["suffix"] or ""]
