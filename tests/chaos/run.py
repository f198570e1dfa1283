"""Run the chaos scenarios and write the reliability report (``make chaos``).

Usage: ``python -m tests.chaos.run --trials N --output docs/reliability.md [--scenarios NAME[,NAME...]]
[--seed S] [--keep-workdir] [--fresh]``, or ``--output REPORT --merge OTHER-runs.json`` to merge the runs
of another report (a run made elsewhere, or into a scratch report) into this one without running any.

One fault-free baseline job per (backend, strategy) the chosen scenarios use, then ``N`` trials of each
scenario variant of :data:`~tests.chaos.catalog.VARIANTS` (default: all). Trial ``i`` of a variant draws
its random choices from ``random.Random(f"{seed}/{variant}/{i}")``, so a run can be repeated. A trial
passes when its job completed with accuracy >= 0.95, the workers' accounting adds up (no record lost or
counted twice, the minibatches of the dataset, every PS at the updates expected), AllreduceStrategy
replicas are bit-identical, and nothing (pod, Service, NetworkPolicy, process) is left behind; the exit
status is 1 if any trial did not pass.

Runs can be split (``make chaos SCENARIOS=a,b``): each run's results are kept in a JSON file beside the
report (``reliability.md`` -> ``reliability-runs.json``), a variant's newest run replacing its earlier
ones, and the report shows every stored run as a table with its commit and trial count. ``--fresh``
forgets the stored runs. The trials' logs are in a temporary folder, deleted at the end unless
``--keep-workdir``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow; pods inherit it

from edl_argo import log
from edl_argo.flags import positive_int
from edl_argo.storage import LocalStorage
from tests.bench.common import Stat
from tests.bench.run import machine, rst_to_markdown, write_atomically
from tests.chaos.allreduce import ALLREDUCE_JOB
from tests.chaos.catalog import VARIANTS
from tests.chaos.scenarios import (
    ACCURACY_TARGET,
    ALLREDUCE,
    CHAOS_JOB,
    CHECKPOINT_STEPS,
    HUNG_TASK_TIMEOUT_SECONDS,
    KUBERNETES,
    PS_KILL_TASK_TIMEOUT_SECONDS,
    S3_OUTAGE_SECONDS,
    S3_RETRY_SECONDS,
    ChaosEnv,
    TrialResult,
    baseline,
    write_digits_dataset,
)
from tests.k8s_stand_in import KubernetesStandIn
from tests.s3_stand_in import S3StandIn

#: One trial as stored: the :class:`TrialResult` fields but its metrics and log, and ``passed``.
Trial = dict[str, Any]


def trial_record(result: TrialResult, load: float) -> Trial:
    data = asdict(result)
    del data["metrics"], data["log"]
    data["wall_seconds"] = round(result.wall_seconds, 1)
    data["passed"] = result.passed
    data["load"] = round(load, 2)
    return data


# --------------------------------------------------------------------------------------------- report


def _stat(values: Sequence[float], digits: int | None = 0) -> str:
    """``median [min–max]`` with ``digits`` decimals (None: by magnitude), or a dash for no values."""
    return Stat.of(values).format(digits) if values else "–"


def _mean_max(values: Sequence[float]) -> str:
    return f"{statistics.mean(values):,.0f} / {max(values):,.0f}" if values else "–"


COLUMNS = (
    "scenario",
    "backend",
    "strategy",
    "trials",
    "completed",
    "passed",
    "records lost (total, must be 0)",
    "records trained twice, mean / max",
    "extra wall time vs baseline, s: median [min–max]",
    "accuracy: median [min–max]",
    "PS versions lost, mean / max",
    "PS updates lost to rollback (job's count), mean / max",
    "load (1 min) at trial start",
)


def strategy_label(strategy: str) -> str:
    """How the report names a distribution strategy."""
    return "allreduce" if strategy == ALLREDUCE else "PS"


def scenario_row(name: str, trials: list[Trial], baseline_seconds: float | None) -> list[str]:
    """The report's table row of one variant's trials."""
    done = [t for t in trials if t["completed"]]
    lost = sum(t["records_lost"] or 0 for t in done)
    extra = [t["wall_seconds"] - baseline_seconds for t in done] if baseline_seconds else []
    first = trials[0]
    return [
        name,
        first["backend"],
        strategy_label(first["strategy"]),
        str(len(trials)),
        str(len(done)),
        str(sum(t["passed"] for t in trials)),
        str(lost) if lost == 0 else f"**{lost}**",
        _mean_max([t["records_trained_twice"] or 0 for t in done]),
        _stat(extra, None),
        _stat([t["accuracy"] for t in done if t["accuracy"] is not None], 3),
        _mean_max([t["versions_lost"] for t in done if t["versions_lost"] is not None]),
        _mean_max(
            [t["updates_lost"] for t in done if t["updates_lost"] is not None and t["strategy"] != ALLREDUCE]
        ),
        _stat([t["load"] for t in trials], 1),
    ]


#: The trials a variant's run needs to meet the reliability goal (all of them passed, no record lost).
GOAL_TRIALS = 20


def _trial_goal_met(trials: list[Trial]) -> bool:
    return len(trials) >= GOAL_TRIALS and all(t["passed"] and t["records_lost"] == 0 for t in trials)


def summary(runs: list[dict[str, Any]]) -> list[str]:
    """The report's first section: every variant of :data:`VARIANTS` with the row of its newest run
    (``runs`` is newest first) and that run's date and commit, or "no run"; and how many variants meet
    the goal of :data:`GOAL_TRIALS` trials, every one passed with no record lost."""
    newest: dict[str, tuple[dict[str, Any], list[Trial]]] = {}
    for run in reversed(runs):  # oldest first, so a newer run of a variant replaces an older one
        for name, trials in run["variants"].items():
            newest[name] = (run, trials)
    header = (*COLUMNS, "run")
    rows = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    short = []
    for name, variant in VARIANTS.items():
        if name not in newest:
            strategy = strategy_label(variant.strategy)
            rows.append(f"| {name} | {variant.backend} | {strategy} | no run |" + " |" * (len(header) - 4))
            short.append(name)
            continue
        run, trials = newest[name]
        reference = run["baselines"].get(_baseline_key(trials[0]))
        row = scenario_row(name, trials, reference["wall_seconds"] if reference else None)
        rows.append("| " + " | ".join([*row, f"{run['started'][:10]}, {run['machine']['code']}"]) + " |")
        if not _trial_goal_met(trials):
            short.append(name)
    met = len(VARIANTS) - len(short)
    verdict = f"**{met} of {len(VARIANTS)} variants** have a run of at least {GOAL_TRIALS} trials, every "
    verdict += "trial passed, 0 records lost" + (f"; short of that: {', '.join(short)}." if short else ".")
    return ["## Summary: the newest run of every variant", "", verdict, "", *rows]


def render(runs: list[dict[str, Any]]) -> str:
    """The markdown report of the stored ``runs`` (newest first)."""
    settings = ", ".join(f"{name} {value}" for name, value in CHAOS_JOB.items())
    allreduce = ", ".join(f"{name} {value}" for name, value in ALLREDUCE_JOB.items())
    out = [
        "# Reliability: the chaos suite",
        "",
        "Generated by `python -m tests.chaos.run` (`make chaos`, split with `make chaos SCENARIOS=...`); "
        "each table below is one run, with its commit, machine and trial count.",
        "",
        f"Every trial is a real digits job ({settings}; synchronous SGD; AllreduceStrategy scenarios: "
        f"{allreduce}). On the *local* backend the workers and PS are local processes; on *kubernetes* "
        "they are pods of the Kubernetes stand-in (`tests/k8s_stand_in`: an API server the master reaches "
        "with the official client, pods run as processes). The master runs in the runner, except in "
        "`master_restart`, where it is an `edl-argo train` subprocess. A trial **passes** when the job "
        f"completes with accuracy >= {ACCURACY_TARGET} and, counted from the workers' own reports in "
        "`metrics.json`'s `accounting`: every record of every epoch trained exactly once in a task done "
        "(*records lost*: the records each epoch misses or counts twice), the minibatches of the tasks "
        "done equal those the dataset makes (a lost or doubled minibatch fails the trial), and every PS "
        "that never restarted is at exactly the model version the minibatches make; AllreduceStrategy "
        "replicas must be bit-identical at the end (the job compares the final weights of every surviving "
        "member but one that joined after the last step: `allreduce_replicas.max_abs_difference` must be "
        "0) and no member may be reported silent "
        "after its pod finished (its peer then waited the collective timeout for it); and nothing is left "
        "behind 30 s after the job ends: no pod, Service or NetworkPolicy of the job (Kubernetes), no "
        "process carrying its `EDL_JOB_NAME` (either backend). *Records trained twice* is the job's own "
        "count of records handed out again after a fault. *PS versions lost* is measured by the runner "
        "around a PS kill; *PS updates lost to rollback* is the job's own count (`accounting."
        "updates_lost_to_rollback`: the updates the workers' minibatches make minus the PS's final "
        "version, for a PS that restarted from its checkpoint; unknown, so left out, when a worker's "
        "attempt also ended unreported). Faults are injected at random points of training progress "
        "(fractions of the tasks done).",
        "",
        f"Scenario settings: PS checkpoints every {CHECKPOINT_STEPS} versions (`ps_kill`, `s3_outage`, "
        f"`allreduce_all_lost`); `--min-task-timeout-seconds {PS_KILL_TASK_TIMEOUT_SECONDS}` in `ps_kill` "
        "(no task times out while the PS restarts); S3 outages of "
        f"{S3_OUTAGE_SECONDS[0]:.0f}-{S3_OUTAGE_SECONDS[1]:.0f} s "
        f"with `EDL_STORAGE_RETRY_SECONDS={S3_RETRY_SECONDS}`; `--min-task-timeout-seconds "
        f"{HUNG_TASK_TIMEOUT_SECONDS}` in `hung_worker` and `allreduce_hang`.",
        "",
        *summary(runs),
    ]
    for run in runs:
        info = run["machine"]
        trials = sorted({len(t) for t in run["variants"].values()})
        out += [
            "",
            f"## Run of {run['started']} UTC: {', '.join(map(str, trials))} trial(s) per scenario",
            "",
            f"`{run['command']}`; took {run['minutes']:.1f} min. Code: {info['code']}. Machine: nproc "
            f"{info['nproc']}, {info['cpu']}, {info['memory']}, {info['os']}; Python {info['python']}, "
            f"TensorFlow {info['tensorflow']}. Load average (1 min) at start {run['loads'][0]:.1f}, at end "
            f"{run['loads'][1]:.1f} (the machine was shared: the last column gives it at each trial's "
            "start).",
            "",
        ]
        for key, reference in run["baselines"].items():
            state = "" if reference["passed"] else f" — **failed**: {'; '.join(reference['notes'])}"
            out.append(
                f"- Baseline {key} (no fault): {reference['wall_seconds']:.0f} s, accuracy "
                + (f"{reference['accuracy']:.3f}" if reference["accuracy"] is not None else "none")
                + state
            )
        out += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        for name, results in run["variants"].items():
            reference = run["baselines"].get(_baseline_key(results[0]))
            seconds = reference["wall_seconds"] if reference else None
            out.append("| " + " | ".join(scenario_row(name, results, seconds)) + " |")
        failed = [(n, i, t) for n, ts in run["variants"].items() for i, t in enumerate(ts) if not t["passed"]]
        if failed:
            out += ["", "Trials that did not pass:", ""]
            out += [f"- {name} #{i}: {_summary(t)}" for name, i, t in failed]
    shown = [name for name in VARIANTS if any(name in run["variants"] for run in runs)]
    out += ["", "## Scenarios", ""]
    for name in shown:
        variant = VARIANTS[name]
        doc = " ".join(rst_to_markdown(variant.doc).split())
        out.append(f"- **{name}** ({variant.backend}, {variant.strategy}): {doc}")
    out += [
        "",
        "`master_restart` runs `edl-argo train` as a subprocess, twice: its extra wall time includes "
        "starting the second master (importing TensorFlow, restoring the state). Every trial's raw "
        "results are in `reliability-runs.json` beside this file.",
        "",
    ]
    return "\n".join(out)


def _baseline_key(trial: Trial) -> str:
    return f"{trial['backend']}/{strategy_label(trial['strategy'])}"


def _summary(trial: Trial) -> str:
    text = f"accuracy {trial['accuracy']}, records lost {trial['records_lost']}; faults: "
    text += "; ".join(trial["faults"]) or "none"
    for label in ("problems", "notes"):
        if trial[label]:
            text += f"; {label}: " + "; ".join(trial[label])
    return text


# ------------------------------------------------------------------------------------------- storage


def runs_file(report: Path) -> Path:
    return report.with_name(report.stem + "-runs.json")


def load_runs(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else []


def merge_runs(stored: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    """``new`` and the stored runs (but an earlier save of ``new`` itself), newest first, each keeping
    only the variants no run started later also ran (runs left empty are dropped)."""
    runs = sorted([r for r in stored if r.get("id") != new["id"]] + [new], key=lambda r: r["started"])
    merged: list[dict[str, Any]] = []
    seen: set[str] = set()
    for run in reversed(runs):
        variants = {k: v for k, v in run["variants"].items() if k not in seen}
        seen |= set(variants)
        if variants or run is new:
            merged.append({**run, "variants": variants})
    return merged


def save(report: Path, run: dict[str, Any], fresh: bool) -> None:
    """Merge ``run`` into the runs stored beside ``report`` and write both (under a lock: several runs
    may share a report)."""
    path = runs_file(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)  # the lock: the folder itself (no lock file left behind)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        stored = merge_runs([] if fresh else load_runs(path), run)
        write_atomically(path, json.dumps(stored, indent=1) + "\n")
        write_atomically(report, render(stored))
        for written in (path, report):
            written.chmod(0o644)  # as a checked-out file (the temporary file was private)
    finally:
        os.close(folder)


# ----------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=positive_int, help="trials of each scenario (required to run any)")
    parser.add_argument("--output", type=Path, required=True, help="markdown report to write")
    parser.add_argument("--scenarios", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--seed", default="0", help="seed of every trial's random choices")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the trials' folders and logs")
    parser.add_argument("--fresh", action="store_true", help="forget the runs stored beside the report")
    parser.add_argument(
        "--merge", type=Path, action="append", default=[], help="runs file of another report to merge in"
    )
    args = parser.parse_args(argv)
    if args.merge:
        for path in args.merge:
            for run in load_runs(path):
                save(args.output, run, fresh=False)
        print(f"[chaos] {len(args.merge)} runs file(s) merged into {args.output}", flush=True)
        return 0
    if args.trials is None:
        parser.error("--trials is required to run scenarios")
    names = [name.strip() for name in args.scenarios.split(",") if name.strip()] or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(VARIANTS)}")
    command = shlex.join(["python", "-m", "tests.chaos.run", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.now(timezone.utc)
    began = time.monotonic()
    load_start = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="edl-chaos-"))
    os.environ["EDL_RUN_DIR"] = str(workdir / "run")  # masters' registry entries and pod files stay here
    os.environ["EDL_NO_PROGRESS_BAR"] = "1"
    log.configure("INFO")
    for handler in logging.getLogger("edl_argo").handlers:
        handler.setLevel(logging.WARNING)  # the console gets warnings; each trial's log has everything
    info = machine()  # the code measured is the code at the start (the tree may change during a run)
    write_digits_dataset(LocalStorage(workdir / "data"))
    chosen = [VARIANTS[name] for name in names]
    s3 = S3StandIn() if "s3_outage" in names else None
    cluster = (
        KubernetesStandIn(workdir / "k8s", echo_logs=False)
        if any(v.backend == KUBERNETES for v in chosen)
        else None
    )
    env = ChaosEnv(workdir / "data", workdir / "trials", s3, kubernetes=cluster)
    baselines: dict[str, Trial] = {}
    variants: dict[str, list[Trial]] = {}
    run = {
        "id": uuid.uuid4().hex,
        "command": command,
        "started": f"{started:%Y-%m-%d %H:%M:%S}",
        "minutes": 0.0,
        "machine": info,
        "loads": [round(load_start, 2), round(load_start, 2)],
        "baselines": baselines,
        "variants": variants,
    }
    fresh = args.fresh

    def checkpoint() -> None:
        """Save what the run has so far: a run cut short still reports its trials."""
        nonlocal fresh
        run.update(minutes=round((time.monotonic() - began) / 60, 1))
        run["loads"][1] = round(os.getloadavg()[0], 2)
        save(args.output, run, fresh)
        fresh = False

    try:
        if s3 is not None:
            s3.start()
        for variant in chosen:
            key = f"{variant.backend}/{strategy_label(variant.strategy)}"
            if key not in baselines:
                overrides = ALLREDUCE_JOB if variant.strategy == ALLREDUCE else {}
                load = os.getloadavg()[0]
                reference = baseline(
                    env, random.Random(f"{args.seed}/baseline"), backend=variant.backend, **overrides
                )
                baselines[key] = trial_record(reference, load)
                print(f"[chaos] baseline {key}: {reference.summary()}", flush=True)
            for i in range(args.trials):
                load = os.getloadavg()[0]
                result = variant.run(env, random.Random(f"{args.seed}/{variant.name}/{i}"))
                variants.setdefault(variant.name, []).append(trial_record(result, load))
                print(f"[chaos] {variant.name} {i + 1}/{args.trials}: {result.summary()}", flush=True)
                checkpoint()
    finally:
        if s3 is not None:
            s3.close()
        if cluster is not None:
            cluster.close()
        if args.keep_workdir:
            print(f"[chaos] trials' folders and logs kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    checkpoint()
    print(f"[chaos] report written to {args.output}", flush=True)
    passed = all(b["passed"] for b in baselines.values()) and all(
        t["passed"] for ts in variants.values() for t in ts
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
