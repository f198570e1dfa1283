"""The worker range's rules (:mod:`edl_argo.master.worker_scaler`) on the real pod manager, dispatcher and
throughput meter, with a backend that runs nothing and a clock the test moves."""

from __future__ import annotations

import pytest

from edl_argo.errors import JobFailedError
from edl_argo.master.pod_manager import PodManager, PodPolicy, WorkerCounts
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher
from edl_argo.master.throughput import ThroughputMeter
from edl_argo.master.worker_scaler import RETRY_WINDOWS, WorkerRange, WorkerScaler
from edl_argo.pods import PodEvent, PodPhase, PodReason, PodRole, PodSpec
from tests.test_pod_manager import RecordingPods

WINDOW = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Job:
    """A pod manager over a backend that runs nothing, its dispatcher, meter and scaler on one clock."""

    def __init__(self, *, start: int, minimum: int = 1, maximum: int, timeout: float = 300.0) -> None:
        self.clock = Clock()
        self.dispatcher = TaskDispatcher(
            {"shard": 10_000}, DispatcherConfig(records_per_task=10, num_epochs=1)
        )
        self.backend = RecordingPods()
        self.pods = PodManager(
            self.backend,  # type: ignore[arg-type]
            PodPolicy(num_workers=start, num_ps=0),
            self.dispatcher,
            lambda i: PodSpec(PodRole.WORKER, i, ("true",)),
            lambda i: PodSpec(PodRole.PS, i, ("true",), port=1),
        )
        self.meter = ThroughputMeter(clock=self.clock)
        self.scaler = WorkerScaler(
            WorkerRange(minimum, maximum, timeout, WINDOW, min_gain=0.5),
            self.pods,
            self.dispatcher,
            self.meter,
            clock=self.clock,
        )
        self.pods.start()

    def event(self, worker: int, phase: PodPhase, reason: str = PodReason.STARTED) -> None:
        self.pods.handle([PodEvent(PodRole.WORKER, worker, phase, None, reason, "", self.clock.now)])

    def train(self, seconds: float, rates: dict[int, float]) -> None:
        """Workers report records at ``rates`` (records/s) for ``seconds``, the scaler ticking each second."""
        for _ in range(int(seconds)):
            self.clock.now += 1.0
            for worker, rate in rates.items():
                self.meter.record(worker, int(rate))
            self.scaler.tick()

    def started(self) -> list[str]:
        return [name for name in self.backend.started if name.startswith("worker")]


def test_pods_that_wait_for_room_count_as_pending_and_scale_down_removes_them_first() -> None:
    job = Job(start=3, maximum=3)
    job.event(0, PodPhase.RUNNING)
    job.event(1, PodPhase.PENDING, PodReason.UNSCHEDULABLE)
    job.event(2, PodPhase.RUNNING)
    assert job.pods.worker_counts() == WorkerCounts(running=2, pending=1, wanted=3)

    job.pods.scale_workers(2)  # the newest is 2, but 1 holds nothing: it goes
    assert job.backend.deleted == [("worker-1", "ScaledDown")]
    assert job.pods.worker_counts() == WorkerCounts(running=2, pending=0, wanted=2)


def test_training_pauses_below_the_minimum_and_resumes_when_enough_workers_run() -> None:
    job = Job(start=2, minimum=2, maximum=2)
    job.event(0, PodPhase.RUNNING)
    job.event(1, PodPhase.PENDING, PodReason.UNSCHEDULABLE)
    job.scaler.tick()
    assert job.scaler.paused
    assert job.dispatcher.get_task(0).kind == "wait"  # no training task while 1 of 2 runs

    job.clock.now += 30
    job.event(1, PodPhase.RUNNING)
    job.scaler.tick()
    assert not job.scaler.paused
    assert job.dispatcher.get_task(0).kind == "task"

    # Preemption takes worker 1: its replacement waits for room, training pauses again.
    job.event(1, PodPhase.DELETED, PodReason.PREEMPTED)
    job.event(2, PodPhase.PENDING, PodReason.UNSCHEDULABLE)
    job.scaler.tick()
    assert job.scaler.paused and job.dispatcher.get_task(0).kind == "wait"
    job.clock.now += 12
    job.event(2, PodPhase.RUNNING)
    job.scaler.tick()
    assert not job.scaler.paused
    # Waiting for the first workers is the job's start, not a pause.
    assert job.scaler.summary()["paused_seconds"] == 12.0


def test_a_pause_longer_than_the_timeout_fails_the_job_with_a_line_that_says_so() -> None:
    job = Job(start=3, minimum=3, maximum=3, timeout=120)
    job.event(0, PodPhase.RUNNING)
    job.event(1, PodPhase.PENDING, PodReason.UNSCHEDULABLE)
    job.scaler.tick()
    job.clock.now += 119
    job.scaler.tick()  # not yet
    job.clock.now += 1
    with pytest.raises(JobFailedError) as failed:
        job.scaler.tick()
    message = str(failed.value)
    assert "--min-workers-timeout" in message and "1 of --min-workers 3" in message
    assert "1 waiting for room" in message and "\n" not in message


