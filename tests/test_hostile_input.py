"""Hostile and bad input: each is a one-line error naming the culprit, a non-zero exit, and no partial
output; malformed gRPC requests are refused while the servers go on serving.

Flag, model-file and local-path errors of the CLI are in tests/test_cli.py, RecordIO fuzzing in
tests/test_recordio.py, S3 error messages of the storage layer in tests/test_storage.py, and the PS's
checks of names, shapes and dtypes in tests/test_ps_service.py; this module adds what those leave out.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import keras
import numpy as np
import pytest
from s3_stand_in import S3StandIn

from edl_argo.data.commands import digits_records, write_dataset
from edl_argo.log import configure as configure_logging
from edl_argo.master.evaluation import EvaluationService, MetricsAccumulator
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.model import load_model_spec
from edl_argo.proto import master_pb2, master_pb2_grpc, ps_pb2, ps_pb2_grpc, tensor_pb2
from edl_argo.ps.server import start_server
from edl_argo.ps.servicer import ParameterServerServicer
from edl_argo.recordio import Compressor
from edl_argo.rpc.channel import make_server
from edl_argo.rpc.tensors import to_indexed_slices, to_tensor
from edl_argo.storage import LocalStorage, open_storage
from tests.engine_helpers import DIGITS_MODEL, read_metrics
from tests.test_cli import error_lines, run_cli

pytestmark = pytest.mark.timeout(240)

#: A job of a few seconds of training: 2 shards of 96 records, 1 worker, 1 PS.
QUICK_JOB = [
    "--num-epochs", "2", "--minibatch-size", "16", "--num-minibatches-per-task", "3",
    "--num-workers", "1", "--num-ps", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def local_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    train, test = digits_records(0.2, 0)
    write_dataset(LocalStorage(root), "train", train[:192], 2, Compressor.NONE, overwrite=False)
    write_dataset(LocalStorage(root), "test", test[:48], 1, Compressor.NONE, overwrite=False)
    return root


def train(data: str | Path, output: Path | str, *extra: str, model: str = DIGITS_MODEL) -> list[str]:
    return ["train", "--model-def", model, "--training-data", str(data), "--output", str(output), *extra]


def one_error_line(err: str) -> str:
    """The one line of stderr that is neither an event line of the master nor a line a pod printed
    (``[worker-0] ...``); no process printed a traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in error_lines(err) if not line.startswith("[")]
    assert len(lines) == 1, err
    return lines[0]


def model_file(directory: Path, name: str, code: str) -> str:
    """The digits model with some of its functions replaced by ``code`` (later definitions win)."""
    path = directory / name
    path.write_text(Path(DIGITS_MODEL).read_text() + "\n\n" + textwrap.dedent(code))
    return str(path)


# ---------------------------------------------------------------------------------------------------
# Flags


@pytest.mark.parametrize(
    ("flags", "culprit"),
    [
        (["--num-epochs", "-1"], "--num-epochs"),
        (["--num-ps", "0"], "--num-ps"),
        (["--num-minibatches-per-task", "0"], "--num-minibatches-per-task"),
        (["--grads-to-wait", "-2"], "--grads-to-wait"),
        (["--max-task-retries", "0"], "--max-task-retries"),
        (["--max-worker-relaunches", "-1"], "--max-worker-relaunches"),
        (["--max-workers", "-1"], "--max-workers"),
        (["--num-workers", "5", "--max-workers", "2"], "--max-workers 2"),
        (["--min-workers", "3", "--max-workers", "2", "--num-workers", "2"], "--min-workers 3"),
        (["--min-workers", "0"], "--min-workers"),
        (["--min-workers", "3", "--num-workers", "2"], "--num-workers 2 is less than --min-workers 3"),
        (["--min-workers-timeout", "0"], "--min-workers-timeout"),
        (["--scale-up-min-gain", "1.5"], "--scale-up-min-gain"),
        (["--scale-up-window-seconds", "0"], "--scale-up-window-seconds"),
        (["--checkpoint-steps", "-1"], "--checkpoint-steps"),
        (["--sync-version-tolerance", "-1"], "--sync-version-tolerance"),
        (["--master-port", "-1"], "--master-port"),
        (["--master-port", "70000"], "--master-port"),
        (["--log-level", "LOUD"], "--log-level"),
        (["--nan-loss", "ignore"], "--nan-loss"),
        (["--job-name", "../../etc/passwd"], "--job-name"),
        (["--job-name", "two words"], "--job-name"),
        (["--backend", "kubernetes", "--image", "img", "--ps-port", "70000"], "--ps-port"),
        (["--backend", "kubernetes", "--image", "img", "--namespace", "Not_A_Namespace"], "--namespace"),
        (["--backend", "kubernetes", "--image", "img", "--checkpoint-steps", "5"], "--checkpoint-dir s3://"),
    ],
)
def test_out_of_range_train_flags_fail_with_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], local_data: Path, tmp_path: Path, flags: list[str], culprit: str
) -> None:
    code, _, err = run_cli(capsys, *train(local_data / "train", tmp_path / "out", *flags))
    assert code == 2
    assert culprit in one_error_line(err)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------
