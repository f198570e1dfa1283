"""Master failover: the state store, its group commit, and a real job whose master is killed and restarted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edl_argo.errors import ConfigError, DataFormatError, EdlError, StorageError
from edl_argo.master.config import TrainConfig
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.failover import STATE_PARTS
from edl_argo.master.job import TrainingJob, dataset_shards
from edl_argo.master.state_store import STATE_KEY, GroupCommit, MasterStateStore, job_fingerprint
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType, held_tasks
from edl_argo.model.outputs import named_arrays
from edl_argo.pods.manifests import MASTER_AUTH_VOLUME
from edl_argo.storage import LocalStorage
from tests.engine_helpers import (
    DIGITS_ACCURACY_FLOOR,
    DIGITS_JOB,
    DIGITS_MODEL,
    assert_no_record_lost,
    digits_config,
    read_metrics,
)
from tests.k8s_helpers import job_selector, kubernetes_ps_port, role_rules, start_master_pod
from tests.k8s_stand_in import KubernetesStandIn

SHARDS = {"a": 100, "b": 60}


def store_for(root: Path, job_name: str = "job", **overrides: Any) -> MasterStateStore:
    config = TrainConfig(model_def="m.py", training_data="data/train", output=str(root), **overrides)
    return MasterStateStore(LocalStorage(root), job_name, job_fingerprint(config, SHARDS, {}))


def parts(marker: int = 0) -> dict[str, Any]:
    return {part: {"marker": marker} for part in STATE_PARTS}


# -- the state file -------------------------------------------------------------------------------------


def test_a_saved_state_loads_back_and_is_removed(tmp_path: Path) -> None:
    store = store_for(tmp_path)
    assert store.load() is None
    store.save(parts(7))
    state = store.load()
    assert state is not None
    assert {part: state[part] for part in STATE_PARTS} == parts(7)
    assert state["job_name"] == "job"
    assert (tmp_path / STATE_KEY).is_file()
    store.remove()
    assert store.load() is None
    store.remove()  # removing none is fine


def test_other_settings_or_another_job_name_are_config_errors_naming_the_file(tmp_path: Path) -> None:
    store_for(tmp_path, num_epochs=3).save(parts())
    url = str(tmp_path / STATE_KEY)
    with pytest.raises(ConfigError, match="num_epochs 3 then, 4 now") as changed:
        store_for(tmp_path, num_epochs=4).load()
    assert url in str(changed.value) and "delete the file" in str(changed.value)
    with pytest.raises(ConfigError, match="records_per_task 512 then, 256 now"):
        store_for(tmp_path, num_epochs=3, num_minibatches_per_task=4).load()
    with pytest.raises(ConfigError, match="--job-name job to continue") as other_job:
        store_for(tmp_path, "other", num_epochs=3).load()
    assert url in str(other_job.value)
    assert store_for(tmp_path, num_epochs=3, num_workers=7, max_task_retries=9).load() is not None  # elastic


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b"[]",
        b'{"format": 99}',
        json.dumps({"format": 1, "job_name": "job"}).encode(),
    ],
    ids=["truncated", "binary", "list", "other-format", "missing-parts"],
)
def test_an_unreadable_state_is_a_data_format_error_naming_the_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / STATE_KEY).parent.mkdir(parents=True)
    (tmp_path / STATE_KEY).write_bytes(content)
    with pytest.raises(DataFormatError, match="delete it to start the job afresh") as error:
        store_for(tmp_path).load()
    assert str(tmp_path / STATE_KEY) in str(error.value)


def test_a_job_whose_saved_dispatcher_is_corrupt_fails_naming_the_file(
    digits_data: Path, tmp_path: Path
) -> None:
    config = digits_config(digits_data, tmp_path / "job")
    fingerprint = job_fingerprint(
        config,
        dataset_shards(config.training_data, "--training-data"),
        dataset_shards(config.validation_data, "--validation-data"),
    )
    store = MasterStateStore(LocalStorage(tmp_path / "job"), config.job_name, fingerprint)
    store.save({part: {} for part in STATE_PARTS} | {"dispatcher": {"format": 1, "doing": []}})
    with pytest.raises(DataFormatError, match=r"cannot be restored \(dispatcher: ") as error:
        TrainingJob.load(config)
    assert str(tmp_path / "job" / STATE_KEY) in str(error.value)


def test_saves_are_atomic_for_a_concurrent_reader(tmp_path: Path) -> None:
    store = store_for(tmp_path)
    big = {part: list(range(20_000)) for part in STATE_PARTS}
    store.save(big)
    done, problems = threading.Event(), []

    def read() -> None:
        while not done.is_set():
            try:
                state = store.load()
                assert state is not None and state["dispatcher"] == big["dispatcher"]
            except (AssertionError, DataFormatError) as error:
                problems.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(30):
        store.save(big)
    done.set()
    reader.join()
    assert not problems


# -- group commit -----------------------------------------------------------------------------------------


def test_a_commit_waits_for_a_save_that_started_after_it_and_commits_share_saves() -> None:
    changes, saved = 0, []
    lock = threading.Lock()
    first_save_started, release_first_save = threading.Event(), threading.Event()

    def snapshot() -> Mapping[str, Any]:
        with lock:
            return {"changes": changes}

    def save(state: Mapping[str, Any]) -> None:
        saved.append(state["changes"])
        if len(saved) == 1:
            first_save_started.set()
            assert release_first_save.wait(10)

    writer = GroupCommit(snapshot, save)
    writer.start()
    seen: list[tuple[int, int]] = []  # (my change, newest change saved when my commit returned)

    def change_and_commit() -> None:
        nonlocal changes
        with lock:
            changes += 1
            mine = changes
        assert writer.commit()
        seen.append((mine, max(saved)))

    threads = [threading.Thread(target=change_and_commit) for _ in range(21)]
    threads[0].start()
    assert first_save_started.wait(10)
    for thread in threads[1:]:  # all change while the first save is being written
        thread.start()
    while True:
        with lock:
            if changes == 21:
                break
        time.sleep(0.001)
    assert [mine for mine, _ in seen] == []  # nobody is answered before a save that includes them
    release_first_save.set()
    for thread in threads:
        thread.join(10)
    writer.close()
    assert len(seen) == 21
    assert all(newest >= mine for mine, newest in seen)
    assert 2 <= len(saved) <= 3  # 21 commits, grouped
    assert writer.saves == len(saved)


def test_changed_does_not_wait_and_a_failed_save_is_retried() -> None:
    attempts, saved = [], []

    def save(state: Mapping[str, Any]) -> None:
        attempts.append(state)
        if len(attempts) == 1:
            raise StorageError("s3://bucket/job/master/state.json: 503 slow down")
        saved.append(state)

    writer = GroupCommit(lambda: {"n": len(attempts)}, save)
    writer.changed()  # before start: nothing blocks
    writer.start()
    assert writer.commit()
    writer.close()
    assert len(attempts) >= 2 and saved
    assert writer.failure is None


def test_a_bug_in_the_snapshot_stops_the_writer_and_releases_waiters() -> None:
    def snapshot() -> Mapping[str, Any]:
        raise TypeError("not serialisable")

    writer = GroupCommit(snapshot, lambda state: None)
    writer.start()
    assert not writer.commit()
    assert isinstance(writer.failure, TypeError)
    writer.close()


def test_a_report_asking_for_the_next_task_is_answered_once_both_changes_are_saved() -> None:
    from edl_argo.master.state_store import DurableMasterServicer
    from edl_argo.proto import master_pb2

    dispatcher = TaskDispatcher(SHARDS, DispatcherConfig(records_per_task=40, num_epochs=1))
    saved: list[dict[str, Any]] = []
    writer = GroupCommit(dispatcher.snapshot, lambda state: saved.append(dict(state)))
    evaluation = EvaluationService(lambda: {}, {}, 1)
    evaluation.dispatcher = dispatcher
    urls = {TaskType.TRAINING: "train", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
    servicer = DurableMasterServicer(dispatcher, evaluation, urls, lambda: 0, commit=writer)
    writer.start()
    first = servicer.GetTask(master_pb2.GetTaskRequest(worker_id=0), None)
    writer.commit()
    before = len(saved)
    request = master_pb2.ReportTaskResultRequest(
        worker_id=0, task_id=first.task.task_id, success=True, get_next_task=True
    )
    response = servicer.ReportTaskResult(request, None)
    writer.close()

    assert response.accepted and response.next_task.kind == master_pb2.GetTaskResponse.TASK
    assert response.next_task.task.task_id != first.task.task_id
    assert before < len(saved) <= before + 2  # one wait: a save of both (two if one had just started)
    doing = held_tasks(saved[-1])
    assert [(d["task"]["task_id"], d["worker_id"]) for d in doing] == [(response.next_task.task.task_id, 0)]
    assert saved[-1]["tasks_done"]["training"] == 1


def test_a_report_retried_after_its_reply_was_lost_gets_the_same_next_task() -> None:
    """The first master saved the report and the next task it handed out, then died before replying:
    the worker's retry, to the restarted master, must get that task, not leave it held until it times
    out (and the worker be replaced as stuck)."""
    from edl_argo.master.servicer import MasterServicer
    from edl_argo.proto import master_pb2

    dispatcher = TaskDispatcher(SHARDS, DispatcherConfig(records_per_task=40, num_epochs=1))
    evaluation = EvaluationService(lambda: {}, {}, 1)
    evaluation.dispatcher = dispatcher
    urls = {TaskType.TRAINING: "train", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
    servicer = MasterServicer(dispatcher, evaluation, urls, lambda: 0)
    first = servicer.GetTask(master_pb2.GetTaskRequest(worker_id=0), None).task
    request = master_pb2.ReportTaskResultRequest(
        worker_id=0, task_id=first.task_id, success=True, get_next_task=True
    )
    lost = servicer.ReportTaskResult(request, None).next_task.task  # this reply never arrives
    retried = servicer.ReportTaskResult(request, None)

    assert not retried.accepted  # the report counted once
    assert retried.next_task.task == lost
    held = dispatcher.oldest_held_task(0)
    assert held is not None and held.task_id == lost.task_id
    other = servicer.GetTask(master_pb2.GetTaskRequest(worker_id=1), None).task
    assert other.task_id not in (first.task_id, lost.task_id)


def test_a_worker_reading_ahead_gets_a_new_task_and_its_tasks_are_requeued_when_it_dies() -> None:
    """A worker that lists the task it holds gets another one (read ahead); a lost answer is given again;
    when the worker dies, the task it was running and the one it read ahead both go back to the queue."""
    from edl_argo.master.servicer import MasterServicer
    from edl_argo.proto import master_pb2

    dispatcher = TaskDispatcher(SHARDS, DispatcherConfig(records_per_task=40, num_epochs=1))
    evaluation = EvaluationService(lambda: {}, {}, 1)
    evaluation.dispatcher = dispatcher
    urls = {TaskType.TRAINING: "train", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
    servicer = MasterServicer(dispatcher, evaluation, urls, lambda: 0)

    def get_task(worker_id: int, held: list[int]) -> master_pb2.Task:
        request = master_pb2.GetTaskRequest(worker_id=worker_id, held_task_ids=held)
        return servicer.GetTask(request, None).task

    first = get_task(0, [])
    ahead = get_task(0, [first.task_id])
    assert ahead.task_id != first.task_id
    assert get_task(0, [first.task_id]) == ahead  # that answer was lost: the same task again
    assert get_task(0, []) == first  # a worker listing nothing holds nothing: its oldest task again
    assert {t.task_id for t in dispatcher.recover_tasks(0)} == {first.task_id, ahead.task_id}
    assert [get_task(1, []).task_id, get_task(1, [first.task_id]).task_id] == [first.task_id, ahead.task_id]


# -- evaluation state -----------------------------------------------------------------------------------


def test_an_open_evaluation_round_continues_after_a_restore_and_counts_each_task_once() -> None:
    import keras

    def metrics() -> dict[str, Any]:
        return {
            "auc": keras.metrics.AUC(num_thresholds=50),
            "hit": lambda labels, outputs: np.asarray(labels) == (np.asarray(outputs) > 0.5),
        }

    rng = np.random.default_rng(0)
    labels, outputs = rng.integers(0, 2, 40), rng.random(40)

    def named(start: int, end: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The outputs and labels of records ``start:end`` as workers report them (named arrays)."""
        return named_arrays(outputs[start:end]), named_arrays(labels[start:end])

    def service() -> tuple[EvaluationService, TaskDispatcher]:
        evaluation = EvaluationService(metrics, {"v": 40}, evaluation_steps=0)
        # Training is over (no epoch): the final round is requested only then, and a restored one counts
        # only then.
        dispatcher = TaskDispatcher(
            {"t": 8},
            DispatcherConfig(records_per_task=10, num_epochs=0),
            on_evaluation_complete=evaluation.round_complete,
        )
        evaluation.dispatcher = dispatcher
        return evaluation, dispatcher

    def report(evaluation: EvaluationService, dispatcher: TaskDispatcher, worker: int) -> None:
        task = dispatcher.get_task(worker).task
        assert task is not None and task.type is TaskType.EVALUATION
        evaluation.report_outputs(task.task_id, 5, *named(task.start, task.end))
        assert dispatcher.report(task.task_id, worker, success=True)

    whole, whole_dispatcher = service()
    assert whole.start_final_round(5)
    for _ in range(4):
        report(whole, whole_dispatcher, 0)

    before, dispatcher = service()
    assert before.start_final_round(5)
    report(before, dispatcher, 0)
    held = dispatcher.get_task(1).task  # its outputs arrive, its report is lost with the master
    assert held is not None
    before.report_outputs(held.task_id, 5, *named(held.start, held.end))
    snapshots = json.loads(json.dumps({"dispatcher": dispatcher.snapshot(), "evaluation": before.snapshot()}))

    after, _ = service()
    restored = TaskDispatcher.restore(snapshots["dispatcher"], on_evaluation_complete=after.round_complete)
    after.dispatcher = restored
    after.restore(snapshots["evaluation"])
    for _ in range(3):  # the held task again (its outputs count once), then the last two
        report(after, restored, 2)
    assert after.final_done
    assert after.final_metrics == pytest.approx(whole.final_metrics)
    assert after.history[-1].records == 40


