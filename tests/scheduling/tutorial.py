"""TEST-ONLY: ElasticDL's preemption tutorial, step by step, on the stand-in's scheduler.

One node of :data:`NODE_CPUS` CPUs. The job's PS runs at ``edl-argo-high``, its 4 workers at ``edl-argo-low``
(one CPU each: 5 of 7 taken). A Deployment of 5 pods at the online service's priority arrives: the scheduler
preempts 3 workers (the 2 free CPUs and 3 workers' make 5); their replacements stay Pending and training goes
on with 1 worker. The Deployment shrinks to 1: the replacements are placed and the job is back at 4 workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.engine_helpers import JobThread
from tests.k8s_helpers import job_selector
from tests.k8s_stand_in import KubernetesStandIn
from tests.k8s_stand_in.utilization import UtilizationRecorder
from tests.scheduling.cluster import Stopwatch, elastic_job, running_workers, service_pod

NODE_CPUS = 7
WORKERS = 4
#: Epochs of digits the job trains.
EPOCHS = 20
SERVICE = "online-service"
#: Records the lone worker trains before the service shrinks: a few seconds of its paced throughput.
RECORDS_WITH_ONE_WORKER = 1000
#: A worker counts as training once it reported a task within this many seconds.
TRAINING_WINDOW_SECONDS = 2.0
#: Bound of every wait of the scenario (seconds).
WAIT_SECONDS = 240


@dataclass
class TutorialRun:
    """What one run of the tutorial showed."""

    metrics: dict[str, Any]
    #: Seconds since the job started of each step: ``four_running``, ``service_created``, ``one_running``,
    #: ``service_shrunk``, ``four_again`` (their pods run), ``four_training`` (each reported a task within
    #: :data:`TRAINING_WINDOW_SECONDS`), ``job_done``.
    moments: dict[str, float]
    #: Workers running, sampled at each step of the tutorial while it was in that state.
    running: dict[str, int] = field(default_factory=dict)
    #: Pending workers while one ran.
    pending_with_one: int = 0
    #: Records trained while one worker ran.
    records_with_one: int = 0
    #: ``(seconds, CPUs requested by the job, by the service)`` samples.
    utilization: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def seconds_to_four_again(self) -> float:
        """From the service shrinking (capacity appearing) to 4 workers running."""
        return round(self.moments["four_again"] - self.moments["service_shrunk"], 2)

    @property
    def seconds_to_four_training(self) -> float:
        """From the service shrinking to 4 workers training (the replacements started and reported a task)."""
        return round(self.moments["four_training"] - self.moments["service_shrunk"], 2)

    @property
    def seconds_to_one(self) -> float:
        """From the service's Deployment created to 1 worker left."""
        return round(self.moments["one_running"] - self.moments["service_created"], 2)


def run_tutorial(
    cluster: KubernetesStandIn, data: Path, output: Path, *, num_epochs: int = EPOCHS
) -> TutorialRun:
    """Run the tutorial on ``cluster`` (one node of :data:`NODE_CPUS` CPUs, see
    :func:`~tests.scheduling.cluster.simulated_cluster`); the job trains ``num_epochs`` of digits."""
    job = elastic_job(cluster, data, output, num_workers=WORKERS, num_epochs=num_epochs)
    selectors = {"job": job_selector(job.config.job_name), "service": f"app={SERVICE}"}
    recorder = UtilizationRecorder(cluster, interval=0.5, selectors=selectors)
    watch = Stopwatch()
    thread = JobThread(job).start()
    run = TutorialRun(metrics={}, moments=watch.moments)
    with recorder:
        thread.wait_until(
            lambda: running_workers(job) == WORKERS and job.throughput.records_total > 0,
            WAIT_SECONDS,
            f"{WORKERS} workers training",
        )
        watch.mark("four_running")
        run.running["four_running"] = running_workers(job)
        cluster.create_deployment(SERVICE, service_pod(), replicas=5)
        watch.mark("service_created")
        thread.wait_until(lambda: running_workers(job) == 1, WAIT_SECONDS, "3 workers preempted")
        watch.mark("one_running")
        before = job.throughput.records_total
        thread.wait_until(
            lambda: job.throughput.records_total >= before + RECORDS_WITH_ONE_WORKER,
            WAIT_SECONDS,
            "training with one worker",
        )
        run.records_with_one = job.throughput.records_total - before
        run.running["one_running"] = running_workers(job)
        run.pending_with_one = job.pods.worker_counts().pending if job.pods else 0
        cluster.scale_deployment(SERVICE, 1)
        watch.mark("service_shrunk")
        thread.wait_until(lambda: running_workers(job) == WORKERS, WAIT_SECONDS, f"{WORKERS} workers again")
        watch.mark("four_again")
        run.running["four_again"] = running_workers(job)
        thread.wait_until(
            lambda: len(job.throughput.records_per_second(TRAINING_WINDOW_SECONDS)) == WORKERS,
            WAIT_SECONDS,
            f"{WORKERS} workers training again",
        )
        watch.mark("four_training")
        run.metrics = thread.join(600)
        watch.mark("job_done")
    run.utilization = [
        (round(s.time - watch.started, 2), float(s.groups.get("job", 0)), float(s.groups.get("service", 0)))
        for s in recorder.samples
        if s.time >= watch.started
    ]
    return run
