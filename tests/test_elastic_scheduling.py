"""Issue 32's scenarios on the Kubernetes stand-in's scheduler (nodes of fixed CPU, priorities, preemption),
with real edl-argo workers training a paced digits model (:mod:`tests.scheduling.paced_digits`). The same
scenarios, measured and plotted, are ``make scheduling`` (docs/scheduling.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edl_argo import log
from tests.engine_helpers import DIGITS_ACCURACY_FLOOR, assert_no_record_lost
from tests.scheduling.cluster import simulated_cluster
from tests.scheduling.tutorial import NODE_CPUS, WORKERS, run_tutorial

pytestmark = pytest.mark.timeout(600)

#: Epochs of digits the tutorial's job trains here (``make scheduling`` trains
#: :data:`~tests.scheduling.tutorial.EPOCHS`, 20). In two runs with 12, the four workers were training
#: again 18-20 s into the job and the job ended 20-21 s later (with 20 epochs, 35 s later); the model
#: reached 0.978 and 0.989.
TUTORIAL_TEST_EPOCHS = 12


@pytest.fixture(autouse=True)
def master_logs_to_stderr() -> None:
    log.configure("INFO")


def test_elasticdl_tutorial_workers_give_way_to_a_high_priority_service_and_come_back(
    digits_data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """ElasticDL's tutorial, step by step: 4 workers; a service of 5 pods at a higher priority preempts 3
    of them, whose replacements wait Pending while 1 worker trains on; the service shrinks to 1 and the job
    is back at 4 workers. Nothing is lost, and the model is as good as without preemption."""
    with simulated_cluster(tmp_path / "k8s", [NODE_CPUS]) as cluster:
        run = run_tutorial(cluster, digits_data, tmp_path / "job", num_epochs=TUTORIAL_TEST_EPOCHS)

    assert run.running == {"four_running": WORKERS, "one_running": 1, "four_again": WORKERS}
    assert run.pending_with_one == WORKERS - 1  # the replacements wait for room, blocking nothing
    assert run.records_with_one > 0
    metrics = run.metrics
    preempted = [e for e in metrics["relaunches"]["events"] if e["reason"] == "Preempted"]
    assert len(preempted) == WORKERS - 1
    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    running = [count[1] for count in metrics["worker_scaling"]["worker_counts"]]
    one = running.index(1, running.index(WORKERS))  # 4 (after the start), then 1, then 4 again
    assert WORKERS in running[one:], running
    # While the service ran at 5 pods the node was full: its pods and the job's together held every CPU.
    full = [
        job + service
        for at, job, service in run.utilization
        if run.moments["one_running"] <= at <= run.moments["service_shrunk"]
    ]
    assert full and max(full) == NODE_CPUS
    assert "training_paused" not in capfd.readouterr().err  # one worker is --min-workers' default: no pause
