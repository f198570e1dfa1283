"""The master under load (issue 34, part 1): ``python -m tests.scale.master_load --workers 10 100 1000 5000
[--store folder|s3] [--seconds S]`` prints a markdown table, one row per number of workers.

For each number of workers N: the real master's service in a process of its own
(:mod:`tests.scale.load_master`: dispatcher, durable servicer, state store on a folder or on the S3
stand-in, job-secret authentication, the master's server limits, pod bookkeeping) and N simulated workers
in a few processes of many threads each (:mod:`tests.scale.load_workers`: the real protocol and retry
policy, no TensorFlow). Tasks are 512 records; a worker trains a task at a per-record pace drawn per task
from a lognormal distribution of median ``--pace-ms`` (5 ms: a task takes 2.6 s at the median, 2.9 s on
average with shape 0.5), fails it with probability ``--fail-rate`` and vanishes holding it (its pod's death
told to the master, which requeues what it held and starts a replacement) with ``--vanish-rate``.

Measured in a window after a warm-up: tasks handed out per second; GetTask and ReportTaskResult latency
as a worker sees it (p50, p99: each call with its retries); the master process's CPU seconds per task and
resident memory (``/proc``); the machine's load average (1 min) at the end of the window, since other
work on the machine moves every figure; the state saves completed in the window (per second, milliseconds each
including the snapshot, bytes written each). Checked after the run (the row says FAIL and the command
exits 1 if not): no record range of any epoch was accepted twice; the records the workers saw accepted,
the dispatcher's count and the ledger's agree for every epoch; at least one epoch was completed (so every
record of it was reported exactly once); and no worker crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from edl_argo.rpc.auth import SECRET_ENV, JobSecret
from tests.bench.common import (
    child_env,
    kill_group,
    process_cpu_seconds,
    process_rss_bytes,
    start_announcing_child,
    tail,
)
from tests.scale.load_master import add_arguments, control_call, shard_name

WORKERS_PER_PROCESS = 1250
WARMUP_SECONDS = 6.0
BUCKET = "scale-load"


@dataclass(frozen=True)
class Row:
    """One run's figures (see the module docstring) and what its checks found."""

    workers: int
    store: str
    tasks_per_s: float
    get_task_ms: tuple[float, float]
    report_ms: tuple[float, float]
    cpu_ms_per_task: float
    client_cpu_ms_per_task: float
    rss_mib: float
    saves_per_s: float
    save_ms: tuple[float, float]
    save_bytes: tuple[float, float]
    vanished: int
    failed: int
    epochs_checked: int
    problems: list[str]
    load_average: float

    HEADER = (
        "| workers | store | tasks/s | GetTask p50 / p99 ms | Report p50 / p99 ms | master CPU ms/task"
        " | workers' CPU ms/task | master RSS MiB | saves/s | save ms p50 / p99 | bytes/save p50 / max"
        " | vanished / failed | epochs checked | machine load | exactly once |\n|" + "---|" * 15
    )

    def markdown(self) -> str:
        return (
            f"| {self.workers:,} | {self.store} | {self.tasks_per_s:,.0f} | {_pair(self.get_task_ms)}"
            f" | {_pair(self.report_ms)} | {self.cpu_ms_per_task:.2f} | {self.client_cpu_ms_per_task:.2f}"
            f" | {self.rss_mib:,.0f}"
            f" | {self.saves_per_s:.1f} | {_pair(self.save_ms)} | {self.save_bytes[0]:,.0f} /"
            f" {self.save_bytes[1]:,.0f} | {self.vanished} / {self.failed} | {self.epochs_checked}"
            f" | {self.load_average:.1f}"
            f" | {'yes' if not self.problems else 'FAIL: ' + '; '.join(self.problems)} |"
        )


def _pair(values: tuple[float, float]) -> str:
    return f"{values[0]:.1f} / {values[1]:.1f}"


