"""A worker's membership in the elastic group: joining rounds and agreeing on one state.

:meth:`ElasticMember.group` returns the :class:`~edl_argo.collective.group.CollectiveGroup` of the
master's current round, forming it first when the round is new. While its round stands it asks the master
nothing: a member learns that a new round began from a piece of that round arriving at its collective
server (a member of the new round is forming it: its first operation sends to its right neighbour), from a
collective operation that fails (see :mod:`~edl_argo.collective.group`), or from its *watch*: a background
thread that, every :data:`WATCH_SECONDS`, reports what the member holds and reads the master's round
without joining it. The step loop only compares round ids it already has.

Forming a round makes every member hold the same state, whatever happened before. The master's answer
names the job's last committed state and checkpoint (:mod:`edl_argo.master.rendezvous`); a member's state
is *eligible* when it descends from the committed one (:mod:`edl_argo.collective.state`; any state is
while nothing is committed). Then:

1. an allreduce of the members' versions (steps applied, eligible or not) tells everyone who holds the
   newest eligible state: that member is the *source*, the lowest rank among equals;
2. when no member is eligible, the member of rank 0 restores the committed checkpoint, and is the source;
   if it cannot (there is none, or it cannot be read), the member holding the newest state is, whatever
   its lineage; if nobody holds any, rank 0's freshly initialised model (at the very first round: the
   group's first model);
3. the source publishes its state for the round on its collective server; every other member pulls it
   (a broadcast by pull) and loads it.

So a new member receives the current model and optimizer state from a surviving member before it trains;
members whose last step was cut short by a failure (some applied it, some did not) converge on the newest
state; a member left behind on a stale branch (dropped from the group while others trained on) never
overrides the group's progress; and a group whose members are all new continues from the committed
checkpoint rather than from scratch. A round formed by step 2 moves the model backwards: every member
reports how, and the master logs and counts the steps lost.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import numpy as np

from edl_argo.collective.group import CollectiveAborted, CollectiveGroup
from edl_argo.collective.mailbox import CollectiveServer
from edl_argo.collective.state import (
    GroupState,
    Lineage,
    StatePoint,
    max_difference,
    point_from_message,
    point_message,
)
from edl_argo.collective.transport import PeerConnections, request_state
from edl_argo.errors import JobFailedError, first_few
from edl_argo.log import get_logger
from edl_argo.proto import master_pb2

log = get_logger(__name__)

#: How often a member's background watch reports its state to the master and reads the master's round.
WATCH_SECONDS = 1.0
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
        self,
        address: str,
        report: master_pb2.RendezvousRequest | None = None,
        budget_seconds: float | None = None,
    ) -> master_pb2.RendezvousResponse:
        """Join or stay in the group; ``report``: what this member holds (its worker id and address are
        filled in); within ``budget_seconds`` when given."""

    def report_collective_failure(self, round_id: int, suspect_worker_id: int, message: str) -> None: ...


class ReplicaState(Protocol):
    """What the group keeps identical on every member."""

    @property
    def version(self) -> int:
        """Steps applied since the group's first state; -1 while the replica never held the group's state."""

    def export_state(self) -> GroupState:
        """A consistent copy of every variable (model, then optimizer), its version and lineage."""

    def import_state(self, state: GroupState) -> None:
        """Replace every variable with ``state``'s values (the order of :meth:`export_state`)."""

    @property
    def lineage(self) -> Lineage:
        """The lineage of the state held."""

    def held(self) -> tuple[int, Lineage]:
        """:attr:`version` and :attr:`lineage`, read together (another thread may be changing them)."""

    @property
    def saved_checkpoint(self) -> StatePoint | None:
        """The newest checkpoint this replica saved, if any."""

    def load_checkpoint(self, point: StatePoint) -> bool:
        """Load the checkpoint of ``point`` (its version, made in its round); False if it cannot."""


