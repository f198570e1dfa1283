"""The pod manager's bookkeeping of workers against the dispatcher's tasks, on a backend that runs nothing."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from edl_argo.master.pod_manager import SCALED_DOWN, PodManager, PodPolicy
from edl_argo.master.rendezvous import RendezvousManager
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, held_tasks
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
        for entry in held_tasks(dispatcher.snapshot())
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


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def crash_loop_manager(
    backoff: float = 10.0, max_relaunches: int = 16, num_workers: int = 1, **manager_options: Any
) -> tuple[PodManager, RecordingPods, Clock]:
    dispatcher = TaskDispatcher({"shard": 100}, DispatcherConfig(records_per_task=10, num_epochs=1))
    pods, clock = RecordingPods(), Clock()
    manager = PodManager(
        pods,  # type: ignore[arg-type]
        PodPolicy(
            num_workers=num_workers,
            num_ps=0,
            max_worker_relaunches=max_relaunches,
            relaunch_backoff_seconds=backoff,
        ),
        dispatcher,
        worker_spec,
        worker_spec,
        clock=clock,
        **manager_options,
    )
    manager.start()
    return manager, pods, clock


def run_then_stop(
    manager: PodManager, worker: int, at: float, ran: float, reason: str = PodReason.KILLED
) -> None:
    phase = PodPhase.DELETED if reason == PodReason.PREEMPTED else PodPhase.FAILED
    manager.handle([PodEvent(PodRole.WORKER, worker, PodPhase.RUNNING, None, PodReason.STARTED, "", at)])
    manager.handle([PodEvent(PodRole.WORKER, worker, phase, 137, reason, "killed", at + ran)])


def test_a_crash_loop_is_relaunched_after_growing_delays_reset_by_a_worker_that_ran_long() -> None:
    manager, pods, clock = crash_loop_manager()
    run_then_stop(manager, 0, at=0.0, ran=2.0)
    assert pods.started == ["worker-0", "worker-1"]  # the first failure: relaunched at once

    delays = []
    for worker in (1, 2, 3):
        run_then_stop(manager, worker, at=0.0, ran=2.0)
        started = len(pods.started)
        waited = 0.0
        while len(pods.started) == started:
            assert waited < 100, "never relaunched"
            clock.now += 0.5
            waited += 0.5
            manager.handle([])
        delays.append(waited)
    assert delays == [10.0, 20.0, 40.0]
    assert manager.worker_relaunches == 4

    run_then_stop(manager, 4, at=0.0, ran=700.0)  # ran 10 minutes and more: the streak is over
    assert pods.started[-1] == "worker-5"


def test_a_preempted_worker_is_replaced_at_once_and_ends_the_streak() -> None:
    manager, pods, _ = crash_loop_manager()
    run_then_stop(manager, 0, at=0.0, ran=1.0)
    run_then_stop(manager, 1, at=0.0, ran=1.0, reason=PodReason.PREEMPTED)
    assert pods.started == ["worker-0", "worker-1", "worker-2"]
    run_then_stop(manager, 2, at=0.0, ran=1.0)
    assert pods.started[-1] == "worker-3"  # a new streak's first failure


def test_a_waiting_relaunch_counts_toward_the_limit_and_the_target_and_scale_down_cancels_it() -> None:
    manager, pods, clock = crash_loop_manager(max_relaunches=2)
    run_then_stop(manager, 0, at=0.0, ran=1.0)
    run_then_stop(manager, 1, at=0.0, ran=1.0)  # waits 10 s
    assert manager.worker_relaunches == 1 and manager.failure is None  # the waiting one keeps the job alive
    run_then_stop(manager, 9, at=0.0, ran=1.0)  # a third: the waiting relaunch counts toward the limit of 2
    assert manager.worker_relaunches == 1 and pods.started == ["worker-0", "worker-1"]
    manager.scale_workers(1)
    assert pods.started == ["worker-0", "worker-1"]  # the target counts the waiting relaunch: none added
    manager.scale_workers(0)
    clock.now += 60
    manager.handle([])
    assert pods.started == ["worker-0", "worker-1"]  # cancelled by the scale-down
    assert manager.worker_relaunches == 1


def test_without_backoff_every_relaunch_starts_at_once() -> None:
    manager, pods, _ = crash_loop_manager(backoff=0)
    for worker in range(4):
        run_then_stop(manager, worker, at=0.0, ran=1.0)
    assert pods.started == [f"worker-{i}" for i in range(5)]


def test_a_scale_request_while_the_ps_start_waits_for_them_and_sets_how_many_workers_start() -> None:
    """``edl-argo scale`` may come as soon as the master serves, while its PS are still starting (a local
    pod template still importing): the workers need the PS's addresses, so the request sets the target and
    the workers start once the PS have, as many as it asked."""
    started: list[str] = []

    def ps_spec(ps_id: int) -> PodSpec:
        return PodSpec(PodRole.PS, ps_id, ("true",), port=2000 + ps_id)

    def spec_of_worker(worker_id: int) -> PodSpec:
        assert "ps-0" in started, "a worker's spec was made before its PS started"
        return worker_spec(worker_id)

    class SlowPods(RecordingPods):
        def start(self, spec: PodSpec) -> None:
            if spec.role == PodRole.PS:  # a scale request arrives while the PS starts
                manager.request_workers(3)
            started.append(spec.name)
            super().start(spec)

    dispatcher = TaskDispatcher({"shard": 100}, DispatcherConfig(records_per_task=10, num_epochs=1))
    pods = SlowPods()
    manager = PodManager(
        pods,  # type: ignore[arg-type]
        PodPolicy(num_workers=1, num_ps=1),
        dispatcher,
        spec_of_worker,
        ps_spec,
    )
    manager.start()
    assert pods.started == ["ps-0", "worker-0", "worker-1", "worker-2"]
    assert manager.live_workers == [0, 1, 2]


def test_a_worker_lost_once_training_is_over_is_not_replaced_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker lost after the last task is done (a hung group member removed as stuck, whose requeued
    task its peer finished at once) gets no replacement: there is nothing left to train. The log says so,
    as for a relaunch that was waiting (a person reading it, and the chaos check, can tell why)."""
    caplog.set_level(logging.INFO, logger="edl_argo.master.pod_manager")
    manager, pods, _ = crash_loop_manager()
    while (task := manager.dispatcher.get_task(0).task) is not None:
        assert manager.dispatcher.report(task.task_id, 0, success=True)
    assert manager.dispatcher.finished

    run_then_stop(manager, 0, at=0.0, ran=1.0)

    assert pods.started == ["worker-0"]
    (dropped,) = [r for r in caplog.records if r.getMessage() == "worker_relaunch_dropped"]
    assert dropped.fields == {"old_worker": 0, "reason": "training is over"}  # type: ignore[attr-defined]


