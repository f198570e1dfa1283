"""The state an AllreduceStrategy group keeps identical on every member, and where it comes from.

A :class:`GroupState` is every model and optimizer variable (in creation order), its *version* (steps
applied since the group's first state) and its :class:`Lineage`: the round in which each of its versions was
made. Within one membership round every member starts from the one state the round formed on and applies
the same steps, so *(version, round that made it)* names one state of the whole job: a state descends from
another exactly when it made that version in that round too (:meth:`Lineage.descends_from`). That is how a
round chooses its source (:mod:`edl_argo.collective.membership`), how a member whose step was interrupted
tells whether the state it adopts already contains it, and how the master recognises the states it may
accept as the job's progress (:mod:`edl_argo.master.rendezvous`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edl_argo.proto import master_pb2


@dataclass(frozen=True)
class StatePoint:
    """One state of the job: ``version``, made in round ``round_id``."""

    version: int
    round_id: int


def point_from_message(message: master_pb2.StatePoint) -> StatePoint | None:
    """The point a rendezvous message names (None for round 0: no point)."""
    return StatePoint(message.version, message.round_id) if message.round_id else None


def point_message(point: StatePoint | None) -> master_pb2.StatePoint:
    """``point`` as a rendezvous message (an empty one for None)."""
    if point is None:
        return master_pb2.StatePoint()
    return master_pb2.StatePoint(version=point.version, round_id=point.round_id)


@dataclass(frozen=True)
class Lineage:
    """Which round made each version of a state: ``(round_id, first_version)`` pairs, oldest first, meaning
    versions from ``first_version`` up to the next pair's were made in ``round_id``. The first pair's
    version is the one the lineage is known from (0: the group's initial model, adopted in that round).
    Empty: unknown (a member that never held the group's state)."""

    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def origin(cls, round_id: int, version: int = 0) -> Lineage:
        """A lineage that starts at ``version``, made (or adopted) in ``round_id``."""
        return cls(((round_id, version),))

    def round_of(self, version: int) -> int | None:
        """The round that made ``version`` (None: before this lineage is known)."""
        found = None
        for round_id, first in self.spans:
            if first > version:
                break
            found = round_id
        return found

    def after_step(self, version: int, round_id: int) -> Lineage:
        """This lineage once ``version`` has been made in ``round_id``."""
        if self.spans and self.spans[-1][0] == round_id:
            return self
        return Lineage((*self.spans, (round_id, version)))

    def descends_from(self, version: int, point: StatePoint) -> bool:
        """Whether the state at ``version`` with this lineage is ``point`` or was made from it."""
        return version >= point.version and self.round_of(point.version) == point.round_id

    def point(self, version: int) -> StatePoint | None:
        """``version`` and the round that made it (None: before this lineage is known)."""
        round_id = self.round_of(version)
        return None if round_id is None else StatePoint(version, round_id)


@dataclass(frozen=True)
class GroupState:
    """A copy of a member's state; ``round_id`` is the round it was published for (-1: current state)."""

    round_id: int
    version: int
    values: list[np.ndarray]
    lineage: Lineage = field(default_factory=Lineage)

    @property
    def nbytes(self) -> int:
        return sum(value.nbytes for value in self.values)


def max_difference(reference: GroupState, other: GroupState) -> float:
    """The largest absolute difference between any variable of two states (0.0: identical)."""
    worst = 0.0
    for ref, value in zip(reference.values, other.values, strict=True):
        if value.size and np.issubdtype(value.dtype, np.number):
            worst = max(worst, float(np.max(np.abs(value.astype(np.float64) - ref.astype(np.float64)))))
    return worst
