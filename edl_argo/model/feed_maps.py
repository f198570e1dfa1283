"""The model file's per-record maps, run on the thread that asks for the element.

A ``feed`` typically maps one function over every record (parse an example, decode an image, scale it).
TensorFlow's ``Dataset.map`` runs each call of that function through its inter-op thread pool: every op of
the function is handed to a pool thread and its end handed back, for every record. For a function of a
few cheap ops those hand-offs are most of the cost: a worker's training stream of the digits records
(``parse_single_example``, then a division) took 1.7 ms of CPU per minibatch of 64 that way and 0.3 ms with
the maps on the calling thread (``docs/profile.md``), CPU that a training step on two cores shares with its
compute.

Within :func:`maps_on_the_calling_thread`, a ``Dataset.map`` called on that thread without
``num_parallel_calls`` builds TensorFlow's sequential map with ``use_inter_op_parallelism=False`` (as
tf.data builds its own internal maps): the function's ops run one after the other on the thread that asks
for the element. What the map computes is the same; tf.data's static optimizations still apply (its map
parallelization may still spread records over threads). A map given ``num_parallel_calls`` is TensorFlow's
parallel map, as asked for, and so is every map built on other threads or outside the context.

TensorFlow has no public option for this: ``Dataset.map`` is wrapped once, on first use of the context,
and the wrapper does what TensorFlow does unless the calling thread is inside the context. If TensorFlow's
private map class changes, nothing is wrapped and maps are TensorFlow's own.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf

_state = threading.local()
_install_lock = threading.Lock()
_installed = False


@contextmanager
def maps_on_the_calling_thread() -> Iterator[None]:
    """On this thread, for the duration: ``Dataset.map`` without ``num_parallel_calls`` runs its function on
    the thread asking for the element (see the module docstring). Nests."""
    _install()
    outer = getattr(_state, "inline", False)
    _state.inline = True
    try:
        yield
    finally:
        _state.inline = outer


def _sequential_map_class() -> Callable[..., tf.data.Dataset] | None:
    """TensorFlow's sequential map dataset class, if it takes ``use_inter_op_parallelism``."""
    try:
        from tensorflow.python.data.ops import map_op
    except ImportError:
        return None
    map_class = getattr(map_op, "_MapDataset", None)
    if map_class is None or "use_inter_op_parallelism" not in inspect.signature(map_class).parameters:
        return None
    return map_class


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
        map_class = _sequential_map_class()
        if map_class is None:
            return
        original = tf.data.Dataset.map

        @functools.wraps(original)
        def map(
            self: tf.data.Dataset,
            map_func: Callable[..., Any],
            num_parallel_calls: int | None = None,
            deterministic: bool | None = None,
            *args: Any,
            **kwargs: Any,
        ) -> tf.data.Dataset:
            plain = num_parallel_calls is None and deterministic is None and not args
            if plain and getattr(_state, "inline", False) and kwargs.keys() <= {"name", "synchronous"}:
                return map_class(
                    self,
                    map_func,
                    force_synchronous=bool(kwargs.get("synchronous")),
                    use_inter_op_parallelism=False,
                    preserve_cardinality=True,
                    name=kwargs.get("name"),
                )
            return original(self, map_func, num_parallel_calls, deterministic, *args, **kwargs)

        tf.data.Dataset.map = map
