"""TEST-ONLY: a simulated cluster for the scheduling scenarios: the Kubernetes stand-in with nodes of fixed
capacity and edl-argo's PriorityClasses, and elastic-train jobs whose masters run in this process."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.priority_classes import MANIFESTS as EDL_ARGO_PRIORITY_CLASSES
from edl_argo.master.job import TrainingJob
from edl_argo.pods.kubernetes import API_URL_ENV
from edl_argo.pods.kubernetes_config import RoleSettings
from tests.k8s_helpers import stand_in_digits_config
from tests.k8s_stand_in import KubernetesStandIn
from tests.k8s_stand_in.scheduler import StandInNode

#: The paced digits model (:mod:`tests.scheduling.paced_digits`): each worker as fast as a simulated CPU.
PACED_MODEL = str(Path(__file__).with_name("paced_digits.py"))
#: The PriorityClass of the online service the scenarios co-locate with training: above everything.
SERVICE_CLASS = "online-service"
#: Every pod of the scenarios requests this much: one simulated CPU.
ONE_CPU = {"cpu": "1", "memory": "1Gi"}
STORAGE_SECRET = {"AWS_ACCESS_KEY_ID": "AKIATESTONLY", "AWS_SECRET_ACCESS_KEY": "test-only-secret-key"}


@contextmanager
def simulated_cluster(
    workdir: Path, cpus_per_node: list[int], *, echo_logs: bool = False
) -> Iterator[KubernetesStandIn]:
    """The stand-in with one node per entry of ``cpus_per_node`` (that many CPUs, memory to spare), edl-argo's
    PriorityClasses and :data:`SERVICE_CLASS`; masters made meanwhile reach it (``EDL_KUBERNETES_API``)."""
    nodes = [StandInNode(f"node-{i}", cpu=str(cpus), memory="64Gi") for i, cpus in enumerate(cpus_per_node)]
    previous = os.environ.get(API_URL_ENV)
    with KubernetesStandIn(workdir, nodes=nodes, echo_logs=echo_logs) as cluster:
        for manifest in EDL_ARGO_PRIORITY_CLASSES:
            cluster.create("priorityclasses", dict(manifest))
        cluster.create_priority_class(SERVICE_CLASS, 100_000)
        cluster.create("secrets", {"metadata": {"name": "storage"}, "stringData": STORAGE_SECRET})
        os.environ[API_URL_ENV] = cluster.url
        try:
            yield cluster
        finally:
            if previous is None:
                os.environ.pop(API_URL_ENV, None)
            else:
                os.environ[API_URL_ENV] = previous


def elastic_job(cluster: KubernetesStandIn, data: Path, output: Path, **overrides: Any) -> TrainingJob:
    """A paced digits job on ``cluster`` whose pods each request one CPU: PS ``edl-argo-high``, workers
    ``edl-argo-low``, opportunistic workers ``edl-argo-opportunistic`` (the elastic-train step's defaults)."""
    config = stand_in_digits_config(
        cluster,
        data,
        output,
        worker=RoleSettings(ONE_CPU, {}, "edl-argo-low"),
        ps=RoleSettings(ONE_CPU, {}, "edl-argo-high"),
        opportunistic_worker_priority="edl-argo-opportunistic",
        **{"model_def": PACED_MODEL, **overrides},
    )
    return TrainingJob.load(config)


def service_pod(cpu: str = "1") -> dict[str, Any]:
    """The pod of the online service: a process that idles, requesting ``cpu``, at :data:`SERVICE_CLASS`."""
    return {
        "priorityClassName": SERVICE_CLASS,
        "terminationGracePeriodSeconds": 5,
        "containers": [
            {
                "name": "main",
                "image": "online-service:test",
                "command": ["sleep", "3600"],
                "resources": {"requests": {"cpu": cpu, "memory": "256Mi"}},
            }
        ],
    }


def running_workers(job: TrainingJob) -> int:
    return job.pods.worker_counts().running if job.pods is not None else 0


def pending_workers(job: TrainingJob) -> int:
    return job.pods.worker_counts().pending if job.pods is not None else 0


@dataclass
class Stopwatch:
    """Seconds since it was made, and named moments."""

    started: float = 0.0

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self.moments: dict[str, float] = {}

    def now(self) -> float:
        return time.monotonic() - self.started

    def mark(self, name: str) -> float:
        self.moments[name] = round(self.now(), 2)
        return self.moments[name]
