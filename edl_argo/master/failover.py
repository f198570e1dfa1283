"""Master failover: what a master saves, how a master started again continues the job, and what a worker
whose reply was lost with the old master gets.

**What is saved.** The state of every part of a running master (:class:`MasterParts`) plus where it ran,
as :func:`state_to_save` makes it: the parts of :data:`STATE_PARTS` (each part's own ``snapshot()``; the
dispatcher's is taken before the evaluation's, as :meth:`~edl_argo.master.evaluation.EvaluationService.
snapshot` requires) and those of :data:`LATER_PARTS`. :mod:`edl_argo.master.state_store` keeps it in the
job's storage as a snapshot and a log of changes (with the job name and the settings a job cannot change),
saves it as it goes (group commit) and answers a worker's report only once the change it made is saved, so
an accepted report is never repeated, and a restart repeats at most the tasks in flight.

**How a restarted master continues.** :func:`take_over`, before the master serves: it adopts the pods the
old master left running (:meth:`~edl_argo.pods.PodBackend.adopt`) and restores every part: the dispatcher
(tasks held by adopted workers stay theirs, with their age, so their reports count; those of workers that
did not survive are requeued, reason ``master_restarted``), the evaluation service, the model version, the
training loss, the ledger and, with AllreduceStrategy, the group's committed state. The master then serves
on the saved port, so running workers carry on, and :meth:`Takeover.start_pods` resumes the pod
bookkeeping: pods that died with the old master are started again (a PS restores its checkpoint). The
model lives in the PSes or, with AllreduceStrategy, in the workers: the group re-forms around any worker
that survived (round ids come from the clock, so they only grow across masters) or, when none did, starts
from its newest checkpoint. Without ``--checkpoint-steps`` a lost PS, or an AllreduceStrategy job with no
surviving worker, has lost the model: the state is discarded and the job starts afresh. Without a state,
or when starting afresh, the pods an earlier master left are removed, and so are the checkpoints of the
job's own checkpoint series (:func:`own_checkpoint_series`), so a new run never restores them.

**A lost reply.** The old master saved that it gave task T to worker W, then died before W got the reply;
W, adopted, asks the new master again. Every ``GetTask`` lists the tasks the worker holds (it reads one task
ahead: it asks for the next while it trains one), so a task the dispatcher has W holding that W does not
list is one whose reply W never got: :func:`lost_reply` hands it to W again, with the same id, counted once
and requeued never. This is the one mechanism for it; it serves any lost ``GetTask`` reply (a master
restart, or a call that timed out after the master answered).

**A handout that was not saved.** The old master gave W task T, W got it, and the master died before
saving that: the new master does not know T, and its dispatcher would give T's id to the next task it hands
out (most likely T's own records, to W or another worker). W's report of T is ignored (the ledger still
counts what it trained: :meth:`~edl_argo.master.ledger.TrainingLedger.add_ignored`), and the records are
trained again under a new id: :func:`skip_unsaved_task_ids` keeps ids a worker lists as held from being
handed out again, so W's report of T is never taken for the new task's. This is what a restart repeats:
the tasks in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from edl_argo.checkpoint import CheckpointSeries
from edl_argo.errors import DataFormatError
from edl_argo.log import get_logger
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.pod_manager import PodManager
from edl_argo.master.rendezvous import RendezvousManager
from edl_argo.master.task_dispatcher import Task, TaskDispatcher, held_tasks
from edl_argo.master.training_stats import TrainingLoss
from edl_argo.pods import PodBackend, PodRole, PodStatus
from edl_argo.storage import open_storage

if TYPE_CHECKING:
    from edl_argo.master.config import TrainConfig
    from edl_argo.master.state_store import MasterStateStore

log = get_logger(__name__)

#: The parts of the state (besides format, job name and fingerprint) every state file has.
STATE_PARTS = (
    "started_at",
    "master_port",
    "ps_ports",
    "dispatcher",
    "evaluation",
    "model_version",
    "training_loss",
    "ledger",
    "pods",
)
#: Parts added since: saved too, but a state saved before one existed still loads (the part is then None).
LATER_PARTS = ("allreduce_group",)


class ModelVersions(Protocol):
    """The newest model version a master knows (:class:`~edl_argo.master.job.VersionTracker`)."""

    @property
    def version(self) -> int: ...

    def observe(self, version: int) -> int: ...


@dataclass
class MasterParts:
    """The parts of a running master whose state is saved; each has its own ``snapshot`` and restore."""

    dispatcher: TaskDispatcher
    evaluation: EvaluationService
    versions: ModelVersions
    training_loss: TrainingLoss
    ledger: TrainingLedger
    rendezvous: RendezvousManager | None


def state_to_save(
    parts: MasterParts, pods: PodManager, *, started_at: float, master_port: int, ps_ports: Sequence[int]
) -> dict[str, Any]:
    """What a restarted master continues from: every part of :data:`STATE_PARTS` and :data:`LATER_PARTS`."""
    return {
        "started_at": started_at,
        "master_port": master_port,
        "ps_ports": list(ps_ports),
        "dispatcher": parts.dispatcher.snapshot(),
        "evaluation": parts.evaluation.snapshot(),  # after the dispatcher's
        "model_version": parts.versions.version,
        "training_loss": parts.training_loss.snapshot(),
        "ledger": parts.ledger.snapshot(),
        "pods": pods.snapshot(),
        "allreduce_group": parts.rendezvous.snapshot() if parts.rendezvous is not None else None,
    }


@dataclass(frozen=True)
class Takeover:
    """How a master starts: continuing ``saved`` with the pods it ``adopted``, or (``saved`` None) afresh.

    ``dispatcher`` is the one to use from now on (the restored one when continuing); ``started_at`` when
    the job started (the first master's start when continuing)."""

    saved: dict[str, Any] | None
    adopted: list[PodStatus]
    dispatcher: TaskDispatcher
    started_at: float

    def master_port(self, configured: int) -> int:
        """The port to serve on: the old master's (where adopted workers expect it), else ``configured``."""
        return int(self.saved["master_port"]) if self.saved is not None else configured

    def start_pods(self, pods: PodManager) -> None:
        """Resume the old master's pod bookkeeping with the adopted pods, or start the job's pods."""
        if self.saved is None:
            pods.start()
        else:
            pods.resume(self.saved["pods"], self.adopted)


def take_over(
    config: TrainConfig,
    store: MasterStateStore,
    saved: dict[str, Any] | None,
    backend: PodBackend,
    parts: MasterParts,
) -> Takeover:
    """Continue from ``saved`` (what :meth:`MasterStateStore.load` read, or None): adopt the old master's
    pods and restore every part of ``parts``: the dispatcher anew (:attr:`Takeover.dispatcher`, which
    ``parts.evaluation`` is given), the others in place. Without a state, or with one the job cannot
    continue from (its model is gone), remove the pods an earlier master left and the job's own
    checkpoints, and start afresh.

    Raises:
        DataFormatError: a part of ``saved`` cannot be restored (naming the state file).
    """
    adopted = backend.adopt()
    if saved is None:
        start_afresh(config, backend, adopted)
        return Takeover(None, [], parts.dispatcher, time.time())
    if parts.rendezvous is not None:
        parts.rendezvous.restore(saved.get("allreduce_group"))
    surviving_ps = {pod.pod_id for pod in adopted if pod.role is PodRole.PS}
    workers = {pod.pod_id for pod in adopted if pod.role is PodRole.WORKER}
    reason = _why_not_continued(config, surviving_ps, workers)
    if reason:
        log.warning("master_state_discarded", job=config.job_name, state=store.url, reason=reason)
        start_afresh(config, backend, adopted)
        return Takeover(None, [], parts.dispatcher, time.time())
    try:
        dispatcher = restored_dispatcher(saved, store, parts.evaluation.round_complete, workers)
        parts.evaluation.dispatcher = dispatcher
        parts.evaluation.restore(saved["evaluation"])
        parts.versions.observe(int(saved["model_version"]))
        parts.training_loss.restore(saved["training_loss"])
        parts.ledger.restore(saved["ledger"])
        started_at = float(saved["started_at"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise store.corrupt(f"{type(error).__name__}: {error}") from None
    accounting = dispatcher.accounting()
    log.info(
        "master_state_restored",
        job=config.job_name,
        state=store.url,
        tasks_done=accounting.tasks_done,
        tasks_total=accounting.tasks_total,
        tasks_requeued=accounting.requeues["master_restarted"]
        - int(saved["dispatcher"]["requeues"]["master_restarted"]),
        workers_adopted=len(workers),
        ps_adopted=len(surviving_ps),
        workers_holding_tasks=len(
            {int(entry["worker_id"]) for entry in held_tasks(saved["dispatcher"])} & workers
        ),
        model_version=parts.versions.version,
        evaluations=len(parts.evaluation.history),
    )
    return Takeover(saved, adopted, dispatcher, started_at)


def _why_not_continued(config: TrainConfig, surviving_ps: set[int], workers: set[int]) -> str:
    """Why the job cannot continue with these pods ("" if it can). The model lives in the PSes (restorable
    from checkpoints) or, with AllreduceStrategy, in the workers: any surviving worker holds it and hands it
    to the others when the group re-forms, and without one the group starts from its newest checkpoint."""
    lost_ps = sorted(set(range(config.num_ps)) - surviving_ps)
    if config.allreduce and not workers and not config.checkpoint_steps:
        return "AllreduceStrategy: no worker survived to hold the model, and no --checkpoint-steps"
    if lost_ps and not config.checkpoint_steps:
        return f"PS {lost_ps} lost without --checkpoint-steps"
    return ""


def restored_dispatcher(
    saved: dict[str, Any],
    store: MasterStateStore,
    on_evaluation_complete: Callable[[int], None],
    live_workers: Collection[int],
) -> TaskDispatcher:
    """The saved dispatcher, with the tasks of workers not in ``live_workers`` requeued (see
    :meth:`TaskDispatcher.restore`); the state's DataFormatError if it is corrupt."""
    try:
        return TaskDispatcher.restore(
            saved["dispatcher"], on_evaluation_complete=on_evaluation_complete, live_workers=live_workers
        )
    except (DataFormatError, KeyError, TypeError, ValueError) as error:
        raise store.corrupt(f"dispatcher: {error}") from None


def check_saved_dispatcher(saved: dict[str, Any], store: MasterStateStore) -> None:
    """The state's DataFormatError if its dispatcher cannot be restored (checked before any pod starts)."""
    try:
        live_workers = {int(entry["worker_id"]) for entry in held_tasks(saved["dispatcher"])}
    except (KeyError, TypeError, ValueError) as error:
        raise store.corrupt(f"dispatcher: {error}") from None
    restored_dispatcher(saved, store, lambda *_: None, live_workers)


def lost_reply(dispatcher: TaskDispatcher, worker_id: int, held_task_ids: Collection[int]) -> Task | None:
    """The task to hand ``worker_id`` again because it never got the reply that gave it: the first task the
    dispatcher has it holding that is not among ``held_task_ids`` (those the worker says it holds). None if
    there is none, or once the job failed."""
    if dispatcher.failure is not None:
        return None
    task = dispatcher.oldest_held_task(worker_id, frozenset(held_task_ids))
    if task is not None:
        log.info("task_assigned_again", task=task.task_id, worker=worker_id)
    return task


def skip_unsaved_task_ids(dispatcher: TaskDispatcher, worker_id: int, held_task_ids: Collection[int]) -> None:
    """Ids ``worker_id`` lists as held that ``dispatcher`` never handed out (an earlier master did, and
    died before saving it) are never given to another task (:meth:`TaskDispatcher.skip_task_ids`)."""
    skipped = dispatcher.skip_task_ids(held_task_ids)
    if skipped:
        log.warning("unsaved_tasks_skipped", worker=worker_id, tasks=skipped)


# ---------------------------------------------------------------------- starting afresh


def start_afresh(config: TrainConfig, backend: PodBackend, leftovers: list[PodStatus]) -> None:
    """The job starts afresh: remove the pods an earlier master of it left (their tasks died with it) and
    the checkpoints of its own series."""
    remove_leftover_pods(config, backend, leftovers)
    remove_stale_checkpoints(config)


def own_checkpoint_series(config: TrainConfig) -> list[CheckpointSeries]:
    """The checkpoint series the holders of job ``config`` save (none without ``--checkpoint-steps``)."""
    if not config.checkpoint_steps:
        return []
    from edl_argo.collective.checkpoint import group_checkpoints  # TensorFlow: only when there are any
    from edl_argo.ps.checkpoint import ps_checkpoints

    storage = open_storage(config.checkpoints_url)
    if config.allreduce:
        return [group_checkpoints(storage)]
    return [ps_checkpoints(storage, i) for i in range(config.num_ps)]


def remove_stale_checkpoints(config: TrainConfig) -> None:
    """A job that starts afresh never restores the checkpoints an earlier run of it left. Only the
    checkpoints its own holders would restore are removed, by name (the series ``ps-<id>`` of its PSes, or
    ``allreduce``); anything else under ``--checkpoint-dir`` is left alone."""
    removed = sum(series.clear() for series in own_checkpoint_series(config))
    if removed:
        log.warning(
            "stale_checkpoints_removed",
            job=config.job_name,
            checkpoints=config.checkpoints_url,
            objects=removed,
        )


def remove_leftover_pods(config: TrainConfig, backend: PodBackend, leftovers: list[PodStatus]) -> None:
    """Delete the pods an earlier master of this job left (adopted from ``backend``) and wait until they are
    gone (at most two minutes). PSes restore their checkpoints when started again."""
    if leftovers:
        log.warning("leftover_pods_removed", job=config.job_name, pods=",".join(p.name for p in leftovers))
    for pod in leftovers:
        backend.delete(pod.role, pod.pod_id, reason="Leftover")
    deadline = time.monotonic() + 120
    while backend.list_pods() and time.monotonic() < deadline:
        backend.events(timeout=0.5)