# Data and storage


def test_a_truncated_shard_is_named_and_nothing_is_written(
    capsys: pytest.CaptureFixture[str], local_data: Path, tmp_path: Path
) -> None:
    data = tmp_path / "train"
    shutil.copytree(local_data / "train", data)
    (truncated,) = data.glob("v-*/data-00001")
    truncated.write_bytes(truncated.read_bytes()[:-100])
    code, _, err = run_cli(capsys, *train(data, tmp_path / "out", *QUICK_JOB))
    assert code == 2
    line = one_error_line(err)
    assert str(truncated) in line and "its manifest says" in line
    assert not (tmp_path / "out").exists()


@pytest.fixture
def s3_dataset(s3_env: str) -> str:
    """``s3_env`` with a digits dataset under ``data/`` and a published (untrained) model under ``model/``."""
    train_records, _ = digits_records(0.2, 0)
    write_dataset(
        open_storage(f"{s3_env}/data"), "train", train_records[:64], 1, Compressor.NONE, overwrite=False
    )
    model = load_model_spec(DIGITS_MODEL).custom_model()
    with tempfile.TemporaryDirectory() as tree:
        model.save(Path(tree) / "model.keras")
        open_storage(s3_env).put_tree(Path(tree), "model")
    return s3_env


@pytest.mark.parametrize(
    ("command", "culprit"),
    [
        ("train --training-data {root}/nothing", "--training-data {root}/nothing"),
        ("train --training-data s3://no-such-bucket-x/data/train", "s3://no-such-bucket-x/data/train"),
        ("train --output s3://no-such-bucket-y/out", "s3://no-such-bucket-y/out"),
        ("train wrong-secret", "--output {root}/out"),  # where the job writes is reached first
        ("train wrong-key-id", "--output {root}/out"),
        ("evaluate --data {root}/nothing", "--data {root}/nothing"),
        ("evaluate --data s3://no-such-bucket-z/test", "s3://no-such-bucket-z/test"),
        ("evaluate --model s3://no-such-bucket-w/model", "s3://no-such-bucket-w/model"),
        ("evaluate wrong-secret", "{root}/model"),
    ],
)
def test_missing_s3_data_buckets_and_wrong_credentials_are_one_line_errors_naming_the_url(
    capsys: pytest.CaptureFixture[str],
    s3_dataset: str,
    monkeypatch: pytest.MonkeyPatch,
    s3_server: S3StandIn,
    command: str,
    culprit: str,
) -> None:
    root = s3_dataset
    name, *change = command.format(root=root).split()
    values = {
        "--model-def": DIGITS_MODEL,
        **(
            {"--training-data": f"{root}/data/train", "--output": f"{root}/out"}
            if name == "train"
            else {"--model": f"{root}/model", "--data": f"{root}/data/train"}
        ),
    }
    if change == ["wrong-secret"]:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + s3_server.secret_key)
    elif change == ["wrong-key-id"]:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "WRONG" + s3_server.access_key)
    else:
        values[change[0]] = change[1]
    argv = [name, *(item for pair in values.items() for item in pair)]
    if name == "train":
        argv += QUICK_JOB
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    line = one_error_line(err)
    assert culprit.format(root=root) in line
    assert ("check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in line) == bool(
        change and "wrong-" in change[0]
    )
    assert out == ""
    bucket, prefix = root.removeprefix("s3://").split("/", 1)
    written = [
        o.object_name for o in s3_server.client().list_objects(bucket, prefix=f"{prefix}/out", recursive=True)
    ]
    assert written == []


