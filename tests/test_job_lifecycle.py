"""A job ends when its step ends: SIGTERM stops a local job, and pods whose master is gone for good end
after ``--master-timeout``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_master_failover import no_pods_left_behind, saved_state, train_command, training_progress


def live_processes_of_groups(groups: set[int]) -> list[int]:
    """Pids of the processes (zombies excluded) whose process group is one of ``groups``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) in groups:
            alive.append(int(entry.name))
    return alive


def pod_groups(run_dir: Path) -> set[int]:
    """The process groups of the local pods recorded under ``run_dir``."""
    import json

    groups = set()
    for record in run_dir.glob("pods/*/*/supervisor"):
        try:
            groups.add(int(json.loads(record.read_text())["pgid"]))
        except (OSError, ValueError, KeyError):
            continue
    return groups


def start_until_training(command: list[str], env: dict[str, str], output: Path, log: Path, progress: float):
    """Start ``command`` and return it once ``progress`` of the training tasks are done."""
    with open(log, "w") as sink:
        master = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while training_progress(saved_state(output)) < progress:
        if master.poll() is not None or time.monotonic() > deadline:
            master.kill()
            pytest.fail(f"the job never reached {progress:.0%} of its tasks:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return master


def wait_until_gone(groups: set[int], seconds: float) -> float:
    """Seconds until no process of ``groups`` is left; fails after ``seconds``."""
    started = time.monotonic()
    while live_processes_of_groups(groups):
        assert time.monotonic() - started < seconds, f"still running: {live_processes_of_groups(groups)}"
        time.sleep(0.2)
    return time.monotonic() - started


@pytest.mark.timeout(300)
def test_sigterm_stops_a_local_job_and_every_pod_within_30_seconds(digits_data: Path, tmp_path: Path) -> None:
    output, run_dir = tmp_path / "job", tmp_path / "run"
    env = {**os.environ, "EDL_RUN_DIR": str(run_dir), "TF_CPP_MIN_LOG_LEVEL": "2"}
    with no_pods_left_behind(run_dir):
        master = start_until_training(
            train_command(digits_data, output), env, output, tmp_path / "master.log", 0.1
        )
        groups = pod_groups(run_dir)
        assert len(groups) == 3  # 2 workers, 1 PS
        master.send_signal(signal.SIGTERM)
        assert master.wait(30) == 143, (tmp_path / "master.log").read_text()[-3000:]
        wait_until_gone(groups, 30)
    log = (tmp_path / "master.log").read_text()
    assert "stop_requested" in log and "edl-argo train: terminated" in log


@pytest.mark.timeout(300)
def test_pods_of_a_sigkilled_local_master_end_after_the_master_timeout(
    digits_data: Path, tmp_path: Path
) -> None:
    output, run_dir = tmp_path / "job", tmp_path / "run"
    env = {**os.environ, "EDL_RUN_DIR": str(run_dir), "TF_CPP_MIN_LOG_LEVEL": "2"}
    timeout = 8
    flags = ("--master-timeout", str(timeout), "--checkpoint-steps", "5")
    with no_pods_left_behind(run_dir):
        master = start_until_training(
            train_command(digits_data, output, *flags), env, output, tmp_path / "master.log", 0.1
        )
        groups = pod_groups(run_dir)
        assert len(groups) == 3
        master.kill()
        master.wait()
        killed = time.monotonic()
        time.sleep(timeout / 2)
        assert len(live_processes_of_groups(groups)) >= 3, "the pods must wait --master-timeout for a master"
        wait_until_gone(groups, timeout + 30 - (time.monotonic() - killed))
    ps_log = next(run_dir.glob("pods/*/ps-0.*/stderr")).read_text()
    assert "ps_stopping" in ps_log and "reason=master_lost" in ps_log and "ps_stopped" in ps_log
    for worker in (0, 1):
        worker_log = next(run_dir.glob(f"pods/*/worker-{worker}.*/stderr")).read_text()
        assert "master_lost" in worker_log