def test_growth_doubles_its_step_while_workers_pay_fully_and_stops_when_they_do_not() -> None:
    job = Job(start=1, maximum=6)
    job.event(0, PodPhase.RUNNING)
    job.train(WINDOW + 1, {0: 100})
    assert job.started() == ["worker-0", "worker-1"]  # 1 worker measured: add one

    job.event(1, PodPhase.RUNNING)
    job.train(WINDOW / 2, {0: 100})  # worker 1 runs but has not trained yet: not measured
    assert len(job.started()) == 2
    job.train(WINDOW + 1, {0: 100, 1: 90})  # +0.9 of a worker's share: the step doubles
    assert job.started()[2:] == ["worker-2", "worker-3"]

    job.event(2, PodPhase.RUNNING)
    job.event(3, PodPhase.RUNNING)
    rates = {0: 70, 1: 70, 2: 70, 3: 70}  # 280 against 190: each added +0.47 of a share, below 0.5
    job.train(WINDOW + 2, rates)
    assert len(job.started()) == 4
    assert job.scaler.growth_stops == 1

    job.train(RETRY_WINDOWS * WINDOW - WINDOW, rates)
    assert len(job.started()) == 4  # not yet
    job.train(WINDOW, rates)
    assert len(job.started()) == 5  # tried again, with one worker
    assert job.scaler.summary()["workers_added"] == 4


def test_a_partial_gain_grows_one_worker_at_a_time() -> None:
    job = Job(start=2, maximum=5)
    job.event(0, PodPhase.RUNNING)
    job.event(1, PodPhase.RUNNING)
    job.train(WINDOW + 1, {0: 100, 1: 100})
    job.event(2, PodPhase.RUNNING)
    job.train(WINDOW + 2, {0: 90, 1: 90, 2: 90})  # 270 against 200: +0.7 of a share
    assert job.started()[3:] == ["worker-3"]


def test_growth_waits_while_a_worker_waits_for_room_and_never_passes_the_maximum() -> None:
    job = Job(start=2, maximum=3)
    job.event(0, PodPhase.RUNNING)
    job.event(1, PodPhase.PENDING, PodReason.UNSCHEDULABLE)
    job.train(3 * WINDOW, {0: 100})
    assert len(job.started()) == 2  # the cluster has no room: nothing more is asked of it

    job.event(1, PodPhase.RUNNING)
    job.train(2 * WINDOW, {0: 100, 1: 100})
    assert len(job.started()) == 3
    job.event(2, PodPhase.RUNNING)
    job.train(3 * WINDOW, {0: 100, 1: 100, 2: 100})
    assert len(job.started()) == 3 and job.pods.worker_counts().wanted == 3


def test_workers_still_waiting_for_room_are_deleted_once_training_is_over() -> None:
    job = Job(start=2, maximum=2)
    job.event(0, PodPhase.RUNNING)
    job.event(1, PodPhase.PENDING, PodReason.UNSCHEDULABLE)
    while (assignment := job.dispatcher.get_task(0)).task is not None:
        job.dispatcher.report(assignment.task.task_id, 0, True)
    assert job.dispatcher.finished
    job.scaler.tick()
    assert job.backend.deleted == [("worker-1", "ScaledDown")]


def test_the_meter_counts_records_per_worker_over_a_sliding_window() -> None:
    clock = Clock()
    meter = ThroughputMeter(clock=clock)
    meter.record(0, 50)
    clock.now += 5
    meter.record(1, 30)
    meter.record(0, 20)
    assert meter.records_per_second(10) == {0: 7.0, 1: 3.0}
    assert meter.records_per_second(4) == {0: 5.0, 1: 7.5}
    clock.now += 6
    assert meter.records_per_second(10) == {0: 2.0, 1: 3.0}
    assert meter.total_records_per_second(10) == 5.0 and meter.records_total == 100


def test_workers_beyond_those_asked_for_are_opportunistic_and_the_first_to_go() -> None:
    job = Job(start=2, maximum=4)
    job.pods.scale_workers(4)  # growth: workers 2 and 3 are beyond the 2 asked for
    assert [spec.opportunistic for spec in job.backend.specs] == [False, False, True, True]

    job.event(0, PodPhase.DELETED, PodReason.PREEMPTED)  # a worker asked for is replaced by one asked for
    assert job.backend.specs[-1].name == "worker-4" and not job.backend.specs[-1].opportunistic

    job.pods.scale_workers(3)  # the newest opportunistic one goes, not the newer worker 4
    assert job.backend.deleted == [("worker-3", "ScaledDown")]

    job.pods.request_workers(4)  # `edl-argo scale --workers 4`: the job now asks for 4
    assert job.backend.specs[-1].name == "worker-5" and not job.backend.specs[-1].opportunistic


def test_an_opportunistic_worker_gets_its_own_priority_class_on_kubernetes() -> None:
    from edl_argo.pods.kubernetes_config import KubernetesConfig, RoleSettings
    from edl_argo.pods.manifests import pod_manifest

    config = KubernetesConfig(
        image="img", worker=RoleSettings(priority_class="low"), opportunistic_worker_priority="lowest"
    )
    spec = PodSpec(PodRole.WORKER, 3, ("edl-argo", "worker"))
    assert pod_manifest("job", config, spec)["spec"]["priorityClassName"] == "low"
    opportunistic = PodSpec(PodRole.WORKER, 3, ("edl-argo", "worker"), opportunistic=True)
    assert pod_manifest("job", config, opportunistic)["spec"]["priorityClassName"] == "lowest"
    unset = KubernetesConfig(image="img", worker=RoleSettings(priority_class="low"))
    assert pod_manifest("job", unset, opportunistic)["spec"]["priorityClassName"] == "low"
