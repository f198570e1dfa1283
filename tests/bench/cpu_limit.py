"""What sizing TensorFlow's thread pools to a CPU quota buys a pod: a measurement, not a test.

``python -m tests.bench.cpu_limit [--cpus 1] [--repeats 3] [--seconds 6] [--models transformer,...]``

A Kubernetes CPU limit is a CFS bandwidth quota, which TensorFlow does not see (:mod:`edl_argo.cpu_limit`).
This creates a cgroup with a quota of ``--cpus`` CPUs below this process's own (cgroup v1 ``cpu`` or v2,
which needs a writable cgroup file system: root in a machine or container of one's own), and runs each
model of the dense suite (``tests/bench/models/dense_suite.py``) in it with ``model.fit`` on the digits,
batch 64, in a fresh process, two ways alternating: with TensorFlow's default pools (one thread per core
of the machine, as a pod had before) and with the pools that :func:`~edl_argo.cpu_limit.
size_tensorflow_threads` gives, as every pod command now does before its first operation. ``fit`` is what a
worker's gradient step and a lone AllreduceStrategy member's step are made of; the PS's update runs in the
same pools. Prints examples per second of each run and the seconds its process was throttled (waiting for
its quota, start-up included), and, per model, sized ÷ default (median [min-max]).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edl_argo.cpu_limit import cgroup_cpu_limit, cpu_cgroups

MODELS = ("transformer", "resnet_bn", "lstm", "big_mlp")
BATCH = 64
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


def run_child(folder: Path, model: str, sized: bool, seconds: float) -> dict[str, float]:
    """One measurement in a fresh process inside ``folder``'s cgroup, with the time it was throttled
    (``throttled_s``, start-up included)."""
    before = throttled_seconds(folder)
    command = [sys.executable, "-m", "tests.bench.cpu_limit", "--child", model, "--seconds", str(seconds)]
    done = subprocess.run(
        [*command, *(["--sized"] if sized else [])],
        preexec_fn=lambda: (folder / "cgroup.procs").write_text(f"{os.getpid()}\n"),
        env={k: v for k, v in os.environ.items() if not k.startswith("TF_NUM_")},
        capture_output=True,
        text=True,
        timeout=CHILD_SECONDS_LIMIT,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"cpu_limit bench: {model} failed:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.splitlines()[-1]), "throttled_s": throttled_seconds(folder) - before}


def child(model_name: str, sized: bool, seconds: float) -> None:
    """Fit ``model_name`` for about ``seconds`` after a warm-up; print examples/s and the pools."""
    from edl_argo.tensorflow_import import import_tensorflow

    import_tensorflow()
    import tensorflow as tf
    from sklearn.datasets import load_digits

    from edl_argo.cpu_limit import size_tensorflow_threads
    from tests.bench.models import dense_suite

    pools = size_tensorflow_threads() if sized else None
    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int32")
    model = getattr(dense_suite, model_name)()
    model.compile(optimizer=dense_suite.optimizer(), loss=dense_suite.loss)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    started, epochs = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        epochs += 1
    elapsed = time.perf_counter() - started
    result = {
        "examples_per_second": epochs * len(x) / elapsed,
        "cpu_limit": cgroup_cpu_limit(),
        "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        "source": pools.source if pools else "default",
    }
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sized", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.sized, args.seconds)
        return 0
    folder = make_cgroup(args.cpus)
    print(
        f"cgroup {folder}, quota {args.cpus} CPUs, on {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}"
    )
    try:
        for model in args.models.split(","):
            ratios = []
            for repeat in range(args.repeats):
                default = run_child(folder, model, sized=False, seconds=args.seconds)
                sized = run_child(folder, model, sized=True, seconds=args.seconds)
                ratios.append(sized["examples_per_second"] / default["examples_per_second"])
                print(
                    f"{model} #{repeat}: default {default['examples_per_second']:,.0f} examples/s "
                    f"(throttled {default['throttled_s']:.1f} s), sized ({sized['intra_op']} and "
                    f"{sized['inter_op']} threads, quota {sized['cpu_limit']}) "
                    f"{sized['examples_per_second']:,.0f} examples/s "
                    f"(throttled {sized['throttled_s']:.1f} s)",
                    flush=True,
                )
            print(
                f"| {model} | {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |",
                flush=True,
            )
    finally:
        folder.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
