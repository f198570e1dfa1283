"""How a text value (a CSV field, a label) is typed: the rules ``edl-argo data convert`` and the CSV and
image-folder readers share.

* An integer is an optional sign and ASCII digits; a decimal number is ``1.5``, ``-2e3``, ``.25`` and the
  like. ``nan``, ``inf``, ``1_000`` or ``0x10`` are not numbers. Callers strip surrounding spaces.
* A column is int64 when every value is an integer in int64's range, else float32 when every value is a
  decimal number that float32 holds, else text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# A whole column of values, one per line, each with the spaces around it that callers would strip.
_INT_COLUMN = re.compile(rf"[ \t]*{_INT.pattern}[ \t]*(?:\n[ \t]*{_INT.pattern}[ \t]*)*")
_FLOAT_COLUMN = re.compile(rf"[ \t]*{_FLOAT.pattern}[ \t]*(?:\n[ \t]*{_FLOAT.pattern}[ \t]*)*")
_INT64 = np.iinfo(np.int64)
_INT32 = np.iinfo(np.int32)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT64_MAX = float(np.finfo(np.float64).max)
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def fits_int64(text: str) -> bool:
    return bool(_INT.fullmatch(text)) and _INT64.min <= int(text) <= _INT64.max


def fits_int32(text: str) -> bool:
    return bool(_INT.fullmatch(text)) and _INT32.min <= int(text) <= _INT32.max


def fits_float32(text: str) -> bool:
    return bool(_FLOAT.fullmatch(text)) and abs(float(text)) <= _FLOAT32_MAX


def fits_float64(text: str) -> bool:
    return bool(_FLOAT.fullmatch(text)) and abs(float(text)) <= _FLOAT64_MAX


def fits_bool(text: str) -> bool:
    return text.lower() in _TRUE + _FALSE


def _bool(text: str) -> bool:
    return text.lower() in _TRUE


#: Column type (:data:`~edl_argo.readers.base.COLUMN_TYPES`) -> (does a stripped text value fit it, its
#: value). Strings take any text as it is.
PARSERS: dict[str, tuple[Callable[[str], bool], Callable[[str], object]]] = {
    "int64": (fits_int64, int),
    "int32": (fits_int32, int),
    "float32": (fits_float32, float),
    "float64": (fits_float64, float),
    "bool": (fits_bool, _bool),
}


def column_values(texts: Sequence[str], dtype: str) -> np.ndarray | None:
    """``texts`` (surrounding spaces and tabs allowed) as a numeric array of ``dtype`` (a :data:`PARSERS`
    type) when every one fits it, checked a column at a time (one regular-expression match over the joined
    column); None when one does not fit, or for ``bool``: the caller then checks value by value
    (:data:`PARSERS`) to name the first that does not."""
    if not texts:
        return np.empty(0, dtype=dtype)
    joined = "\n".join(texts)
    if dtype in ("int64", "int32"):
        if not _INT_COLUMN.fullmatch(joined):
            return None
        limits = _INT64 if dtype == "int64" else _INT32
        try:
            values = np.array(list(map(int, texts)), dtype=np.int64)
        except OverflowError:
            return None
        if values.min() < limits.min or values.max() > limits.max:
            return None
        return values.astype(dtype)
    if dtype in ("float32", "float64") and _FLOAT_COLUMN.fullmatch(joined):
        values = np.array(list(map(float, texts)), dtype=np.float64)
        limit = _FLOAT32_MAX if dtype == "float32" else _FLOAT64_MAX
        if not np.all(np.abs(values) <= limit):
            return None
        return values.astype(dtype)
    return None


def infer_type(values: Iterable[str]) -> str:
    """``int64``, ``float32`` or ``string``: the narrowest type of the rules above that holds every
    (stripped) value; ``string`` for no values."""
    could_be_int = could_be_float = True
    seen = False
    for value in values:
        seen = True
        if could_be_int and not fits_int64(value):
            could_be_int = False
        if not could_be_int and not fits_float32(value):
            could_be_float = False
            break
    if not seen:
        return "string"
    return "int64" if could_be_int else "float32" if could_be_float else "string"


def list_option(value: Any) -> list[str]:
    """A list option given as ``"a,b,c"`` (``--data-options``) or as a JSON list."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return [str(name) for name in value]
