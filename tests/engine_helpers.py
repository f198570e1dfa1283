"""Helpers for tests that run real training jobs (master in the test process, pods as processes)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from edl_argo.data.commands import digits_records, write_dataset
from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.recordio import Compressor
from edl_argo.stop import Terminated
from edl_argo.storage.base import Storage

ROOT = Path(__file__).resolve().parents[1]
DIGITS_MODEL = str(ROOT / "examples" / "model_zoo" / "digits.py")
CTR_MODEL = str(ROOT / "examples" / "model_zoo" / "ctr.py")


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -c code *args``, run from the repository, its output captured as text; it may fail."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def python_lines(code: str, *args: str) -> list[str]:
    """The lines ``python -c code *args`` printed (:func:`run_python`), which must succeed."""
    done = run_python(code, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


#: Small, quick digits settings. 8 epochs measured 0.964-0.989 over 55 chaos trials, yet CI runs under load
#: saw 0.925-0.947 (a late loss spike of SGD with momentum; one worker's loss went 0.011 -> 0.050 in its last
#: epoch in a measured run), so the tests train 10.
DIGITS_JOB = {
    "num_epochs": 10,
    "shuffle": True,
    "minibatch_size": 32,
    "num_minibatches_per_task": 4,
    "num_workers": 2,
    "num_ps": 1,
}


def write_digits_dataset(storage: Storage) -> None:
    """scikit-learn's digits as ``train/`` (4 snappy shards) and ``test/`` (2 gzip shards) in ``storage``."""
    train, test = digits_records(test_fraction=0.2, seed=0)
    write_dataset(storage, "train", train, 4, Compressor.SNAPPY, overwrite=False)
    write_dataset(storage, "test", test, 2, Compressor.GZIP, overwrite=False)


#: The accuracy every digits job must reach: the issues' acceptance criterion.
DIGITS_ACCURACY_FLOOR = 0.95


def digits_config(data: Path, output: Path, **overrides: Any) -> TrainConfig:
    values = {
        "model_def": DIGITS_MODEL,
        "training_data": str(data / "train"),
        "validation_data": str(data / "test"),
        "output": str(output),
        "job_name": f"test-{output.name}",
        **DIGITS_JOB,
        **overrides,
    }
    return TrainConfig(**values)


