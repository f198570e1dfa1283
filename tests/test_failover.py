"""The failover module (edl_argo/master/failover.py): what a master saves, how a master started again
takes over (adopting pods, restoring each part, or starting afresh), and the one mechanism for a
``GetTask`` reply lost with the old master. No processes: the parts run in this one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edl_argo.master.config import TrainConfig
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.failover import LATER_PARTS, STATE_PARTS, MasterParts, state_to_save, take_over
from edl_argo.master.job import VersionTracker
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.rendezvous import RendezvousManager
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.state_store import DurableMasterServicer, MasterStateStore, job_fingerprint
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType, held_tasks
from edl_argo.master.training_stats import TrainingLoss
from edl_argo.pods import PodPhase, PodRole, PodStatus
from edl_argo.proto import master_pb2
from edl_argo.storage import LocalStorage

SHARDS = {"a": 100, "b": 60}
URLS = {TaskType.TRAINING: "train", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}


def first_master() -> tuple[TaskDispatcher, MasterServicer]:
    """A master of one epoch of :data:`SHARDS` in tasks of 40 records (five tasks), and its service."""
    dispatcher = TaskDispatcher(SHARDS, DispatcherConfig(records_per_task=40, num_epochs=1))
    evaluation = EvaluationService(lambda: {}, {}, 1)
    evaluation.dispatcher = dispatcher
    return dispatcher, MasterServicer(dispatcher, evaluation, URLS, lambda: 0)


class _NoCommit:
    """The state writer's interface, for a master whose saves are the test's business."""

    def commit(self) -> bool:
        return True

    def changed(self) -> None:
        pass


def restarted_master(saved: dict[str, Any], live: set[int]) -> tuple[TaskDispatcher, Any]:
    """A master restarted from the dispatcher state ``saved`` (as read back from the state file) whose
    adopted workers are ``live``: its dispatcher and its service, wired as the job wires them."""
    evaluation = EvaluationService(lambda: {}, {}, 1)
    saved = json.loads(json.dumps(saved))
    dispatcher = TaskDispatcher.restore(
        saved, on_evaluation_complete=evaluation.round_complete, live_workers=live
    )
    evaluation.dispatcher = dispatcher
    servicer = DurableMasterServicer(dispatcher, evaluation, URLS, lambda: 0, commit=_NoCommit())
    return dispatcher, servicer


def get_task(servicer: Any, worker_id: int, held: list[int]) -> Any:
    """The task ``servicer`` hands ``worker_id``, which lists ``held`` as the tasks it holds (or None)."""
    response = servicer.GetTask(master_pb2.GetTaskRequest(worker_id=worker_id, held_task_ids=held), None)
    return response.task if response.kind == master_pb2.GetTaskResponse.TASK else None


def finish_the_epoch(dispatcher: TaskDispatcher, servicer: Any, held: dict[int, list[int]]) -> list[int]:
    """Workers ``held`` (worker -> the tasks it holds) report every task they hold and then go on asking
    until nothing is left; returns the ids of every task handed out here, in order."""
    handed_out = []
    for _ in range(50):
        for worker, tasks in held.items():
            for task_id in tasks:
                report = master_pb2.ReportTaskResultRequest(worker_id=worker, task_id=task_id, success=True)
                assert servicer.ReportTaskResult(report, None).accepted, (worker, task_id)
            task = get_task(servicer, worker, [])
            held[worker] = [] if task is None else [task.task_id]
            handed_out += held[worker]
        if dispatcher.finished:
            return handed_out
    pytest.fail("the epoch did not end")


def test_a_task_whose_reply_was_lost_with_the_master_is_handed_to_its_worker_again() -> None:
    """The master saved that it gave task T to worker 0, then died before worker 0 got the reply. Worker 0
    asks the restarted master again, without T among the tasks it holds: it gets T (the same id and
    records), nobody else ever does, and the epoch ends with every record trained once."""
    dispatcher, before = first_master()
    other = get_task(before, 1, [])  # worker 1 got its task
    lost = get_task(before, 0, [])  # this reply never reached worker 0
    saved = dispatcher.snapshot()  # ... but the master saved it, then died

    restored, servicer = restarted_master(saved, live={0, 1})
    again = get_task(servicer, 0, [])
    assert again == lost
    handed_out = finish_the_epoch(restored, servicer, {0: [again.task_id], 1: [other.task_id]})
    assert lost.task_id not in handed_out and other.task_id not in handed_out
    accounting = restored.accounting()
    assert accounting.records_done_per_epoch == {0: sum(SHARDS.values())}
    assert accounting.tasks_done == accounting.tasks_total == 5


def test_a_worker_reading_ahead_keeps_its_task_across_a_restart_and_gets_its_lost_reply_again() -> None:
    """Workers read one task ahead: they ask for the next task while they train one, listing it. After a
    restart, a worker that lists the task it trains keeps it (nothing is requeued, nothing trained twice),
    and one whose last reply was lost gets that task again."""
    dispatcher, before = first_master()
    training_0 = get_task(before, 0, [])
    lost = get_task(before, 0, [training_0.task_id])  # read ahead; this reply never arrived
    training_1 = get_task(before, 1, [])  # worker 1 trains it and has not asked ahead yet
    saved = dispatcher.snapshot()

    restored, servicer = restarted_master(saved, live={0, 1})
    assert get_task(servicer, 0, [training_0.task_id]) == lost
    ahead_1 = get_task(servicer, 1, [training_1.task_id])
    assert ahead_1.task_id not in (training_0.task_id, lost.task_id, training_1.task_id)
    held = {0: [training_0.task_id, lost.task_id], 1: [training_1.task_id, ahead_1.task_id]}
    handed_out = finish_the_epoch(restored, servicer, held)
    assert not {training_0.task_id, lost.task_id, training_1.task_id, ahead_1.task_id} & set(handed_out)
    accounting = restored.accounting()
    assert accounting.records_done_per_epoch == {0: sum(SHARDS.values())}
    assert accounting.records_trained_twice == 0
    assert set(accounting.requeues.values()) == {0}


# -- taking over ----------------------------------------------------------------------------------------


class AdoptingBackend:
    """The pod backend's part that a take-over uses: the pods an old master left, and their removal."""

    def __init__(self, pods: list[tuple[PodRole, int]]) -> None:
        self.pods = [PodStatus(role, pod_id, PodPhase.RUNNING) for role, pod_id in pods]
        self.deleted: list[str] = []

    def adopt(self) -> list[PodStatus]:
        return list(self.pods)

    def delete(self, role: PodRole, pod_id: int, reason: str = "") -> None:
        self.deleted += [pod.name for pod in self.pods if (pod.role, pod.pod_id) == (role, pod_id)]
        self.pods = [pod for pod in self.pods if (pod.role, pod.pod_id) != (role, pod_id)]

    def list_pods(self) -> list[PodStatus]:
        return list(self.pods)

    def events(self, timeout: float) -> list[Any]:
        return []


