"""The chaos scenarios (tests/chaos/), each once with a fixed seed: ``make test``'s reduced ``make chaos``.
Every trial is a real digits job that must pass as in ``make chaos`` (completed, accuracy >= 0.95, the
workers' accounting adds up, AllreduceStrategy replicas bit-identical, nothing left behind); each test
then checks that its fault really happened and was handled the intended way (relaunch, checkpoint
restore, retry, timeout, adoption, relisting).

Every variant has its one trial here, the Kubernetes ones included: the stand-in forks their containers
from a pod template (``tests/k8s_stand_in/forked.py``), which made the 21 trials once marked slow take
218 s on 2 test processes instead of 257 s. ``make chaos`` repeats each with several seeds.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edl_argo.master.config import add_train_flags, config_from_args
from edl_argo.master.job import TrainingJob
from tests.chaos.catalog import VARIANTS
from tests.chaos.pods import KubernetesPods, LocalPods, left_behind
from tests.chaos.scenarios import (
    CHECKPOINT_STEPS,
    ChaosEnv,
    TrialResult,
    check_outcome,
    members_suspected_after_they_finished,
    worker_kills,
)
from tests.engine_helpers import DIGITS_MODEL, assert_no_record_lost
from tests.k8s_helpers import role_rules
from tests.k8s_stand_in import KubernetesStandIn
from tests.reader_data import FILE_FORMATS, write_digits_as, write_digits_table
from tests.s3_stand_in import S3StandIn

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def chaos_env(
    digits_data: Path, s3_server: S3StandIn, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChaosEnv]:
    with KubernetesStandIn(tmp_path_factory.mktemp("k8s"), echo_logs=False) as cluster:
        cluster.enforce_rules(role_rules())
        yield ChaosEnv(
            digits_data, tmp_path_factory.mktemp("chaos"), s3_server, echo=True, kubernetes=cluster
        )


def run_trial(scenario: str, env: ChaosEnv) -> TrialResult:
    """One trial of ``scenario`` with a fixed seed; it must pass (see the module docstring)."""
    result = VARIANTS[scenario].run(env, random.Random(f"test_chaos/{scenario}"))
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


@pytest.mark.parametrize("fmt", FILE_FORMATS)
def test_killed_workers_lose_no_record_reading_each_file_format(
    chaos_env: ChaosEnv, fmt: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The worker-kill trial on the digits written as TFRecord, CSV and Parquet files: a killed worker's
    tasks go back to the queue and every record is trained once per epoch, whatever reader serves them."""
    data = write_digits_as(fmt, tmp_path_factory.mktemp(f"digits-{fmt}"))
    result = worker_kills(chaos_env, random.Random(f"test_chaos/{fmt}"), data=str(data))
    assert result.passed, result.summary()
    assert_no_record_lost(result.metrics)
    assert result.faults, "no fault was injected"
    assert result.metrics["records_per_epoch"] == 1437