def percentile(values: Sequence[float], share: float) -> float:
    """The ``share`` quantile of ``values`` (nearest rank), 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


@contextlib.contextmanager
def state_location(store: str, folder: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """Where the master saves its state (URL) and the environment it needs: a folder, or a bucket of a
    fresh S3 stand-in."""
    if store == "folder":
        yield str(folder / "output"), {}
        return
    from tests.s3_stand_in import S3StandIn

    with S3StandIn() as s3:
        s3.create_bucket(BUCKET)
        yield f"s3://{BUCKET}/output", s3.env()


def epoch_ranges(shards: int, shard_records: int, records_per_task: int) -> set[tuple[str, int, int]]:
    """Every task's ``(shard, start, end)`` of one epoch of the load run's dataset (:mod:`load_master`)."""
    return {
        (shard_name(i), start, min(start + records_per_task, shard_records))
        for i in range(shards)
        for start in range(0, shard_records, records_per_task)
    }


def check_exactly_once(
    seen: dict[str, Any], stats: dict[str, Any], expected: set[tuple[str, int, int]]
) -> tuple[int, list[str]]:
    """The epochs completed, and what the run did wrong (see the module docstring). ``expected``: the
    ranges of one epoch."""
    problems: list[str] = []
    accepted = Counter(tuple(entry) for entry in seen["accepted"])
    twice = [key for key, count in accepted.items() if count > 1]
    if twice:
        problems.append(f"{len(twice)} record ranges accepted twice, e.g. {twice[0]}")
    maybe = {tuple(entry) for entry in seen["retried_not_accepted"]} - set(accepted)
    low: Counter[str] = Counter()
    high: Counter[str] = Counter()
    reported: dict[str, set[tuple[str, int, int]]] = {}
    for accepted_for_sure, ranges in ((True, set(accepted)), (False, maybe)):
        for shard, start, end, epoch in ranges:
            high[str(epoch)] += end - start
            low[str(epoch)] += (end - start) if accepted_for_sure else 0
            reported.setdefault(str(epoch), set()).add((shard, start, end))
    dispatcher, ledger = stats["records_done_per_epoch"], stats["ledger_records_per_epoch"]
    complete = 0
    for epoch in sorted(set(high) | set(dispatcher) | set(ledger), key=int):
        done = dispatcher.get(epoch, 0)
        if ledger.get(epoch, 0) != done or not low[epoch] <= done <= high[epoch]:
            problems.append(
                f"epoch {epoch}: dispatcher {done} records done, ledger {ledger.get(epoch, 0)}, workers saw"
                f" {low[epoch]} accepted (+{high[epoch] - low[epoch]} retried)"
            )
        if done == stats["records_per_epoch"]:
            complete += 1
            missing = expected - reported.get(epoch, set())
            if missing:
                problems.append(
                    f"epoch {epoch} done but {len(missing)} ranges never reported, e.g. {min(missing)}"
                )
    if not complete:
        problems.append("no epoch completed: run longer or with fewer tasks per epoch")
    if seen["vanished"] and not stats["requeues"]["worker_died"]:
        problems.append("workers vanished but no task was requeued as worker_died")
    for failure in ("failure", "writer_failure"):
        if stats[failure]:
            problems.append(f"master {failure}: {stats[failure]}")
    if seen["crashed"]:
        problems.append(f"{len(seen['crashed'])} workers crashed, first: {seen['crashed'][0]}")
    return complete, problems


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The :class:`~tests.scale.load_workers.Seen` of every worker process as one."""
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            merged[key] = merged.get(key, type(value)()) + value
    return merged


