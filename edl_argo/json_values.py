"""JSON that strict readers accept: numpy values become plain numbers and lists, NaN and ±Infinity ``null``.

Python's ``json`` writes non-finite floats as the bare tokens ``NaN`` and ``Infinity``, which are not JSON.
Every JSON file and line edl-argo writes with numbers computed by a model (predictions, metrics) goes
through :func:`dumps`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["dumps", "json_data"]


def json_data(value: Any) -> Any:
    """``value`` with numpy arrays and scalars as lists and numbers, and non-finite floats as None."""
    if isinstance(value, Mapping):
        return {str(key): json_data(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return np.where(np.isfinite(value), value, None).tolist() if value.size else value.tolist()
        return json_data(value.tolist())
    if isinstance(value, np.generic):
        return json_data(value.item())
    if isinstance(value, list | tuple):
        return [json_data(item) for item in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`json_data` (``value``); never writes NaN or Infinity."""
    return json.dumps(json_data(value), allow_nan=False, **kwargs)
