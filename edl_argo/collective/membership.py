"""A worker's membership in the elastic group: joining rounds and agreeing on one state.

:meth:`ElasticMember.group` returns the :class:`~edl_argo.collective.group.CollectiveGroup` of the
master's current round, forming it first when the round is new. Forming a round makes every member hold
the same state, whatever happened before:

1. an allreduce of the members' versions (steps applied; -1 for a member that never held the group's
   state, such as a new worker) tells everyone who holds the newest state — the *source*: the highest
   version, the lowest rank among equals;
2. the source publishes its state for the round on its collective server; every other member pulls it
   (a broadcast by pull) and loads it.

So a new member receives the current model and optimizer state from a surviving member before it trains,
and members whose last step was cut short by a failure (some applied it, some did not) converge on the
newest state. No checkpoint on durable storage is involved. At the very first round every member is new
and the source's freshly initialised model becomes everyone's.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import grpc
import numpy as np

from edl_argo.collective.group import CollectiveAborted, CollectiveGroup
from edl_argo.collective.mailbox import CollectiveServer
from edl_argo.collective.transport import PeerConnections, request_state
from edl_argo.errors import JobFailedError
from edl_argo.log import get_logger
from edl_argo.proto import collective_pb2, master_pb2
from edl_argo.rpc.tensors import from_tensor, to_tensor

log = get_logger(__name__)

#: How long a worker may go on being told it is not a member before it gives up.
NOT_A_MEMBER_GIVE_UP_SECONDS = 120.0
#: How long one check that a round is still current (made every half second while a wait is slow) may ask
#: the master. A master that does not answer in time leaves the round current: the wait's own timeout
#: (``--collective-timeout-seconds``) still bounds it.
ROUND_CHECK_SECONDS = 2.0


class RendezvousClient(Protocol):
    """The master calls a member makes (:class:`edl_argo.worker.master_client.MasterClient`)."""

    worker_id: int

    def rendezvous(
        self, address: str, budget_seconds: float | None = None
    ) -> master_pb2.RendezvousResponse: ...

    def report_collective_failure(self, round_id: int, suspect_worker_id: int, message: str) -> None: ...


class ReplicaState(Protocol):
    """What the group keeps identical on every member."""

    @property
    def version(self) -> int:
        """Steps applied since the group's first state; -1 while the replica never held the group's state."""

    def export_state(self) -> tuple[list[np.ndarray], list[int]]:
        """A consistent copy of every variable (model, then optimizer), and the rounds of recent steps."""

    def import_state(self, values: list[np.ndarray], version: int, recent_step_rounds: list[int]) -> None:
        """Replace every variable with ``values`` (the order of :meth:`export_state`)."""


def state_message(
    round_id: int, version: int, values: list[np.ndarray], rounds: list[int]
) -> collective_pb2.ModelState:
    return collective_pb2.ModelState(
        round_id=round_id,
        version=version,
        variables=[to_tensor(v, str(i)) for i, v in enumerate(values)],
        recent_step_rounds=rounds,
    )


class ElasticMember:
    """One worker's side of the rendezvous (see the module docstring).

    ``replica`` is the state this member contributes and receives; the collective server this object
    starts serves its published state and, for round ``-1``, its current state (for the master's export).
    """

    def __init__(
        self,
        master: RendezvousClient,
        replica: ReplicaState,
        host: str,
        port: int,
        timeout: float,
    ) -> None:
        self._master = master
        self._replica = replica
        self._timeout = timeout
        self._published: collective_pb2.ModelState | None = None
        self._publish_lock = threading.Lock()
        self._server = CollectiveServer(host, port, self._state_for)
        self._peers = PeerConnections()
        self._group: CollectiveGroup | None = None
        self.address = self._server.address

    @property
    def current(self) -> CollectiveGroup | None:
        return self._group

    def group(self) -> CollectiveGroup:
        """The group of the master's current round, formed (state agreed) if the round is new."""
        response = self._master.rendezvous(self.address)
        if self._group is not None and response.round_id == self._group.round_id:
            return self._group
        self._group = None
        give_up = time.monotonic() + NOT_A_MEMBER_GIVE_UP_SECONDS
        while response.rank < 0:
            if time.monotonic() > give_up:
                raise JobFailedError(
                    f"worker {self._master.worker_id} was not admitted to the group for "
                    f"{NOT_A_MEMBER_GIVE_UP_SECONDS:.0f} s"
                )
            time.sleep(0.1)
            response = self._master.rendezvous(self.address)
        self._peers.retain({m.address for m in response.members})
        group = CollectiveGroup(
            response.round_id,
            response.rank,
            [(m.worker_id, m.address) for m in response.members],
            self._server.mailbox,
            self._peers,
            lambda: self._round_is_current(response.round_id),
            self._timeout,
        )
        self._agree_on_state(group)
        self._group = group
        return group

    def _round_is_current(self, round_id: int) -> bool:
        """Whether the master's current round is still ``round_id``, asked within
        :data:`ROUND_CHECK_SECONDS`; True when the master does not answer in time (nothing says it ended)."""
        try:
            current = self._master.rendezvous(self.address, budget_seconds=ROUND_CHECK_SECONDS)
        except grpc.RpcError as error:
            log.warning("round_check_unanswered", round=round_id, code=str(error.code()))
            return True
        return current.round_id == round_id

    def _agree_on_state(self, group: CollectiveGroup) -> None:
        votes = np.zeros(group.size, dtype=np.float64)
        votes[group.rank] = self._replica.version + 1
        votes = group.allreduce(votes)
        source = int(np.argmax(votes))  # the first maximum: the lowest rank among equals
        if source == group.rank:
            values, rounds = self._replica.export_state()
            if self._replica.version < 0:  # the group's first state is this member's initial model
                self._replica.import_state(values, 0, rounds)
            with self._publish_lock:
                self._published = state_message(group.round_id, self._replica.version, values, rounds)
        else:
            state = group.pull_state(source)
            self._replica.import_state(
                [np.array(from_tensor(t)) for t in state.variables],
                state.version,
                list(state.recent_step_rounds),
            )
        log.info(
            "group_formed",
            round=group.round_id,
            rank=group.rank,
            world_size=group.size,
            state_from=group.worker_id_of(source),
            version=self._replica.version,
        )

    def abandon(self, error: CollectiveAborted) -> None:
        """A round failed: report the suspect (if any); the next :meth:`group` call forms the next round."""
        self._group = None
        log.warning("collective_aborted", round=error.round_id, suspect=error.suspect, error=str(error)[:300])
        if error.suspect is not None:
            self._master.report_collective_failure(error.round_id, error.suspect, str(error))

    def _state_for(self, round_id: int) -> collective_pb2.ModelState | None:
        if round_id < 0:
            values, rounds = self._replica.export_state()
            return state_message(-1, self._replica.version, values, rounds)
        with self._publish_lock:
            published = self._published
        return published if published is not None and published.round_id == round_id else None

    def close(self) -> None:
        self._server.stop()
        self._peers.close()


def member_states(addresses: list[str], timeout: float = 30.0) -> list[collective_pb2.ModelState]:
    """The current state of every member at ``addresses`` that answers with one within ``timeout`` seconds
    (the master's export); members that cannot be reached or have none are left out.

    Raises :class:`JobFailedError` if none answers with a state.
    """
    states: list[collective_pb2.ModelState] = []
    errors: list[str] = []
    for address in addresses:
        try:
            state = request_state(address, -1, timeout)
        except OSError as error:
            errors.append(f"{address}: {error}")
            continue
        if state is None:
            errors.append(f"{address}: no state")
        else:
            states.append(state)
    if not states:
        raise JobFailedError(f"no worker of the group returned the trained model ({'; '.join(errors)})")
    return states


def max_state_difference(states: list[collective_pb2.ModelState]) -> float:
    """The largest absolute difference between any variable of any two states (0.0: identical replicas)."""
    reference = [from_tensor(t) for t in states[0].variables]
    worst = 0.0
    for state in states[1:]:
        for ref, tensor in zip(reference, state.variables, strict=True):
            value = from_tensor(tensor)
            if value.size and np.issubdtype(value.dtype, np.number):
                worst = max(worst, float(np.max(np.abs(value.astype(np.float64) - ref.astype(np.float64)))))
    return worst