def test_killed_workers_lose_no_record_reading_a_sql_table(
    chaos_env: ChaosEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The worker-kill trial on the digits as tables of a SQLite database, read in key order."""
    url = write_digits_table(tmp_path_factory.mktemp("digits-sql") / "digits.db")
    result = worker_kills(
        chaos_env,
        random.Random("test_chaos/sql"),
        training_data=f"{url}#train",
        validation_data=f"{url}#test",
        data_options="key=id",
    )
    assert result.passed, result.summary()
    assert_no_record_lost(result.metrics)
    assert result.faults, "no fault was injected"
    assert result.metrics["records_per_epoch"] == 1437


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
    assert _task_timeout_floor(digits_data, tmp_path) == 60
    assert _task_timeout_floor(digits_data, tmp_path, "--min-task-timeout-seconds", "5") == 5
    with pytest.raises(SystemExit):
        _task_timeout_floor(digits_data, tmp_path, "--min-task-timeout-seconds", "0")


def test_an_allreduce_member_waiting_on_a_hung_peer_keeps_its_task(digits_data: Path, tmp_path: Path) -> None:
    """A member blocked in a collective on a hung peer holds its task until the collective times out
    (``--collective-timeout-seconds``), then the group re-forms without the peer and it goes on. Its task must
    not time out first: that replaced the healthy member too, the whole group was lost and the model started
    again from version 0 (2 of 20 ``allreduce_hang`` trials, accuracy 0.947). So an AllreduceStrategy job
    reclaims tasks only after twice the collective timeout, whatever the floor asked."""
    allreduce = ("--distribution-strategy", "AllreduceStrategy")
    assert _task_timeout_floor(digits_data, tmp_path, *allreduce) == 120
    short = ("--min-task-timeout-seconds", "5", "--collective-timeout-seconds", "15")
    assert _task_timeout_floor(digits_data, tmp_path, *allreduce, *short) == 30
    assert _task_timeout_floor(digits_data, tmp_path, *allreduce, "--min-task-timeout-seconds", "500") == 500


def _task_timeout_floor(digits_data: Path, tmp_path: Path, *extra: str) -> float:
    """The dispatcher's task-timeout floor of a digits job loaded from the command line plus ``extra``."""
    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    flags = ["--model-def", DIGITS_MODEL, "--training-data", str(digits_data / "train")]
    flags += ["--output", str(tmp_path / "job"), *extra]
    config = config_from_args(parser.parse_args(flags))
    return TrainingJob.load(config).dispatcher.snapshot()["config"]["task_timeout_floor"]


# -------------------------------------------------------------------------- the other backend and strategy


def _relaunched(result: TrialResult, count: int, reason: str) -> None:
    events = result.metrics["relaunches"]["events"]
    assert len([e for e in events if e["reason"] == reason]) >= count, events


def _workers_replaced(result: TrialResult) -> None:
    assert result.metrics["relaunches"]["worker"] == len(result.faults) >= 1, result.metrics["relaunches"]


def _ps_restored(result: TrialResult) -> None:
    assert result.metrics["relaunches"]["ps"] == 1
    assert result.logged(r"ps_restored version=\d+")


def _eviction_storm(result: TrialResult) -> None:
    _relaunched(result, 2, "Preempted")


def _api_errors(result: TrialResult) -> None:
    assert result.logged(r"api_retry|watch_failed"), "no API call met the errors"
    _relaunched(result, 1, "Deleted")


def _watch_cut(result: TrialResult) -> None:
    assert result.logged(r"watch_failed"), "the master never saw its watch fail"
    _relaunched(result, 1, "Deleted")


def _watch_cut_410(result: TrialResult) -> None:
    _watch_cut(result)
    assert result.logged(r"pods_relisted"), "the master did not list its pods again after 410 Gone"


def _pod_quota(result: TrialResult) -> None:
    assert result.logged(r"pod_create_retry .*exceeded quota"), "no pod creation met the quota"
    _relaunched(result, 1, "Deleted")


def _member_lost(result: TrialResult) -> None:
    assert result.metrics["relaunches"]["worker"] >= 1
    assert result.metrics["allreduce_replicas"]["members_compared"] >= 1


def _member_hung(result: TrialResult) -> None:
    paused = int(re.findall(r"worker-(\d+)", result.faults[0])[0])
    assert result.logged(rf"worker_stuck worker={paused}\b"), "the paused member was not found stuck"
    # Replaced, unless its peer had trained everything else before it was found stuck and then finished its
    # requeued task at once (the master replaces no worker once training is over).
    relaunched = any(e["old_id"] == paused for e in result.metrics["relaunches"]["events"])
    over = result.logged(rf'worker_relaunch_dropped old_worker={paused} reason="training is over"')
    assert relaunched or over, "the paused member was neither replaced nor lost after training was over"
    assert result.logged(r"rendezvous_round|group_formed"), "the group never re-formed"


def _all_lost(result: TrialResult) -> None:
    assert result.logged(r"replica_restored version=\d+"), "no replacement restored the checkpoint"


def _scaled(result: TrialResult) -> None:
    assert len(result.logged(r"worker_removed worker=\d+")) == 3


def _master_restarted(result: TrialResult) -> None:
    assert len(result.logged(r"master_state_restored")) == 1
    assert result.logged(r"pod_adopted"), "the new master adopted no pod"


#: Variant -> what its trial must show besides passing.
CHECKS: dict[str, Callable[[TrialResult], None]] = {
    "worker_kills_k8s": _workers_replaced,
    "ps_kill_k8s": _ps_restored,
    "master_restart": _master_restarted,
    "master_restart_k8s": _master_restarted,
    "eviction_storm_k8s": _eviction_storm,
    "api_errors_k8s": _api_errors,
    "watch_cut_k8s": _watch_cut,
    "watch_cut_410_k8s": _watch_cut_410,
    "pod_quota_k8s": _pod_quota,
    "allreduce_kill": _member_lost,
    "allreduce_kill_k8s": _member_lost,
    "allreduce_hang": _member_hung,
    "allreduce_hang_k8s": _member_hung,
    "allreduce_scale_1_4_1": _scaled,
    "allreduce_scale_1_4_1_k8s": _scaled,
    "allreduce_all_lost": _all_lost,
    "allreduce_all_lost_k8s": _all_lost,
    "allreduce_master_restart": _master_restarted,
    "allreduce_master_restart_k8s": _master_restarted,
}


@pytest.mark.parametrize("variant", list(CHECKS))
def test_scenario_variant_passes_and_shows_its_fault(chaos_env: ChaosEnv, variant: str) -> None:
    CHECKS[variant](run_trial(variant, chaos_env))


def test_every_variant_has_a_trial_in_this_file() -> None:
    covered = {"worker_kills", "ps_kill", "s3_outage", "scale_1_4_1", "hung_worker", *CHECKS}
    assert covered == set(VARIANTS)


# ------------------------------------------------------------------------------- the pass criteria can fail


def _metrics(**accounting: Any) -> dict[str, Any]:
    ps = {"ps": 0, "model_version": 100, "updates_expected": 100, "restored_from_version": -1}
    return {"accounting": {"minibatches_trained": 100, "parameter_servers": [ps], **accounting}}


def test_a_lost_or_doubled_minibatch_or_a_differing_replica_fails_the_trial() -> None:
    assert check_outcome(_metrics(), 100) == []
    assert "trained 101 minibatches" in check_outcome(_metrics(minibatches_trained=101), 100)[0]
    assert "trained 99 minibatches" in check_outcome(_metrics(minibatches_trained=99), 100)[0]
    behind = {"ps": 0, "model_version": 98, "updates_expected": 100, "restored_from_version": -1}
    assert "PS 0 at version 98" in check_outcome(_metrics(parameter_servers=[behind]), 100)[0]
    rolled_back = {**behind, "restored_from_version": 90}  # restarted from its checkpoint: counted apart
    assert check_outcome(_metrics(parameter_servers=[rolled_back]), 100) == []
    replicas = {"members": 2, "members_compared": 2, "max_abs_difference": 1e-7, "members_left_out": []}
    assert "replicas differ" in check_outcome({**_metrics(), "allreduce_replicas": replicas}, 100)[0]
    one_of_two = {**replicas, "members_compared": 1, "max_abs_difference": 0.0}
    one_of_two["members_left_out"] = ["a: gone"]
    problems = check_outcome({**_metrics(), "allreduce_replicas": one_of_two}, 100)
    assert problems == ["replicas: 1 of the final round's 2 members compared; left out: ['a: gone']"]
    joined_late = {**one_of_two, "members_left_out": [], "members_behind": ["b: version 177 of round 4"]}
    assert check_outcome({**_metrics(), "allreduce_replicas": joined_late}, 100) == []


def test_a_member_reported_silent_after_its_pod_finished_fails_the_trial() -> None:
    """The master's lines of a trial whose group kept a finished worker in its round (allreduce_hang once
    waited 15 s so); a peer reported before the worker finished is no problem."""
    log = [
        "... WARNING rendezvous collective_failure_reported reporter=1 round=7 suspect=0 message=...",
        "... INFO pod_manager worker_finished worker=1",
        "... WARNING rendezvous collective_failure_reported reporter=2 round=9 suspect=1 message=...",
    ]
    assert members_suspected_after_they_finished(log[:2]) == []
    assert members_suspected_after_they_finished(log) == [
        "worker 1 was still a member of a round after its pod finished"
    ]


def test_a_process_or_kubernetes_object_of_the_job_left_behind_fails_the_trial(tmp_path: Path) -> None:
    from edl_argo.pods import LocalProcessBackend

    job = "leftover-probe"
    code = "import time; time.sleep(60)"
    environ = {"EDL_JOB_NAME": job, "PATH": "/usr/bin:/bin"}
    orphan = subprocess.Popen([sys.executable, "-c", code], env=environ)
    try:
        found = left_behind(LocalPods(LocalProcessBackend(job), job), seconds=1)
        assert [thing.split()[:2] for thing in found] == [["process", str(orphan.pid)]]
        assert orphan.wait(10) == -signal.SIGKILL  # removed, so the next trial starts clean
    finally:
        orphan.kill()
    with KubernetesStandIn(tmp_path, echo_logs=False) as cluster:
        labels = {"app.kubernetes.io/instance": job}
        cluster.create(
            "services",
            {"metadata": {"name": f"{job}-ps-0", "labels": labels}, "spec": {"ports": [{"port": 1}]}},
        )
        found = left_behind(KubernetesPods(cluster, job), seconds=1)
        assert found == [f"service {job}-ps-0"]
        assert cluster.objects("services") == []


# ------------------------------------------------------------------------------------ the report's summary


def _stored_trial(passed: bool = True, records_lost: int = 0) -> dict[str, Any]:
    return {
        "backend": "local",
        "strategy": "ParameterServerStrategy",
        "completed": True,
        "passed": passed,
        "records_lost": records_lost,
        "records_trained_twice": 0,
        "wall_seconds": 40.0,
        "accuracy": 0.98,
        "versions_lost": None,
        "updates_lost": 0,
        "load": 1.0,
    }


def _stored_run(started: str, **variants: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "started": started,
        "machine": {"code": f"commit {started[-2:]}"},
        "baselines": {},
        "variants": variants,
    }


def test_the_summary_counts_only_variants_whose_newest_run_has_20_trials_all_passed() -> None:
    from tests.chaos.run import GOAL_TRIALS, summary

    runs = [  # newest first, as stored
        _stored_run("2026-11-28 01:00:02", worker_kills=[_stored_trial()] * GOAL_TRIALS),
        _stored_run(
            "2026-11-28 00:00:01",
            worker_kills=[_stored_trial(passed=False)],  # replaced by the newer run
            ps_kill=[_stored_trial()] * GOAL_TRIALS,
            hung_worker=[_stored_trial()] * (GOAL_TRIALS - 1),  # too few trials
            s3_outage=[_stored_trial()] * (GOAL_TRIALS - 1) + [_stored_trial(passed=False, records_lost=3)],
        ),
    ]
    text = "\n".join(summary(runs))
    short = text.split("short of that: ")[1].split("\n")[0]
    assert f"**2 of {len(VARIANTS)} variants**" in text
    assert "worker_kills," not in short and "ps_kill," not in short
    assert "hung_worker" in short and "s3_outage" in short and "master_restart" in short
    assert "| worker_kills | local | PS | 20 | 20 | 20 | 0 |" in text and "commit 02 |" in text
    assert "| s3_outage | local | PS | 20 | 20 | 19 | **3** |" in text
    assert "| master_restart | local | PS | no run |" in text