def run(workers: int, args: argparse.Namespace, folder: Path) -> Row:
    """One load run with ``workers`` simulated workers."""
    mean_task_s = args.records_per_task * args.pace_ms / 1000 * 2.718281828 ** (args.pace_sigma**2 / 2)
    expected_tasks = min(workers / mean_task_s, args.expected_capacity) * args.seconds
    tasks_per_epoch = max(20, int(expected_tasks / 4))
    shard_tasks = 10
    shards, shard_records = max(1, tasks_per_epoch // shard_tasks), args.records_per_task * shard_tasks
    job = [
        "--shards", str(shards),
        "--shard-records", str(shard_records),
        "--records-per-task", str(args.records_per_task),
        "--epochs", str(args.epochs),
        "--max-task-retries", str(args.max_task_retries),
    ]  # fmt: skip
    secret = JobSecret.generate()
    log_path = folder / f"load-{workers}.log"
    with (
        state_location(args.store, folder / f"state-{workers}") as (url, store_env),
        log_path.open("ab") as log,
    ):
        env = child_env(**store_env, **{SECRET_ENV: secret.hex()})
        master, ports = start_announcing_child(
            "tests.scale.load_master",
            ["--state", url, "--workers", str(workers), *job],
            log,
            what="master",
            env=env,
        )
        clients = []
        try:
            master_address, control_address = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
            started = time.time()
            stop_at = started + args.seconds
            outputs = []
            for first in range(0, workers, WORKERS_PER_PROCESS):
                output = folder / f"seen-{workers}-{first}.json"
                behaviour = [
                    "--pace-ms", str(args.pace_ms), "--pace-sigma", str(args.pace_sigma),
                    "--fail-rate", str(args.fail_rate), "--vanish-rate", str(args.vanish_rate),
                ]  # fmt: skip
                process, _ = start_announcing_child(
                    "tests.scale.load_workers",
                    ["--master", master_address, "--control", control_address, "--first-id", str(first),
                     "--count", str(min(WORKERS_PER_PROCESS, workers - first)), "--stop-at", str(stop_at),
                     "--output", str(output), *behaviour],
                    log, what="worker process", env=env,
                )  # fmt: skip
                clients.append(process)
                outputs.append(output)
            time.sleep(max(0.0, started + WARMUP_SECONDS - time.time()))
            window_start, cpu_start = time.time(), process_cpu_seconds(master.pid)
            clients_start = sum(process_cpu_seconds(process.pid) for process in clients)
            time.sleep(max(0.0, stop_at - 1.0 - time.time()))
            window_end, cpu_end = time.time(), process_cpu_seconds(master.pid)
            clients_cpu = sum(process_cpu_seconds(process.pid) for process in clients) - clients_start
            rss, load_average = process_rss_bytes(master.pid), os.getloadavg()[0]
            for process in clients:
                process.wait(timeout=args.seconds + 120)
            with grpc.insecure_channel(control_address) as channel:
                stats = control_call(channel, "Stats", {"since": window_start}, 30.0)
        finally:
            for process in [*clients, master]:
                kill_group(process)
    seen = merge([json.loads(output.read_text()) for output in outputs])
    window = window_end - window_start
    handed_out = sum(1 for at in seen["handed_out_at"] if window_start <= at < window_end)
    saves = [save for save in stats["saves"] if save[0] < window_end]
    if not seen["handed_out_at"]:
        print(tail(log_path), file=sys.stderr)
    complete, problems = check_exactly_once(
        seen, stats, epoch_ranges(shards, shard_records, args.records_per_task)
    )
    return Row(
        workers=workers,
        store=args.store,
        tasks_per_s=handed_out / window,
        get_task_ms=(percentile(seen["get_task_s"], 0.5) * 1e3, percentile(seen["get_task_s"], 0.99) * 1e3),
        report_ms=(percentile(seen["report_s"], 0.5) * 1e3, percentile(seen["report_s"], 0.99) * 1e3),
        cpu_ms_per_task=(cpu_end - cpu_start) / max(handed_out, 1) * 1e3,
        client_cpu_ms_per_task=clients_cpu / max(handed_out, 1) * 1e3,
        rss_mib=rss / 2**20,
        saves_per_s=len(saves) / window,
        save_ms=(
            percentile([(s[1] + s[2]) * 1e3 for s in saves], 0.5),
            percentile([(s[1] + s[2]) * 1e3 for s in saves], 0.99),
        ),
        save_bytes=(
            statistics.median([s[3] for s in saves]) if saves else 0,
            max((s[3] for s in saves), default=0),
        ),
        vanished=seen["vanished"],
        failed=seen["failed_reports"],
        epochs_checked=complete,
        problems=problems,
        load_average=load_average,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000, 5000])
    parser.add_argument("--store", choices=["folder", "s3"], default="folder")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each run")
    parser.add_argument("--pace-ms", type=float, default=5.0, help="median milliseconds per record")
    parser.add_argument("--pace-sigma", type=float, default=0.5, help="lognormal shape of the pace")
    parser.add_argument("--fail-rate", type=float, default=0.005)
    parser.add_argument("--vanish-rate", type=float, default=0.002)
    parser.add_argument(
        "--expected-capacity",
        type=float,
        default=400.0,
        help="tasks/s the master is assumed to reach (sizes epochs)",
    )
    add_arguments(parser)
    parser.add_argument("--keep", type=Path, help="a folder to keep the runs' logs and state in")
    args = parser.parse_args(argv)
    rows = []
    with contextlib.ExitStack() as stack:
        if args.keep:  # logs and state stay there
            args.keep.mkdir(parents=True, exist_ok=True)
            folder = tempfile.mkdtemp(prefix="master-load-", dir=args.keep)
        else:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="edl-master-load-"))
        for workers in args.workers:
            row = run(workers, args, Path(folder))
            print(row.markdown() if rows else Row.HEADER + "\n" + row.markdown(), flush=True)
            rows.append(row)
    return 1 if any(row.problems for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