class ElasticMember:
    """One worker's side of the rendezvous (see the module docstring).

    ``replica`` is the state this member contributes and receives; the collective server this object
    starts serves its published state and, for round ``-1``, its current state (for the master's export).
    The watch thread starts once the member formed its first round and stops on :meth:`close`.
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
        self._published: GroupState | None = None
        self._publish_lock = threading.Lock()
        self._server = CollectiveServer(host, port, self._state_for)
        self._peers = PeerConnections()
        self._group: CollectiveGroup | None = None
        self.address = self._server.address
        # How this member's state was agreed last: the round, and the origin and point it formed on.
        self._formed = master_pb2.RendezvousRequest()
        self._ended_round = 0  # the newest round the watch saw the master leave
        self._closed = threading.Event()
        self._watch_thread: threading.Thread | None = None

    @property
    def current(self) -> CollectiveGroup | None:
        return self._group

    def _rendezvous(
        self, budget_seconds: float | None = None, watch: bool = False
    ) -> master_pb2.RendezvousResponse:
        """The master's current round, told what this member holds (within ``budget_seconds`` if given;
        ``watch``: without joining it)."""
        report = master_pb2.RendezvousRequest(watch=watch)
        report.MergeFrom(self._formed)
        version, lineage = self._replica.held()
        point = lineage.point(version) if version >= 0 else None
        if point is not None:
            report.state.CopyFrom(point_message(point))
        saved = self._replica.saved_checkpoint
        if saved is not None and lineage.round_of(saved.version) == saved.round_id:
            report.checkpoint.CopyFrom(point_message(saved))
        return self._master.rendezvous(self.address, report, budget_seconds)

    def group(self) -> CollectiveGroup:
        """The group of the master's current round, formed (state agreed) if the round is new.

        No master call while nothing says the round this member formed has ended (see the module
        docstring)."""
        current = self._group
        if current is not None and not self._ended(current.round_id):
            return current
        response = self._rendezvous()
        if current is not None and response.round_id == current.round_id:
            return current
        self._group = None
        give_up = time.monotonic() + NOT_A_MEMBER_GIVE_UP_SECONDS
        while response.rank < 0:
            if time.monotonic() > give_up:
                raise JobFailedError(
                    f"worker {self._master.worker_id} was not admitted to the group for "
                    f"{NOT_A_MEMBER_GIVE_UP_SECONDS:.0f} s"
                )
            time.sleep(0.1)
            response = self._rendezvous()
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
        self._agree_on_state(
            group, point_from_message(response.committed), point_from_message(response.checkpoint)
        )
        self._group = group
        if self._formed.formed_from != master_pb2.DESCENDANT:
            self._rendezvous()  # the master records the step back now, not at the next watch
        if self._watch_thread is None:
            self._watch_thread = threading.Thread(target=self._watch, name="membership-watch", daemon=True)
            self._watch_thread.start()
        return group

    @property
    def stale(self) -> bool:
        """Whether something this member saw says the round it formed last has ended."""
        current = self._group
        return current is not None and self._ended(current.round_id)

    def _ended(self, round_id: int) -> bool:
        """Whether something this member saw says round ``round_id`` is over (no master call)."""
        return self._ended_round >= round_id or self._server.mailbox.newest_round > round_id

    def _watch(self) -> None:
        """Every :data:`WATCH_SECONDS` until closed: report what this member holds, and note when the
        master's round is no longer the one this member formed (its next :meth:`group` call re-forms)."""
        while not self._closed.wait(WATCH_SECONDS):
            group = self._group
            if group is None:
                continue  # forming, or about to: the step loop asks the master itself
            try:
                response = self._rendezvous(ROUND_CHECK_SECONDS, watch=True)
            except grpc.RpcError as error:
                log.warning("membership_watch_unanswered", round=group.round_id, code=str(error.code()))
                continue
            if response.round_id != group.round_id:
                self._ended_round = max(self._ended_round, group.round_id)

    def _round_is_current(self, round_id: int) -> bool:
        """Whether the master's current round is still ``round_id``, asked within
        :data:`ROUND_CHECK_SECONDS`; True when the master does not answer in time (nothing says it ended)."""
        try:
            current = self._rendezvous(budget_seconds=ROUND_CHECK_SECONDS, watch=True)
        except grpc.RpcError as error:
            log.warning("round_check_unanswered", round=round_id, code=str(error.code()))
            return True
        if current.round_id != round_id:
            self._ended_round = max(self._ended_round, round_id)
            return False
        return True

    def _agree_on_state(
        self, group: CollectiveGroup, committed: StatePoint | None, checkpoint: StatePoint | None
    ) -> None:
        version = self._replica.version
        eligible = version >= 0 and (
            committed is None or self._replica.lineage.descends_from(version, committed)
        )
        votes = np.zeros(2 * group.size, dtype=np.float64)
        votes[group.rank] = version + 1 if eligible else 0
        votes[group.size + group.rank] = version + 1
        votes = group.allreduce(votes)
        eligible_votes, held = votes[: group.size], votes[group.size :]
        origin = master_pb2.DESCENDANT
        if eligible_votes.max() > 0 or committed is None:
            source = int(np.argmax(eligible_votes))  # the first maximum: the lowest rank among equals
        else:
            restored = np.zeros(1)
            if group.rank == 0 and checkpoint is not None:
                restored[0] = self._replica.load_checkpoint(checkpoint)
            if group.allreduce(restored)[0] > 0:
                source, origin = 0, master_pb2.CHECKPOINT
            elif held.max() > 0:
                source, origin = int(np.argmax(held)), master_pb2.MEMBER
            else:
                source, origin = 0, master_pb2.FRESH
        if source == group.rank:
            state = self._replica.export_state()
            if state.version < 0:  # a fresh model (at the first round: the group's first state)
                state = GroupState(-1, 0, state.values, Lineage.origin(group.round_id))
                self._replica.import_state(state)
            with self._publish_lock:
                self._published = GroupState(group.round_id, state.version, state.values, state.lineage)
        else:
            self._replica.import_state(group.pull_state(source))
        formed = self._replica.lineage.point(self._replica.version)
        self._formed = master_pb2.RendezvousRequest(
            formed_round=group.round_id,
            formed_from=origin,
            formed_state=point_message(formed) if formed else None,
        )
        log.info(
            "group_formed",
            round=group.round_id,
            rank=group.rank,
            world_size=group.size,
            state_from=group.worker_id_of(source),
            version=self._replica.version,
        )
        if origin != master_pb2.DESCENDANT:
            assert committed is not None
            log.warning(
                "group_state_restored",
                round=group.round_id,
                origin=master_pb2.StateOrigin.Name(origin).lower(),
                committed_version=committed.version,
                version=self._replica.version,
                steps_lost=max(0, committed.version - self._replica.version),
            )

    def abandon(self, error: CollectiveAborted) -> None:
        """A round failed: report the suspect (if any); the next :meth:`group` call forms the next round."""
        self._group = None
        log.warning("collective_aborted", round=error.round_id, suspect=error.suspect, error=str(error)[:300])
        if error.suspect is not None:
            self._master.report_collective_failure(error.round_id, error.suspect, str(error))

    def _state_for(self, round_id: int) -> GroupState | None:
        if round_id < 0:
            return self._replica.export_state()
        with self._publish_lock:
            published = self._published
        return published if published is not None and published.round_id == round_id else None

    def close(self) -> None:
        """Stop the watch, tell the master what this member holds (its last steps count as committed),
        then stop serving."""
        self._closed.set()
        if self._watch_thread is not None:
            self._watch_thread.join(ROUND_CHECK_SECONDS + 1)
            if self._group is not None:
                try:
                    self._rendezvous(ROUND_CHECK_SECONDS, watch=True)
                except grpc.RpcError as error:
                    log.warning("final_report_unanswered", code=str(error.code()))
        self._server.stop()
        self._peers.close()


