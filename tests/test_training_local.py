"""End-to-end training jobs with the local pod backend: the engine's acceptance tests.

Jobs with faults (killed workers and PS, scaling, a hung worker, ...) are in tests/test_chaos.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from edl_argo import cli, log
from edl_argo.errors import JobFailedError
from edl_argo.master.job import TrainingJob, dataset_shards
from edl_argo.storage.trees import POINTER_NAME
from edl_argo.worker.main import SKIP_MINIBATCH_ENV
from tests.engine_helpers import (
    DIGITS_ACCURACY_FLOOR,
    DIGITS_MODEL,
    assert_no_record_lost,
    digits_config,
    expected_minibatches,
    model_dir,
    read_metrics,
)


@pytest.fixture(autouse=True)
def master_logs_to_stderr() -> None:
    """The master runs in the test process; send its event lines to stderr as `edl-argo train` does."""
    log.configure("INFO")


def test_sync_job_trains_digits_and_publishes_model(digits_data: Path, tmp_path: Path, capsys) -> None:
    output = tmp_path / "job"
    metrics = TrainingJob.load(digits_config(digits_data, output)).run()

    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert_no_record_lost(metrics)
    published = model_dir(output)
    assert (output / "model" / POINTER_NAME).is_file()  # the pointer names the version: the switch
    for name in ("saved_model/saved_model.pb", "model.keras", "metrics.json", "flags.json"):
        assert (published / name).exists(), name
    assert read_metrics(output)["final_metrics"] == metrics["final_metrics"]
    assert json.loads((published / "flags.json").read_text())["num_workers"] == 2

    capsys.readouterr()
    model = str(output / "model")  # the published tree: evaluate and predict follow its pointer
    args = ["--model", model, "--model-def", DIGITS_MODEL, "--data", str(digits_data / "test")]
    assert cli.main(["evaluate", *args]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["accuracy"] == pytest.approx(metrics["final_metrics"]["accuracy"], abs=1e-6)

    predictions = tmp_path / "predictions"
    assert cli.main(["predict", *args, "--output", str(predictions)]) == 0
    lines = [
        json.loads(line) for f in sorted(predictions.rglob("*.jsonl")) for line in f.read_text().splitlines()
    ]
    assert len(lines) == int(evaluated["records"]) == 360
    test_shards = dataset_shards(str(digits_data / "test"), "test")
    # Predictions name a shard as the dataset's manifest does, without the version folder it lives in.
    every_record = {
        (shard.rsplit("/", 1)[-1], record) for shard, size in test_shards.items() for record in range(size)
    }
    assert {(p["shard"], p["record"]) for p in lines} == every_record  # each record predicted once
    assert all(len(p["output"]) == 10 for p in lines)


#: Asynchronous SGD applies stale gradients, so its accuracy after the synchronous jobs' 10 epochs varies from
#: run to run (once below 0.95 here, 0.958-0.981 otherwise); 12 epochs keep it above the floor.
ASYNC_DIGITS_EPOCHS = 12


def test_async_job_trains_digits(digits_data: Path, tmp_path: Path) -> None:
    config = digits_config(digits_data, tmp_path / "job", use_async=True, num_epochs=ASYNC_DIGITS_EPOCHS)
    metrics = TrainingJob.load(config).run()
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert_no_record_lost(metrics)


def digits_gradient_bytes() -> int:
    """The bytes of one minibatch's gradients of the digits model: one value per trainable parameter."""
    from edl_argo.model import load_model_spec

    model = load_model_spec(DIGITS_MODEL).custom_model()
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_variables)


#: The parameter-server combinations the tests above do not cover; each job must end with every PS at the
#: model version its minibatches make (one per minibatch, or one per grads_to_wait of them).
PS_COMBINATIONS = {
    "sync_2ps_3workers": {"num_ps": 2, "num_workers": 3},
    # 2 epochs of 92 minibatches of 16: the last of 62 steps averages one push.
    "sync_grads_to_wait_3": {
        "num_ps": 2,
        "num_workers": 2,
        "grads_to_wait": 3,
        "minibatch_size": 16,
        "num_epochs": 2,
    },
    "sync_version_tolerance_1": {"num_ps": 2, "num_workers": 2, "sync_version_tolerance": 1},
    "async_pipelined": {"num_ps": 2, "num_workers": 2, "use_async": True, "pipelined": True},
}


#: Slow (``make test-slow``): stale-push acceptance within the tolerance is covered by test_ps_service.
SLOW_COMBINATIONS = {"sync_version_tolerance_1"}


