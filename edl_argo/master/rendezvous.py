"""Membership of an AllreduceStrategy job's worker group, owned by the master.

The group lives in *rounds*. A round is an id and the ordered list of its members (worker id and the
address of its collective server); a member's rank is its index, and the members form a ring in rank
order. Any change of membership starts a new round with a larger id:

* a worker **joins** with its first :meth:`RendezvousManager.rendezvous` call (a new pod, a replacement,
  a pod placed after being Pending, a scale-up);
* a worker **leaves** when its pod stops (:meth:`remove`, from the pod events the master sees) or when a
  member reports that it did not answer a collective operation in time (:meth:`report_failure`). A worker
  that was reported but is alive joins again on its next call, in yet another round.

A reported worker that is hung (SIGSTOP, a dead node: no pod event) or cannot be reached by its peers (a
silent network path to its collective server) would never leave for good, or keep rejoining rounds it
cannot take part in. :meth:`stuck` names it, for the master to restart it as it restarts a worker that died:
a worker that was reported and then did not call the master for the collective timeout (a live member's
watch calls every second), or that was reported again before it formed a round since. Once training is
over there is nothing left to rejoin: :meth:`silent_since_reported` names every reported worker that made
no call in two watch intervals since its report, so that the master does not wait for it to exit.

A member's step loop makes no call while its round stands: it learns of a new round from a piece of that
round arriving at its collective server (a member of the new round is already forming it), from a failed
collective operation, or from its own background *watch* call (``watch`` set: report and read the round,
about once a second, without joining; see :mod:`edl_argo.collective.membership`). A collective operation
waiting longer than a moment asks the same way. What a round does with its members (broadcast of the
state, rank order) is the workers' business.

With each call a member also reports the state it holds (a version and the round that made it, see
:mod:`edl_argo.collective.state`) and the newest checkpoint it saved. The manager keeps the job's **last
committed state** and **last committed checkpoint** from the reports of members that formed in the
current round (their states all descend from the state the round formed on), and hands both to every
member: a round forms only on a member's state that descends from the committed one, and restores the
committed checkpoint when no member holds one. When a round had to form on a state older than the committed
one (:attr:`restores`), the steps lost are logged (``model_moved_backwards``) and counted
(:attr:`steps_lost`, in ``metrics.json``). The committed state lags a member's newest by the steps it made
since its last watch call (about a second's worth; none after a member that closed cleanly, which reports
as it leaves).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edl_argo.collective.membership import WATCH_SECONDS
from edl_argo.collective.state import StatePoint, point_from_message, point_message
from edl_argo.log import get_logger
from edl_argo.proto import master_pb2

log = get_logger(__name__)

#: Once training is over, how long a reported worker may make no call before :meth:`RendezvousManager.
#: silent_since_reported` names it: two of a live member's watch intervals.
SILENT_AFTER_TRAINING_SECONDS = 2 * WATCH_SECONDS


@dataclass
class _Suspect:
    """A worker a member reported: when it last called the master (or was reported), how many times it
    was reported without forming a round since, and whether it called after its last report."""

    last_call: float
    times: int
    called_since_report: bool = False


@dataclass(frozen=True)
class Member:
    worker_id: int
    address: str


@dataclass(frozen=True)
class Round:
    """One membership round: its id and its members in rank order."""

    round_id: int
    members: tuple[Member, ...]

    def rank_of(self, worker_id: int) -> int:
        """The worker's rank in this round, or -1 if it is not a member."""
        for rank, member in enumerate(self.members):
            if member.worker_id == worker_id:
                return rank
        return -1


def clock_round_base() -> int:
    """A first round id larger than any round of an earlier master of the job: now in milliseconds.

    Round ids must only grow, also across a master restart (a worker drops pieces of rounds older than
    its own); a master creates far fewer than one round per millisecond, so a restarted master's clock
    is ahead of every round its predecessor numbered.
    """
    return int(time.time() * 1000)


