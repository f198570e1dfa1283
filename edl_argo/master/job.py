"""One training job from start to published model: the master's main loop.

It wires the parts together and owns no policy of its own: tasks come from the
:class:`~edl_argo.master.task_dispatcher.TaskDispatcher`, pods from the
:class:`~edl_argo.master.pod_manager.PodManager`, metrics from the
:class:`~edl_argo.master.evaluation.EvaluationService`, the model from
:mod:`~edl_argo.master.export`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edl_argo.errors import ConfigError, JobFailedError
from edl_argo.flags import add_flag, pod_host
from edl_argo.log import get_logger
from edl_argo.master.config import TrainConfig
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.export import model_from_parameter_servers, publish_model
from edl_argo.master.pod_manager import PodManager, PodPolicy
from edl_argo.master.registry import register_master, unregister_master
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.master.training_stats import TrainingLoss
from edl_argo.model import Mode, ModelSpec, load_model_spec
from edl_argo.pods import LocalProcessBackend, PodBackend, PodRole, PodSpec, find_free_port
from edl_argo.progress import ProgressReporter
from edl_argo.proto import master_pb2_grpc
from edl_argo.recordio import ShardReader, list_shards
from edl_argo.rpc.channel import make_server
from edl_argo.storage import open_storage
from edl_argo.worker.data import make_batches
from edl_argo.worker.ps_client import ParameterServerClient

log = get_logger(__name__)

#: How long workers get to exit on their own after the job is done, before they are deleted.
WORKER_EXIT_GRACE_SECONDS = 15.0


def dataset_shards(url: str, flag: str) -> dict[str, int]:
    """Shard key -> record count of every shard under ``url``; :class:`ConfigError` if there are none."""
    storage = open_storage(url)
    shards = {key: ShardReader(storage, key).num_records for key in list_shards(storage)}
    if not shards:
        raise ConfigError(
            f"{flag} {url}: no shards there (expected RecordIO files, e.g. from `edl-argo data`)"
        )
    return shards


@dataclass
class VersionTracker:
    """The newest model version any worker reported."""

    version: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, version: int) -> int:
        with self._lock:
            self.version = max(self.version, version)
            return self.version


class TrainingJob:
    """Runs one job: start the master service and pods, dispatch until done, export, clean up."""

    def __init__(self, config: TrainConfig, backend: PodBackend | None = None) -> None:
        self.config = config
        self.spec: ModelSpec = load_model_spec(config.model_def)
        self.training_shards = dataset_shards(config.training_data, "--training-data")
        self.validation_shards = (
            dataset_shards(config.validation_data, "--validation-data") if config.validation_data else {}
        )
        self.output = open_storage(config.output)
        self.versions = VersionTracker()
        self.training_loss = TrainingLoss()
        self.evaluation = EvaluationService(
            self.spec.eval_metrics_fn, self.validation_shards, config.evaluation_steps
        )
        self.dispatcher = TaskDispatcher(
            self.training_shards,
            DispatcherConfig(
                records_per_task=config.records_per_task,
                num_epochs=config.num_epochs,
                shuffle=config.shuffle,
                seed=config.seed,
                max_task_retries=config.max_task_retries,
            ),
            on_evaluation_complete=self.evaluation.round_complete,
        )
        self.evaluation.dispatcher = self.dispatcher
        self.backend = backend or _default_backend(config)
        self.host = pod_host()
        k8s = config.kubernetes
        self.ps_ports = [
            k8s.ps_port_of(i) if k8s else find_free_port(self.host) for i in range(config.num_ps)
        ]
        self.pods: PodManager | None = None
        self._server: Any = None
        self._master_address = ""

    # ------------------------------------------------------------------ pod commands

    def _ps_addresses(self) -> str:
        return ",".join(self.backend.address(PodRole.PS, i) for i in range(self.config.num_ps))

    def ps_spec(self, ps_id: int) -> PodSpec:
        c = self.config
        command = [
            "edl-argo", "ps",
            "--ps-id", str(ps_id),
            "--num-ps", str(c.num_ps),
            "--port", str(self.ps_ports[ps_id]),
            "--model-def", c.model_def,
            "--grads-to-wait", str(c.grads_to_wait),
            "--sync-version-tolerance", str(c.sync_version_tolerance),
            "--checkpoint-steps", str(c.checkpoint_steps),
            "--log-level", c.log_level,
        ]  # fmt: skip
        if c.checkpoint_steps:
            command += ["--checkpoint-dir", c.checkpoint_dir]
        if c.use_async:
            command.append("--use-async")
        if c.lr_staleness_modulation:
            command.append("--lr-staleness-modulation")
        return PodSpec(PodRole.PS, ps_id, tuple(command), port=self.ps_ports[ps_id])

    def worker_spec(self, worker_id: int) -> PodSpec:
        c = self.config
        command = (
            "edl-argo", "worker",
            "--worker-id", str(worker_id),
            "--master-addr", self._master_address,
            "--ps-addrs", self._ps_addresses(),
            "--model-def", c.model_def,
            "--minibatch-size", str(c.minibatch_size),
            "--evaluation-steps", str(c.evaluation_steps),
            "--log-level", c.log_level,
        )  # fmt: skip
        if c.pipelined:
            command += ("--pipelined",)
        return PodSpec(PodRole.WORKER, worker_id, command)

    # ------------------------------------------------------------------ lifecycle

    def _on_version(self, version: int) -> None:
        self.evaluation.on_model_version(self.versions.observe(version))

    def _start_master_service(self) -> None:
        self._server = make_server()
        servicer = MasterServicer(
            self.dispatcher,
            self.evaluation,
            {
                TaskType.TRAINING: self.config.training_data,
                TaskType.EVALUATION: self.config.validation_data,
                TaskType.PREDICTION: "",
            },
            current_version=lambda: self.versions.version,
            on_version=self._on_version,
            scale_workers=lambda n: self.pods.scale_workers(n) if self.pods else n,
            training_loss=self.training_loss,
        )
        master_pb2_grpc.add_MasterServicer_to_server(servicer, self._server)
        port = self._server.add_insecure_port(f"{self.host}:{self.config.master_port}")
        self._server.start()
        self._master_address = f"{self.host}:{port}"
        register_master(self.config.job_name, self._master_address)
        log.info("master_started", job=self.config.job_name, address=self._master_address)

    def run(self) -> dict[str, Any]:
        """Train to completion and publish the model; returns the metrics written to metrics.json."""
        started = time.time()
        c = self.config
        log.info(
            "job_started",
            job=c.job_name,
            training_shards=len(self.training_shards),
            records=sum(self.training_shards.values()),
            epochs=c.num_epochs,
            workers=c.num_workers,
            ps=c.num_ps,
            mode="async" if c.use_async else f"sync(grads_to_wait={c.grads_to_wait})",
        )
        self._start_master_service()
        self.pods = PodManager(
            self.backend,
            PodPolicy(c.num_workers, c.num_ps, c.max_worker_relaunches, c.max_ps_relaunches),
            self.dispatcher,
            self.worker_spec,
            self.ps_spec,
        )
        progress = ProgressReporter(f"train {c.job_name}")
        try:
            self._remove_leftover_pods()
            self.pods.start()
            self._dispatch_until_done(progress)
            metrics = self._metrics(started)
            self._wait_for_workers()
            self._export(metrics)
            log.info(
                "job_succeeded",
                job=c.job_name,
                wall_time=round(time.time() - started, 1),
                **metrics["final_metrics"],
            )
            return metrics
        finally:
            progress.close()
            self.backend.close(grace_seconds=2.0)
            self._server.stop(grace=1.0)
            unregister_master(self.config.job_name)

    def _remove_leftover_pods(self) -> None:
        """Delete the pods an earlier master of this job left (a cluster backend adopts and lists them)
        and wait until they are gone: their tasks died with that master. PSes restore their checkpoints
        when started again."""
        leftovers = self.backend.list_pods()
        if leftovers:
            log.warning(
                "leftover_pods_removed", job=self.config.job_name, pods=",".join(p.name for p in leftovers)
            )
        for pod in leftovers:
            self.backend.delete(pod.role, pod.pod_id, reason="Leftover")
        deadline = time.monotonic() + 120
        while self.backend.list_pods() and time.monotonic() < deadline:
            self.backend.events(timeout=0.5)

    def _dispatch_until_done(self, progress: ProgressReporter) -> None:
        assert self.pods is not None
        while True:
            self.pods.handle(self.backend.events(timeout=0.5))
            for _task, worker_id in self.dispatcher.reclaim_timed_out_tasks():
                self.pods.restart_stuck_worker(worker_id)
            progress.update(*self.dispatcher.progress())
            failure = self.dispatcher.failure or self.pods.failure
            if failure is not None:
                raise failure
            if self.dispatcher.finished and self.evaluation.final_done:
                return

    def _wait_for_workers(self) -> None:
        assert self.pods is not None
        deadline = time.monotonic() + WORKER_EXIT_GRACE_SECONDS
        while self.pods.live_workers and time.monotonic() < deadline:
            self.pods.handle(self.backend.events(timeout=0.5))

    def _metrics(self, started: float) -> dict[str, Any]:
        assert self.pods is not None
        accounting = self.dispatcher.accounting()
        return {
            "job_name": self.config.job_name,
            "status": "succeeded",
            "final_metrics": self.evaluation.final_metrics,
            "evaluations": [
                {
                    "model_version": r.model_version,
                    "metrics": r.metrics,
                    "records": r.records,
                    "final": r.final,
                }
                for r in self.evaluation.history
            ],
            "model_version": self.versions.version,
            "records_per_epoch": accounting.records_per_epoch,
            "records_done_per_epoch": {str(k): v for k, v in accounting.records_done_per_epoch.items()},
            "records_trained_twice": accounting.records_trained_twice,
            "training_loss_per_epoch": {str(k): v for k, v in self.training_loss.per_epoch().items()},
            "task_requeues": accounting.requeues,
            "relaunches": {
                "worker": self.pods.worker_relaunches,
                "ps": self.pods.ps_relaunches,
                "events": [vars(r) for r in self.pods.relaunches],
            },
            "wall_time_seconds": round(time.time() - started, 3),
        }

    def _sample_features(self) -> Any:
        storage = open_storage(self.config.training_data)
        shard = next(iter(self.training_shards))
        records = ShardReader(storage, shard).read(
            0, min(self.config.minibatch_size, self.training_shards[shard])
        )
        features, _labels = next(iter(make_batches(self.spec, records, Mode.EVALUATION, len(records))))
        return features

    def _export(self, metrics: dict[str, Any]) -> None:
        ps = ParameterServerClient(self._ps_addresses().split(","), retry_budget_seconds=60)
        try:
            model = model_from_parameter_servers(self.spec, ps, self._sample_features())
        finally:
            ps.close()
        publish_model(self.output, model, metrics, self.config.to_json())


def run_train(args: Any) -> int:
    from edl_argo.master.config import config_from_args

    config = config_from_args(args)
    if args.yaml:
        from edl_argo.master.dry_run import render_train_manifests

        print(render_train_manifests(config), end="")
        return 0
    try:
        metrics = TrainingJob(config).run()
    except JobFailedError as error:
        log.error("job_failed", job=config.job_name, error=str(error))
        raise
    if args.metrics_output:
        Path(args.metrics_output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.metrics_output).write_text(json.dumps(metrics["final_metrics"], sort_keys=True))
    final = " ".join(f"{k}={v:.4f}" for k, v in metrics["final_metrics"].items())
    print(
        f"job {config.job_name} succeeded: model at {config.output.rstrip('/')}/model {final}",
        file=sys.stdout,
    )
    return 0


def _default_backend(config: TrainConfig) -> PodBackend:
    if config.backend != "kubernetes":
        return LocalProcessBackend(config.job_name)
    if config.kubernetes is None:
        raise ConfigError("--backend kubernetes needs its settings (TrainConfig.kubernetes)")
    from edl_argo.pods.kubernetes import KubernetesBackend  # the client is slow to import: only when used

    return KubernetesBackend(config.job_name, config.kubernetes)


def register(subparsers: Any) -> None:
    from edl_argo.master.config import add_train_flags

    parser = subparsers.add_parser("train", help="run an elastic training job (this process is the master)")
    add_train_flags(parser)
    add_flag(parser, "--metrics-output", default="", metavar="PATH", help="also write final metrics as JSON")
    parser.set_defaults(run=run_train)