@pytest.mark.parametrize(
    "combination",
    [
        pytest.param(c, marks=pytest.mark.slow) if c in SLOW_COMBINATIONS else c
        for c in sorted(PS_COMBINATIONS)
    ],
)
def test_ps_combinations_end_at_the_expected_model_version(
    combination: str, digits_data: Path, tmp_path: Path
) -> None:
    settings = {"num_epochs": 3, **PS_COMBINATIONS[combination]}
    config = digits_config(digits_data, tmp_path / combination, **settings)
    minibatches = expected_minibatches(config)
    grads_to_wait = config.grads_to_wait
    if grads_to_wait > 1:
        assert minibatches % grads_to_wait, "the job must leave pushes waiting at the end"
    expected_version = -(-minibatches // grads_to_wait)  # the last, partial step is applied too
    metrics = TrainingJob.load(config).run()
    assert_no_record_lost(metrics)
    assert metrics["model_version"] == expected_version
    accounting = metrics["accounting"]
    assert accounting["minibatches_trained"] == minibatches
    assert [
        (p["ps"], p["model_version"], p["updates_expected"]) for p in accounting["parameter_servers"]
    ] == [(ps_id, expected_version, expected_version) for ps_id in range(config.num_ps)]
    assert accounting["updates_lost_to_rollback"] == 0
    # Every minibatch's gradients reached the PS once, each PS its share: the bytes they took add up to the
    # model's gradient bytes per minibatch, and each PS took the same share with every push.
    rows = accounting["parameter_servers"]
    assert sum(p["gradient_bytes_accepted"] for p in rows) == minibatches * digits_gradient_bytes()
    assert all(p["gradient_bytes_accepted"] % p["pushes_accepted"] == 0 for p in rows), rows
    shares = [p["gradient_bytes_accepted"] for p in rows]
    assert accounting["gradient_bytes_max_over_mean"] == pytest.approx(
        max(shares) * len(shares) / sum(shares), abs=1e-4
    )
    # Learning, not accuracy, is the point here (chance is 0.1). Asynchronous pipelined SGD with momentum
    # is not dependable in 3 epochs (0.08 to 0.71 measured across runs; the README says so): for it, this
    # test checks the accounting above only.
    if not config.pipelined:
        assert metrics["final_metrics"]["accuracy"] >= 0.8, "the model must learn"


def test_a_minibatch_a_worker_skips_fails_the_job_naming_its_task(
    digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test-only fault: a worker reads every record of task 3 but trains only 3 of its 4 minibatches."""
    monkeypatch.setenv(SKIP_MINIBATCH_ENV, "3")
    config = digits_config(digits_data, tmp_path / "job", num_epochs=1, evaluation_steps=0)
    with pytest.raises(JobFailedError) as failure:
        TrainingJob.load(config).run()
    message = str(failure.value)
    assert "accounting: training task 3 (shard" in message, message
    assert "in 3 minibatches" in message and "expected 4 minibatches of 32" in message, message
    assert not (tmp_path / "job" / "model").exists()


def test_a_job_grows_one_worker_at_a_time_to_max_workers_and_trains_every_record_once(
    digits_data: Path, tmp_path: Path
) -> None:
    """``--num-workers 1 --max-workers 2``: once worker 0 has trained for a measured window, a second worker
    starts and joins; the worker counts over time show it, and the accounting still holds."""
    config = digits_config(
        digits_data, tmp_path / "job", num_workers=1, max_workers=2, num_epochs=20, scale_up_window_seconds=1
    )
    metrics = TrainingJob.load(config).run()

    scaling = metrics["worker_scaling"]
    assert scaling["workers_added"] == 1
    running = [count[1] for count in scaling["worker_counts"]]
    assert running[0] <= 1 and max(running) == 2
    assert "1" in scaling["records_per_second_measured"]
    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR


def test_a_worker_killed_at_start_each_time_is_relaunched_after_growing_delays_then_the_job_fails(
    digits_data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A crash loop: every worker is SIGKILLed as it starts. Relaunches back off (at once, then 1, 2 and 4 s
    with ``--relaunch-backoff-seconds 1``); the job fails after ``--max-worker-relaunches 4``, naming why."""
    model = tmp_path / "killed_in_workers.py"
    model.write_text(
        "import os, signal, sys\n"
        "if sys.argv[1:2] == ['worker']:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"exec(open({DIGITS_MODEL!r}).read())\n"
    )
    config = digits_config(
        digits_data,
        tmp_path / "job",
        model_def=str(model),
        num_workers=1,
        max_worker_relaunches=4,
        relaunch_backoff_seconds=1,
    )
    with pytest.raises(JobFailedError) as failed:
        TrainingJob.load(config).run()

    assert "workers died 5 times, more than --max-worker-relaunches 4" in str(failed.value)
    assert "Killed" in str(failed.value)
    err = capfd.readouterr().err
    announced = [
        float(s) for s in re.findall(r"worker_relaunch_backed_off .*next_attempt_in_seconds=(\S+)", err)
    ]
    assert announced == [1.0, 2.0, 4.0]
    lost = [_seconds(line) for line in err.splitlines() if " worker_lost worker=" in line]
    relaunched = [_seconds(line) for line in err.splitlines() if " worker_relaunched " in line]
    gaps = [started - stopped for stopped, started in zip(lost, relaunched, strict=False)]
    assert len(gaps) == 4 and gaps == sorted(gaps)
    assert gaps[-1] - gaps[0] >= 3.0


def _seconds(line: str) -> float:
    """The time of a log line, in seconds of its day."""
    clock = line.split()[0].split("T")[1].rstrip("Z")
    hours, minutes, seconds = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
