"""``edl-argo worker``: the process a worker pod runs.

Loop: tasks stream in from the master, each read with one ranged read while the task before it trains
(:mod:`edl_argo.worker.task_stream`), through one input pipeline for the whole job (``feed`` traced once,
:func:`edl_argo.worker.data.stream_batches`) → train batch by batch (evaluation and prediction tasks: one
pipeline for each mode, :class:`~edl_argo.worker.data.TaskBatches`) → report. WAIT means "ask again
shortly"; DONE means exit 0. The main thread's time per section (input wait, compute, PS, peers, master)
is measured (:mod:`edl_argo.worker.step_timers`), sent with every training task's report and logged at
exit (``worker_step_times``). A task that raises is reported failed with the error (the master retries it
elsewhere, up to a bound) and the worker goes on.

A task that fails with a model error (raised in the model file's code, :mod:`edl_argo.model.user_code`;
what the input pipeline raises is ``feed``'s) is reported as one, naming the model file and the function:
the master fails the job when a second worker reports the same error for the same task. Before the
worker's first training step, a model error fails the job at once: a model that cannot train its first
minibatch fails the same way on every worker, and relaunching workers would only pay their start-up.

A minibatch whose loss is NaN or infinite is never pushed. With ``--nan-loss skip`` the worker goes on
with the next one and reports how many it skipped (``nan_batches_skipped``); with ``--nan-loss fail`` (the
default) it reports the task as fatally failed, naming the model version, task and shard, and the master
fails the job at once: retrying elsewhere would meet the same NaN. A minibatch whose loss is finite but
whose gradients are not (:mod:`edl_argo.worker.gradient_check`) is never pushed either: ``--nan-gradients``
decides in the same way, and ``nan_gradients_skipped`` counts those skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edl_argo.checkpoint import open_checkpoint_storage
from edl_argo.collective.flags import ALLREDUCE
from edl_argo.errors import ConfigError, JobFailedError
from edl_argo.flags import pod_host
from edl_argo.log import get_logger
from edl_argo.model import Mode, ModelSpec, load_model_spec
from edl_argo.model.contract import model_options_from_args
from edl_argo.model.outputs import (
    as_given,
    concatenate,
    named_arrays,
    num_records,
    output_names,
    prediction_lines,
)
from edl_argo.model.user_code import ModelError, error_line, mark, model_error_of
from edl_argo.proto import master_pb2
from edl_argo.readers import SERIALIZED, ReaderSpec, RecordSchema
from edl_argo.recordio import ShardChangedError
from edl_argo.rpc.master_watch import PROBE_SECONDS, MasterWatch
from edl_argo.rpc.tls import load_tls_dir
from edl_argo.settings import add_role_settings
from edl_argo.stop import exit_now
from edl_argo.storage import open_storage
from edl_argo.worker.gradient_check import NonFiniteGradientError
from edl_argo.worker.input_prefetch import WaitTimePrefetcher
from edl_argo.worker.master_client import MasterClient
from edl_argo.worker.step_timers import STEP_TIMERS, as_counters
from edl_argo.worker.step_trace import StepTrace, TracedMinibatch
from edl_argo.worker.task_reporter import TaskReporter

if TYPE_CHECKING:
    from edl_argo.worker.data import TaskBatches
    from edl_argo.worker.task_stream import StreamedTask

log = get_logger(__name__)

#: Test-only fault: the id of a training task whose first minibatch the worker skips (it is read but not
#: trained), so that tests can see the master's accounting catch a lost minibatch.
SKIP_MINIBATCH_ENV = "EDL_TEST_SKIP_MINIBATCH_OF_TASK"
#: Minibatches the training input prepares ahead of the one being trained (while the step waits).
PREFETCH_MINIBATCHES = 2

_MODES = {
    master_pb2.TRAINING: Mode.TRAINING,
    master_pb2.EVALUATION: Mode.EVALUATION,
    master_pb2.PREDICTION: Mode.PREDICTION,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("worker", help="run one worker of a job (started by the master)")
    add_role_settings(parser, "worker")
    parser.set_defaults(run=run_worker)


class Replica(Protocol):
    """The model as a worker trains it: :class:`ModelReplica` (parameter servers) or
    :class:`AllreduceReplica` (a group of full replicas)."""

    @property
    def version(self) -> int: ...

    def ensure_built(self, features: Any) -> None: ...

    def sync(self) -> None: ...

    def train_minibatch(self, features: Any, labels: Any) -> float: ...

    @property
    def last_update(self) -> int:
        """The update the last trained minibatch was applied in (the synchronous step PS 0 assigned, or the
        group's version after the step; -1: none), for :mod:`edl_argo.worker.step_trace`."""
        ...

    def flush(self) -> None: ...

    def predict(self, features: Any) -> Any: ...

    @property
    def model(self) -> Any: ...

    def idle_step(self) -> bool: ...

    def close(self) -> None: ...


@dataclass
class _TaskProgress:
    """What the minibatches of one training task did so far."""

    started: float
    minibatches: int = 0
    steps: int = 0
    skipped: int = 0
    skipped_gradients: int = 0
    #: Minibatches whose step LossScaleOptimizer's dynamic scale skipped (their gradients overflowed).
    skipped_by_loss_scale: int = 0
    records: int = 0
    total_loss: float = 0.0
    #: Why the task failed (its remaining minibatches are skipped; the report says so).
    error: Exception | None = None


class Worker:
    """Runs tasks from the master until it says DONE.

    Tasks come as a stream (:class:`~edl_argo.worker.task_stream.TaskStream`) through one input pipeline
    for the whole job (:func:`~edl_argo.worker.data.stream_batches`): the next task is fetched and read
    while the current one trains. A task is reported done after its last minibatch was applied.

    While the master has no task for it (WAIT), the worker gives its replica an :meth:`Replica.idle_step`
    (a member of an allreduce group keeps the group's steps going) and backs off only when that did no work.
    """

    _reporter: TaskReporter  # made by run()

    def __init__(
        self,
        worker_id: int,
        spec: ModelSpec,
        master: MasterClient,
        replica: Replica,
        minibatch_size: int,
        evaluation_steps: int = 0,
        prediction_output: str = "",
        nan_loss: str = "fail",
        nan_gradients: str = "fail",
        log_loss_steps: int = 0,
        training_schema: RecordSchema = SERIALIZED,
    ) -> None:
        """``log_loss_steps``: log the mean loss of every so many training steps of this worker (0: never;
        :meth:`_log_loss`). ``training_schema``: what a record of the training data is (serialized
        records, or a row of columns), which the input pipeline is built for."""
        self._training_schema = training_schema
        self.worker_id = worker_id
        self._log_loss_steps = log_loss_steps
        self._loss_steps = 0  # training steps of this worker since it started
        self._loss_since_logged = 0.0  # the sum of their losses since the last loss event
        self._nan_loss = nan_loss
        self._nan_gradients = nan_gradients
        self._spec = spec
        self._master = master
        self._replica = replica
        from edl_argo.worker.data import RecordSource  # TensorFlow: imported when run, not for --help

        self._source = RecordSource()
        self._minibatch_size = minibatch_size
        self._evaluation_steps = evaluation_steps
        self._prediction_output = prediction_output
        self._processor = spec.prediction_outputs_processor() if spec.prediction_outputs_processor else None
        self._reported_version = -1
        self._progress: dict[int, _TaskProgress] = {}  # training tasks being run, by stream seq
        self._input_seq = 0  # the stream seq of the task whose minibatches the input pipeline gives next
        self._stepped = False  # a training step succeeded (see the module docstring: model errors)
        self._timers_at: dict[str, float] = {}  # STEP_TIMERS.totals() at the last report
        self._skip_minibatch_of_task = int(os.environ.get(SKIP_MINIBATCH_ENV) or -1)
        self._trace = StepTrace.from_env(worker_id)  # None unless EDL_STEP_TRACE asks for one
        self._task_inputs: dict[tuple[str, RecordSchema], TaskBatches] = {}  # see _task_input

    def run(self) -> None:
        from edl_argo.worker.data import StreamElements, stream_batches
        from edl_argo.worker.task_stream import WAIT_SEQ, TaskStream

        STEP_TIMERS.bind()
        self._timers_at = STEP_TIMERS.totals()
        stream = TaskStream(self._master, self._source, self._training_schema)
        reporter = self._reporter = TaskReporter(on_failure=stream.close)
        try:
            schema = self._training_schema
            pipeline = stream_batches(self._spec, stream.generate, self._minibatch_size, schema)
        except Exception as error:  # the model's input function, traced once here, raised
            try:
                self._fail_on_input_function(error)
            finally:
                reporter.close(raise_failure=False)
            return
        elements = WaitTimePrefetcher(StreamElements(iter(pipeline)), PREFETCH_MINIBATCHES, STEP_TIMERS)
        wait = 0.05
        try:
            while True:
                with STEP_TIMERS.section("input"):
                    element = self._next_element(elements)
                if element is None:
                    break
                seq, minibatch = element
                if minibatch is not None:
                    self._train_minibatch(seq, stream.task(seq).task, minibatch)
                    continue
                if seq == WAIT_SEQ:
                    if self._replica.idle_step():
                        wait = 0.05
                    else:
                        time.sleep(wait)
                        wait = min(1.0, wait * 2)
                    stream.resume()
                    continue
                wait = 0.05
                if not self._finish_task(stream.task(seq), sent=lambda seq=seq: stream.finished(seq)):
                    return  # the job failed
            reporter.close()  # every report sent (or the error that stopped them raised)
            if stream.failure is not None:
                raise stream.failure
            log.info("worker_done", worker=self.worker_id)
        finally:
            stream.close()
            elements.close()
            reporter.close(raise_failure=False)
            if self._trace is not None:
                self._trace.close()
            totals = STEP_TIMERS.totals()
            log.info("worker_step_times", **{name: round(seconds, 3) for name, seconds in totals.items()})

    def _next_element(self, elements: Iterator[Any]) -> Any:
        """The input pipeline's next element, or None at its end. What the pipeline raises is ``feed``'s (the
        task stream never raises): it fails the task whose minibatches come next (the rest of them are
        skipped), and the pipeline goes on with its next element (each error consumed one)."""
        from edl_argo.worker.task_stream import WAIT_SEQ

        while True:
            try:
                element = next(elements, None)
            except Exception as error:
                progress = self._progress.setdefault(self._input_seq, _TaskProgress(time.monotonic()))
                if progress.error is None:
                    progress.error = mark(error, self._spec.source, self._spec.names["feed"])
                continue
            if element is not None and element[0] != WAIT_SEQ:
                seq, minibatch = element
                self._input_seq = seq if minibatch is not None else seq + 1
            return element

    def _train_minibatch(self, seq: int, task: master_pb2.Task, batch: Any) -> None:
        """Train one minibatch of training task ``task`` (streamed as ``seq``), unless the task failed."""
        from edl_argo.worker.replica import NonFiniteLossError, StepSkipped

        progress = self._progress.setdefault(seq, _TaskProgress(time.monotonic()))
        if progress.error is not None:
            return
        features, labels, weights = split_batch(batch)
        progress.records += num_records(features)
        progress.minibatches += 1
        if progress.minibatches == 1 and task.task_id == self._skip_minibatch_of_task:
            log.warning("minibatch_skipped_by_test_fault", task=task.task_id)
            return
        try:
            with STEP_TIMERS.section("compute"):
                if weights is None:
                    loss = self._replica.train_minibatch(features, labels)
                else:
                    loss = self._replica.train_minibatch(features, labels, weights)  # type: ignore[call-arg]
        except StepSkipped:
            progress.skipped_by_loss_scale += 1  # as fit skips it; logged by the replica
            return
        except NonFiniteLossError as error:
            if self._nan_loss != "skip":
                progress.error = error
                return
            progress.skipped += 1
            log.warning("nan_batch_skipped", task=task.task_id, shard=task.shard, error=str(error))
            return
        except NonFiniteGradientError as error:
            if self._nan_gradients != "skip":
                progress.error = error
                return
            progress.skipped_gradients += 1
            log.warning("nan_gradients_skipped", task=task.task_id, shard=task.shard, error=str(error))
            return
        except JobFailedError:
            raise
        except Exception as error:  # a task-level failure, reported when the task's minibatches are through
            progress.error = error
            return
        progress.steps += 1
        self._stepped = True
        progress.total_loss += loss
        self._log_loss(loss)
        if self._trace is not None:
            self._trace_minibatch(task, progress.minibatches - 1, num_records(features))
        self._maybe_report_version()

    def _log_loss(self, loss: float) -> None:
        """Count one training step at ``loss``; every ``log_loss_steps`` steps, log their mean loss as one
        ``loss`` event whose message (``Loss = 0.53 at step 1200``, the step being the model version after
        it) a ``grep Loss`` of the pod's log finds."""
        if self._log_loss_steps <= 0:
            return
        self._loss_steps += 1
        self._loss_since_logged += float(loss)
        if self._loss_steps % self._log_loss_steps:
            return
        mean = self._loss_since_logged / self._log_loss_steps
        self._loss_since_logged = 0.0
        version = self._replica.version
        log.info(
            "loss",
            message=f"Loss = {mean:.6g} at step {version}",
            loss=mean,
            step=version,
            worker=self.worker_id,
            worker_steps=self._loss_steps,
        )

    def _trace_minibatch(self, task: master_pb2.Task, index: int, examples: int) -> None:
        """Trace minibatch ``index`` of ``task``, just applied (:mod:`edl_argo.worker.step_trace`)."""
        assert self._trace is not None
        self._trace.record(
            TracedMinibatch(
                worker=self.worker_id,
                task=task.task_id,
                epoch=task.epoch,
                shard=task.shard,
                start=task.start,
                end=task.end,
                minibatch=index,
                examples=examples,
                update=self._replica.last_update,
            )
        )

    def _finish_task(self, streamed: StreamedTask, sent: Callable[[], None]) -> bool:
        """Finish ``streamed`` (a training task's minibatches were all trained; evaluation and prediction
        tasks run now) and hand its report to the reporter (``sent()`` runs once the master has it); False
        when the job failed."""
        task = streamed.task
        progress = self._progress.pop(streamed.seq, None) or _TaskProgress(time.monotonic())

        def work() -> dict[str, Any]:
            if streamed.error is not None:
                raise streamed.error
            if task.type == master_pb2.TRAINING:
                if progress.error is not None:
                    raise progress.error
                return {**self._trained(task, progress), READ_COUNTER: int(streamed.read_seconds * 1e6)}
            schema = self._source.spec(task).schema
            batches = self._task_input(_MODES[task.type], schema).batches(streamed.records)
            with contextlib.closing(batches):  # a task left early leaves nothing for the next
                if task.type == master_pb2.EVALUATION:
                    return self._evaluate(task, batches)
                return self._predict(task, batches)

        return self._run_task(task, progress, work, sent)

    def _task_input(self, mode: str, schema: RecordSchema) -> TaskBatches:
        """The input pipeline of this worker's evaluation or prediction tasks in ``mode`` on data of
        ``schema``, built by the first such task (``feed`` traced once for all of them)."""
        from edl_argo.worker.data import TaskBatches

        key = (mode, schema)
        if key not in self._task_inputs:  # a build that raised is tried again by the next task
            self._task_inputs[key] = TaskBatches(self._spec, mode, schema, self._minibatch_size)
        return self._task_inputs[key]

    def _run_task(
        self,
        task: master_pb2.Task,
        progress: _TaskProgress,
        work: Callable[[], dict[str, Any]],
        sent: Callable[[], None],
    ) -> bool:
        """Report the outcome of ``task`` as ``work()`` returns its counters or raises; False when the
        failure fails the job."""
        from edl_argo.worker.replica import NonFiniteLossError

        try:
            counters = work()
        except NonFiniteLossError as error:
            return self._fail_job(
                task,
                f"{error} (task {task.task_id}, shard {task.shard}); lower the learning rate or use"
                " --nan-loss skip",
            )
        except NonFiniteGradientError as error:
            return self._fail_job(
                task,
                f"{error} (task {task.task_id}, shard {task.shard}); check the model for operations"
                " whose gradient is not finite (sqrt or norm at 0) or use --nan-gradients skip",
            )
        except ShardChangedError as error:  # retrying cannot help: the data the job started with are gone
            return self._fail_job(task, str(error))
        except JobFailedError:
            raise
        except Exception as error:  # a task-level failure: the master requeues the task
            found = model_error_of(error)
            if found is not None and not self._stepped:
                return self._fail_job(task, self._before_first_step(task, found))
            message = error_line(error) if found is None else str(found)
            log.error("task_failed", task=task.task_id, shard=task.shard, error=message)
            # Minibatches trained before the failure reached the model: the accounting counts them.
            counters = {"steps": progress.steps} if task.type == master_pb2.TRAINING else {}
            self._report(
                task, sent, success=False, error=message, counters=counters, model_error=found is not None
            )
            return True
        counters["millis"] = int((time.monotonic() - progress.started) * 1000)
        mean_loss = counters.pop("mean_loss", 0.0)
        self._report(task, sent, success=True, counters=counters, mean_loss=mean_loss)
        return True

    def _report(self, task: master_pb2.Task, sent: Callable[[], None], **result: Any) -> None:
        """Hand ``task``'s result to the reporter (:mod:`edl_argo.worker.task_reporter`); a training task's
        report carries the main thread's time per section since the last report (``time_<section>_us``,
        :mod:`edl_argo.worker.step_timers`)."""
        now = STEP_TIMERS.totals()
        if task.type == master_pb2.TRAINING:
            result["counters"] = {**result["counters"], **as_counters(self._timers_at, now)}
        self._timers_at = now
        task_id = task.task_id
        self._reporter.send(lambda: self._master.report_task_result(task_id, next_task=False, **result), sent)

    def _fail_on_input_function(self, error: Exception) -> None:
        """The model's input function raised when the worker's pipeline was built: no task can train,
        and retrying cannot help, so the job fails, naming the task this worker was to train next."""
        response = self._master.get_task()
        if response.kind != master_pb2.GetTaskResponse.TASK:
            raise error  # no task to name (the job is ending): the worker's exit says what went wrong
        feed = self._spec.names["feed"]
        found = model_error_of(error) or ModelError(self._spec.source, feed, error_line(error))
        self._fail_job(response.task, self._before_first_step(response.task, found))

    def _before_first_step(self, task: master_pb2.Task, found: ModelError) -> str:
        """The job's one-line error for a model error before this worker's first training step."""
        kind = _MODES.get(task.type, "training")
        return (
            f"{found} ({kind} task {task.task_id}, shard {task.shard}; worker {self.worker_id} failed so"
            " before its first training step: the model fails the same way on every worker)"
        )

    def _fail_job(self, task: master_pb2.Task, message: str) -> bool:
        """Report ``task`` as a failure no retry can mend: the master fails the job with ``message``."""
        log.error("task_failed", task=task.task_id, shard=task.shard, fatal=True, error=message)
        task_id = task.task_id
        # After the reports before it, and sent before the worker ends.
        self._reporter.send(
            lambda: self._master.report_task_result(task_id, success=False, error=message, fatal=True)
        )
        self._reporter.flush()
        return False

    def _trained(self, task: master_pb2.Task, progress: _TaskProgress) -> dict[str, Any]:
        """The counters of a training task whose minibatches were all trained; they tell the master's
        accounting the records the input yielded and the minibatches trained (:mod:`edl_argo.master.ledger`).
        """
        with STEP_TIMERS.section("compute"):
            self._replica.flush()  # the task's last gradients are applied before it is reported done
        steps = progress.steps
        mean_loss = progress.total_loss / steps if steps else 0.0
        log.debug("task_trained", steps=steps, loss=mean_loss, version=self._replica.version)
        return {
            "records": progress.records,
            "steps": steps,
            "nan_batches_skipped": progress.skipped,
            "nan_gradients_skipped": progress.skipped_gradients,
            "loss_scale_skipped": progress.skipped_by_loss_scale,
            "epoch": task.epoch,
            "model_version": self._replica.version,
            "mean_loss": mean_loss,
        }

    def _maybe_report_version(self) -> None:
        if self._evaluation_steps <= 0:
            return
        version = self._replica.version
        if version // self._evaluation_steps > self._reported_version // self._evaluation_steps:
            self._master.report_version(version)
            self._reported_version = version

    def _evaluate(self, task: master_pb2.Task, batches: Any) -> dict[str, int]:
        outputs: list[dict[str, np.ndarray]] = []
        labels: list[dict[str, np.ndarray]] = []
        for batch in batches:
            features, batch_labels, _weights = split_batch(batch)
            if not outputs:
                self._replica.ensure_built(features)
                self._replica.sync()
            names = output_names(self._replica.model)
            outputs.append(named_arrays(self._replica.predict(features), names))
            labels.append(named_arrays(batch_labels))
        if outputs:
            self._master.report_evaluation_outputs(
                task.task_id, task.model_version, concatenate(outputs), concatenate(labels)
            )
        return {"records": sum(num_records(o) for o in outputs)}

    def _predict(self, task: master_pb2.Task, batches: Any) -> dict[str, int]:
        outputs: list[dict[str, np.ndarray]] = []
        for features in batches:
            if not outputs:
                self._replica.ensure_built(features)
                self._replica.sync()
            batch = named_arrays(self._replica.predict(features), output_names(self._replica.model))
            if self._processor is not None:
                self._processor.process(as_given(batch), self.worker_id)
            outputs.append(batch)
        if self._prediction_output and outputs:
            write_predictions(self._prediction_output, task.shard, task.start, concatenate(outputs))
        return {"records": sum(num_records(o) for o in outputs)}


def split_batch(batch: Any) -> tuple[Any, Any, Any]:
    """``(features, labels, sample_weights or None)`` of a batch ``feed`` made as ``(features, labels)`` or
    ``(features, labels, sample_weights)``."""
    if isinstance(batch, tuple) and len(batch) == 3:
        return batch
    features, labels = batch
    return features, labels, None


def write_predictions(url: str, shard: str, start: int, outputs: dict[str, np.ndarray]) -> str:
    """Write one JSON line per record (:func:`~edl_argo.model.outputs.prediction_lines`) as one object."""
    key = f"{shard}.{start:012d}.jsonl"
    open_storage(url).write(
        key, "".join(line + "\n" for line in prediction_lines(shard, start, outputs)).encode()
    )
    return key


#: The counter of a training task's report: microseconds its records took to read (``TaskStream`` reads
#: them on its own thread, one task ahead, so this overlaps training; the input wait is what it did not hide).
READ_COUNTER = "read_us"


def training_schema(data_spec: str) -> RecordSchema:
    """The schema of ``--training-data-spec`` (serialized records without one); ConfigError if it is not
    a spec's JSON."""
    if not data_spec:
        return SERIALIZED
    try:
        return ReaderSpec.from_json(data_spec).schema
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--training-data-spec is not a reader spec: {error}") from None


def run_worker(args: argparse.Namespace) -> int:
    tls = load_tls_dir(args.tls_dir) if args.tls_dir else None  # a bad file fails before TensorFlow loads
    from edl_argo.worker.allreduce_replica import AllreduceReplica  # TensorFlow: see edl_argo.cli
    from edl_argo.worker.ps_client import ParameterServerClient
    from edl_argo.worker.replica import ModelReplica

    spec = load_model_spec(args.model_def, model_options_from_args(args))
    # The watch ends the worker when the master is lost; calls keep retrying a little longer, so that
    # the watch, not a call, decides.
    budget = args.master_timeout + 2 * PROBE_SECONDS
    master = MasterClient(
        args.master_addr,
        args.worker_id,
        retry_budget_seconds=budget,
        rpc_timeout_seconds=args.rpc_timeout_seconds,
        tls=tls,
    )
    watch = MasterWatch(args.master_addr, args.master_timeout, _master_lost, tls=tls).start()
    replica: Replica
    if args.distribution_strategy == ALLREDUCE:
        replica = AllreduceReplica(
            spec,
            master,
            pod_host(),
            args.collective_port,
            collective_timeout=args.collective_timeout_seconds,
            scale_lr_by_world_size=args.scale_lr_by_world_size,
            checkpoint_storage=open_checkpoint_storage(args.checkpoint_dir, args.checkpoint_steps),
            checkpoint_steps=args.checkpoint_steps,
        )
        log.info("worker_started", worker=args.worker_id, master=args.master_addr, collective=replica.address)
    else:
        ps_addresses = [a for a in args.ps_addrs.split(",") if a]
        if not ps_addresses:
            raise ConfigError("--ps-addrs is required with --distribution-strategy ParameterServerStrategy")
        ps = ParameterServerClient(ps_addresses, rpc_timeout_seconds=args.rpc_timeout_seconds, tls=tls)
        replica = ModelReplica(spec, ps, pipelined=args.pipelined)
        log.info("worker_started", worker=args.worker_id, master=args.master_addr, ps=args.ps_addrs)
    worker = Worker(
        args.worker_id,
        spec,
        master,
        replica,
        args.minibatch_size,
        evaluation_steps=args.evaluation_steps,
        prediction_output=args.prediction_output,
        nan_loss=args.nan_loss,
        nan_gradients=args.nan_gradients,
        log_loss_steps=args.log_loss_steps,
        training_schema=training_schema(args.training_data_spec),
    )
    try:
        worker.run()
    finally:
        watch.close()
        replica.close()
    return 0


#: Exit status of a worker whose master stayed unreachable for ``--master-timeout``.
MASTER_LOST_EXIT_CODE = 3


def _master_lost() -> None:
    """The master is gone for good: end the worker at once, whatever its main thread is waiting for (a
    parameter server, a peer, the master itself); a worker holds nothing that must be saved."""
    log.error("worker_stopping", reason="master_lost", exit_code=MASTER_LOST_EXIT_CODE)
    exit_now(MASTER_LOST_EXIT_CODE)
