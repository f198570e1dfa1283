"""The pod manager's bookkeeping of workers against the dispatcher's tasks, on a backend that runs nothing."""

from __future__ import annotations

from edl_argo.master.pod_manager import SCALED_DOWN, PodManager, PodPolicy
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher
from edl_argo.pods import PodEvent, PodPhase, PodReason, PodRole, PodSpec


class RecordingPods:
    """A backend that runs nothing and records what it was asked to start and delete."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.specs: list[PodSpec] = []
        self.deleted: list[tuple[str, str]] = []

    def start(self, spec: PodSpec) -> None:
        self.started.append(spec.name)
        self.specs.append(spec)

    def delete(self, role: PodRole, pod_id: int, *, reason: str = PodReason.DELETED, **_: object) -> None:
        self.deleted.append((f"{role.value}-{pod_id}", reason))


def worker_spec(worker_id: int) -> PodSpec:
    return PodSpec(PodRole.WORKER, worker_id, ("true",))


def held_by(dispatcher: TaskDispatcher, worker_id: int) -> list[int]:
    return [
        entry["task"]["task_id"]
        for entry in dispatcher.snapshot()["doing"]
        if entry["worker_id"] == worker_id
    ]


def test_a_task_a_scaled_down_worker_took_while_it_stopped_is_requeued_when_it_ends() -> None:
    """Scaling down requeues the tasks a worker holds, then asks its pod to stop; until it has, the worker
    may still ask for a task and get one. When its pod ends that task goes back to the queue at once, not
    after the task timeout (a whole epoch waited for it: 180 s in a chaos trial)."""
    dispatcher = TaskDispatcher({"shard": 100}, DispatcherConfig(records_per_task=10, num_epochs=1))
    pods = RecordingPods()
    manager = PodManager(
        pods,  # type: ignore[arg-type]
        PodPolicy(num_workers=2, num_ps=0),
        dispatcher,
        worker_spec,
        worker_spec,
    )
    manager.start()
    first = dispatcher.get_task(1).task
    assert first is not None

    manager.scale_workers(1)
    assert pods.deleted == [("worker-1", SCALED_DOWN)]
    assert held_by(dispatcher, 1) == []
    late = dispatcher.get_task(1).task  # asked before its pod stopped
    assert late is not None and held_by(dispatcher, 1) == [late.task_id]

    manager.handle([PodEvent(PodRole.WORKER, 1, PodPhase.DELETED, 137, PodReason.DELETED, "", 0.0)])

    assert held_by(dispatcher, 1) == []
    served = [dispatcher.get_task(0).task for _ in range(10)]
    assert sorted(task.start for task in served if task is not None) == list(range(0, 100, 10))
