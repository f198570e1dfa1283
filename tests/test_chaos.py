"""The chaos scenarios (tests/chaos/scenarios.py), each once with a fixed seed: ``make test``'s reduced
``make chaos``. Every trial is a real digits job that must complete with accuracy >= 0.95 and every record
of every epoch trained exactly once in a successful task; each test then checks that its fault really
happened and was handled the intended way (relaunch, checkpoint restore, retry, timeout, adoption).

These replace the engine tests' worker-killed, PS-killed and 1 -> 3 -> 1 scaling jobs. The master_restart
scenario runs in ``make chaos`` only: ``make test`` covers the same fault, a master SIGKILLed and run again,
in tests/test_master_failover.py, with stricter checks (which pods were adopted, which tasks trained twice).
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import pytest

from edl_argo.master.config import add_train_flags, config_from_args
from edl_argo.master.job import TrainingJob
from tests.chaos.scenarios import CHECKPOINT_STEPS, SCENARIOS, ChaosEnv, TrialResult
from tests.engine_helpers import DIGITS_MODEL, assert_no_record_lost
from tests.s3_stand_in import S3StandIn


@pytest.fixture(scope="module")
def chaos_env(digits_data: Path, s3_server: S3StandIn, tmp_path_factory: pytest.TempPathFactory) -> ChaosEnv:
    return ChaosEnv(digits_data, tmp_path_factory.mktemp("chaos"), s3_server, echo=True)


def run_trial(scenario: str, env: ChaosEnv) -> TrialResult:
    """One trial of ``scenario`` with a fixed seed; it must pass (see the module docstring)."""
    result = SCENARIOS[scenario](env, random.Random(f"test_chaos/{scenario}"))
    assert result.passed, result.summary()
    assert_no_record_lost(result.metrics)
    assert result.faults, "no fault was injected"
    return result


def test_killed_workers_are_replaced_and_their_tasks_requeued(chaos_env: ChaosEnv) -> None:
    result = run_trial("worker_kills", chaos_env)

    killed = [int(worker) for fault in result.faults for worker in re.findall(r"worker-(\d+)", fault)]
    relaunches = result.metrics["relaunches"]
    assert relaunches["worker"] == len(killed) >= 1
    assert sorted(event["old_id"] for event in relaunches["events"]) == sorted(killed)
    assert result.metrics["task_requeues"]["worker_died"] >= 1
    for worker in killed:
        assert result.logged(rf"worker_relaunched old_worker={worker}\b"), worker


def test_killed_ps_restarts_from_its_latest_checkpoint(chaos_env: ChaosEnv) -> None:
    result = run_trial("ps_kill", chaos_env)

    assert result.metrics["relaunches"]["ps"] == 1
    assert result.logged(r"ps_relaunched ps=0\b")
    assert result.logged(r"\[ps-0\] .* ps_restored version=\d+")
    # Restored from the newest checkpoint (one every CHECKPOINT_STEPS versions, saved in the background).
    assert result.versions_lost is not None
    assert 0 <= result.versions_lost <= 2 * CHECKPOINT_STEPS, result.versions_lost
    # The job counts the same loss itself: the updates its minibatches make minus the PS's final version.
    assert result.updates_lost == result.versions_lost, result.metrics["accounting"]


def test_job_rides_out_an_s3_outage(chaos_env: ChaosEnv) -> None:
    result = run_trial("s3_outage", chaos_env)

    assert result.logged(r"storage_retry"), "no storage call met the outage"
    assert result.metrics["relaunches"] == {"worker": 0, "ps": 0, "events": []}


def test_scaling_one_to_four_to_one_worker(chaos_env: ChaosEnv) -> None:
    result = run_trial("scale_1_4_1", chaos_env)

    assert result.metrics["relaunches"]["worker"] == 0
    assert len(result.logged(r"worker_removed worker=\d+")) == 3


def test_hung_worker_task_is_reclaimed_on_timeout(chaos_env: ChaosEnv) -> None:
    result = run_trial("hung_worker", chaos_env)

    paused = int(re.findall(r"worker-(\d+)", result.faults[0])[0])
    assert result.metrics["task_requeues"]["timeout"] >= 1
    events = result.metrics["relaunches"]["events"]
    assert [(e["old_id"], e["reason"]) for e in events] == [(paused, "Stuck")]


def test_min_task_timeout_flag_sets_the_dispatcher_timeout_floor(digits_data: Path, tmp_path: Path) -> None:
    """hung_worker relies on ``--min-task-timeout-seconds`` reaching the dispatcher (default: 60 s)."""
    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    flags = ["--model-def", DIGITS_MODEL, "--training-data", str(digits_data / "train")]
    flags += ["--output", str(tmp_path / "job")]
    default = config_from_args(parser.parse_args(flags))
    chosen = config_from_args(parser.parse_args([*flags, "--min-task-timeout-seconds", "5"]))

    assert TrainingJob.load(default).dispatcher.snapshot()["config"]["task_timeout_floor"] == 60
    assert TrainingJob.load(chosen).dispatcher.snapshot()["config"]["task_timeout_floor"] == 5
    with pytest.raises(SystemExit):
        parser.parse_args([*flags, "--min-task-timeout-seconds", "0"])