# ---------------------------------------------------------------------------------------------------
# Models that fail while training (real jobs: a worker and a PS as processes)


def test_a_feed_that_raises_fails_the_job_naming_the_task_shard_and_error(
    capsys: pytest.CaptureFixture[str], local_data: Path, tmp_path: Path
) -> None:
    model = model_file(
        tmp_path,
        "bad_feed.py",
        """
        def feed(dataset, mode, metadata):
            raise ValueError("feature 'pixels' is not in the records")
        """,
    )
    output = tmp_path / "out"
    argv = train(local_data / "train", output, *QUICK_JOB, "--max-task-retries", "2", model=model)
    code, out, err = run_cli(capsys, *argv)
    assert code == 1
    line = one_error_line(err)
    assert "training task" in line and re.search(r"shard v-\S+/data-0000", line), line
    assert "ValueError: feature 'pixels' is not in the records" in line
    assert f"model file {model}, function feed: ValueError: " in line, line
    assert "job succeeded" not in out
    assert not (output / "model").exists()


#: A feed whose parse spec does not match the records (they have no feature "pixels"): it traces, and then
#: fails on every record, the same way on every worker.
WRONG_PARSE_SPEC = """
_WRONG = {"pixels": tf.io.FixedLenFeature([64], tf.float32), "label": tf.io.FixedLenFeature([1], tf.int64)}


def feed(dataset, mode, metadata):
    return dataset.map(lambda record: tuple(tf.io.parse_single_example(record, _WRONG).values()))
"""


def test_a_feed_that_fails_on_every_record_fails_the_job_at_once_naming_the_model_file_and_feed(
    capsys: pytest.CaptureFixture[str], local_data: Path, tmp_path: Path
) -> None:
    """A deterministic model error is not retried on worker after worker (--max-worker-relaunches is 16):
    the first worker whose first step fails in the model's code fails the job with that error."""
    model = model_file(tmp_path, "wrong_spec.py", WRONG_PARSE_SPEC)
    output = tmp_path / "out"
    argv = train(local_data / "train", output, *QUICK_JOB, "--num-workers", "2", model=model)
    code, out, err = run_cli(capsys, *argv)
    assert code == 1
    line = one_error_line(err)
    assert f"model file {model}, function feed: InvalidArgumentError: " in line, line
    assert "pixels" in line and "training task" in line, line
    workers_started = re.findall(r"pod_started .*pod=\S*worker-(\d+)", err)
    assert 1 <= len(workers_started) <= 2, workers_started
    assert "worker_relaunched" not in err and "no workers left" not in err
    assert "job succeeded" not in out
    assert not (output / "model").exists()


#: A loss that is NaN on every minibatch whose labels add up to an odd number (about half of them).
NAN_ON_ODD_LABEL_SUMS = """
def loss(labels, predictions):
    labels = tf.reshape(labels, [-1])
    mean = tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )
    odd = tf.equal(tf.math.floormod(tf.reduce_sum(tf.cast(labels, tf.int64)), 2), 1)
    return tf.where(odd, tf.constant(float("nan")), mean)
"""


def test_a_nan_loss_fails_the_job_at_once_naming_version_task_and_shard(
    capsys: pytest.CaptureFixture[str], local_data: Path, tmp_path: Path
) -> None:
    model = model_file(tmp_path, "nan_loss.py", NAN_ON_ODD_LABEL_SUMS)
    output = tmp_path / "out"
    code, _, err = run_cli(capsys, *train(local_data / "train", output, *QUICK_JOB, model=model))
    assert code == 1
    line = one_error_line(err)
    assert line.startswith("edl-argo train: error: training loss became NaN at model version "), line
    assert line.endswith("; lower the learning rate or use --nan-loss skip"), line
    assert "(task " in line and re.search(r", shard v-\S+/data-0000", line), line
    assert "failed" not in line  # not retried until max-task-retries: the first NaN ends the job
    assert "worker_lost" not in err and "worker_relaunched" not in err  # the worker did not crash
    assert not (output / "model").exists()


