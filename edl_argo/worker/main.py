"""``edl-argo worker``: the process a worker pod runs.

Loop: ask the master for a task → read its records (one ranged read) → ``feed`` → train, evaluate or
predict batch by batch → report. WAIT means "ask again shortly"; DONE means exit 0. A task that raises is
reported failed with the error (the master retries it elsewhere, up to a bound) and the worker goes on.

A minibatch whose loss is NaN or infinite is never pushed. With ``--nan-loss skip`` the worker goes on
with the next one and reports how many it skipped (``nan_batches_skipped``); with ``--nan-loss fail`` (the
default) it reports the task as fatally failed, naming the model version, task and shard, and the master
fails the job at once: retrying elsewhere would meet the same NaN. A minibatch whose loss is finite but
whose gradients are not (:mod:`edl_argo.worker.gradient_check`) is never pushed either: ``--nan-gradients``
decides in the same way, and ``nan_gradients_skipped`` counts those skipped.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any, Protocol

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
from edl_argo.proto import master_pb2
from edl_argo.recordio import ShardChangedError
from edl_argo.rpc.master_watch import PROBE_SECONDS, MasterWatch
from edl_argo.settings import add_role_settings
from edl_argo.storage import open_storage
from edl_argo.worker.gradient_check import NonFiniteGradientError
from edl_argo.worker.master_client import MasterClient

log = get_logger(__name__)

#: Test-only fault: the id of a training task whose first minibatch the worker skips (it is read but not
#: trained), so that tests can see the master's accounting catch a lost minibatch.
SKIP_MINIBATCH_ENV = "EDL_TEST_SKIP_MINIBATCH_OF_TASK"

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

    def flush(self) -> None: ...

    def predict(self, features: Any) -> Any: ...

    @property
    def model(self) -> Any: ...

    def idle_step(self) -> bool: ...

    def close(self) -> None: ...


class Worker:
    """Runs tasks from the master until it says DONE.

    While the master has no task for it (WAIT), the worker gives its replica an :meth:`Replica.idle_step`
    (a member of an allreduce group keeps the group's steps going) and backs off only when that did no work.
    """

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
    ) -> None:
        self.worker_id = worker_id
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
        self._task_steps = 0  # minibatches of the current training task trained so far
        self._skip_minibatch_of_task = int(os.environ.get(SKIP_MINIBATCH_ENV) or -1)

    def run(self) -> None:
        wait = 0.05
        response = self._master.get_task()
        while True:
            if response.kind == master_pb2.GetTaskResponse.DONE:
                log.info("worker_done", worker=self.worker_id)
                return
            if response.kind == master_pb2.GetTaskResponse.TASK:
                wait = 0.05
                response = self._run_task(response.task)
                continue
            if not self._replica.idle_step():
                time.sleep(wait)
                wait = min(1.0, wait * 2)
            else:
                wait = 0.05
            response = self._master.get_task()

    def _run_task(self, task: master_pb2.Task) -> master_pb2.GetTaskResponse:
        """Run ``task``, report its outcome, and return the master's next answer (given with the report)."""
        from edl_argo.worker.data import make_batches
        from edl_argo.worker.replica import NonFiniteLossError

        started = time.monotonic()
        self._task_steps = 0
        try:
            records = self._source.read(task.data_url, task.shard, task.start, task.end, task.shard_version)
            batches = make_batches(self._spec, records, _MODES[task.type], self._minibatch_size)
            if task.type == master_pb2.TRAINING:
                counters = self._train(batches, task)
            elif task.type == master_pb2.EVALUATION:
                counters = self._evaluate(task, batches)
            else:
                counters = self._predict(task, batches)
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
            message = f"{type(error).__name__}: {error}".splitlines()[0][:500]
            log.error("task_failed", task=task.task_id, shard=task.shard, error=message)
            # Minibatches trained before the failure reached the model: the accounting counts them.
            counters = {"steps": self._task_steps} if task.type == master_pb2.TRAINING else {}
            report = self._master.report_task_result(
                task.task_id, success=False, error=message, counters=counters
            )
            return report.next_task
        counters["millis"] = int((time.monotonic() - started) * 1000)
        mean_loss = counters.pop("mean_loss", 0.0)
        report = self._master.report_task_result(
            task.task_id, success=True, counters=counters, mean_loss=mean_loss
        )
        return report.next_task

    def _fail_job(self, task: master_pb2.Task, message: str) -> master_pb2.GetTaskResponse:
        """Report ``task`` as a failure no retry can mend: the master fails the job with ``message``."""
        log.error("task_failed", task=task.task_id, shard=task.shard, fatal=True, error=message)
        self._master.report_task_result(task.task_id, success=False, error=message, fatal=True)
        return self._master.get_task()  # the job failed: the master says DONE

    def _train(self, batches: Any, task: master_pb2.Task) -> dict[str, Any]:
        """Train every minibatch of ``task``; the counters tell the master's accounting the records the
        input yielded and the minibatches trained (:mod:`edl_argo.master.ledger`)."""
        from edl_argo.worker.replica import NonFiniteLossError

        steps = 0
        skipped = 0
        skipped_gradients = 0
        records = 0
        total_loss = 0.0
        for index, batch in enumerate(batches):
            features, labels, weights = split_batch(batch)
            records += num_records(features)
            if index == 0 and task.task_id == self._skip_minibatch_of_task:
                log.warning("minibatch_skipped_by_test_fault", task=task.task_id)
                continue
            try:
                if weights is None:
                    total_loss += self._replica.train_minibatch(features, labels)
                else:
                    total_loss += self._replica.train_minibatch(features, labels, weights)  # type: ignore[call-arg]
            except NonFiniteLossError as error:
                if self._nan_loss != "skip":
                    raise
                skipped += 1
                log.warning("nan_batch_skipped", task=task.task_id, shard=task.shard, error=str(error))
                continue
            except NonFiniteGradientError as error:
                if self._nan_gradients != "skip":
                    raise
                skipped_gradients += 1
                log.warning("nan_gradients_skipped", task=task.task_id, shard=task.shard, error=str(error))
                continue
            steps += 1
            self._task_steps = steps
            self._maybe_report_version()
        self._replica.flush()  # the task's last gradients are applied before it is reported done
        mean_loss = total_loss / steps if steps else 0.0
        log.debug("task_trained", steps=steps, loss=mean_loss, version=self._replica.version)
        return {
            "records": records,
            "steps": steps,
            "nan_batches_skipped": skipped,
            "nan_gradients_skipped": skipped_gradients,
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


def run_worker(args: argparse.Namespace) -> int:
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
    )
    watch = MasterWatch(args.master_addr, args.master_timeout, _master_lost).start()
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
        ps = ParameterServerClient(ps_addresses, rpc_timeout_seconds=args.rpc_timeout_seconds)
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
    logging.shutdown()
    os._exit(MASTER_LOST_EXIT_CODE)