@dataclass
class GroupStateSurvey:
    """The master's reading of the group's states at the end of training: the newest state, and how far the
    replicas that hold it differ from it."""

    newest: GroupState
    #: The members whose state was compared with the newest: those at the newest state (its version, made
    #: in the same round) and those of another lineage.
    members_compared: int
    max_abs_difference: float
    versions: list[int]
    #: The members left out, each as ``"address: why"`` (unreachable, or no state).
    left_out: list[str] = field(default_factory=list)
    #: The members that hold an earlier state of the newest one's lineage, each as ``"address: version V of
    #: round R"``: they joined the final round after its last step, so they took no part in the steps since.
    behind: list[str] = field(default_factory=list)


def survey_member_states(
    addresses: list[str], timeout: float = 30.0, token: bytes | None = None
) -> GroupStateSurvey:
    """Read the current state of every member at ``addresses`` that answers with one, each frame within
    ``timeout`` seconds (the master's export); members that cannot be reached or have none are left out.

    A member whose state is an earlier state of the newest one's lineage is *behind* (it joined after the
    last step), named and not compared: every other member's values are compared with the newest, and
    replicas that stepped together must not differ at all. One member's state is held at a time besides the
    newest (so the master holds at most two states). Raises :class:`JobFailedError` if none answers.
    ``token``: the job's collective token (default: this process's).
    """
    newest: GroupState | None = None
    at_newest: list[tuple[int, str]] = []  # the members at the newest state: (position, description)
    behind: list[tuple[int, str]] = []
    differences: list[float] = []
    versions: set[int] = set()
    errors: list[str] = []
    for position, address in enumerate(addresses):
        try:
            state = request_state(address, -1, timeout, token)
        except OSError as error:
            errors.append(f"{address}: {error}")
            continue
        if state is None:
            errors.append(f"{address}: no state")
            continue
        versions.add(state.version)
        described = (
            position,
            f"{address}: version {state.version} of round {state.lineage.round_of(state.version)}",
        )
        if newest is not None and _is_earlier_state_of(state, newest):
            behind.append(described)
        elif newest is not None and _is_earlier_state_of(newest, state):
            behind.extend(at_newest)
            newest, at_newest = state, [described]
        else:
            if newest is not None:
                differences.append(max_difference(newest, state))
            if newest is None or state.version > newest.version:
                newest, at_newest = state, [described]
            elif state.lineage.point(state.version) == newest.lineage.point(newest.version):
                at_newest.append(described)
    if newest is None:
        raise JobFailedError(
            f"no worker of the group returned the trained model ({first_few(errors, 'more workers')})"
        )
    return GroupStateSurvey(
        newest,
        len(addresses) - len(errors) - len(behind),  # every member that answered and is not behind
        max(differences, default=0.0),
        sorted(versions),
        errors,
        [description for _, description in sorted(behind)],
    )


def _is_earlier_state_of(state: GroupState, other: GroupState) -> bool:
    """Whether ``state`` is an earlier state of ``other``'s lineage (``other`` was made from it)."""
    point = state.lineage.point(state.version)
    return (
        state.version < other.version
        and point is not None
        and other.lineage.descends_from(other.version, point)
    )
