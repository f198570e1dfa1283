"""The master's pod policy: which pods to run, and what to do when one stops.

Kept apart from task bookkeeping (:mod:`edl_argo.master.task_dispatcher`) and from how pods run
(:class:`edl_argo.pods.PodBackend`). The policy:

* PS first, then workers. Worker ids are never reused: a replacement gets a new id, so a late event of
  the dead worker can never be mistaken for its replacement.
* A worker that stops without finishing (killed, preempted, deleted by someone else, crashed): its tasks
  go back to the queue at once and a replacement starts, within ``max_worker_relaunches``. A worker
  killed for memory (``OOMKilled``) is not replaced unless ``relaunch_oom``: more of the same would die
  the same way.
* A worker whose predecessors keep failing soon after they start is relaunched after a growing delay
  (:mod:`edl_argo.master.relaunch_backoff`); the log line ``worker_relaunch_backed_off`` says when. A
  relaunch waiting for its time counts toward the workers wanted and toward ``max_worker_relaunches``.
* A PS that stops is relaunched with the same id and address (it restores its latest checkpoint),
  within ``max_ps_relaunches``.
* Scaling changes the target number of workers: new ids start, or workers are deleted (their tasks
  requeued, as preemption would): Pending ones first (they hold nothing), then opportunistic ones, then
  the newest.
* The job *asks for* ``num_workers`` workers (``edl-argo scale`` changes that:
  :meth:`~PodManager.request_workers`). Workers started beyond that many (growth,
  :mod:`edl_argo.master.worker_scaler`) are *opportunistic* (:attr:`PodSpec.opportunistic
  <edl_argo.pods.base.PodSpec.opportunistic>`): a cluster may give them a lower priority.
* A worker counts as *running* from its RUNNING event, as *pending* while the cluster has no room for it
  (a PENDING event), until its pod stops (:meth:`~PodManager.worker_counts`, what
  :mod:`edl_argo.master.worker_scaler` decides from).
* A restarted master (see :mod:`edl_argo.master.failover`) :meth:`~PodManager.resume` s from the
  :meth:`~PodManager.snapshot` of the one before instead of starting pods: the pods the backend adopted
  keep running under their ids, and those that died with the old master are started again (a PS with its
  id, a worker with a new one), each counted as a relaunch with reason ``LostWithMaster``.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edl_argo.errors import JobFailedError
from edl_argo.log import get_logger
from edl_argo.master.relaunch_backoff import RelaunchBackoff
from edl_argo.master.task_dispatcher import TaskDispatcher
from edl_argo.pods import PodBackend, PodEvent, PodPhase, PodReason, PodRole, PodSpec, PodStatus

log = get_logger(__name__)

#: Reason the master gives when it removes a worker on purpose (scale-down, stuck).
SCALED_DOWN = "ScaledDown"
STUCK = "Stuck"
#: Relaunch reason of a pod that was gone when a restarted master took over.
LOST_WITH_MASTER = "LostWithMaster"


@dataclass
class PodPolicy:
    num_workers: int
    num_ps: int
    max_worker_relaunches: int = 16
    max_ps_relaunches: int = 8
    relaunch_oom: bool = False
    #: The first delay of a crash loop's relaunches (:mod:`edl_argo.master.relaunch_backoff`; 0: none).
    relaunch_backoff_seconds: float = 0.0


@dataclass(frozen=True)
class WorkerCounts:
    """The job's workers now: ``running`` (their pod runs), ``pending`` (waiting for room in the cluster)
    and ``wanted`` (the target: running, pending or being started)."""

    running: int
    pending: int
    wanted: int


@dataclass
class RelaunchRecord:
    """One relaunch, for logs and metrics.json."""

    role: str
    old_id: int
    new_id: int
    reason: str
    message: str = ""


@dataclass(frozen=True)
class DelayedRelaunch:
    """A worker relaunch waiting for its time (``due``, on the manager's clock)."""

    due: float
    old_id: int
    reason: str
    message: str
    streak: int


@dataclass
class PodManager:
    """Starts the job's pods and applies :class:`PodPolicy` to the events of ``backend``.

    ``worker_spec(id)`` and ``ps_spec(id)`` build the spec of a pod. :meth:`handle` is called from the
    master's main loop only; :meth:`scale_workers` may be called from any thread. ``on_worker_stopped(id,
    reason)`` hears of every worker pod that ended, however and whenever it ended (an AllreduceStrategy
    job's group loses the member at once).
    """

    backend: PodBackend
    policy: PodPolicy
    dispatcher: TaskDispatcher
    worker_spec: Callable[[int], PodSpec]
    ps_spec: Callable[[int], PodSpec]
    on_worker_stopped: Callable[[int, str], None] | None = None
    relaunches: list[RelaunchRecord] = field(default_factory=list)
    failure: JobFailedError | None = None
    _live_workers: set[int] = field(default_factory=set)
    _pending_workers: set[int] = field(default_factory=set)
    _opportunistic_workers: set[int] = field(default_factory=set)
    _requested_workers: int | None = None
    _finished_workers: set[int] = field(default_factory=set)
    _removing: dict[int, str] = field(default_factory=dict)
    _next_worker_id: int = 0
    _target_workers: int = 0
    _started: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Monotonic clock of the delayed relaunches (tests move it).
    clock: Callable[[], float] = time.monotonic
    _delayed: list[DelayedRelaunch] = field(default_factory=list)
    #: Running workers: when each started running (``time.time()``; an adopted one: when it was adopted).
    _running_since: dict[int, float] = field(default_factory=dict)
    _backoff: RelaunchBackoff = field(init=False)

    def __post_init__(self) -> None:
        self._backoff = RelaunchBackoff(self.policy.relaunch_backoff_seconds)

    def start(self) -> None:
        """Start the PS, then the workers: as many as the policy says, or as a scale request that came
        while the PS were starting asked (workers need the PS's addresses)."""
        for ps_id in range(self.policy.num_ps):
            self.backend.start(self.ps_spec(ps_id))
        with self._lock:
            self._started = True
        self.scale_workers(self._requested)

    def snapshot(self) -> dict[str, Any]:
        """Worker ids, target and relaunches, as JSON data: what :meth:`resume` continues from."""
        with self._lock:
            return {
                "next_worker_id": self._next_worker_id,
                "target_workers": self._target_workers,
                "requested_workers": self._requested,
                "opportunistic_workers": sorted(self._opportunistic_workers),
                "live_workers": sorted(self._live_workers),
                "removing": {str(worker_id): reason for worker_id, reason in self._removing.items()},
                "relaunches": [vars(record) for record in self.relaunches],
            }

    def resume(self, snapshot: Mapping[str, Any], adopted: list[PodStatus]) -> None:
        """Take over the pods of a master that died, instead of :meth:`start`.

        ``snapshot`` is that master's :meth:`snapshot`, ``adopted`` what the backend adopted. Adopted pods
        keep running under their ids (a worker the snapshot did not know yet too: new ids start above
        every id seen). A PS that is gone is started again with its id; workers that are gone are
        replaced up to the target, unless no task is left; workers being removed are removed again.
        """
        adopted_workers = {pod.pod_id for pod in adopted if pod.role is PodRole.WORKER}
        adopted_ps = {pod.pod_id for pod in adopted if pod.role is PodRole.PS}
        removing = {int(worker_id): str(reason) for worker_id, reason in snapshot["removing"].items()}
        with self._lock:
            self.relaunches = [RelaunchRecord(**record) for record in snapshot["relaunches"]]
            self._target_workers = int(snapshot["target_workers"])
            self._requested_workers = int(snapshot.get("requested_workers", self._target_workers))
            self._opportunistic_workers = {int(i) for i in snapshot.get("opportunistic_workers", ())}
            self._next_worker_id = max([int(snapshot["next_worker_id"]), *(i + 1 for i in adopted_workers)])
            self._live_workers = set(adopted_workers)
            adopted_at = time.time()
            self._running_since = {
                pod.pod_id: adopted_at
                for pod in adopted
                if pod.role is PodRole.WORKER and pod.phase is PodPhase.RUNNING
            }
            self._started = True
        for ps_id in sorted(set(range(self.policy.num_ps)) - adopted_ps):
            self.backend.start(self.ps_spec(ps_id))
            self.relaunches.append(RelaunchRecord(PodRole.PS.value, ps_id, ps_id, LOST_WITH_MASTER))
            log.warning("ps_relaunched", ps=ps_id, reason=LOST_WITH_MASTER)
        for worker_id in sorted(adopted_workers & set(removing)):
            self._remove_worker(worker_id, removing[worker_id])
        lost = sorted({int(i) for i in snapshot["live_workers"]} - adopted_workers - set(removing))
        log.info("pods_resumed", workers=sorted(adopted_workers), ps=sorted(adopted_ps), workers_lost=lost)
        if self.dispatcher.finished:
            return
        for old_id in lost[: max(0, self._target_workers - len(adopted_workers - set(removing)))]:
            new_id = self._start_worker()
            self.relaunches.append(RelaunchRecord(PodRole.WORKER.value, old_id, new_id, LOST_WITH_MASTER))
            log.warning("worker_relaunched", old_worker=old_id, new_worker=new_id, reason=LOST_WITH_MASTER)
        self.scale_workers(self._target_workers)

    @property
    def live_workers(self) -> list[int]:
        with self._lock:
            return sorted(self._live_workers)

    def is_worker(self, worker_id: int) -> bool:
        """Whether ``worker_id`` is a worker this manager started (or adopted) whose pod has not stopped.
        Any id is, before :meth:`start` or :meth:`resume` (no worker is known yet)."""
        with self._lock:
            return not self._started or worker_id in self._live_workers

    @property
    def worker_relaunches(self) -> int:
        """Worker relaunches started (those waiting for their time are not, yet)."""
        return sum(1 for r in self.relaunches if r.role == PodRole.WORKER.value)

    @property
    def _worker_relaunches_asked(self) -> int:
        """Worker relaunches started or waiting for their time: what ``max_worker_relaunches`` bounds."""
        with self._lock:
            return self.worker_relaunches + len(self._delayed)

    @property
    def ps_relaunches(self) -> int:
        return sum(1 for r in self.relaunches if r.role == PodRole.PS.value)

    def worker_counts(self) -> WorkerCounts:
        """How many workers run, wait for room, and are wanted (workers being removed do not count)."""
        with self._lock:
            staying = self._live_workers - set(self._removing)
            return WorkerCounts(
                running=len(staying & self._running_since.keys()),
                pending=len(staying & self._pending_workers),
                wanted=self._target_workers,
            )

    @property
    def _requested(self) -> int:
        """The workers the job asks for: ``num_workers``, or what :meth:`request_workers` set."""
        return self.policy.num_workers if self._requested_workers is None else self._requested_workers

    def request_workers(self, count: int) -> int:
        """The job now asks for ``count`` workers (``edl-argo scale``): :meth:`scale_workers` to it, and
        workers started from now on up to that many are not opportunistic."""
        with self._lock:
            self._requested_workers = count
        return self.scale_workers(count)

    def scale_workers(self, count: int) -> int:
        """Set the target number of workers; returns it. Scale-down removes Pending workers first, then
        opportunistic ones, then the others; newest first within each."""
        with self._lock:
            self._target_workers = count
            if not self._started:  # the workers start with the job, at the target asked last
                return count
            staying = self._live_workers - set(self._removing)
            cancelled = self._delayed[max(0, count - len(staying)) :]
            del self._delayed[max(0, count - len(staying)) :]
            by_preference = sorted(
                staying,
                key=lambda i: (i not in self._pending_workers, i not in self._opportunistic_workers, -i),
            )
            surplus = by_preference[: max(0, len(staying) - count)]
            missing = count - len(staying) - len(self._delayed)
        for worker_id in surplus:
            self._remove_worker(worker_id, SCALED_DOWN)
        for _ in range(max(0, missing)):
            self._start_worker()
        if cancelled:
            log.info("worker_relaunches_cancelled", relaunches=len(cancelled), target=count)
        if surplus or missing > 0:
            log.info("workers_scaled", target=count, removed=len(surplus), added=max(0, missing))
        return count

    def restart_stuck_worker(self, worker_id: int) -> None:
        """A worker held a task past its timeout, or its group found it silent: remove it; its replacement
        starts on its DELETED event, unless training is over by then."""
        log.warning("worker_stuck", worker=worker_id)
        self._remove_worker(worker_id, STUCK)

    def restart_stuck_ps(self, ps_id: int) -> None:
        """A PS stopped answering (:mod:`edl_argo.master.ps_watch`): delete it; its terminal event starts
        it again, restoring its checkpoint, as a PS that died."""
        log.warning("ps_stuck", ps=ps_id)
        self.backend.delete(PodRole.PS, ps_id, reason=STUCK)

    def _start_worker(self) -> int:
        with self._lock:
            worker_id = self._next_worker_id
            self._next_worker_id += 1
            staying = self._live_workers - set(self._removing)
            opportunistic = len(staying - self._opportunistic_workers) >= self._requested
            self._live_workers.add(worker_id)
            if opportunistic:
                self._opportunistic_workers.add(worker_id)
        spec = self.worker_spec(worker_id)
        self.backend.start(dataclasses.replace(spec, opportunistic=True) if opportunistic else spec)
        return worker_id

    def _remove_worker(self, worker_id: int, reason: str) -> None:
        with self._lock:
            if worker_id not in self._live_workers or worker_id in self._removing:
                return
            self._removing[worker_id] = reason
        requeued = self.dispatcher.recover_tasks(worker_id)
        log.info("worker_removing", worker=worker_id, reason=reason, tasks_requeued=len(requeued))
        self.backend.delete(PodRole.WORKER, worker_id, reason=reason)

    def handle(self, events: list[PodEvent]) -> None:
        """Apply the policy to ``events``, and start the delayed relaunches whose time has come."""
        self._start_due_relaunches()
        for event in events:
            if event.phase.is_terminal:
                if event.role is PodRole.WORKER:
                    self._worker_stopped(event)
                else:
                    self._ps_stopped(event)
            else:
                if event.role is PodRole.WORKER:
                    self._worker_phase(event)
                log.info("pod_phase", pod=event.name, phase=event.phase.value, reason=event.reason)

    def _worker_phase(self, event: PodEvent) -> None:
        with self._lock:
            if event.pod_id not in self._live_workers:
                return
            if event.phase is PodPhase.RUNNING:
                self._running_since[event.pod_id] = event.timestamp
                self._pending_workers.discard(event.pod_id)
            elif event.phase is PodPhase.PENDING and event.reason == PodReason.UNSCHEDULABLE:
                self._pending_workers.add(event.pod_id)

    def _worker_stopped(self, event: PodEvent) -> None:
        worker_id = event.pod_id
        if self.on_worker_stopped is not None:
            self.on_worker_stopped(worker_id, event.reason)
        with self._lock:
            self._live_workers.discard(worker_id)
            self._pending_workers.discard(worker_id)
            self._opportunistic_workers.discard(worker_id)
            running_since = self._running_since.pop(worker_id, None)
            removed_reason = self._removing.pop(worker_id, None)
        if event.phase is PodPhase.SUCCEEDED:
            self._finished_workers.add(worker_id)
            log.info("worker_finished", worker=worker_id)
            return
        # Removing a worker requeued what it held, but it may have been handed a task since, before its
        # pod stopped: that one goes back now, not on the task timeout.
        requeued = self.dispatcher.recover_tasks(worker_id)
        if removed_reason == SCALED_DOWN:
            log.info("worker_removed", worker=worker_id, tasks_requeued=len(requeued))
            return
        log.warning(
            "worker_lost",
            worker=worker_id,
            phase=event.phase.value,
            reason=removed_reason or event.reason,
            exit_code=event.exit_code,
            tasks_requeued=len(requeued),
            message=event.summary,
        )
        if self.dispatcher.finished:
            log.info("worker_relaunch_dropped", old_worker=worker_id, reason="training is over")
            return
        if event.reason == PodReason.OOM_KILLED and not self.policy.relaunch_oom:
            log.error("worker_oom_killed_not_relaunched", worker=worker_id)
            self._fail_if_no_workers(
                f"worker {worker_id} was OOMKilled; raise --worker-resource-limit memory"
            )
            return
        if self._worker_relaunches_asked >= self.policy.max_worker_relaunches:
            self._fail_if_no_workers(
                f"workers died {self._worker_relaunches_asked + 1} times, more than --max-worker-relaunches "
                f"{self.policy.max_worker_relaunches}; last: worker {worker_id} {event.reason} "
                f"{event.summary}"
            )
            return
        with self._lock:
            short = self._target_workers - len(self._live_workers - set(self._removing)) - len(self._delayed)
        if short <= 0:
            return
        reason = removed_reason or event.reason
        ran = 0.0 if running_since is None else max(0.0, event.timestamp - running_since)
        delay, streak = self._backoff.stopped(worker_id, reason, ran)
        relaunch = DelayedRelaunch(self.clock() + delay, worker_id, reason, event.summary, streak)
        if delay <= 0:
            self._relaunch(relaunch)
            return
        with self._lock:
            self._delayed.append(relaunch)
        at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=delay)
        log.warning(
            "worker_relaunch_backed_off",
            old_worker=worker_id,
            reason=reason,
            failures_in_a_row=streak,
            ran_seconds=round(ran, 1),
            next_attempt_in_seconds=round(delay, 1),
            next_attempt_at=at.strftime("%Y-%m-%dT%H:%M:%SZ"),
        )

    def _start_due_relaunches(self) -> None:
        with self._lock:
            now = self.clock()
            due = [r for r in self._delayed if r.due <= now]
            self._delayed = [r for r in self._delayed if r.due > now]
        for relaunch in due:
            if self.dispatcher.finished:
                log.info("worker_relaunch_dropped", old_worker=relaunch.old_id, reason="training is over")
                continue
            self._relaunch(relaunch)

    def _relaunch(self, relaunch: DelayedRelaunch) -> None:
        """Start the replacement of worker ``relaunch.old_id`` now, continuing its line's streak."""
        new_id = self._start_worker()
        self._backoff.replaced(new_id, relaunch.streak)
        self.relaunches.append(
            RelaunchRecord(PodRole.WORKER.value, relaunch.old_id, new_id, relaunch.reason, relaunch.message)
        )
        log.info("worker_relaunched", old_worker=relaunch.old_id, new_worker=new_id, reason=relaunch.reason)

    def _fail_if_no_workers(self, message: str) -> None:
        with self._lock:
            waiting = bool(self._delayed)
        if not self.live_workers and not waiting and self.failure is None:
            self.failure = JobFailedError(f"no workers left: {message}")

    def _ps_stopped(self, event: PodEvent) -> None:
        if self.dispatcher.finished and event.phase is not PodPhase.FAILED:
            return
        log.warning(
            "ps_lost",
            ps=event.pod_id,
            reason=event.reason,
            exit_code=event.exit_code,
            message=event.summary,
        )
        if self.ps_relaunches >= self.policy.max_ps_relaunches:
            self.failure = JobFailedError(
                f"PS {event.pod_id} stopped ({event.reason}) after {self.ps_relaunches} PS relaunches "
                f"(--max-ps-relaunches {self.policy.max_ps_relaunches}): {event.summary}"
            )
            return
        self.backend.start(self.ps_spec(event.pod_id))
        self.relaunches.append(RelaunchRecord(PodRole.PS.value, event.pod_id, event.pod_id, event.reason))
        log.info("ps_relaunched", ps=event.pod_id, reason=event.reason)
