"""Many arrays through one TensorFlow call as few tensors: the small ones of each dtype in one flat tensor.

Every argument of a TensorFlow function call costs tens of microseconds of dispatch, whatever its size,
and the small variables of a model (biases, normalization scales and statistics) are most of its variables:
a ResNet's 37 variables took 4.9-5.5 ms of a worker's step to install one by one, 2.8 ms as one buffer that
one call splits. A large array travels alone: copying it into a buffer would cost more than its dispatch.
Which arrays are small is the wire's rule (:func:`edl_argo.rpc.packed.group_small`).

:class:`PackedLayout` is the layout of one list of arrays: :meth:`~PackedLayout.pack` turns arrays into the
call's arguments outside the function and :meth:`~PackedLayout.unpack` turns them back inside.

The PS's update does not pack its arguments this way (splitting and joining inside the compiled update made
XLA's compilation 1 s longer): it holds the small variables packed instead
(:class:`~edl_argo.ps.optimizer.DenseOptimizer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from edl_argo.rpc.packed import group_small
from edl_argo.rpc.rope import as_tf_tensor


class PackedLayout:
    """How arrays of given shapes and dtypes (in a fixed order) travel: first one flat tensor per dtype of
    the small ones (in order of first appearance), then each large one as it is."""

    def __init__(self, specs: Sequence[tuple[Sequence[int], np.dtype | str | tf.DType]]) -> None:
        self._shapes = [tuple(int(d) for d in shape) for shape, _ in specs]
        self._dtypes = [np.dtype(tf.as_dtype(dtype).as_numpy_dtype) for _, dtype in specs]
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self._shapes]
        self._groups, self._alone = group_small(
            [(size * dtype.itemsize, dtype) for size, dtype in zip(sizes, self._dtypes, strict=True)]
        )
        self._sizes = sizes

    def signature(self) -> list[tf.TensorSpec]:
        """The specs of the packed tensors, for ``tf.function``'s ``input_signature``."""
        return [
            tf.TensorSpec([sum(self._sizes[i] for i in members)], tf.as_dtype(dtype))
            for dtype, members in self._groups.items()
        ] + [tf.TensorSpec(self._shapes[i], tf.as_dtype(self._dtypes[i])) for i in self._alone]

    def pack(self, arrays: Sequence[np.ndarray], given: bool) -> list[tf.Tensor]:
        """The call's arguments for ``arrays`` (eager). ``given``: the arrays are the caller's to give away
        (never read or changed afterwards), and a large one may be shared with TensorFlow instead of
        copied; small ones are always copied into their group's buffer."""
        packed = [
            tf.constant(np.concatenate([arrays[i].ravel() for i in members]))
            for members in self._groups.values()
        ]
        for i in self._alone:
            # TensorFlow may keep a numpy array's memory: one not given is copied first.
            packed.append(as_tf_tensor(arrays[i]) if given else tf.constant(arrays[i].copy()))
        return packed

    def unpack(self, packed: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Inside the function: the arrays, in their order, from :meth:`pack`'s tensors."""
        arrays: list[tf.Tensor | None] = [None] * len(self._shapes)
        for flat, members in zip(packed, self._groups.values(), strict=False):
            parts = tf.split(flat, [self._sizes[i] for i in members]) if len(members) > 1 else [flat]
            for i, part in zip(members, parts, strict=True):
                arrays[i] = tf.reshape(part, self._shapes[i])
        for i, tensor in zip(self._alone, packed[len(self._groups) :], strict=True):
            arrays[i] = tensor
        return arrays  # type: ignore[return-value]