def test_every_worker_pod_that_ends_is_told_to_the_listener_also_once_training_is_over() -> None:
    """An AllreduceStrategy job's group must lose a member whose pod ended whenever it ends: its master
    once took that from the events of its training loop only, so a worker that finished after the last
    task kept its place in the round, and a peer still in a group step with it waited the whole
    collective timeout for it (15 s of a chaos trial's 57 s; 60 s by default)."""
    rendezvous = RendezvousManager()
    manager, pods, _ = crash_loop_manager(num_workers=3, on_worker_stopped=rendezvous.remove)
    for worker_id in range(3):
        rendezvous.rendezvous(worker_id, f"127.0.0.1:{7000 + worker_id}")
    while (task := manager.dispatcher.get_task(0).task) is not None:
        assert manager.dispatcher.report(task.task_id, 0, success=True)
    assert manager.dispatcher.finished

    manager.handle([PodEvent(PodRole.WORKER, 1, PodPhase.SUCCEEDED, 0, PodReason.COMPLETED, "", 0.0)])
    assert [member.worker_id for member in rendezvous.current.members] == [0, 2]
    manager.handle([PodEvent(PodRole.WORKER, 0, PodPhase.FAILED, 1, PodReason.ERROR, "", 0.0)])
    assert [member.worker_id for member in rendezvous.current.members] == [2]
    assert pods.started == ["worker-0", "worker-1", "worker-2"]  # nothing left to train: no replacement