class PodsSnapshot:
    """The pod manager's part that saving uses."""

    def snapshot(self) -> dict[str, Any]:
        return {
            "next_worker_id": 2,
            "target_workers": 2,
            "live_workers": [0, 1],
            "removing": {},
            "relaunches": [],
        }


def job_config(tmp_path: Path, **overrides: Any) -> TrainConfig:
    return TrainConfig(model_def="m.py", training_data="data/train", output=str(tmp_path), **overrides)


def new_parts(config: TrainConfig) -> MasterParts:
    """A master's parts as a new master makes them, before any take-over."""
    evaluation = EvaluationService(lambda: {}, {}, 1)
    dispatcher = TaskDispatcher(
        SHARDS,
        DispatcherConfig(records_per_task=40, num_epochs=1),
        on_evaluation_complete=evaluation.round_complete,
    )
    evaluation.dispatcher = dispatcher
    rendezvous = RendezvousManager(0) if config.allreduce else None
    return MasterParts(
        dispatcher, evaluation, VersionTracker(), TrainingLoss(), TrainingLedger(32), rendezvous
    )


def saved_by_a_first_master(config: TrainConfig, store: MasterStateStore) -> dict[str, Any]:
    """Workers 0 and 1 each hold a task, one task is done, model version 7: saved, then read back."""
    parts = new_parts(config)
    held = [parts.dispatcher.get_task(worker).task for worker in (0, 1, 0)]
    assert all(held) and parts.dispatcher.report(held[2].task_id, 0, success=True)
    parts.versions.observe(7)
    parts.training_loss.add(0, 0.5, 3)
    state = state_to_save(parts, PodsSnapshot(), started_at=123.0, master_port=4321, ps_ports=[5000])  # type: ignore[arg-type]
    assert set(state) == {*STATE_PARTS, *LATER_PARTS}
    store.save(state)
    loaded = store.load()
    assert loaded is not None
    return loaded


