"""What sizing TensorFlow's thread pools to a CPU quota buys a pod: a measurement, not a test.

``python -m tests.bench.cpu_limit [--cpus 1] [--repeats 3] [--seconds 6] [--models transformer,...]``

A Kubernetes CPU limit is a CFS bandwidth quota, which TensorFlow does not see (:mod:`edl_argo.cpu_limit`).
This creates a cgroup with a quota of ``--cpus`` CPUs below this process's own (cgroup v1 ``cpu`` or v2,
which needs a writable cgroup file system: root in a machine or container of one's own), and runs each
model of the dense suite (``tests/bench/models/dense_suite.py``) in it with the training benchmarks'
``model.fit`` baseline (:mod:`tests.bench.train_baselines`: the digits' records through the model file's
``feed``, batch 64), in a fresh process each time, two ways alternating: with TensorFlow's default pools
(one thread per core of the machine, as a pod had before) and with the pools that
:func:`~edl_argo.cpu_limit.size_tensorflow_threads` gives (``--size-thread-pools``), as every pod command
now does before its first operation. ``fit`` is what a worker's gradient step and a lone AllreduceStrategy
member's step are made of; the PS's update runs in the same pools. Prints examples per second of each
run and the seconds the cgroup was throttled (waiting for its quota) while it was timed, and, per model,
sized ÷ default (median [min-max]).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from edl_argo.cpu_limit import cpu_cgroups
from tests.bench.common import child_env
from tests.bench.data import digits_train_records, write_records
from tests.bench.training import SUITE, BaselineChild, ModelCase

#: The dense suite's models by name (``transformer``, ``big_mlp``, ...).
MODELS = {case.name.removeprefix("suite_"): case for case in SUITE}
#: Untimed steps of each fresh process before its one timed window (tracing, the first steps' allocations).
WARMUP_STEPS = 20
CHILD_SECONDS_LIMIT = 600.0


def make_cgroup(cpus: float) -> Path:
    """A new cgroup below this process's own with a quota of ``cpus`` CPUs (its folder)."""
    period = 100_000
    for mount_point, relative in cpu_cgroups():
        parent = mount_point / relative
        folder = parent / f"edl-bench-cpu-limit-{os.getpid()}"
        try:
            folder.mkdir()
            if (folder / "cpu.max").exists():
                (folder / "cpu.max").write_text(f"{int(cpus * period)} {period}\n")
            else:
                (folder / "cpu.cfs_period_us").write_text(f"{period}\n")
                (folder / "cpu.cfs_quota_us").write_text(f"{int(cpus * period)}\n")
        except OSError as error:
            if folder.exists():
                folder.rmdir()
            raise SystemExit(
                f"cpu_limit bench: cannot make a cgroup with a CPU quota in {parent}: {error}"
            ) from None
        return folder
    raise SystemExit("cpu_limit bench: no cgroup file system with the cpu controller is mounted here")


def throttled_seconds(folder: Path) -> float:
    """The time the cgroup's processes have waited for their quota (``cpu.stat``: v1 ``throttled_time`` in
    nanoseconds, v2 ``throttled_usec``)."""
    values = dict(line.split() for line in (folder / "cpu.stat").read_text().splitlines() if " " in line)
    if "throttled_usec" in values:
        return int(values["throttled_usec"]) / 1e6
    return int(values.get("throttled_time", 0)) / 1e9


def measure(case: ModelCase, data: Path, folder: Path, sized: bool, seconds: float, log: Path) -> dict:
    """One measurement by a fresh ``fit`` baseline process (:class:`~tests.bench.training.BaselineChild`)
    inside ``folder``'s cgroup: its ``ready`` line (the pools it has), examples per second, and the time
    the cgroup was throttled while it was timed (``throttled_s``)."""
    child = BaselineChild(
        "fit",
        case,
        data,
        WARMUP_STEPS,
        log,
        more_args=["--size-thread-pools"] if sized else [],
        env={name: value for name, value in child_env().items() if not name.startswith("TF_NUM_")},
        preexec_fn=lambda: (folder / "cgroup.procs").write_text(f"{os.getpid()}\n"),
    )
    try:
        ready = child.wait_ready(CHILD_SECONDS_LIMIT)
        before = throttled_seconds(folder)
        timed = child.measure(seconds, CHILD_SECONDS_LIMIT)
        return {**ready, **timed, "throttled_s": throttled_seconds(folder) - before}
    finally:
        child.close()


def compare(name: str, data: Path, folder: Path, log: Path, repeats: int, seconds: float) -> None:
    """Print ``repeats`` pairs of measurements of model ``name``, default pools then sized, and the ratios."""
    case = MODELS[name]
    ratios = []
    for repeat in range(repeats):
        default = measure(case, data, folder, False, seconds, log)
        sized = measure(case, data, folder, True, seconds, log)
        ratios.append(sized["examples_per_s"] / default["examples_per_s"])
        print(
            f"{name} #{repeat}: default {default['examples_per_s']:,.0f} examples/s "
            f"(throttled {default['throttled_s']:.1f} s of {default['s']:.1f}), sized "
            f"({sized['intra_op']} and {sized['inter_op']} threads, quota {sized['cpu_limit']}) "
            f"{sized['examples_per_s']:,.0f} examples/s "
            f"(throttled {sized['throttled_s']:.1f} s of {sized['s']:.1f})",
            flush=True,
        )
    print(f"| {name} | {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - MODELS.keys())
    if unknown:
        parser.error(f"--models: no dense-suite model {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    with tempfile.TemporaryDirectory(prefix="edl-bench-cpu-limit-") as work:
        data, log = Path(work) / "data", Path(work) / "baselines.log"  # a failure quotes the log's end
        write_records(data, digits_train_records())
        folder = make_cgroup(args.cpus)
        print(
            f"cgroup {folder}, quota {args.cpus} CPUs, on {os.cpu_count()} cores; "
            f"load {os.getloadavg()[0]:.1f}"
        )
        try:
            for model in args.models.split(","):
                compare(model, data, folder, log, args.repeats, args.seconds)
        finally:
            folder.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
