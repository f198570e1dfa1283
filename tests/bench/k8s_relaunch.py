"""How fast the Kubernetes backend replaces a worker pod deleted mid-training, against the stand-in.

A digits job runs with ``--backend kubernetes`` (master in this process, its two workers and PS run by the
stand-in cluster of ``tests/k8s_stand_in`` as processes, reached through the official client over HTTP).
At set points of its progress, a live worker's pod is deleted through the API, as the cluster does when
it preempts a pod. For each deletion:

* **event → create**: from the watch event that reports the deletion (the pod's first version with a
  ``deletionTimestamp``, time of the stand-in's change) to the master's create call for the replacement
  (time the stand-in received the POST). It includes the deleted worker's exit after SIGTERM, since the
  backend reports a deleted pod once its container has stopped. Goal: < 1 s.
* **stopped → create**: from the deleted pod's terminal status (its container stopped) to that create call:
  the master's own reaction (watch delivery, event, relaunch policy, API call).
* **event → first task**: to the replacement worker's first task from the master (process start, TensorFlow
  import and model build included); a replacement that starts after the job's last task has none.
* **tasks requeued**: the tasks the dispatcher requeued for the deleted worker, against the tasks that worker
  held when it was deleted (counted from the dispatcher's assignments and reports). Goal: no more than
  those; and no record lost over the job.

Entry point: :func:`bench_k8s_relaunch`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from edl_argo.master.job import TrainingJob
from edl_argo.master.task_dispatcher import TaskAssignment
from edl_argo.pods.kubernetes import API_URL_ENV
from edl_argo.pods.kubernetes_config import KubernetesConfig
from edl_argo.storage import LocalStorage
from tests.bench.common import BenchContext, BenchResult, Stat
from tests.engine_helpers import JobThread, assert_no_record_lost, digits_config, write_digits_dataset
from tests.k8s_helpers import MASTER_USER_AGENT, kubernetes_ps_port
from tests.k8s_stand_in import KubernetesStandIn

#: Job progress (fraction of tasks done) at which a worker pod is deleted.
QUICK_POINTS, FULL_POINTS = (0.3,), (0.15, 0.35, 0.55)
#: Jobs per run; each deletes a worker at every point.
QUICK_JOBS, FULL_JOBS = 1, 2


@dataclass
class _TaskLedger:
    """Per worker: when it got its first task, and how many tasks it holds (assigned, not reported)."""

    first_task: dict[int, float] = field(default_factory=dict)
    held: Counter[int] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, job: TrainingJob) -> None:
        """Wrap the dispatcher's ``get_task`` and ``report`` on this instance (no engine change)."""
        dispatcher = job.dispatcher
        get_task, report = dispatcher.get_task, dispatcher.report

        def timed_get_task(worker_id: int) -> TaskAssignment:
            assignment = get_task(worker_id)
            if assignment.kind == "task":
                with self.lock:
                    self.first_task.setdefault(worker_id, time.time())
                    self.held[worker_id] += 1
            return assignment

        def counted_report(task_id: int, worker_id: int, success: bool, error: str = "") -> bool:
            accepted = report(task_id, worker_id, success, error)
            if accepted:
                with self.lock:
                    self.held[worker_id] -= 1
            return accepted

        dispatcher.get_task = timed_get_task  # type: ignore[method-assign]
        dispatcher.report = counted_report  # type: ignore[method-assign]


@dataclass
class _Deletion:
    pod: str
    held_tasks: int


def bench_k8s_relaunch(quick: bool) -> list[dict[str, Any]]:
    """Rows ``{"measure", "unit", "median", "min", "max", "values", "goal", "met"}`` (see the module)."""
    samples: dict[str, list[float]] = {
        "event_to_create": [],
        "stopped_to_create": [],
        "event_to_first_task": [],
    }
    requeued, held = 0, 0
    with tempfile.TemporaryDirectory(prefix="bench-k8s-") as tmp:
        root = Path(tmp)
        data = root / "data"
        write_digits_dataset(LocalStorage(data))
        with KubernetesStandIn(root / "cluster", echo_logs=False) as cluster:
            previous = os.environ.get(API_URL_ENV)
            os.environ[API_URL_ENV] = cluster.url
            try:
                for run in range(QUICK_JOBS if quick else FULL_JOBS):
                    job_samples, job_requeued, job_held = _run_job(
                        cluster, data, root / f"job{run}", QUICK_POINTS if quick else FULL_POINTS
                    )
                    for key, values in job_samples.items():
                        samples[key] += values
                    requeued, held = requeued + job_requeued, held + job_held
            finally:
                if previous is None:
                    os.environ.pop(API_URL_ENV, None)
                else:
                    os.environ[API_URL_ENV] = previous
    creates, first_tasks = samples["event_to_create"], samples["event_to_first_task"]
    in_flight = held / len(creates)
    return [
        _row(
            "worker pod deletion event → replacement create call", "s", creates, "< 1 s", max(creates) < 1.0
        ),
        _row(
            "deleted worker's container stopped → replacement create call", "s", samples["stopped_to_create"]
        ),
        _row(
            f"worker pod deletion event → replacement's first task ({len(first_tasks)} of {len(creates)}"
            " replacements started before the job ended)",
            "s",
            first_tasks,
        ),
        _row(
            f"tasks requeued per deletion (the deleted worker held {in_flight:.2f} on average)",
            "tasks",
            [requeued / len(creates)],
            "≤ the deleted worker's in-flight tasks; no record lost",
            requeued <= held,
        ),
    ]