def test_a_restarted_master_keeps_the_tasks_of_adopted_workers_and_requeues_the_others(
    tmp_path: Path,
) -> None:
    config = job_config(tmp_path, num_ps=1)
    store = MasterStateStore(LocalStorage(tmp_path), "job", job_fingerprint(config, SHARDS, {}))
    saved = saved_by_a_first_master(config, store)
    held = {
        int(entry["worker_id"]): int(entry["task"]["task_id"]) for entry in held_tasks(saved["dispatcher"])
    }
    backend = AdoptingBackend([(PodRole.PS, 0), (PodRole.WORKER, 0)])  # worker 1 died with the master
    parts = new_parts(config)

    takeover = take_over(config, store, saved, backend, parts)  # type: ignore[arg-type]

    assert takeover.saved is saved and [pod.name for pod in takeover.adopted] == ["ps-0", "worker-0"]
    assert takeover.started_at == 123.0 and takeover.master_port(0) == 4321
    restored = takeover.dispatcher
    assert restored is not parts.dispatcher and parts.evaluation.dispatcher is restored
    assert restored.held_task(held[0], 0) is not None  # worker 0's report will count
    assert restored.held_task(held[1], 1) is None
    assert restored.get_task(2).task.task_id == held[1]  # requeued at the front
    accounting = restored.accounting()
    assert accounting.requeues["master_restarted"] == 1 and accounting.tasks_done == 1
    assert parts.versions.version == 7 and parts.training_loss.per_epoch() == {0: 0.5}
    assert backend.deleted == []


def test_a_state_saved_before_the_allreduce_group_was_saved_still_continues(tmp_path: Path) -> None:
    config = job_config(tmp_path, distribution_strategy="AllreduceStrategy", num_ps=0)
    store = MasterStateStore(LocalStorage(tmp_path), "job", job_fingerprint(config, SHARDS, {}))
    saved = saved_by_a_first_master(config, store)
    older = {part: value for part, value in saved.items() if part not in LATER_PARTS}
    store.save({part: older[part] for part in STATE_PARTS})
    loaded = store.load()
    assert loaded is not None and "allreduce_group" not in loaded
    parts = new_parts(config)

    takeover = take_over(config, store, loaded, AdoptingBackend([(PodRole.WORKER, 1)]), parts)  # type: ignore[arg-type]

    assert takeover.saved is not None and parts.rendezvous is not None
    assert parts.rendezvous.committed is None and parts.versions.version == 7


