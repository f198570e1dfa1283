"""TEST-ONLY: ``make scheduling``: issue 32's scenarios on the stand-in's scheduler, each elastic and
gang-scheduled in the same run, measured and plotted (docs/scheduling.md shows the results).

* **tutorial**: ElasticDL's preemption tutorial (:mod:`tests.scheduling.tutorial`).
* **two jobs**: ElasticDL's utilization experiment scaled to 2 nodes of 4 CPUs: two jobs that each ask for
  5 CPUs (a PS and 4 workers), the second submitted :data:`SECOND_JOB_DELAY` s after the first. Elastic:
  ``--min-workers 1 --max-workers 7``, the second job starts with the room left and each grows into what
  frees up. Gang-scheduled: a job starts only when all its 5 pods fit (as a plain TFJob under a gang
  scheduler), with ``--min-workers = --num-workers = --max-workers 4``.
* **co-located**: a job next to an online service at a higher priority whose pod count follows a daily curve
  compressed to :data:`DAY_SECONDS` (1 to 6 pods of 1 CPU). Elastic: ``--num-workers 2 --max-workers 7``;
  gang-scheduled: 2 workers, ``--min-workers 2`` (it pauses when the service takes one of them).

Every worker is a real ``edl-argo worker`` training the paced digits model
(:mod:`tests.scheduling.paced_digits`: a worker trains about 250 records/s, as fast as its simulated CPU,
without using the machine's cores), every PS a real ``edl-argo ps``; the masters run in this process.
Utilization is the CPU requested by running pods over the cluster's CPU, integrated over the scenario
(:mod:`tests.k8s_stand_in.utilization`).

Usage: ``python -m tests.scheduling.run --output docs/scheduling [--scenario NAME ...]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edl_argo import log
from edl_argo.storage import LocalStorage
from tests.engine_helpers import JobThread, write_digits_dataset
from tests.k8s_helpers import job_selector
from tests.k8s_stand_in.utilization import UtilizationRecorder
from tests.scheduling.cluster import Stopwatch, elastic_job, service_pod, simulated_cluster
from tests.scheduling.plots import step_chart
from tests.scheduling.tutorial import EPOCHS, NODE_CPUS, WORKERS, run_tutorial

SECOND_JOB_DELAY = 20.0
TWO_JOB_EPOCHS = 75
DAY_SECONDS = 60.0
CO_LOCATED_EPOCHS = 50
#: How often the service's pod count follows the curve, and the job's progress is sampled.
CURVE_STEP_SECONDS = 3.0
SCALE_UP_WINDOW = 4
#: The two- and co-located scenarios' cluster: 2 nodes of 4 CPUs.
NODE_CPUS_TWO_NODES = [4, 4]
CLUSTER_CPUS = sum(NODE_CPUS_TWO_NODES)
MODES = ("elastic", "gang")
TWO_MODE_TITLES = {
    "two-jobs": "Two jobs, {mode}: CPUs held (of 8)",
    "co-located": "Job next to an online service, {mode}: CPUs held (of 8)",
}
SERVICE = "online-service"
JOB_SECONDS_LIMIT = 900.0


def _job_summary(
    metrics: dict[str, Any], submitted: float = 0.0, started: float = 0.0, done: float | None = None
) -> dict[str, Any]:
    """One job's line of the results: its times (seconds since the scenario began), accuracy and records
    lost, the most workers it ran and how many were preempted."""
    done = started + metrics["wall_time_seconds"] if done is None else done
    lost = sum(metrics["records_per_epoch"] - n for n in metrics["records_done_per_epoch"].values())
    return {
        "submitted": round(submitted, 1),
        "started": round(started, 1),
        "done": round(done, 1),
        "completion_seconds": round(done - submitted, 1),
        "accuracy": round(metrics["final_metrics"]["accuracy"], 4),
        "records_lost": lost,
        "most_workers": max((c[1] for c in metrics["worker_scaling"]["worker_counts"]), default=0),
        "preempted": sum(1 for e in metrics["relaunches"]["events"] if e["reason"] == "Preempted"),
    }


def _series(
    recorder: UtilizationRecorder, origin: float, group: str | None = None
) -> list[tuple[float, float]]:
    return _changes(
        [
            (round(s.time - origin, 2), float(s.requested if group is None else s.groups.get(group, 0)))
            for s in recorder.samples
            if s.time >= origin
        ]
    )


def _outcome(
    elastic: bool, utilization: float, recorder: UtilizationRecorder, origin: float, groups: dict[str, str]
) -> dict[str, Any]:
    """What every two-mode scenario reports: its mode, utilization, and the CPUs held over time by each of
    ``groups`` (series name -> the recorder's group) and by all pods."""
    series = {name: _series(recorder, origin, group) for name, group in groups.items()}
    return {
        "mode": "elastic" if elastic else "gang",
        "utilization": round(utilization, 3),
        "series": {**series, "all pods": _series(recorder, origin)},
    }


def _changes(points: list[Any]) -> list[Any]:
    """A step function's ``(x, y)`` points reduced to those where ``y`` changes, and the last one."""
    kept = [p for i, p in enumerate(points) if i == 0 or p[1] != points[i - 1][1]]
    return kept + points[-1:] if points and kept[-1] is not points[-1] else kept


def _free_cpus(recorder: UtilizationRecorder) -> float:
    sample = recorder.sample()
    return float(sample.allocatable - sample.requested)


def two_jobs(workdir: Path, data: Path, *, elastic: bool) -> dict[str, Any]:
    """Two jobs of 5 CPUs on 8, the second submitted :data:`SECOND_JOB_DELAY` s after the first."""
    sizes = (
        {"num_workers": 4, "min_workers": 1, "max_workers": 7}
        if elastic
        else {"num_workers": 4, "min_workers": 4, "max_workers": 4}
    )
    with simulated_cluster(workdir / "k8s", NODE_CPUS_TWO_NODES) as cluster:
        jobs = {
            name: elastic_job(
                cluster,
                data,
                workdir / name,
                num_epochs=TWO_JOB_EPOCHS,
                scale_up_window_seconds=SCALE_UP_WINDOW,
                **sizes,
            )
            for name in ("a", "b")
        }
        selectors = {name: job_selector(job.config.job_name) for name, job in jobs.items()}
        with UtilizationRecorder(cluster, interval=0.5, selectors=selectors) as recorder:
            watch = Stopwatch()
            threads: dict[str, JobThread] = {}
            times: dict[str, dict[str, float]] = {}
            threads["a"] = JobThread(jobs["a"]).start()
            times["a"] = {"submitted": 0.0, "started": 0.0}
            time.sleep(SECOND_JOB_DELAY)
            times["b"] = {"submitted": watch.now()}
            deadline = time.monotonic() + JOB_SECONDS_LIMIT
            while not elastic and _free_cpus(recorder) < 5:  # gang: all 5 pods must fit
                if time.monotonic() > deadline:
                    raise RuntimeError("the second job never found room for its 5 pods")
                time.sleep(0.5)
            times["b"]["started"] = watch.now()
            threads["b"] = JobThread(jobs["b"]).start()
            results: dict[str, Any] = {}
            done_at: dict[str, float] = {}
            for name in ("a", "b"):
                metrics = threads[name].join(JOB_SECONDS_LIMIT)
                done_at[name] = watch.now()
                results[name] = metrics
            # A job is done when its thread ends; take each job's own end from its metrics' wall time.
            summaries = {}
            for name, metrics in results.items():
                started = times[name]["started"]
                done = min(done_at[name], started + metrics["wall_time_seconds"])
                summaries[name] = _job_summary(metrics, times[name]["submitted"], started, done)
            end = max(s["done"] for s in summaries.values())
            utilization = recorder.utilization(watch.started, watch.started + end)
    return {
        **_outcome(elastic, utilization, recorder, watch.started, {"job a": "a", "job b": "b"}),
        "jobs": summaries,
        "horizon_seconds": end,
    }


def service_replicas(at: float) -> int:
    """The online service's pod count at ``at`` seconds: a day compressed to :data:`DAY_SECONDS`, from 1 pod
    at night to 6 at midday."""
    return 1 + round(5 * (1 - math.cos(2 * math.pi * at / DAY_SECONDS)) / 2)


def co_located(workdir: Path, data: Path, *, elastic: bool) -> dict[str, Any]:
    """A job next to a service that follows :func:`service_replicas`, on 2 nodes of 4 CPUs."""
    sizes = (
        {"num_workers": 2, "min_workers": 1, "max_workers": 7}
        if elastic
        else {"num_workers": 2, "min_workers": 2, "max_workers": 2}
    )
    with simulated_cluster(workdir / "k8s", NODE_CPUS_TWO_NODES) as cluster:
        cluster.create_deployment(SERVICE, service_pod(), replicas=service_replicas(0))
        job = elastic_job(
            cluster,
            data,
            workdir / "job",
            num_epochs=CO_LOCATED_EPOCHS,
            scale_up_window_seconds=SCALE_UP_WINDOW,
            **sizes,
        )
        selectors = {"job": job_selector(job.config.job_name), "service": f"app={SERVICE}"}
        with UtilizationRecorder(cluster, interval=0.5, selectors=selectors) as recorder:
            watch = Stopwatch()
            thread = JobThread(job).start()
            progress: list[tuple[float, float]] = []
            replicas: list[tuple[float, float]] = []
            while thread.result is None and thread.error is None:
                at = watch.now()
                if at > JOB_SECONDS_LIMIT:
                    raise RuntimeError("the co-located job did not finish in time")
                wanted = service_replicas(at)
                if not replicas or replicas[-1][1] != wanted:
                    cluster.scale_deployment(SERVICE, wanted)
                    replicas.append((round(at, 2), wanted))
                done, total = job.dispatcher.progress()
                progress.append((round(at, 2), round(100 * done / total, 1) if total else 0.0))
                time.sleep(CURVE_STEP_SECONDS)
            metrics = thread.join(60)
            end = watch.now()
            summary = _job_summary(metrics, done=min(end, metrics["wall_time_seconds"]))
            utilization = recorder.utilization(watch.started, watch.started + summary["done"])
    return {
        **_outcome(elastic, utilization, recorder, watch.started, {"service": "service", "job": "job"}),
        "job": summary,
        "progress_percent": _changes(progress),
    }


def tutorial(workdir: Path, data: Path) -> dict[str, Any]:
    """The tutorial, and the same job on the same cluster without the service (its accuracy to compare)."""
    with simulated_cluster(workdir / "k8s", [NODE_CPUS]) as cluster:
        run = run_tutorial(cluster, data, workdir / "job")
    with simulated_cluster(workdir / "k8s-alone", [NODE_CPUS]) as cluster:
        alone = elastic_job(cluster, data, workdir / "alone", num_workers=WORKERS, num_epochs=EPOCHS)
        without_preemption = _job_summary(JobThread(alone).start().join(JOB_SECONDS_LIMIT))
    metrics = run.metrics
    return {
        "moments": run.moments,
        "without_preemption": without_preemption,
        "seconds_to_one_worker": run.seconds_to_one,
        "seconds_to_four_workers_again": run.seconds_to_four_again,
        "seconds_to_four_workers_training": run.seconds_to_four_training,
        "records_with_one_worker": run.records_with_one,
        "pending_with_one_worker": run.pending_with_one,
        "job": _job_summary(metrics),
        "worker_counts": metrics["worker_scaling"]["worker_counts"],
        "series": {
            "job": [(at, job) for at, job, _ in run.utilization],
            "service": [(at, service) for at, _, service in run.utilization],
        },
    }


def _plot(
    output: Path,
    name: str,
    title: str,
    series: dict[str, list[tuple[float, float]]],
    y_label: str,
    y_max: float,
) -> None:
    (output / f"{name}.svg").write_text(
        step_chart(title, series, x_label="seconds", y_label=y_label, y_max=y_max)
    )


SCENARIOS: dict[str, Callable[[Path, Path], dict[str, Any]]] = {
    "tutorial": tutorial,
    "two-jobs": lambda workdir, data: {
        mode: two_jobs(workdir / mode, data, elastic=mode == "elastic") for mode in MODES
    },
    "co-located": lambda workdir, data: {
        mode: co_located(workdir / mode, data, elastic=mode == "elastic") for mode in MODES
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/scheduling"))
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), default=[])
    parser.add_argument("--plots-only", action="store_true", help="redraw the plots of the results kept")
    args = parser.parse_args(argv)
    log.configure("WARNING")
    args.output.mkdir(parents=True, exist_ok=True)
    results_path = args.output / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if args.plots_only:
        _plots(args.output, results)
        return 0
    with tempfile.TemporaryDirectory(prefix="edl-scheduling-") as tmp:
        workdir = Path(tmp)
        data = workdir / "data"
        write_digits_dataset(LocalStorage(data))
        for name in args.scenario or list(SCENARIOS):
            started = time.time()
            results[name] = SCENARIOS[name](workdir / name, data)
            results[name]["scenario_seconds"] = round(time.time() - started, 1)
            print(f"{name}: done in {results[name]['scenario_seconds']} s", file=sys.stderr, flush=True)
            results_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    _plots(args.output, results)
    print(json.dumps({k: _headline(k, v) for k, v in results.items()}, indent=1))
    return 0


def _plots(output: Path, results: dict[str, Any]) -> None:
    if "tutorial" in results:
        _plot(
            output,
            "tutorial",
            "ElasticDL's tutorial: CPUs held by the job and by the service",
            results["tutorial"]["series"],
            "CPUs",
            NODE_CPUS,
        )
    for name, title in TWO_MODE_TITLES.items():
        for mode in MODES if name in results else ():
            series = results[name][mode]["series"]
            _plot(output, f"{name}-{mode}", title.format(mode=mode), series, "CPUs", CLUSTER_CPUS)
    if "co-located" in results:
        progress = {mode: results["co-located"][mode]["progress_percent"] for mode in MODES}
        _plot(
            output,
            "co-located-progress",
            "Job next to an online service: training tasks done",
            progress,
            "% of tasks",
            100,
        )


def _headline(name: str, result: dict[str, Any]) -> Any:
    if name == "tutorial":
        keys = ("seconds_to_one_worker", "seconds_to_four_workers_again", "seconds_to_four_workers_training")
        return {k: result[k] for k in (*keys, "job", "without_preemption")}
    return {
        mode: {k: v for k, v in result[mode].items() if k not in ("series", "progress_percent")}
        for mode in MODES
    }


if __name__ == "__main__":
    sys.exit(main())