def _run_job(
    cluster: KubernetesStandIn, data: Path, output: Path, points: tuple[float, ...]
) -> tuple[dict[str, list[float]], int, int]:
    """One job with a worker deletion at each of ``points``; its samples, requeued and held task counts."""
    settings = KubernetesConfig(image="edl-argo:bench", ps_port=kubernetes_ps_port())
    name = f"bench-{os.urandom(3).hex()}"
    job = TrainingJob.load(
        digits_config(data, output, job_name=name, backend="kubernetes", kubernetes=settings)
    )
    ledger = _TaskLedger()
    ledger.attach(job)
    thread = JobThread(job).start()
    deletions: list[_Deletion] = []
    with cluster.api_client() as api:
        core = k8s.CoreV1Api(api)
        for point in points:
            thread.wait_until(
                lambda p=point: thread.progress_fraction() >= p, 300, f"{point:.0%} of the tasks"
            )
            assert job.pods is not None
            worker_id = min(job.pods.live_workers)
            pod = f"{name}-worker-{worker_id}"
            thread.wait_until(lambda pod=pod: _phase(cluster, pod) == "Running", 120, f"{pod} running")
            with ledger.lock:
                held = ledger.held[worker_id]
            deletions.append(_Deletion(pod, held))
            core.delete_namespaced_pod(pod, "default")
            thread.wait_until(lambda: len(job.pods.relaunches) >= len(deletions), 120, "the relaunch")
    metrics = thread.join(600)
    assert_no_record_lost(metrics)

    samples: dict[str, list[float]] = {
        "event_to_create": [],
        "stopped_to_create": [],
        "event_to_first_task": [],
    }
    creates = sorted(
        c.time for c in cluster.calls if c.user_agent.startswith(MASTER_USER_AGENT) and c.verb == "create"
        and c.resource == "pods"
    )  # fmt: skip
    for deletion, relaunch in zip(deletions, job.pods.relaunches, strict=True):
        event, stopped = _deletion_times(cluster, deletion.pod)
        create = next(t for t in creates if t >= event)
        samples["event_to_create"].append(create - event)
        samples["stopped_to_create"].append(create - stopped)
        if relaunch.new_id in ledger.first_task:  # else the job ended before the replacement started
            samples["event_to_first_task"].append(ledger.first_task[relaunch.new_id] - event)
    requeued = int(metrics["task_requeues"].get("worker_died", 0))
    return samples, requeued, sum(d.held_tasks for d in deletions)


def _deletion_times(cluster: KubernetesStandIn, pod: str) -> tuple[float, float]:
    """When ``pod`` first showed a deletionTimestamp, and when its container was seen stopped."""
    changes = [e for e in cluster.store.journal if e.resource == "pods" and e.obj["metadata"]["name"] == pod]
    event = next(e.time for e in changes if e.obj["metadata"].get("deletionTimestamp"))
    stopped = next(
        e.time
        for e in changes
        if e.obj["status"].get("phase") in ("Succeeded", "Failed") or e.type == "DELETED"
    )
    return event, stopped


def _phase(cluster: KubernetesStandIn, pod: str) -> str:
    return str(((cluster.pod(pod) or {}).get("status") or {}).get("phase", ""))


def _row(
    measure: str, unit: str, values: list[float], goal: str = "", met: bool | None = None
) -> dict[str, Any]:
    """One result row; median, min and max are None when nothing was measured."""
    return {
        "measure": measure,
        "unit": unit,
        "median": statistics.median(values) if values else None,
        "min": min(values, default=None),
        "max": max(values, default=None),
        "values": values,
        "goal": goal,
        "met": met,
    }


def k8s_relaunch(ctx: BenchContext) -> BenchResult:
    """The relaunch figures as a section of the ``make bench`` report."""
    started = time.monotonic()
    rows = bench_k8s_relaunch(ctx.quick)
    return BenchResult(
        name="k8s_relaunch",
        title="Worker relaunch on Kubernetes (the API-server stand-in on loopback)",
        method=(__doc__ or "").strip(),
        columns=["measure", "value", "goal", "met"],
        rows=[
            {
                "measure": row["measure"],
                "value": Stat.of(row["values"]).format() + f" {row['unit']}" if row["values"] else "-",
                "goal": row["goal"] or "-",
                "met": "-" if row["met"] is None else ("yes" if row["met"] else "**no**"),
            }
            for row in rows
        ],
        seconds=time.monotonic() - started,
    )


if __name__ == "__main__":
    import json
    import sys

    for row in bench_k8s_relaunch(quick="--quick" in sys.argv):
        print(json.dumps(row, ensure_ascii=False))