@pytest.mark.parametrize(
    ("settings", "adopted", "reason"),
    [
        ({"num_ps": 1}, [(PodRole.WORKER, 0), (PodRole.WORKER, 1)], "PS [0] lost without --checkpoint-steps"),
        ({"distribution_strategy": "AllreduceStrategy", "num_ps": 0}, [], "no worker survived"),
    ],
    ids=["ps-lost", "allreduce-no-worker"],
)
def test_a_job_whose_model_is_gone_starts_afresh_and_removes_the_pods_left(
    tmp_path: Path,
    settings: dict[str, Any],
    adopted: list[tuple[PodRole, int]],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = job_config(tmp_path, **settings)
    store = MasterStateStore(LocalStorage(tmp_path), "job", job_fingerprint(config, SHARDS, {}))
    saved = saved_by_a_first_master(config, store)
    backend = AdoptingBackend(adopted)
    parts = new_parts(config)

    takeover = take_over(config, store, saved, backend, parts)  # type: ignore[arg-type]

    assert takeover.saved is None and takeover.adopted == [] and takeover.dispatcher is parts.dispatcher
    assert takeover.master_port(2221) == 2221 and takeover.started_at > 123.0
    assert sorted(backend.deleted) == sorted(f"{role.value}-{pod_id}" for role, pod_id in adopted)
    assert parts.versions.version == 0 and parts.dispatcher.accounting().tasks_done == 0
    discarded = [r for r in caplog.records if r.getMessage() == "master_state_discarded"]
    assert len(discarded) == 1 and reason in discarded[0].fields["reason"]


def test_saved_state_round_trips_through_json_as_the_state_file_holds_it(tmp_path: Path) -> None:
    config = job_config(tmp_path, num_ps=1)
    store = MasterStateStore(LocalStorage(tmp_path), "job", job_fingerprint(config, SHARDS, {}))
    saved = saved_by_a_first_master(config, store)
    assert json.loads(json.dumps(saved)) == saved
    assert saved["ps_ports"] == [5000] and saved["allreduce_group"] is None


# -- what a restart repeats is accounted for ---------------------------------------------------------------

MINIBATCH = 10  # a task of 40 records is 4 minibatches


def trained(task: master_pb2.Task) -> dict[str, int]:
    """The counters of a training task trained to its end: one update of the PS per minibatch."""
    records = task.end - task.start
    return {"records": records, "steps": -(-records // MINIBATCH), "epoch": task.epoch}


@pytest.mark.parametrize("first_to_ask", [0, 1], ids=["its-worker-asks-first", "another-worker-asks-first"])
def test_a_task_handed_out_after_the_last_save_is_trained_again_and_adds_up_in_the_accounting(
    first_to_ask: int,
) -> None:
    """The old master gave worker 0 a task after its last save (worker 0 got it and trains it); the
    restarted master does not know, and hands the same records out again, never under an id worker 0
    listed as held: worker 0's report of its task is ignored, whoever asks first. Both trainings reached
    the PS: the ledger counts the ignored one, so the PS's version adds up exactly, and a report sent again
    after its reply was lost is not counted again."""
    from edl_argo.master.ledger import PsReport

    ledger = TrainingLedger(MINIBATCH)
    dispatcher, before = first_master()
    before._ledger = ledger
    first = get_task(before, 0, [])
    saved = json.loads(json.dumps({"dispatcher": dispatcher.snapshot(), "ledger": ledger.snapshot()}))
    unsaved = get_task(before, 0, [first.task_id])  # worker 0 got it; the master died before saving

    restored, servicer = restarted_master(saved["dispatcher"], live={0, 1})
    after = TrainingLedger(MINIBATCH)
    after.restore(saved["ledger"])
    servicer._ledger = after
    updates = 0  # the PS's version: one update per minibatch any worker trained

    def report(worker: int, task: master_pb2.Task) -> bool:
        nonlocal updates
        request = master_pb2.ReportTaskResultRequest(
            worker_id=worker, task_id=task.task_id, success=True, counters=trained(task)
        )
        updates += trained(task)["steps"]
        accepted = servicer.ReportTaskResult(request, None).accepted
        retried = servicer.ReportTaskResult(request, None).accepted  # its reply was lost: sent again
        assert not retried
        return accepted

    assert report(0, first)
    again = get_task(servicer, first_to_ask, [unsaved.task_id] if first_to_ask == 0 else [])
    assert (again.shard, again.start, again.end) == (unsaved.shard, unsaved.start, unsaved.end)
    assert (again.task_id == unsaved.task_id) == (first_to_ask == 1)  # a listed id is never reused
    assert not report(0, unsaved)  # worker 0's first training of it: ignored, yet counted
    assert report(first_to_ask, again)
    while (task := get_task(servicer, 1, [])) is not None:
        assert report(1, task)
    assert restored.finished
    section, problems = after.ps_updates(restored.accounting(), [PsReport(0, updates, 0, -1)])
    assert problems == []
    assert section["minibatches_trained"] == 16 and updates == 20
    assert section["minibatches_of_ignored_reports"] == 4