# -- a real job whose master is killed --------------------------------------------------------------------


@contextlib.contextmanager
def no_pods_left_behind(run_dir: Path) -> Iterator[None]:
    """Kill whatever pods a failed test leaves (their supervisors' process groups)."""
    try:
        yield
    finally:
        for record in run_dir.glob("pods/*/*/supervisor"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                os.killpg(json.loads(record.read_text())["pgid"], signal.SIGKILL)


def train_command(data: Path, output: Path, *flags: str) -> list[str]:
    """``edl-argo train`` of the digits job (:data:`DIGITS_JOB`) named ``failover``, plus ``flags``."""
    settings = {
        "--job-name": "failover",
        "--output": str(output),
        "--model-def": DIGITS_MODEL,
        "--training-data": str(data / "train"),
        "--validation-data": str(data / "test"),
        "--num-epochs": str(DIGITS_JOB["num_epochs"]),
        "--minibatch-size": str(DIGITS_JOB["minibatch_size"]),
        "--num-minibatches-per-task": str(DIGITS_JOB["num_minibatches_per_task"]),
        "--num-workers": str(DIGITS_JOB["num_workers"]),
        "--num-ps": str(DIGITS_JOB["num_ps"]),
    }
    command = [str(Path(sys.executable).parent / "edl-argo"), "train", "--shuffle", *flags]
    return command + [token for pair in settings.items() for token in pair]


def saved_state(output: Path) -> dict[str, Any] | None:
    """The state the master of the job writing to ``output`` saved (its snapshot with the segments since
    applied, as a restarted master reads it), or None if there is none or it is being rewritten."""
    try:
        snapshot = json.loads((output / STATE_KEY).read_text())
        store = MasterStateStore(LocalStorage(output), snapshot["job_name"], snapshot["fingerprint"])
        return store.load()
    except (OSError, ValueError, KeyError, EdlError):  # a compaction replaced what was listed: read again
        return None


def training_progress(state: dict[str, Any] | None) -> float:
    if state is None:
        return 0.0
    return state["dispatcher"]["tasks_done"]["training"] / state["dispatcher"]["tasks_created"]["training"]


def kill_the_master_and_start_it_again(
    command: list[str],
    env: dict[str, str],
    output: Path,
    first_log: Path,
    pod_starts: Callable[[str], None] = lambda attempt: None,
) -> tuple[str, int]:
    """Run ``command``, SIGKILL it once 30% of the training tasks are done, run it again to the end;
    ``pod_starts("first")`` and ``pod_starts("second")`` before each (what a new pod of the master gets).

    Returns the second run's output and the records of the training tasks in flight at the kill (held
    by workers in the state the first run saved last)."""
    pod_starts("first")
    with open(first_log, "w") as log:
        first = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while training_progress(saved_state(output)) < 0.3:
                assert first.poll() is None, first_log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the first master never reached 30% of the tasks"
                time.sleep(0.1)
        finally:
            first.kill()  # SIGKILL: no clean-up of any kind
            first.wait()
    at_kill = saved_state(output)
    assert at_kill is not None
    in_flight = [entry["task"] for entry in held_tasks(at_kill["dispatcher"])]
    pod_starts("second")
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    return second.stderr, sum(t["end"] - t["start"] for t in in_flight if t["type"] == "training")


def assert_the_job_continued(output: Path, log: str, in_flight_records: int) -> None:
    """The restarted master finished the job with the pods of the first: nothing lost, at most the
    tasks in flight trained again, nothing relaunched, the state removed."""
    metrics = read_metrics(output)
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert_no_record_lost(metrics)
    assert metrics["records_trained_twice"] <= in_flight_records
    relaunches = metrics["relaunches"]
    assert relaunches["worker"] == relaunches["ps"] == 0, (relaunches["events"], log[-3000:])
    assert log.count("master_state_restored") == 1
    assert "worker_relaunched" not in log and "ps_relaunched" not in log
    assert not (output / STATE_KEY).exists(), "the state is removed once the model is published"


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "strategy",
    ["ParameterServerStrategy", pytest.param("AllreduceStrategy", marks=pytest.mark.slow)],  # 60 s more
)
def test_a_killed_master_started_again_adopts_its_pods_and_finishes_the_job(
    digits_data: Path, tmp_path: Path, strategy: str
) -> None:
    """With AllreduceStrategy the model lives in the workers: the adopted workers re-form their group under
    the new master (its round ids are larger) and go on from the state they hold."""
    output, run_dir = tmp_path / "job", tmp_path / "run"
    env = {**os.environ, "EDL_RUN_DIR": str(run_dir), "TF_CPP_MIN_LOG_LEVEL": "2"}
    with no_pods_left_behind(run_dir):
        log, in_flight_records = kill_the_master_and_start_it_again(
            train_command(digits_data, output, "--distribution-strategy", strategy),
            env,
            output,
            tmp_path / "first.log",
        )
    assert_the_job_continued(output, log, in_flight_records)
    pods = ("worker-0", "worker-1") if strategy == "AllreduceStrategy" else ("worker-0", "worker-1", "ps-0")
    for pod in pods:
        assert f"pod_adopted job=failover pod={pod} " in log, pod
    assert "pod_started" not in log  # the same pods carried on ...
    for worker in (0, 1):  # ... and the adopted workers worked until the end
        assert any(
            line.startswith(f"[worker-{worker}] ") and "worker_done" in line for line in log.splitlines()
        )


