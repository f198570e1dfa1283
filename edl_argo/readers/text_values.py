"""How a text value (a CSV field, a label) is typed: the rules ``edl-argo data convert`` and the CSV and
image-folder readers share.

* An integer is an optional sign and ASCII digits; a decimal number is ``1.5``, ``-2e3``, ``.25`` and the
  like. ``nan``, ``inf``, ``1_000`` or ``0x10`` are not numbers. Callers strip surrounding spaces.
* A column is int64 when every value is an integer in int64's range, else float32 when every value is a
  decimal number that float32 holds, else text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
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