class JobThread:
    """Runs a job in a background thread so a test can act on it (kill pods, scale) while it trains.

    A job still running when its test ends (the test failed before joining it) is stopped by the
    ``jobs_end_with_their_test`` fixture (tests/conftest.py) through :meth:`stop_all`: otherwise its pods
    would go on, and the next test's job of the same name would adopt them."""

    _running: ClassVar[set[JobThread]] = set()
    _running_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, job: TrainingJob) -> None:
        self.job = job
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.job.run()
        except BaseException as error:  # surfaced by join()
            self.error = error
        finally:
            with JobThread._running_lock:
                JobThread._running.discard(self)

    def start(self) -> JobThread:
        with JobThread._running_lock:
            JobThread._running.add(self)
        self._thread.start()
        return self

    @classmethod
    def stop_all(cls, timeout: float = 60.0) -> list[str]:
        """Stop the jobs still running as a local master stops on SIGTERM (:class:`edl_argo.stop.Terminated`
        raised in their thread: their ``finally`` stops their pods), each within ``timeout``; their names."""
        with cls._running_lock:
            running = list(cls._running)
        for job_thread in running:
            if (ident := job_thread._thread.ident) is not None:
                stop = ctypes.py_object(Terminated)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), stop)
        names = [job_thread.job.config.job_name for job_thread in running]
        for name, job_thread in zip(names, running, strict=True):
            job_thread._thread.join(timeout)
            if job_thread._thread.is_alive():
                raise AssertionError(f"job {name} did not stop within {timeout:g} s")
        return names

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        import time

        deadline = time.monotonic() + timeout
        while not condition():
            if not self._thread.is_alive():
                raise AssertionError(f"job ended before {what}: {self.error!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def join(self, timeout: float) -> dict[str, Any]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError("job did not finish in time")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def progress_fraction(self) -> float:
        done, total = self.job.dispatcher.progress()
        return done / total if total else 0.0


def expected_minibatches(config: TrainConfig) -> int:
    """The minibatches a job trains when nothing fails: every task of every epoch, each cut into minibatches
    of ``minibatch_size`` (the last one of a task may be smaller)."""
    from edl_argo.master.job import dataset_shards

    per_task, size = config.records_per_task, config.minibatch_size
    per_epoch = sum(
        -(-min(per_task, records - start) // size)
        for records in dataset_shards(config.training_data, "--training-data").values()
        for start in range(0, records, per_task)
    )
    return per_epoch * config.num_epochs


def model_dir(output: Path, name: str = "model") -> Path:
    """The folder of the tree (a model) published at ``output/name``: the version its pointer names."""
    from edl_argo.storage import LocalStorage
    from edl_argo.storage.trees import open_tree

    return output / name / open_tree(LocalStorage(output / name), "").folder


def read_metrics(output: Path) -> dict[str, Any]:
    return json.loads((model_dir(output) / "metrics.json").read_text())


def assert_no_record_lost(metrics: dict[str, Any]) -> None:
    """Every epoch trained every record of the dataset, counted at both ends: the tasks the dispatcher
    marked done, and the records the workers' own inputs yielded (``accounting.records_reported_per_epoch``,
    summed from their task reports), each against the dataset's size from its manifest."""
    dataset_records = metrics["records_per_epoch"]
    dispatched = metrics["records_done_per_epoch"]
    trained = metrics["accounting"]["records_reported_per_epoch"]
    assert dispatched, "no epochs accounted"
    assert sorted(trained) == sorted(dispatched), (trained, dispatched)
    assert all(done == dataset_records for done in dispatched.values()), dispatched
    assert all(count == dataset_records for count in trained.values()), trained


#: How long a test waits for its turn to run an elastic-train step (the other runs' whole pipelines).
MASTER_PORT_TURN_SECONDS = 540.0


@contextlib.contextmanager
def master_port_turn() -> Iterator[None]:
    """Held while a test runs a pipeline with an elastic-train step here. The step serves its master on a
    fixed port (2221: in a cluster each step's pod has an address of its own), so two such runs at once on
    one machine (the suite's test processes side by side) collide: they take turns, through a lock file
    every test process sees. AssertionError if the turn does not come within
    :data:`MASTER_PORT_TURN_SECONDS`."""
    path = Path(tempfile.gettempdir()) / "edl-argo-tests-master-port.lock"
    deadline = time.monotonic() + MASTER_PORT_TURN_SECONDS
    with path.open("a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"no turn at the master's port in {MASTER_PORT_TURN_SECONDS} s"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


#: A ``loss`` of the model contract that branches in Python on a tensor's value. Keras 3's ``fit`` traces its
#: step without AutoGraph, which would have made the branch a ``tf.cond``: there it fails while tracing.
#: Appended to a model file, it replaces the file's ``loss``.
PYTHON_BRANCH_ON_A_TENSOR_LOSS = """

def loss(labels, predictions):
    if tf.reduce_mean(labels) > 1e9:
        return tf.reduce_mean(tf.abs(predictions - labels))
    return tf.reduce_mean(tf.square(predictions - labels))
"""


def assert_fails_as_in_fit(
    model_file: str, train: Callable[[Any, Any], object], features: Any, labels: Any
) -> None:
    """``train(features, labels)`` (one step of a job's worker) fails with the error ``model.fit`` raises for
    the same model file and minibatch, and names the model file's function at fault (its ``loss``)."""
    import keras
    import pytest
    import tensorflow as tf

    from edl_argo.model import load_model_spec
    from edl_argo.model.user_code import model_error_of

    spec = load_model_spec(model_file)
    model = spec.custom_model()
    model.compile(optimizer=spec.optimizer(), loss=spec.loss)
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        model.fit(features, labels, batch_size=len(labels), epochs=1, verbose=0)
    keras.backend.clear_session(free_memory=False)
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError) as raised:
        train(features, labels)
    found = model_error_of(raised.value)
    assert found is not None and (found.source, found.function) == (model_file, "loss"), repr(raised.value)


def mse_model_file(optimizer: str, custom_model: str) -> str:
    """A model file of the model contract: mean squared error, the optimizer ``optimizer`` (a Python
    expression, e.g. ``keras.optimizers.SGD(0.05)``), minibatches given as they are, no metric, and
    ``custom_model`` (the source of its ``def custom_model():``)."""
    return f"""
import keras
import tensorflow as tf

def feed(dataset, mode, metadata):
    return dataset

def loss(labels, predictions):
    return tf.reduce_mean(tf.square(predictions - labels))

def optimizer():
    return {optimizer}

def eval_metrics_fn():
    return {{}}

{custom_model}"""
