"""Importing TensorFlow without what no edl-argo process uses of it."""

from __future__ import annotations

import sys


def import_tensorflow() -> None:
    """Import TensorFlow with scikit-learn hidden from it, then visible again.

    Keras (loaded with TensorFlow) imports scikit-learn, and through it SciPy's statistics, for its
    scikit-learn wrappers (``keras.wrappers``): 1.2 s of a core, a fifth of TensorFlow's import, in every
    process that loads a model (the master and every pod), though none uses those wrappers. Hidden, Keras
    defines them without scikit-learn (using one then says scikit-learn is missing); a model file that
    imports scikit-learn itself, after this, still gets it. Does nothing more than ``import tensorflow``
    when either is imported already.
    """
    hidden = "sklearn" not in sys.modules
    if hidden:
        sys.modules["sklearn"] = None  # type: ignore[assignment]  # the import system's "not installed"
    try:
        import tensorflow  # noqa: F401
    finally:
        if hidden and sys.modules.get("sklearn", ...) is None:
            del sys.modules["sklearn"]