@pytest.mark.slow  # 75 s; the take-over itself is tested in test_failover.py, a local restart above
@pytest.mark.timeout(400)
def test_a_killed_master_on_kubernetes_started_again_adopts_its_pods(
    digits_data: Path, tmp_path: Path
) -> None:
    output = tmp_path / "job"
    with KubernetesStandIn(tmp_path / "k8s", echo_logs=False) as cluster:
        cluster.enforce_rules(role_rules())
        env = {
            **os.environ,
            "EDL_RUN_DIR": str(tmp_path / "run"),
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "EDL_KUBERNETES_API": cluster.url,
        }
        for name in ("EDL_POD_NAME", "EDL_POD_UID", "EDL_WORKFLOW_NAME", "EDL_WORKFLOW_UID", "POD_IP"):
            env.pop(name, None)
        kubernetes = [
            "--backend",
            "kubernetes",
            "--image",
            "edl-argo:test",
            "--ps-port",
            str(kubernetes_ps_port()),
        ]
        # The master's pod mounts the job's auth Secret (the elastic-train step's volume): empty for the
        # first master, which creates it; the restarted master reads the job's secret there (its Role
        # cannot read Secrets through the API).
        secrets = tmp_path / "master-secrets"

        def pod_starts(attempt: str) -> None:
            env.update(start_master_pod(cluster, "failover", secrets))
            assert any((secrets / MASTER_AUTH_VOLUME).iterdir()) == (attempt == "second")

        log, in_flight_records = kill_the_master_and_start_it_again(
            train_command(digits_data, output, *kubernetes), env, output, tmp_path / "first.log", pod_starts
        )
        assert cluster.objects("pods", job_selector("failover")) == []  # cleaned up at the end
    assert_the_job_continued(output, log, in_flight_records)
    for pod in ("worker-0", "worker-1", "ps-0"):
        assert f"pod_adopted job=failover pod=failover-{pod} " in log, pod
    assert "pod_created" not in log  # the same pods carried on ...
    for worker in (0, 1):  # ... to the end
        assert f"pod_exited job=failover pod=failover-worker-{worker} phase=Succeeded" in log
