"""How long a local job takes to train its first step, with its pods forked from the pod template, with
each pod importing TensorFlow itself (``EDL_LOCAL_PREFORK=0``), and with the master and its pods forked from
a warm server (``edl-argo warm``, started before the trials): a measurement, not a test.

``python -m tests.bench.pod_start [--trials 3]``

Each trial runs ``edl-argo train`` (a program of its own, as a user runs it) on the tests' digits job (2
workers, 1 PS: :data:`tests.engine_helpers.DIGITS_JOB`) with ``EDL_STEP_TRACE`` set, and times from
starting the program to the first line a worker appends to its step trace (written when its first
minibatch's update is applied: :mod:`edl_argo.worker.step_trace`); the job is then stopped (SIGTERM). The
ways alternate, so all see the same machine. Prints every trial (with when the master had read the
job's parts, the template was ready, the first pod started, and the machine's load average) and the median
of each way.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edl_argo.pods.prefork import PREFORK_ENV
from edl_argo.pods.warm import WARM_ENV
from edl_argo.storage.local import LocalStorage
from tests.engine_helpers import DIGITS_JOB, DIGITS_MODEL, write_digits_dataset

#: How long one trial may take to reach its first step.
FIRST_STEP_DEADLINE_SECONDS = 120.0


def train_command(data: Path, output: Path, job_name: str) -> list[str]:
    """``edl-argo train`` of the tests' digits job."""
    command = [
        str(Path(sys.executable).parent / "edl-argo"),
        "train",
        "--model-def",
        DIGITS_MODEL,
        "--training-data",
        str(data / "train"),
        "--validation-data",
        str(data / "test"),
        "--output",
        str(output),
        "--job-name",
        job_name,
    ]
    for name, value in DIGITS_JOB.items():
        command += [f"--{name.replace('_', '-')}", str(value).lower()]
    return command


#: Events of the master's log whose first occurrence :func:`milestones` times.
MILESTONES = {"job_started": "parts read", "pod_template_ready": "template ready", "pod_started": "first pod"}


def milestones(master_log: Path, started: float) -> dict[str, float]:
    """Seconds from ``started`` (a ``time.time()``) to the first line of each of :data:`MILESTONES` in the
    master's log (its lines start with an ISO time in UTC)."""
    found: dict[str, float] = {}
    for line in master_log.read_text(errors="replace").splitlines():
        words = line.split()
        if len(words) < 4 or words[3] not in MILESTONES or MILESTONES[words[3]] in found:
            continue
        moment = datetime.datetime.fromisoformat(words[0].replace("Z", "+00:00")).timestamp()
        found[MILESTONES[words[3]]] = moment - started
    return found


#: The ways a trial runs the job: label -> what its environment adds.
WAYS = {
    "forked from the template": {PREFORK_ENV: "1", WARM_ENV: "0"},
    "exec (EDL_LOCAL_PREFORK=0)": {PREFORK_ENV: "0", WARM_ENV: "0"},
    "warm server (edl-argo warm)": {PREFORK_ENV: "1", WARM_ENV: "1"},
}


def seconds_to_first_step(data: Path, folder: Path, way: str, warm_run_dir: Path) -> float:
    """Run the job once (in ``folder``) the ``way`` :data:`WAYS` names and time it to its first step (see
    the module docstring). The warm way runs under ``warm_run_dir``, where the server listens."""
    trace = folder / "trace"
    run_dir = warm_run_dir if WAYS[way][WARM_ENV] == "1" else folder / "run"
    env = dict(os.environ, EDL_STEP_TRACE=str(trace), EDL_NO_PROGRESS_BAR="1", EDL_RUN_DIR=str(run_dir))
    env.update(WAYS[way])
    job_name = f"pod-start-{folder.name}"
    with open(folder / "master.log", "wb") as log:
        started, wall_clock = time.monotonic(), time.time()
        master = subprocess.Popen(
            train_command(data, folder / "output", job_name),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while not any(path.stat().st_size for path in trace.glob("worker-*.jsonl")):
                if master.poll() is not None:
                    raise RuntimeError(f"the job ended before its first step: see {folder / 'master.log'}")
                if time.monotonic() - started > FIRST_STEP_DEADLINE_SECONDS:
                    raise RuntimeError(f"no step within {FIRST_STEP_DEADLINE_SECONDS:g} s")
                time.sleep(0.01)
            seconds = time.monotonic() - started
            shown = ", ".join(
                f"{name} {at:.2f}" for name, at in milestones(folder / "master.log", wall_clock).items()
            )
            print(
                f"  ({shown}, first step {seconds:.2f} s; load average {os.getloadavg()[0]:.1f})", flush=True
            )
            return seconds
        finally:
            master.send_signal(signal.SIGTERM)
            try:
                master.wait(60)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials of each way (default 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pod-start-") as root:
        data = Path(root) / "digits"
        write_digits_dataset(LocalStorage(data))
        warm_run_dir = Path(root) / "warm-run"
        program = str(Path(sys.executable).parent / "edl-argo")
        server_env = dict(os.environ, EDL_RUN_DIR=str(warm_run_dir))
        subprocess.run([program, "warm", "--idle-minutes", "10"], env=server_env, check=True, timeout=300)
        results: dict[str, list[float]] = {way: [] for way in WAYS}
        try:
            for trial in range(args.trials):
                for number, way in enumerate(WAYS):
                    folder = Path(root) / f"way{number}-trial{trial}"
                    folder.mkdir()
                    print(f"trial {trial + 1}, {way}:", flush=True)
                    results[way].append(seconds_to_first_step(data, folder, way, warm_run_dir))
        finally:
            subprocess.run([program, "warm", "--stop"], env=server_env, check=False, timeout=60)
        print()
        for way, values in results.items():
            median, low, high = statistics.median(values), min(values), max(values)
            print(f"{way}: median {median:.2f} s (min {low:.2f}, max {high:.2f})")


if __name__ == "__main__":
    main()