class RendezvousManager:
    """Thread-safe membership bookkeeping: join, leave, and the current :class:`Round`.

    ``first_round``: the id before the first round (:func:`clock_round_base` for a job's master).
    """

    def __init__(self, first_round: int = 0) -> None:
        self._lock = threading.Lock()
        self._members: dict[int, str] = {}  # worker id -> address, in join order
        self._round = Round(first_round, ())
        self._departed: set[int] = set()  # pods that stopped: a late call from them is not a join
        self.committed: StatePoint | None = None
        self.checkpoint: StatePoint | None = None
        #: Every round that formed on a state older than the committed one: what it lost.
        self.restores: list[dict[str, object]] = []
        self._restored_round = 0
        # Reported workers that have not formed a round since, by worker id.
        self._suspects: dict[int, _Suspect] = {}
        self._stuck: set[int] = set()
        self._training_over = False

    @property
    def current(self) -> Round:
        with self._lock:
            return self._round

    @property
    def steps_lost(self) -> int:
        with self._lock:
            return sum(int(str(restore["steps_lost"])) for restore in self.restores)

    def rendezvous(
        self, worker_id: int, address: str, report: master_pb2.RendezvousRequest | None = None
    ) -> Round:
        """The current round, after taking ``report`` (what the worker holds) into account and adding
        ``worker_id`` at ``address`` if it is not a member yet (unless ``report.watch``: a member's
        background call only reads the round)."""
        with self._lock:
            suspect = self._suspects.get(worker_id)
            if suspect is not None:
                formed_since = report is not None and report.formed_round == self._round.round_id
                if formed_since and self._round.rank_of(worker_id) >= 0:
                    del self._suspects[worker_id]
                else:
                    suspect.last_call, suspect.called_since_report = time.monotonic(), True
            if report is not None and self._round.rank_of(worker_id) >= 0:
                self._take_report_locked(worker_id, report)
            if report is not None and report.watch:
                return self._round
            if worker_id in self._departed or self._members.get(worker_id) == address:
                return self._round
            changed = "address" if worker_id in self._members else "joined"
            self._members[worker_id] = address
            self._next_round_locked(f"worker {worker_id} {changed}")
            return self._round

    def end_training(self) -> None:
        """Training is over and the master has read the group's trained state: from now on members' reports
        change neither the committed state nor the restores. (A member left alone as its peers finish forms
        a round on whatever it holds; when it joined after the last step that is an older state, and no step
        of the job is lost by it.)"""
        with self._lock:
            self._training_over = True

    def remove(self, worker_id: int, reason: str) -> None:
        """The worker's pod stopped: it leaves the group for good."""
        with self._lock:
            self._departed.add(worker_id)
            self._suspects.pop(worker_id, None)
            if self._members.pop(worker_id, None) is not None:
                self._next_round_locked(f"worker {worker_id} left ({reason})")

    def report_failure(self, reporter: int, round_id: int, suspect: int, message: str) -> None:
        """A member of round ``round_id`` could not complete an operation because of ``suspect``.

        Reports about an old round are ignored: the group has already moved on. The suspect leaves the
        group; if it is alive it joins again on its next call.
        """
        with self._lock:
            if round_id != self._round.round_id:
                return
            log.warning(
                "collective_failure_reported",
                reporter=reporter,
                round=round_id,
                suspect=suspect,
                message=message[:300],
            )
            if self._members.pop(suspect, None) is not None:
                known = self._suspects.get(suspect)
                self._suspects[suspect] = _Suspect(time.monotonic(), 1 if known is None else known.times + 1)
                self._next_round_locked(f"worker {suspect} did not answer worker {reporter}")
            else:
                # The suspect is unknown or already gone: still make every member start over together.
                self._next_round_locked(f"worker {reporter} could not complete round {round_id}")

    def stuck(self, timeout: float) -> list[int]:
        """Reported workers to restart (each named once): silent to the master for ``timeout`` seconds
        since, or reported twice without forming a round in between."""
        now = time.monotonic()
        return self._name_stuck(lambda s: s.times >= 2 or now - s.last_call > timeout)

    def silent_since_reported(self) -> list[int]:
        """Training is over: the reported workers that have not called the master in the two watch
        intervals since their report (each named once, by this or :meth:`stuck`). A live one calls every
        interval; one that is hung would hold the job's end until it is deleted."""
        now = time.monotonic()
        return self._name_stuck(
            lambda s: not s.called_since_report and now - s.last_call > SILENT_AFTER_TRAINING_SECONDS
        )

    def _name_stuck(self, is_stuck: Callable[[_Suspect], bool]) -> list[int]:
        with self._lock:
            found = [
                worker_id
                for worker_id, suspect in self._suspects.items()
                if worker_id not in self._stuck and is_stuck(suspect)
            ]
            self._stuck.update(found)
            for worker_id in found:
                del self._suspects[worker_id]
        for worker_id in found:
            log.warning("group_member_stuck", worker=worker_id)
        return found

    def snapshot(self) -> dict[str, Any]:
        """The committed state and checkpoint and the restores, for a restarted master (JSON-ready)."""
        with self._lock:
            return {
                "committed": None
                if self.committed is None
                else [self.committed.version, self.committed.round_id],
                "checkpoint": None
                if self.checkpoint is None
                else [self.checkpoint.version, self.checkpoint.round_id],
                "restores": list(self.restores),
            }

    def restore(self, snapshot: dict[str, Any] | None) -> None:
        """Continue from an earlier master's :meth:`snapshot` (None: there is none). What it committed may
        be a few steps behind the group: those steps descend from it, so it is still a safe bound."""
        if not snapshot:
            return
        with self._lock:
            self.committed = StatePoint(*snapshot["committed"]) if snapshot.get("committed") else None
            self.checkpoint = StatePoint(*snapshot["checkpoint"]) if snapshot.get("checkpoint") else None
            self.restores = list(snapshot.get("restores", []))

    def _take_report_locked(self, worker_id: int, report: master_pb2.RendezvousRequest) -> None:
        if self._training_over:
            return
        if report.formed_round != self._round.round_id:
            return  # its state may be older than the round's: not yet agreed, or from an earlier round
        if report.formed_from != master_pb2.DESCENDANT and self._restored_round != report.formed_round:
            self._restored_round = report.formed_round
            formed = point_from_message(report.formed_state)
            lost = max(0, self.committed.version - formed.version) if self.committed and formed else 0
            restore: dict[str, object] = {
                "round": report.formed_round,
                "origin": master_pb2.StateOrigin.Name(report.formed_from).lower(),
                "committed_version": self.committed.version if self.committed else -1,
                "restored_version": formed.version if formed else 0,
                "steps_lost": lost,
            }
            self.restores.append(restore)
            log.warning("model_moved_backwards", worker=worker_id, **{k: str(v) for k, v in restore.items()})
            self.committed = formed
            self.checkpoint = formed if report.formed_from == master_pb2.CHECKPOINT else None
        state = point_from_message(report.state)
        if state is not None and (self.committed is None or state.version > self.committed.version):
            self.committed = state
        checkpoint = point_from_message(report.checkpoint)
        if checkpoint is not None and (not self.checkpoint or checkpoint.version > self.checkpoint.version):
            self.checkpoint = checkpoint

    def response(self, current: Round, worker_id: int) -> master_pb2.RendezvousResponse:
        """What the master answers ``worker_id``'s Rendezvous call in round ``current``."""
        with self._lock:
            committed, checkpoint = self.committed, self.checkpoint
        return master_pb2.RendezvousResponse(
            round_id=current.round_id,
            rank=current.rank_of(worker_id),
            members=[
                master_pb2.RendezvousMember(worker_id=m.worker_id, address=m.address) for m in current.members
            ],
            committed=point_message(committed),
            checkpoint=point_message(checkpoint),
        )

    def _next_round_locked(self, why: str) -> None:
        members = tuple(Member(w, a) for w, a in sorted(self._members.items()))
        self._round = Round(self._round.round_id + 1, members)
        log.info(
            "rendezvous_round",
            round=self._round.round_id,
            world_size=len(members),
            members=",".join(str(m.worker_id) for m in members),
            why=why,
        )
