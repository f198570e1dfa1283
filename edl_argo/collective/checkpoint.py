"""Checkpoints of an AllreduceStrategy group's state, so that losing every worker at once loses little.

The group's model lives only in its members. Normally a survivor hands it to the others when a round
forms, but when all of them are gone at once (a preemption of every low-priority worker pod, a master
restarted with none of its workers left) nobody holds it. With ``--checkpoint-steps N``, the member of
rank 0 saves the group's state every N versions into the :class:`~edl_argo.checkpoint.CheckpointSeries`
:data:`SERIES` of ``--checkpoint-dir``, and a worker that starts loads the newest checkpoint before it
joins (its version is then the checkpoint's instead of -1), so the group re-forms from it, or from a
survivor's newer state when there is one.

A checkpoint is the frames a member streams a state in (:func:`~edl_argo.collective.transport.encode_state`:
a manifest naming every variable's dtype and shape, the version and the lineage, then the variables' bytes),
so a state of any size can be saved. Checkpoints of earlier versions (one ``ModelState`` message holding
every variable) are still read.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from edl_argo.checkpoint import Checkpointer, CheckpointSeries
from edl_argo.collective.state import GroupState, Lineage
from edl_argo.collective.transport import MAGIC, BufferFrames, FrameError, encode_state, read_state
from edl_argo.errors import DataFormatError
from edl_argo.proto import collective_pb2
from edl_argo.rpc.tensors import TensorDecodeError, from_tensor
from edl_argo.storage.base import Storage

#: The series' name in ``--checkpoint-dir``.
SERIES = "allreduce"


def group_checkpoints(storage: Storage) -> CheckpointSeries:
    """The group's checkpoints in ``storage``."""
    return CheckpointSeries(storage, SERIES)


def group_checkpointer(storage: Storage, every: int) -> Checkpointer[GroupState]:
    """Saves the group's state every ``every`` versions, in the background."""
    return Checkpointer(group_checkpoints(storage), every, encode_state)


def decode_state(data: bytes, source: str = "checkpoint") -> GroupState:
    """Parse a checkpoint; :class:`DataFormatError` naming ``source`` if it is not one."""
    if data[: len(MAGIC)] != MAGIC:
        return _decode_whole_message(data, source)
    frames = BufferFrames(data, source)
    try:
        state = read_state(frames, source)
    except FrameError as error:
        raise DataFormatError(f"{source} is not an AllreduceStrategy checkpoint: {error}") from None
    if state is None or not state.values or state.version < 0 or not frames.exhausted:
        raise DataFormatError(
            f"{source} is not an AllreduceStrategy checkpoint: no variables, no version or trailing bytes"
        )
    return state


def _decode_whole_message(data: bytes, source: str) -> GroupState:
    """A checkpoint of an earlier version: one ``ModelState`` holding every variable. Its lineage is known
    from its own version on (the round of its last step)."""
    message = collective_pb2.ModelState()
    try:
        message.ParseFromString(data)
        values = [np.array(from_tensor(t)) for t in message.variables]
    except (DecodeError, TensorDecodeError) as error:
        raise DataFormatError(f"{source} is not an AllreduceStrategy checkpoint: {error}") from None
    if not values or message.version < 0:
        raise DataFormatError(f"{source} is not an AllreduceStrategy checkpoint: no variables or no version")
    last_round = message.recent_step_rounds[-1] if message.recent_step_rounds else message.round_id
    return GroupState(message.round_id, message.version, values, Lineage.origin(last_round, message.version))
