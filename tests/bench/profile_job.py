"""Where a training job's time goes: sample our worker and PS processes with py-spy while they train.

``python -m tests.bench.profile_job --model MODEL [--allreduce] [--seconds 20] [--output DIR] [--native]``
(MODEL: cnn, ctr, digits, or a model of the dense suite: big_mlp, resnet_bn, transformer, lstm)

Runs the model's local job as the training benchmark does (:class:`tests.bench.training.OurJob`: 1 worker,
1 PS, 2 for CTR, sync; with ``--allreduce``, AllreduceStrategy with 1 worker), lets it warm up, then
records every worker and PS process, and this process (where the job's master runs, on its server and
state-saving threads) with ``py-spy record --idle --threads`` for ``--seconds`` while the job trains, and
times that window. Prints, per process and thread group, the milliseconds per training step spent in the
functions that take the most (inclusive, and self; threads waiting for work are left out), and writes
py-spy's raw collapsed stacks (for flame graphs) to ``--output``. Needs ``py-spy`` (``pip install
py-spy``) in the environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Pods started with exec: pod_processes finds them by their command lines, and the supervisor's parent
# (a forked pod's are the pod template's: edl_argo.pods.prefork).
os.environ.setdefault("EDL_LOCAL_PREFORK", "0")

from tests.bench.data import write_records
from tests.bench.training import ALLREDUCE_ONE_WORKER, CNN, CTR, DIGITS, SUITE, OurJob

CASES = {
    "cnn": CNN,
    "ctr": CTR,
    "digits": DIGITS,
    **{case.name.removeprefix("suite_"): case for case in SUITE},
}
#: py-spy samples per second.
RATE = 100


def pod_processes() -> dict[str, int]:
    """``{"worker-0": pid, "ps-0": pid, ...}``: the ``edl-argo worker|ps`` processes this process started,
    each the child of its pod's supervisor (``edl_argo.pods.local``), which is this process's child."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        commands[int(entry.name)] = [w.decode(errors="replace") for w in cmdline]
    found = {}
    for pid, words in commands.items():
        supervisor = parents[pid]
        if parents.get(supervisor) != os.getpid() or "-c" in words:  # not a pod, or its supervisor
            continue
        program = next((i for i, word in enumerate(words) if word.endswith("edl-argo")), None)
        if program is None or program + 1 >= len(words):
            continue
        role = words[program + 1]
        flag = f"--{role}-id"  # left out when it is the default, 0
        found[f"{role}-{words[words.index(flag) + 1] if flag in words else 0}"] = pid
    return found


#: Leaf frames of a thread that waits for work (a pool thread, a gRPC poller), not a cost.
_IDLE_LEAVES = ("_worker (thread.py)", "Condition.wait (threading.py)", "_serve (_server.py)")


def summarize(raw: Path, steps: float, rate: int, keep_main_waits: bool, top: int = 16) -> str:
    """Per thread group (a process's main thread; its other threads together): wall time per training
    step spent in the functions that take the most, inclusive and self. Threads waiting for work are left
    out, except the main thread's waits when ``keep_main_waits`` (a worker waiting for its PS calls)."""
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    busy: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        frames = [_short(frame) for frame in frames]
        group = "main thread" if "MainThread" in thread else "other threads"
        if not frames:
            continue
        if frames[-1] in _IDLE_LEAVES and not (keep_main_waits and group == "main thread"):
            continue
        count = int(count_text)
        busy[group] += count
        for frame in dict.fromkeys(frames):
            inclusive[group][frame] += count
        leaves[group][frames[-1]] += count
    per_step = 1000.0 / rate / steps  # ms per step of one sample
    lines = []
    for group, total in sorted(busy.items()):
        lines.append(f"  {group}: {total * per_step:,.1f} ms busy per step")
        shown = [(f, n) for f, n in inclusive[group].most_common() if n < 0.98 * total][:top]
        lines += [f"    {n * per_step:8.1f} ms  {f}" for f, n in shown]
        lines.append("    self:")
        lines += [f"    {n * per_step:8.1f} ms  {f}" for f, n in leaves[group].most_common(top // 2)]
    return "\n".join(lines)


def _short(frame: str) -> str:
    """``function (path/to/file.py:12)`` -> ``function (file.py)``."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({file})" if file else name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=sorted(CASES), required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--output", type=Path, default=None, help="folder for py-spy's raw stacks")
    parser.add_argument("--native", action="store_true", help="also sample native (C/C++) frames")
    parser.add_argument("--num-ps", type=int, default=0, help="parameter servers (default: the case's)")
    parser.add_argument("--allreduce", action="store_true", help="AllreduceStrategy, 1 worker, no PS")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy")
    case = CASES[args.model]
    workdir = Path(tempfile.mkdtemp(prefix="edl-profile-"))
    output = args.output or workdir / "profiles"
    output.mkdir(parents=True, exist_ok=True)
    os.environ["EDL_RUN_DIR"] = str(workdir / "run")
    os.environ["EDL_NO_PROGRESS_BAR"] = "1"
    try:
        data = Path(write_records(workdir / "data", case.records(False)))
        with (workdir / "job.log").open("a") as log:
            overrides: dict[str, object] = {}
            if args.allreduce:
                overrides = ALLREDUCE_ONE_WORKER[1]
            elif args.num_ps:
                overrides = {"num_ps": args.num_ps}
            job = OurJob(case, data, workdir, log, overrides)
            job.start()
            try:
                job.window(3.0, first=True)  # warm-up, then paused
                pods = {**pod_processes(), "master": os.getpid()}  # the job's master runs in this process
                print(f"profiling {', '.join(f'{k} (pid {v})' for k, v in sorted(pods.items()))}", flush=True)
                extra = ["--native"] if args.native else []
                spies = {
                    name: subprocess.Popen(
                        [
                            *(py_spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds))),
                            *("--idle", "--threads", "--rate", str(RATE), "--format", "raw"),
                            *("-o", str(output / f"{name}.txt"), *extra),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                    )
                    for name, pid in pods.items()
                }
                time.sleep(0.5)
                window = job.window(args.seconds - 1.0, first=False)
                for name, spy in spies.items():
                    _, err = spy.communicate(timeout=args.seconds + 60)
                    if spy.returncode:
                        print(f"py-spy failed for {name}: {err.decode(errors='replace')[-500:]}")
            finally:
                job.stop()
        steps = window.examples_per_s * int(args.seconds) / 64
        print(
            f"\n{args.model}: {window.examples_per_s:,.0f} examples/s while profiled, "
            f"{1000 * int(args.seconds) / steps:,.0f} ms per step of 64"
        )
        for name in sorted(spies):
            raw = output / f"{name}.txt"
            if raw.exists():
                print(f"\n{name}  ({raw})\n{summarize(raw, steps, RATE, name.startswith('worker'))}")
    finally:
        for path in workdir.iterdir():  # the data, logs and job output; only py-spy's stacks are kept
            if path == output:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if args.output is None:
            print(f"\nraw stacks kept in {output}")
        else:
            workdir.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
