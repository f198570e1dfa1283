"""Live metrics: the Prometheus endpoint of a running job, its TensorBoard event files, the loss and
evaluation log lines, the throughput meter, and the elastic-train step's scrape annotations and artifact."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from edl_argo import log
from edl_argo.errors import ConfigError, StorageError
from edl_argo.hera.elastic_train import METRICS_PATH, METRICS_PORT, METRICS_PORT_NAME, TENSORBOARD_DIR
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.job import TrainingJob
from edl_argo.master.metrics import PodCounts, count_pods
from edl_argo.master.state_store import DurableMasterServicer
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher
from edl_argo.master.tensorboard_log import TENSORBOARD_PREFIX, EventFileWriter, crc32c
from edl_argo.master.throughput import ThroughputMeter
from edl_argo.master.training_stats import TrainingReport
from edl_argo.pods import PodPhase, PodRole, PodStatus, find_free_port
from edl_argo.proto import master_pb2
from edl_argo.storage import LocalStorage
from tests.engine_helpers import JobThread, digits_config
from tests.manifests import load_documents
from tests.test_failover import SHARDS, URLS, _NoCommit, get_task

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ the throughput meter


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_meter_counts_the_records_of_each_worker_in_the_window() -> None:
    clock = FakeClock()
    meter = ThroughputMeter(clock=clock)
    meter.record(0, 100)  # at 1000
    clock.now = 1005.0
    meter.record(1, 50)
    meter.record(0, 20, at=1004.0)  # a late sample, given its own time
    clock.now = 1010.0
    assert meter.records_per_second(10.0) == {0: 2.0, 1: 5.0}  # (1000, 1010]: the sample at 1000 is out
    assert meter.records_per_second(11.0) == pytest.approx({0: 120 / 11, 1: 50 / 11})
    assert meter.total_records_per_second(11.0) == pytest.approx(170 / 11)
    assert meter.records_per_second(5.0) == {}  # (1005, 1010]: a sample at the window's start is out
    assert meter.records_per_second(5.0, now=1005.0) == {0: 4.0, 1: 10.0}
    assert meter.total_records_per_second(3.0, now=1020.0) == 0.0
    with pytest.raises(ValueError, match="window_seconds"):
        meter.records_per_second(0)
    with pytest.raises(ValueError, match="records"):
        meter.record(0, -1)


def test_the_meter_forgets_samples_older_than_its_longest_window() -> None:
    clock = FakeClock(0.0)
    meter = ThroughputMeter(clock=clock, retention_seconds=10.0)
    for second in range(1000):  # 1000 s of two workers reporting every second
        clock.now = float(second)
        meter.record(second % 2, 1)
        meter.record(7, 1)
    kept = sum(len(samples) for samples in meter._samples.values())
    assert kept <= 2 * 10 + 2, kept  # O(workers x window): 10 s of worker 7, 5 samples each of 0 and 1
    assert meter.total_records_per_second(1000.0) == pytest.approx(kept / 1000.0)  # the rest is gone
    clock.now = 2000.0
    meter.record(3, 5)
    assert meter.records_per_second(100.0) == {3: 0.05}  # workers without samples are forgotten
    assert set(meter._samples) == {3}
    for second in range(2000, 2200):  # the 1000 s window asked for above keeps 1000 s, not 10
        clock.now = float(second)
        meter.record(3, 1)
    assert meter.total_records_per_second(300.0) == pytest.approx(205 / 300)


def test_the_meter_counts_every_record_of_concurrent_reports() -> None:
    meter = ThroughputMeter()
    threads = [
        threading.Thread(target=lambda w=w: [meter.record(w % 4, 3) for _ in range(2000)]) for w in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rates = meter.records_per_second(60.0)
    assert sorted(rates) == [0, 1, 2, 3]
    assert sum(rates.values()) * 60.0 == pytest.approx(8 * 2000 * 3)


# ------------------------------------------------------------------ event files and pod counts


def test_crc32c_is_castagnoli() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


class FlakyStorage(LocalStorage):
    """Local storage whose writes fail while ``failing``."""

    failing = False

    def write(self, key: str, data: bytes) -> None:
        if self.failing:
            raise StorageError(f"{key}: injected failure")
        super().write(key, data)


def test_event_files_are_read_back_by_tensorboard_and_uploaded_whole(tmp_path: Path) -> None:
    storage = FlakyStorage(tmp_path / "out")
    writer = EventFileWriter(storage, clock=lambda: 1.5e9, max_file_bytes=400)
    for step in range(10):
        writer.scalar("loss", 1.0 / (step + 1), step if step != 5 else 2)  # a step that goes back is kept
    assert writer.upload()
    folder = tmp_path / "out" / TENSORBOARD_PREFIX
    first = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert len(first) > 1  # the files were rotated

    storage.failing = True
    writer.scalar("accuracy", 0.5, 9)
    assert not writer.upload()  # logged; nothing half-written: the objects are those of the last upload
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == first
    storage.failing = False
    assert writer.close()  # the failed file goes up with the final upload
    assert not writer._folder.exists()  # the local files are gone

    events = EventAccumulator(str(folder))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["accuracy", "loss"]
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    expected = [(s if s != 5 else 2, 1.0 / (s + 1)) for s in range(10)]
    assert [step for step, _ in losses] == [step for step, _ in expected]
    assert [v for _, v in losses] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert [(e.step, e.value, e.wall_time) for e in events.Scalars("accuracy")] == [(9, 0.5, 1.5e9)]


def test_an_event_the_local_disk_refuses_is_dropped_not_raised(tmp_path: Path) -> None:
    writer = EventFileWriter(LocalStorage(tmp_path / "out"))
    writer.scalar("loss", 1.0, 1)
    shutil.rmtree(writer._folder)  # the temporary folder is gone (a full or cleaned /tmp)
    writer.scalar("loss", 0.5, 2)  # logged, not raised: it runs on the master's serving threads
    assert not writer.upload()
    assert not writer.close()


def test_pods_count_as_running_or_pending_only_when_listed_so() -> None:
    statuses = [
        PodStatus(PodRole.WORKER, 0, PodPhase.RUNNING),
        PodStatus(PodRole.WORKER, 1, PodPhase.PENDING),
        PodStatus(PodRole.WORKER, 2, PodPhase.FAILED),  # its terminal event not handled yet
        PodStatus(PodRole.WORKER, 3, PodPhase.RUNNING),  # being removed: not a live worker
        PodStatus(PodRole.PS, 0, PodPhase.RUNNING),
    ]
    assert count_pods(statuses, PodRole.WORKER, {0, 1, 2, 4}, 3, 2) == PodCounts(1, 1, 3, 2)
    assert count_pods(statuses, PodRole.PS, range(2), 2, 0) == PodCounts(1, 0, 2, 0)


# ------------------------------------------------------------------ the one place reports are counted


def test_each_training_report_is_counted_once_across_retries_and_a_master_restart() -> None:
    """The hook the throughput and the loss scalars hang on sees each task once: not the worker's retry of
    a report whose reply it lost, nor that report sent again to a master restarted from the saved state."""
    counted: list[TrainingReport] = []

    def master(dispatcher: TaskDispatcher) -> DurableMasterServicer:
        evaluation = EvaluationService(lambda: {}, {}, 1)
        evaluation.dispatcher = dispatcher
        return DurableMasterServicer(
            dispatcher, evaluation, URLS, lambda: 7, commit=_NoCommit(), on_training_report=counted.append
        )

    def report(task_id: int) -> master_pb2.ReportTaskResultRequest:
        counters = {"steps": 2, "model_version": 3}
        return master_pb2.ReportTaskResultRequest(
            worker_id=0, task_id=task_id, success=True, counters=counters, mean_loss=0.5
        )

    dispatcher = TaskDispatcher(SHARDS, DispatcherConfig(records_per_task=40, num_epochs=1))
    first = master(dispatcher)
    done = get_task(first, 0, [])
    assert first.ReportTaskResult(report(done.task_id), None).accepted
    assert not first.ReportTaskResult(report(done.task_id), None).accepted  # the retry
    held = get_task(first, 0, [])
    saved = json.loads(json.dumps(dispatcher.snapshot()))
    restarted = master(TaskDispatcher.restore(saved, live_workers={0}))
    assert not restarted.ReportTaskResult(report(done.task_id), None).accepted  # counted before the restart
    assert restarted.ReportTaskResult(report(held.task_id), None).accepted
    assert counted == [TrainingReport(0, 0, 40, 2, 0.5, 3)] * 2


# ------------------------------------------------------------------ a job


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples the master serves at ``127.0.0.1:port``, by name and sorted labels (5 s at most)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{METRICS_PATH}", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_job_serves_live_metrics_and_writes_tensorboard_scalars(
    digits_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """While the job trains, its endpoint answers with tasks done and records per second; once it is over,
    its event files hold the loss of every training task, the loss of every epoch and every evaluation, as
    metrics.json has them, and the logs hold the workers' loss lines and the master's evaluation lines."""
    log.configure("INFO")
    port = find_free_port()
    output = tmp_path / "job"
    config = digits_config(
        digits_data, output, num_epochs=4, evaluation_steps=60, metrics_port=port, log_loss_steps=20
    )
    job = TrainingJob.load(config)
    running = JobThread(job).start()
    live: dict = {}

    def trained_a_task() -> bool:
        try:
            samples = scrape(port)
        except OSError:  # not serving yet
            return False
        live.update(samples)
        return samples.get(("edl_tasks_done_total", (("job", config.job_name), ("type", "training"))), 0) > 0

    running.wait_until(trained_a_task, 180, "a training task done, seen on the metrics endpoint")
    assert running.progress_fraction() < 1.0  # scraped while the job still trained
    job_label = ("job", config.job_name)
    assert live[("edl_records_per_second", (job_label,))] > 0
    assert any(name == "edl_worker_records_per_second" and value > 0 for (name, _), value in live.items())
    assert live[("edl_pods_wanted", (job_label, ("role", "worker")))] == 2
    assert live[("edl_pods_wanted", (job_label, ("role", "ps")))] == 1
    assert live[("edl_pods", (job_label, ("phase", "running"), ("role", "ps")))] == 1
    assert live[("edl_state_saves_total", (job_label,))] >= 1
    assert live[("edl_training_loss", (job_label,))] > 0

    metrics = running.join(300)
    with pytest.raises(OSError):  # the endpoint is gone with the job
        scrape(port)

    # The collector, read after the job, against metrics.json.
    def final(name: str, **labels: str) -> float | None:
        return job.metrics_registry.get_sample_value(name, {"job": config.job_name, **labels})

    records_per_task = config.records_per_task
    tasks_per_epoch = sum(math.ceil(n / records_per_task) for n in job.training_shards.values())
    training_tasks = tasks_per_epoch * config.num_epochs
    assert final("edl_tasks_done_total", type="training") == training_tasks
    tasks_per_evaluation = sum(math.ceil(n / records_per_task) for n in job.validation_shards.values())
    assert final("edl_tasks_done_total", type="evaluation") == tasks_per_evaluation * len(
        metrics["evaluations"]
    )
    assert final("edl_tasks_queued", type="training") == final("edl_tasks_running", type="training") == 0
    assert final("edl_records_trained_total") == sum(metrics["records_done_per_epoch"].values())
    assert final("edl_model_version") == metrics["model_version"]
    assert final("edl_pod_relaunches_total", role="worker") == metrics["relaunches"]["worker"]
    assert final("edl_evaluations_total") == len(metrics["evaluations"])
    assert final("edl_evaluation_model_version") == metrics["evaluations"][-1]["model_version"]
    for name, value in metrics["final_metrics"].items():
        assert final("edl_evaluation_metric", metric=name) == value
    for epoch, loss in metrics["training_loss_per_epoch"].items():
        assert final("edl_epoch_training_loss", epoch=epoch) == loss

    # The event files, read by TensorBoard's own reader.
    events = EventAccumulator(str(output / TENSORBOARD_PREFIX))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"loss", "epoch_loss", "records_per_second", "workers", "evaluation/accuracy"} <= scalars
    losses = [e.value for e in events.Scalars("loss")]
    assert len(losses) == training_tasks  # one per training task report the master accepted
    per_epoch = metrics["training_loss_per_epoch"]
    epoch_losses = {str(e.step): e.value for e in events.Scalars("epoch_loss")}
    assert epoch_losses == pytest.approx(per_epoch, rel=1e-6)
    # Every digits task trains 4 minibatches (shards of ~360 records, tasks of 128): the mean of the tasks'
    # losses is the mean of the epochs' minibatch-weighted losses.
    assert metrics["accounting"]["minibatches_trained"] == 4 * training_tasks
    assert statistics.fmean(losses) == pytest.approx(statistics.fmean(per_epoch.values()), rel=1e-5)
    evaluations = {
        name.removeprefix("evaluation/"): [(e.step, e.value) for e in events.Scalars(name)]
        for name in scalars
        if name.startswith("evaluation/")
    }
    assert sorted(evaluations) == sorted(metrics["final_metrics"])
    for name, points in evaluations.items():
        expected = [(r["model_version"], r["metrics"][name]) for r in metrics["evaluations"]]
        assert [step for step, _ in points] == [step for step, _ in expected]
        assert [value for _, value in points] == pytest.approx([value for _, value in expected], rel=1e-6)
        assert points[-1][1] == pytest.approx(metrics["final_metrics"][name], rel=1e-6)
    assert len(metrics["evaluations"]) >= 2  # periodic ones and the final one
    assert max(e.value for e in events.Scalars("records_per_second")) > 0

    # The logs: the workers' loss lines (every 20 steps of each) and the master's evaluation lines.
    err = capsys.readouterr().err
    loss_lines = [line for line in err.splitlines() if "Loss" in line and "[worker-" in line]
    assert loss_lines, err[-2000:]
    assert all(re.search(r'message="Loss = [0-9.e+-]+ at step \d+"', line) for line in loss_lines), (
        loss_lines[:3]
    )
    evaluation_lines = [line for line in err.splitlines() if "Evaluation" in line]
    assert len(evaluation_lines) == len(metrics["evaluations"]), evaluation_lines
    last = next(r for r in metrics["evaluations"] if r["final"])
    final_line = next(line for line in evaluation_lines if f"model version {last['model_version']}:" in line)
    assert f"accuracy={metrics['final_metrics']['accuracy']:.6g}" in final_line


def test_a_taken_metrics_port_is_a_one_line_error_naming_the_flag(digits_data: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = digits_config(digits_data, tmp_path / "job", metrics_port=port)
        job = TrainingJob.load(config)
        started = time.monotonic()
        with pytest.raises(ConfigError) as raised:
            job.run()
    message = str(raised.value)
    assert "--metrics-port" in message and str(port) in message and "\n" not in message, message
    assert job.backend.list_pods() == []  # no pod was started
    assert time.monotonic() - started < 30
    assert list((tmp_path / "job").rglob("*")) == []  # a refused new job leaves no state, no secret


# ------------------------------------------------------------------ the Argo step


def test_the_train_step_is_scraped_on_its_metrics_port_and_outputs_tensorboard() -> None:
    (document,) = load_documents(ROOT / "templates" / "elastic-train.yaml")
    template = document["spec"]["templates"][0]
    annotations = template["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": METRICS_PATH,
    }
    container = template["container"]
    assert {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"} in container["ports"]
    command = container["command"]
    assert command[command.index("--metrics-port") + 1] == str(METRICS_PORT)
    output = command[command.index("--output") + 1]
    (artifact,) = [a for a in template["outputs"]["artifacts"] if a["name"] == "tensorboard"]
    assert artifact["path"] == TENSORBOARD_DIR == f"{output}/{TENSORBOARD_PREFIX}"
    (policy,) = load_documents(ROOT / "templates" / "metrics-network-policy.yaml")
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": METRICS_PORT_NAME, "protocol": "TCP"}]
    labels = template["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()  # it selects the master
