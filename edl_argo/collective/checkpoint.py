"""Checkpoints of an AllreduceStrategy group's state, so that losing every worker at once loses little.

The group's model lives only in its members. Normally a survivor hands it to the others when a round
forms, but when all of them are gone at once (a preemption of every low-priority worker pod, a master
restarted with none of its workers left) nobody holds it. With ``--checkpoint-steps N``, the member of
rank 0 saves the group's state every N versions into the :class:`~edl_argo.checkpoint.CheckpointSeries`
:data:`SERIES` of ``--checkpoint-dir``, and a worker that starts loads the newest checkpoint before it
joins (its version is then the checkpoint's instead of -1), so the group re-forms from it, or from a
survivor's newer state when there is one.

A checkpoint is a serialised :class:`~edl_argo.proto.collective_pb2.ModelState`: every model and optimizer
variable in creation order, the version, and the rounds of the last steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from edl_argo.checkpoint import Checkpointer, CheckpointSeries
from edl_argo.collective.membership import state_message
from edl_argo.errors import DataFormatError
from edl_argo.proto import collective_pb2
from edl_argo.storage.base import Storage

#: The series' name in ``--checkpoint-dir``.
SERIES = "allreduce"


def group_checkpoints(storage: Storage) -> CheckpointSeries:
    """The group's checkpoints in ``storage``."""
    return CheckpointSeries(storage, SERIES)


@dataclass(frozen=True)
class GroupSnapshot:
    """A copy of the group's state taken between steps (encoded on the checkpointer's thread)."""

    version: int
    round_id: int
    values: list[np.ndarray]
    recent_step_rounds: list[int]


def group_checkpointer(storage: Storage, every: int) -> Checkpointer[GroupSnapshot]:
    """Saves the group's state every ``every`` versions, in the background."""
    return Checkpointer(group_checkpoints(storage), every, encode_snapshot)


def encode_snapshot(snapshot: GroupSnapshot) -> bytes:
    """The snapshot as a serialised ``ModelState`` (what :func:`decode_state` reads)."""
    state = state_message(snapshot.round_id, snapshot.version, snapshot.values, snapshot.recent_step_rounds)
    return state.SerializeToString()


def decode_state(data: bytes, source: str = "checkpoint") -> collective_pb2.ModelState:
    """Parse :func:`encode_snapshot`'s output; :class:`DataFormatError` naming ``source`` if it is not one."""
    state = collective_pb2.ModelState()
    try:
        state.ParseFromString(data)
    except DecodeError as error:
        raise DataFormatError(f"{source} is not an AllreduceStrategy checkpoint: {error}") from None
    if not state.variables or state.version < 0:
        raise DataFormatError(f"{source} is not an AllreduceStrategy checkpoint: no variables or no version")
    return state
