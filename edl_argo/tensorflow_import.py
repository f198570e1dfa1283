"""Importing TensorFlow without what no edl-argo process uses of it, and without the collector's work."""

from __future__ import annotations

import gc
import sys


def import_tensorflow() -> None:
    """Import TensorFlow with scikit-learn hidden from it and Python's cyclic collector paused; then put
    every object the process holds, most of them the import's, out of the collector's reach.

    Keras (loaded with TensorFlow) imports scikit-learn, and through it SciPy's statistics, for its
    scikit-learn wrappers (``keras.wrappers``): 1.2 s of a core, a fifth of TensorFlow's import, in every
    process that loads a model (the master and every pod), though none uses those wrappers. Hidden, Keras
    defines them without scikit-learn (using one then says scikit-learn is missing); a model file that
    imports scikit-learn itself, after this, still gets it.

    The import makes about 450,000 objects (modules, functions, op definitions) that live as long as the
    process. With the collector running, it collected 600-660 times during the import, 5 of them over every
    object (0.4-0.5 s of the import's 2.2-2.3 s on a 2-core AMD EPYC), and each later full collection
    walked them all again (300,000 objects allocated after the import: 0.46 s, 0.06 s with them frozen).
    Paused during the import, and every object the process then holds moved to the permanent generation
    after it (``gc.freeze``: the import's, and what the process made before it, which in an edl-argo
    process is little), neither happens. The price: cycles among the frozen objects that become garbage
    are never freed (the import itself leaves 1,537 such objects; a caller that held many objects before
    may leave more). The collector is left as the caller had it.

    Does nothing when TensorFlow is imported already; scikit-learn imported already is not hidden.
    """
    if "tensorflow" in sys.modules:
        return
    hidden = "sklearn" not in sys.modules
    if hidden:
        sys.modules["sklearn"] = None  # type: ignore[assignment]  # the import system's "not installed"
    collecting = gc.isenabled()
    gc.disable()
    try:
        import tensorflow  # noqa: F401
    finally:
        if hidden and sys.modules.get("sklearn", ...) is None:
            del sys.modules["sklearn"]
        if "tensorflow" in sys.modules:
            gc.freeze()
        if collecting:
            gc.enable()