def test_nan_loss_skip_skips_and_counts_those_minibatches(
    capsys: pytest.CaptureFixture[str], local_data: Path, tmp_path: Path
) -> None:
    model = model_file(tmp_path, "nan_loss.py", NAN_ON_ODD_LABEL_SUMS)
    output = tmp_path / "out"
    argv = train(local_data / "train", output, *QUICK_JOB, "--nan-loss", "skip", model=model)
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    metrics = read_metrics(output)
    # 2 epochs x 2 shards of 96 records x 6 minibatches of 16; each is NaN with probability 1/2.
    assert 0 < metrics["nan_batches_skipped"] < 24
    assert all(np.isfinite(loss) for loss in metrics["training_loss_per_epoch"].values())
    assert metrics["relaunches"]["worker"] == 0
    assert "nan_batch_skipped" in err


# ---------------------------------------------------------------------------------------------------
# Malformed gRPC requests


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    assert "\n" not in (error.value.details() or "")
    return error.value


@pytest.fixture
def master() -> Iterator[tuple[master_pb2_grpc.MasterStub, TaskDispatcher, EvaluationService]]:
    """A master service on 127.0.0.1: 2 training tasks, and an evaluation round of model version 5 whose
    metric takes one row of class scores per label."""

    def accuracy(labels: np.ndarray, outputs: np.ndarray) -> np.ndarray:
        return np.equal(labels, np.argmax(outputs, axis=1))

    evaluation = EvaluationService(lambda: {"accuracy": accuracy}, {"test": 4}, 1)
    evaluation.dispatcher = dispatcher = TaskDispatcher(
        {"train": 20},
        DispatcherConfig(records_per_task=10, num_epochs=1),
        on_evaluation_complete=evaluation.round_complete,
    )
    evaluation.on_model_version(5)
    urls = {TaskType.TRAINING: "train", TaskType.EVALUATION: "test", TaskType.PREDICTION: ""}
    server = make_server()
    master_pb2_grpc.add_MasterServicer_to_server(
        MasterServicer(dispatcher, evaluation, urls, current_version=lambda: 5), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield master_pb2_grpc.MasterStub(channel), dispatcher, evaluation
    server.stop(None)


def test_malformed_master_requests_are_refused_or_ignored_and_the_master_goes_on(
    master: tuple[master_pb2_grpc.MasterStub, TaskDispatcher, EvaluationService],
) -> None:
    stub, dispatcher, evaluation = master
    evaluation_task = stub.GetTask(master_pb2.GetTaskRequest(worker_id=1)).task
    assert evaluation_task.type == master_pb2.EVALUATION and evaluation_task.model_version == 5
    training_task = stub.GetTask(master_pb2.GetTaskRequest(worker_id=2)).task
    scores = to_tensor(np.eye(4, 10, dtype=np.float32), "output")
    labels = to_tensor(np.arange(4, dtype=np.int64), "labels")

    def outputs(worker: int = 1, task: int = evaluation_task.task_id, **fields: Any) -> tensor_pb2.Empty:
        request = {
            "worker_id": worker,
            "task_id": task,
            "model_version": 5,
            "outputs": [scores],
            "labels": labels,
        }
        return stub.ReportEvaluationOutputs(master_pb2.ReportEvaluationOutputsRequest(**(request | fields)))

    def report(**fields: Any) -> master_pb2.ReportTaskResultResponse:
        return stub.ReportTaskResult(master_pb2.ReportTaskResultRequest(**fields))

    invalid: list[tuple[Callable[[], Any], str]] = [
        (lambda: stub.GetTask(master_pb2.GetTaskRequest(worker_id=-1)), "worker_id"),
        (
            lambda: report(worker_id=2, task_id=training_task.task_id, success=True, counters={"steps": -3}),
            "'steps'",
        ),
        (
            lambda: report(worker_id=2, task_id=training_task.task_id, success=True, mean_loss=float("nan")),
            "mean_loss",
        ),
        (
            lambda: stub.ReportVersion(master_pb2.ReportVersionRequest(worker_id=1, model_version=-7)),
            "model_version",
        ),
        (
            lambda: outputs(labels=tensor_pb2.Tensor(name="labels", dtype="complex128", shape=[4])),
            "complex128",
        ),
        (
            lambda: outputs(labels=tensor_pb2.Tensor(name="labels", dtype="int64", shape=[4], content=b"x")),
            "labels",
        ),
        (lambda: outputs(labels=to_tensor(np.arange(3, dtype=np.int64))), "one row per label"),
        (lambda: outputs(outputs=[]), "one row per label"),
        (lambda: outputs(labels=to_tensor(np.int64(3))), "one row per label"),
    ]
    for call, reason in invalid:
        error = refused(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert reason in error.details(), error.details()
    # Reports about tasks the worker does not hold are ignored, not errors.
    assert not report(worker_id=9, task_id=training_task.task_id, success=True).accepted
    assert not report(worker_id=2, task_id=12345, success=False, error_message="x").accepted
    assert not report(worker_id=9, task_id=training_task.task_id, success=False, fatal=True).accepted
    outputs(worker=9)  # ignored: worker 9 holds nothing
    outputs(task=training_task.task_id, worker=2)  # ignored: not an evaluation task
    outputs(model_version=4)  # ignored: not the version of this task
    assert dispatcher.failure is None

    # ... and the master goes on: the real reports count.
    outputs()
    assert report(worker_id=1, task_id=evaluation_task.task_id, success=True).accepted
    assert evaluation.history[-1].records == 4 and evaluation.history[-1].metrics["accuracy"] == 1.0
    assert report(worker_id=2, task_id=training_task.task_id, success=True, counters={"steps": 1}).accepted

    # Outputs that the model's metrics cannot take (one score per record, not one row of scores).
    evaluation.on_model_version(6)
    task = stub.GetTask(master_pb2.GetTaskRequest(worker_id=1)).task
    error = refused(
        lambda: outputs(task=task.task_id, model_version=6, outputs=[to_tensor(np.ones(4, np.float32))])
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"task {task.task_id}" in error.details()
    assert stub.GetTask(master_pb2.GetTaskRequest(worker_id=2)).kind == master_pb2.GetTaskResponse.TASK


def test_a_bug_in_the_masters_metrics_code_is_internal_and_logged_once_with_its_traceback(
    master: tuple[master_pb2_grpc.MasterStub, TaskDispatcher, EvaluationService],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Well-formed outputs that edl-argo's own aggregation fails on are the master's fault (INTERNAL, its
    traceback on one ERROR line), not the caller's (INVALID_ARGUMENT is for outputs the model's metrics
    refuse: the test above)."""
    stub, dispatcher, _ = master
    task = stub.GetTask(master_pb2.GetTaskRequest(worker_id=1)).task
    assert task.type == master_pb2.EVALUATION

    def counting_bug(self: MetricsAccumulator, outputs: Any, labels: Any) -> None:
        return {}["records"]  # a bug of the master's own bookkeeping

    monkeypatch.setattr(MetricsAccumulator, "update", counting_bug)
    configure_logging("INFO")
    capsys.readouterr()
    request = master_pb2.ReportEvaluationOutputsRequest(
        worker_id=1,
        task_id=task.task_id,
        model_version=5,
        outputs=[to_tensor(np.eye(4, 10, dtype=np.float32), "output")],
        labels=to_tensor(np.arange(4, dtype=np.int64), "labels"),
    )
    error = refused(lambda: stub.ReportEvaluationOutputs(request))
    assert error.code() == grpc.StatusCode.INTERNAL, error.details()
    assert error.details() == "ReportEvaluationOutputs: the master failed (KeyError); see its log"
    (line,) = [line for line in capsys.readouterr().err.splitlines() if " ERROR " in line]
    assert " request_failed " in line and "rpc=ReportEvaluationOutputs" in line
    assert f"task={task.task_id}" in line and "error=\"KeyError: 'records'\"" in line
    trace = re.search(r'traceback="([^"]*)"', line)
    assert trace is not None and "servicer.py:" in trace[1] and "counting_bug" in trace[1].split(" < ")[-1]
    assert stub.GetTask(master_pb2.GetTaskRequest(worker_id=2)).kind == master_pb2.GetTaskResponse.TASK
    assert dispatcher.failure is None


def test_a_fatal_task_failure_fails_the_job_at_once_with_the_workers_message(
    master: tuple[master_pb2_grpc.MasterStub, TaskDispatcher, EvaluationService],
) -> None:
    stub, dispatcher, _ = master
    stub.GetTask(master_pb2.GetTaskRequest(worker_id=1))  # the evaluation task
    task = stub.GetTask(master_pb2.GetTaskRequest(worker_id=2)).task
    message = f"training loss became NaN at model version 3 (task {task.task_id}, shard train)"
    request = master_pb2.ReportTaskResultRequest(
        worker_id=2, task_id=task.task_id, success=False, error_message=message, fatal=True
    )
    assert stub.ReportTaskResult(request).accepted
    assert dispatcher.failure is not None and str(dispatcher.failure) == message
    assert stub.GetTask(master_pb2.GetTaskRequest(worker_id=2)).kind == master_pb2.GetTaskResponse.DONE


def test_malformed_parameter_server_requests_are_refused_and_it_goes_on() -> None:
    servicer = ParameterServerServicer(lambda: keras.optimizers.SGD(0.1), jit_compile=False)
    server, port = start_server(servicer, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    try:
        ids = to_tensor(np.array([1, 2], dtype=np.int64))
        pull = ps_pb2.PullEmbeddingVectorsRequest(name="emb", ids=ids)
        error = refused(lambda: stub.PullEmbeddingVectors(pull))  # before any worker pushed the model
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "PushModel" in error.details()

        table = ps_pb2.EmbeddingTableInfo(name="emb", dim=2, initializer="zeros", dtype="float32")
        for bad_model, reason in [
            (ps_pb2.Model(embedding_table_infos=[table, table]), "'emb'"),
            (ps_pb2.Model(embedding_table_infos=[ps_pb2.EmbeddingTableInfo(name="t", dim=-2)]), "'t'"),
            (ps_pb2.Model(dense_parameters=[to_tensor(np.ones(2, np.int32), "w")]), "'w'"),
            (ps_pb2.Model(dense_parameters=[to_tensor(np.ones(2, np.float32), "")]), "''"),
        ]:
            error = refused(lambda model=bad_model: stub.PushModel(model))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in error.details(), (
                error.details()
            )
        weights = to_tensor(np.ones(2, np.float32), "w")
        assert stub.PushModel(
            ps_pb2.Model(dense_parameters=[weights], embedding_table_infos=[table])
        ).accepted

        def lookup(name: str, values: np.ndarray) -> ps_pb2.PullEmbeddingVectorsRequest:
            return ps_pb2.PullEmbeddingVectorsRequest(name=name, ids=to_tensor(values))

        def push_rows(row_ids: list[int]) -> ps_pb2.PushGradientsResponse:
            rows = to_indexed_slices(np.ones((len(row_ids), 2), np.float32), np.array(row_ids))
            request = ps_pb2.PushGradientsRequest(gradients=ps_pb2.Model(embedding_tables={"emb": rows}))
            return stub.PushGradients(request)

        calls: list[tuple[Callable[[], Any], str]] = [
            (
                lambda: stub.PullEmbeddingVectors(lookup("emb", np.array([3, -1], np.int64))),
                "id -1 is negative",
            ),
            (lambda: stub.PullEmbeddingVectors(lookup("emb", np.ones((2, 2), np.int64))), "1-D int64"),
            (lambda: stub.PullEmbeddingVectors(lookup("nope", np.array([1], np.int64))), "'nope'"),
            (
                lambda: stub.PullEmbeddingVectorsBatch(
                    ps_pb2.PullEmbeddingVectorsBatchRequest(
                        lookups=[
                            lookup("emb", np.array([1], np.int64)),
                            lookup("other", np.array([1], np.int64)),
                        ]
                    )
                ),
                "'other'",
            ),
            (lambda: stub.PullEmbeddingTable(ps_pb2.PullEmbeddingTableRequest(name="nope")), "'nope'"),
            (lambda: push_rows([4, -2]), "id -2 is negative"),
        ]
        for call, reason in calls:
            error = refused(call)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert reason in error.details(), error.details()
        assert servicer.version == 0  # nothing was applied
        assert push_rows([4, 2]).accepted and servicer.version == 1
        rows = np.frombuffer(
            stub.PullEmbeddingVectors(lookup("emb", np.array([4], np.int64))).content, np.float32
        )
        np.testing.assert_allclose(rows, [-0.1, -0.1])  # zeros - lr * 1
    finally:
        channel.close()
        server.stop(None)
