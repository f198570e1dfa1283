"""One training job from start to published model: the master's main loop.

It wires the parts together and owns no policy of its own: tasks come from the
:class:`~edl_argo.master.task_dispatcher.TaskDispatcher`, pods from the
:class:`~edl_argo.master.pod_manager.PodManager`, metrics from the
:class:`~edl_argo.master.evaluation.EvaluationService`, the model from
:mod:`~edl_argo.master.export`.

**Failover.** The job's state is saved in its ``--master-state`` (default ``--output``) as it goes
(:mod:`edl_argo.master.state_store`).
A master started again for the same job (same ``--job-name`` and ``--output``, e.g. by Argo's
retryStrategy, or by hand after it was killed) finds it and continues: it adopts the pods the old master
left running (:meth:`~edl_argo.pods.PodBackend.adopt`), restores the dispatcher (tasks held by adopted
workers stay theirs; only those of workers that did not survive are requeued), the evaluations, the model
version, the training loss and the pod bookkeeping, and serves on the same port, so running workers
carry on. PSes that did not survive are started again and restore their checkpoints; without
``--checkpoint-steps`` their parameters would be lost, so the job starts afresh instead. With
AllreduceStrategy the model lives in the workers: the job continues if any worker survived (the group
re-forms around it; round ids come from the clock, so they only grow across masters) or, when none did,
from the group's newest checkpoint; without ``--checkpoint-steps`` it starts afresh. Without a saved
state, pods left by an earlier master are removed and the job starts afresh: checkpoints an earlier run
left in its checkpoint series (``<output>/checkpoints/ps-<id>``, ``allreduce``) are removed too, so a new
run never restores them; nothing else there is touched.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edl_argo.addresses import join_host_port
from edl_argo.collective.membership import survey_member_states
from edl_argo.collective.transport import FRAME_CAP_ENV
from edl_argo.errors import ConfigError, DataFormatError, JobFailedError, StorageError
from edl_argo.flags import add_flag, pod_host
from edl_argo.log import get_logger
from edl_argo.master.config import TrainConfig
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.ledger import PsReport, TrainingLedger
from edl_argo.master.pod_manager import PodManager, PodPolicy
from edl_argo.master.ps_watch import ParameterServerWatch
from edl_argo.master.registry import register_master, unregister_master
from edl_argo.master.rendezvous import RendezvousManager, clock_round_base
from edl_argo.master.state_store import (
    MASTER_THREADS,
    DurableMasterServicer,
    GroupCommit,
    MasterStateStore,
    commit_wait_seconds,
    job_fingerprint,
)
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.master.training_stats import TrainingLoss
from edl_argo.model import Mode, ModelSpec, load_model_spec
from edl_argo.model.source import StagedModel, pin_model_def, stage_model_def
from edl_argo.pods import LocalProcessBackend, PodBackend, PodRole, PodSpec, PodStatus, find_free_port
from edl_argo.progress import ProgressReporter
from edl_argo.proto import master_pb2_grpc
from edl_argo.recordio import ShardReader, open_dataset
from edl_argo.rpc.auth import MASTER_IDENTITY, JobSecret
from edl_argo.rpc.channel import make_server
from edl_argo.stop import stop_on_sigterm
from edl_argo.storage import open_storage

log = get_logger(__name__)

#: How long workers get to exit on their own after the job is done, before they are deleted.
WORKER_EXIT_GRACE_SECONDS = 15.0


def dataset_shards(url: str, flag: str) -> dict[str, int]:
    """Shard key -> record count of every shard the dataset manifest at ``url`` names; DataFormatError
    naming ``flag`` and what is missing if the dataset is incomplete."""
    return open_dataset(open_storage(url), what=flag).records


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

    #: The model its pods run, when ``--model-def`` is in storage (:mod:`edl_argo.model.source`).
    model: StagedModel | None = None

    def __init__(self, config: TrainConfig, backend: PodBackend | None = None) -> None:
        self.config = config
        state_url = config.master_state or config.output
        self.model = stage_model_def(config.model_def, state_url, shared=config.kubernetes is not None)
        self.spec: ModelSpec = load_model_spec(self.pod_model_def, config.model_options)
        if config.scale_lr_by_world_size:
            from edl_argo.collective.learning_rate import check_world_size_scaling  # TensorFlow: see cli

            check_world_size_scaling(self.spec.optimizer)
        # Each shard's version is pinned here: tasks carry it, and workers read only that version.
        self.training_data = open_dataset(open_storage(config.training_data), what="--training-data")
        self.training_shards = self.training_data.records
        validation = config.validation_data
        self.validation_data = (
            open_dataset(open_storage(validation), what="--validation-data") if validation else None
        )
        self.validation_shards = self.validation_data.records if self.validation_data else {}
        if config.allreduce and len(self._sample_batch(Mode.TRAINING)) == 3:
            raise ConfigError(
                f"feed of {config.model_def} yields (features, labels, sample_weights) in training: "
                "AllreduceStrategy does not apply sample weights; use ParameterServerStrategy"
            )
        self.output = open_storage(config.output)
        self.output.exists("model")  # reach --output now: a missing bucket or a denial fails here
        self.versions = VersionTracker()
        self.training_loss = TrainingLoss()
        self.ledger = TrainingLedger(config.minibatch_size, 1 if config.use_async else config.grads_to_wait)
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
                task_timeout_floor=config.min_task_timeout_seconds,
            ),
            on_evaluation_complete=self.evaluation.round_complete,
        )
        self.evaluation.dispatcher = self.dispatcher
        fingerprint = job_fingerprint(config, self.training_shards, self.validation_shards)
        state_storage = open_storage(config.master_state) if config.master_state else self.output
        self.state_store = MasterStateStore(state_storage, config.job_name, fingerprint)
        self._saved = self.state_store.load()  # what an earlier master of this job saved, if anything
        if self.model is not None:  # a continued job keeps its model, even if the URL changed since
            staged = self.model
            self.model = pin_model_def(staged, state_url, config.job_name, continuing=self._saved is not None)
            if self.model != staged:
                self.spec = load_model_spec(self.pod_model_def)
        if self._saved is not None:
            self._restored_dispatcher(None)  # a corrupt state fails here, before any pod starts
        self._state_writer = GroupCommit(
            self._state, self.state_store.save, wait_seconds=commit_wait_seconds(config.rpc_timeout_seconds)
        )
        self.backend = backend or _default_backend(config)
        self.job_secret = self._job_secret()
        self.backend.use_job_secret(self.job_secret)
        self.credential = self.job_secret.credential(MASTER_IDENTITY)
        self.host = pod_host()
        k8s = config.kubernetes
        self.ps_ports = (
            [int(port) for port in self._saved["ps_ports"]]
            if self._saved is not None
            else [k8s.ps_port_of(i) if k8s else find_free_port(self.host) for i in range(config.num_ps)]
        )
        self.pods: PodManager | None = None
        self._ps_watch: ParameterServerWatch | None = None
        # AllreduceStrategy: the workers' group, and the trained state fetched from it before they exit.
        self.rendezvous = RendezvousManager(clock_round_base()) if config.allreduce else None
        if self.rendezvous is not None and self._saved is not None:
            self.rendezvous.restore(self._saved.get("allreduce_group"))
        self._group_state: Any = None
        self._replicas: dict[str, Any] = {}
        self._server: Any = None
        # Parameter servers: their status once every training task is done (pending pushes applied).
        self._ps_status: list[Any] | None = None
        self._ps_status_lock = threading.Lock()
        self._master_address = ""
        self._master_port = 0
        self._started = 0.0

    def _job_secret(self) -> JobSecret:
        """The job's secret: the one an earlier master of the job made (kept by the backend, else beside
        the state), or a new one, kept likewise (see :mod:`edl_argo.rpc.auth`)."""
        kept = self.backend.stored_job_secret()
        if kept is None and self._saved is not None and not self.backend.keeps_job_secret:
            kept = self.state_store.load_secret()
        if kept is not None:
            log.info("job_secret_reused", job=self.config.job_name)
            return kept
        secret = JobSecret.generate()
        if not self.backend.keeps_job_secret:
            self.state_store.save_secret(secret)
        return secret

    # ------------------------------------------------------------------ pod commands

    @property
    def pod_model_def(self) -> str:
        """The ``--model-def`` of the job's pods: the staged bundle of a model in storage, else as given."""
        return self.model.pod_model_def if self.model else self.config.model_def

    def _ps_addresses(self) -> str:
        return ",".join(self.backend.address(PodRole.PS, i) for i in range(self.config.num_ps))

    def ps_spec(self, ps_id: int) -> PodSpec:
        c = self.config
        command = [
            "edl-argo", "ps",
            "--ps-id", str(ps_id),
            "--num-ps", str(c.num_ps),
            "--port", str(self.ps_ports[ps_id]),
            "--master-addr", self._master_address,
            "--master-timeout", str(c.master_timeout),
            "--model-def", self.pod_model_def,
            *c.model_options.to_args(),
            "--grads-to-wait", str(c.grads_to_wait),
            "--sync-version-tolerance", str(c.sync_version_tolerance),
            "--checkpoint-steps", str(c.checkpoint_steps),
            "--log-level", c.log_level,
        ]  # fmt: skip
        if c.checkpoint_steps:
            command += ["--checkpoint-dir", c.checkpoints_url]
        if c.use_async:
            command.append("--use-async")
        if c.lr_staleness_modulation:
            command.append("--lr-staleness-modulation")
        return PodSpec(PodRole.PS, ps_id, tuple(command), port=self.ps_ports[ps_id])

    def worker_spec(self, worker_id: int) -> PodSpec:
        c = self.config
        command: tuple[str, ...] = (
            "edl-argo", "worker",
            "--worker-id", str(worker_id),
            "--master-addr", self._master_address,
            "--master-timeout", str(c.master_timeout),
            "--model-def", self.pod_model_def,
            *c.model_options.to_args(),
            "--minibatch-size", str(c.minibatch_size),
            "--evaluation-steps", str(c.evaluation_steps),
            "--nan-loss", c.nan_loss,
            "--rpc-timeout-seconds", str(c.rpc_timeout_seconds),
            "--log-level", c.log_level,
        )  # fmt: skip
        port: int | None = None
        if c.allreduce:
            # In a cluster every pod has its own address, so one declared port (which the job's
            # NetworkPolicy opens) serves every worker; on one machine each worker takes a free port.
            port = c.kubernetes.collective_port if c.kubernetes else None
            command += (
                "--distribution-strategy", c.distribution_strategy,
                "--collective-port", str(port or 0),
                "--collective-timeout-seconds", str(c.collective_timeout_seconds),
            )  # fmt: skip
            if c.scale_lr_by_world_size:
                command += ("--scale-lr-by-world-size",)
            if c.checkpoint_steps:
                command += (
                    "--checkpoint-steps",
                    str(c.checkpoint_steps),
                    "--checkpoint-dir",
                    c.checkpoints_url,
                )
        else:
            command += ("--ps-addrs", self._ps_addresses())
        if c.pipelined:
            command += ("--pipelined",)
        env = (
            {FRAME_CAP_ENV: os.environ[FRAME_CAP_ENV]}
            if c.allreduce and os.environ.get(FRAME_CAP_ENV)
            else {}
        )
        return PodSpec(PodRole.WORKER, worker_id, command, env=env, port=port)

    # ------------------------------------------------------------------ lifecycle

    def _on_version(self, version: int) -> None:
        self.evaluation.on_model_version(self.versions.observe(version))

    def _start_master_service(self, restored_holders: set[int]) -> None:
        self._server = make_server(MASTER_THREADS, self.job_secret, "master")
        servicer = DurableMasterServicer(
            self.dispatcher,
            self.evaluation,
            {
                TaskType.TRAINING: self.config.training_data,
                TaskType.EVALUATION: self.config.validation_data,
                TaskType.PREDICTION: "",
            },
            shard_versions={
                TaskType.TRAINING: self.training_data.versions,
                TaskType.EVALUATION: self.validation_data.versions if self.validation_data else {},
            },
            current_version=lambda: self.versions.version,
            on_version=self._on_version,
            scale_workers=lambda n: self.pods.scale_workers(n) if self.pods else n,
            training_loss=self.training_loss,
            rendezvous=self.rendezvous,
            ready_to_finish=lambda: self.rendezvous is None or self._group_state is not None,
            finish_training=self._apply_pending_updates,
            ledger=self.ledger,
            commit=self._state_writer,
            restored_holders=restored_holders,
        )
        master_pb2_grpc.add_MasterServicer_to_server(servicer, self._server)
        # A restarted master serves where the workers it adopts expect it.
        wanted = int(self._saved["master_port"]) if self._saved is not None else self.config.master_port
        try:
            port = self._server.add_insecure_port(join_host_port(self.host, wanted))
        except RuntimeError:
            port = 0
        if not port or (wanted and port != wanted):
            raise JobFailedError(
                f"the master cannot serve on {join_host_port(self.host, wanted)}: the port is taken"
            )
        self._master_port = port
        self._server.start()
        self._master_address = self.backend.expose_master(join_host_port(self.host, port))
        register_master(self.config.job_name, join_host_port(self.host, port), self.job_secret)
        log.info("master_started", job=self.config.job_name, address=self._master_address)

    def run(self) -> dict[str, Any]:
        """Train to completion and publish the model; returns the metrics written to metrics.json."""
        from edl_argo.master.export import ModelNotPublishedError, publish_kept_model  # TensorFlow: see cli

        c = self.config
        kept = publish_kept_model(self.output, self.state_store.storage) if self._saved is not None else None
        if kept is not None:  # an earlier run trained it and could not publish it
            self.state_store.remove()
            log.info("job_succeeded", job=c.job_name, published="kept_model", **kept.get("final_metrics", {}))
            return kept
        self._started = time.time() if self._saved is None else float(self._saved["started_at"])
        log.info(
            "job_started",
            job=c.job_name,
            training_shards=len(self.training_shards),
            records=sum(self.training_shards.values()),
            epochs=c.num_epochs,
            workers=c.num_workers,
            ps=c.num_ps,
            mode=(
                "allreduce"
                if c.allreduce
                else "async"
                if c.use_async
                else f"sync(grads_to_wait={c.grads_to_wait})"
            ),
        )
        adopted, restored_holders = self._take_over()
        started = self._started
        self._start_master_service(restored_holders)
        self.pods = PodManager(
            self.backend,
            PodPolicy(c.num_workers, c.num_ps, c.max_worker_relaunches, c.max_ps_relaunches),
            self.dispatcher,
            self.worker_spec,
            self.ps_spec,
        )
        progress = ProgressReporter(f"train {c.job_name}")
        try:
            if self._saved is None:
                self.pods.start()
            else:
                self.pods.resume(self._saved["pods"], adopted)
            self._state_writer.start()
            self._state_writer.changed()
            if c.num_ps:
                self._ps_watch = ParameterServerWatch(
                    lambda ps_id: self.backend.address(PodRole.PS, ps_id),
                    c.num_ps,
                    c.rpc_timeout_seconds,
                    credential=self.credential,
                )
            self._dispatch_until_done(progress)
            self._apply_pending_updates()  # when no worker asked for a task after the last one
            metrics = self._metrics(started)
            self._check_accounting(metrics)
            self._wait_for_workers()
            self._export(metrics)
            self._forget_state()
            log.info(
                "job_succeeded",
                job=c.job_name,
                wall_time=round(time.time() - started, 1),
                **metrics["final_metrics"],
            )
            return metrics
        except ModelNotPublishedError:
            raise  # the state stays with the kept model: the next run publishes it
        except JobFailedError:
            self._forget_state()  # failed for good: a new run starts afresh
            raise
        except StorageError as error:  # the store failed while the job ran: a run-time failure (exit 1)
            raise JobFailedError(f"job {c.job_name} failed while running: {error}") from error
        finally:
            progress.close()
            if self._ps_watch is not None:
                self._ps_watch.close()
            self._state_writer.close()
            self.backend.close(grace_seconds=2.0)
            self._server.stop(grace=1.0)
            unregister_master(self.config.job_name)

    # ------------------------------------------------------------------ failover

    def _state(self) -> dict[str, Any]:
        """What a restarted master continues from (:data:`~edl_argo.master.state_store.STATE_PARTS`).

        The dispatcher's snapshot comes before the evaluation's, as :meth:`EvaluationService.snapshot`
        requires."""
        assert self.pods is not None
        return {
            "started_at": self._started,
            "master_port": self._master_port,
            "ps_ports": self.ps_ports,
            "dispatcher": self.dispatcher.snapshot(),
            "evaluation": self.evaluation.snapshot(),
            "model_version": self.versions.version,
            "training_loss": self.training_loss.snapshot(),
            "ledger": self.ledger.snapshot(),
            "pods": self.pods.snapshot(),
            # Not in STATE_PARTS: a state saved before it existed is still read.
            "allreduce_group": self.rendezvous.snapshot() if self.rendezvous is not None else None,
        }

    def _restored_dispatcher(self, live_workers: Collection[int] | None) -> TaskDispatcher:
        """The saved dispatcher, with the tasks of workers not in ``live_workers`` requeued (None: as if
        every worker had survived, to check the state); the state's DataFormatError if it is corrupt."""
        assert self._saved is not None
        try:
            snapshot = self._saved["dispatcher"]
            if live_workers is None:
                live_workers = {int(entry["worker_id"]) for entry in snapshot["doing"]}
            return TaskDispatcher.restore(
                snapshot, on_evaluation_complete=self.evaluation.round_complete, live_workers=live_workers
            )
        except (DataFormatError, KeyError, TypeError, ValueError) as error:
            raise self.state_store.corrupt(f"dispatcher: {error}") from None

    def _take_over(self) -> tuple[list[PodStatus], set[int]]:
        """Continue from the saved state, if any: adopt the old master's pods and restore every part.
        Returns the adopted pods and the adopted workers that hold tasks. Without a state (or one that
        cannot be continued), remove the pods an earlier master left and start afresh."""
        c, saved = self.config, self._saved
        adopted = self.backend.adopt()
        if saved is None:
            self._remove_leftover_pods(adopted)
            self._remove_stale_checkpoints()
            return [], set()
        surviving_ps = {pod.pod_id for pod in adopted if pod.role is PodRole.PS}
        lost_ps = sorted(set(range(c.num_ps)) - surviving_ps)
        workers = {pod.pod_id for pod in adopted if pod.role is PodRole.WORKER}
        # The model lives in the PSes (restorable from checkpoints) or, with AllreduceStrategy, in the
        # workers: any surviving worker holds it and hands it to the others when the group re-forms, and
        # without one the group starts from its newest checkpoint.
        reason = ""
        if c.allreduce and not workers and not c.checkpoint_steps:
            reason = "AllreduceStrategy: no worker survived to hold the model, and no --checkpoint-steps"
        elif lost_ps and not c.checkpoint_steps:
            reason = f"PS {lost_ps} lost without --checkpoint-steps"
        if reason:
            log.warning("master_state_discarded", job=c.job_name, state=self.state_store.url, reason=reason)
            self._saved = None
            self._started = time.time()
            self._remove_leftover_pods(adopted)
            self._remove_stale_checkpoints()
            return [], set()
        try:
            self.dispatcher = self._restored_dispatcher(workers)
            self.evaluation.dispatcher = self.dispatcher
            self.evaluation.restore(saved["evaluation"])
            self.versions.observe(int(saved["model_version"]))
            self.training_loss.restore(saved["training_loss"])
            self.ledger.restore(saved["ledger"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise self.state_store.corrupt(f"{type(error).__name__}: {error}") from None
        holders = {int(entry["worker_id"]) for entry in saved["dispatcher"]["doing"]} & workers
        accounting = self.dispatcher.accounting()
        log.info(
            "master_state_restored",
            job=c.job_name,
            state=self.state_store.url,
            tasks_done=accounting.tasks_done,
            tasks_total=accounting.tasks_total,
            tasks_requeued=accounting.requeues["master_restarted"]
            - int(saved["dispatcher"]["requeues"]["master_restarted"]),
            workers_adopted=len(workers),
            ps_adopted=len(surviving_ps),
            workers_holding_tasks=len(holders),
            model_version=self.versions.version,
            evaluations=len(self.evaluation.history),
        )
        return adopted, holders

    def _remove_stale_checkpoints(self) -> None:
        """A job that starts afresh never restores the checkpoints an earlier run of it left. Only the
        checkpoints its own holders would restore are removed, by name (the series ``ps-<id>`` of its PSes,
        or ``allreduce``); anything else under ``--checkpoint-dir`` is left alone."""
        from edl_argo.collective.checkpoint import group_checkpoints
        from edl_argo.ps.checkpoint import ps_checkpoints

        c = self.config
        if not c.checkpoint_steps:
            return
        storage = open_storage(c.checkpoints_url)
        own = (
            [group_checkpoints(storage)]
            if c.allreduce
            else [ps_checkpoints(storage, i) for i in range(c.num_ps)]
        )
        removed = sum(series.clear() for series in own)
        if removed:
            log.warning(
                "stale_checkpoints_removed", job=c.job_name, checkpoints=c.checkpoints_url, objects=removed
            )

    def _forget_state(self) -> None:
        """The job is over: stop saving its state and remove it."""
        self._state_writer.close()
        self.state_store.remove()

    def _remove_leftover_pods(self, leftovers: list[PodStatus]) -> None:
        """Delete the pods an earlier master of this job left (adopted from the backend) and wait until
        they are gone: their tasks died with that master. PSes restore their checkpoints when started
        again."""
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
            events = self.backend.events(timeout=0.5)
            self.pods.handle(events)
            if events:
                self._state_writer.changed()
            if self.rendezvous is not None:
                for event in events:
                    if event.role is PodRole.WORKER and event.phase.is_terminal:
                        self.rendezvous.remove(event.pod_id, event.reason)
            for _task, worker_id in self.dispatcher.reclaim_timed_out_tasks():
                self.pods.restart_stuck_worker(worker_id)
                self._state_writer.changed()
            for ps_id in self._ps_watch.silent() if self._ps_watch is not None else ():
                self.pods.restart_stuck_ps(ps_id)
            progress.update(*self.dispatcher.progress())
            if self._state_writer.failure is not None:
                raise self._state_writer.failure
            failure = self.dispatcher.failure or self.pods.failure
            if failure is not None:
                raise failure
            if self.dispatcher.finished and self.evaluation.final_done:
                if self.rendezvous is None:
                    return
                if self._group_state is None:
                    # Before any worker is told DONE: the group's trained state, for the export.
                    self._fetch_group_state()
                return

    def _fetch_group_state(self) -> None:
        """Read every member's state; keep the newest for the export and record how far replicas differ."""
        assert self.rendezvous is not None
        current = self.rendezvous.current
        survey = survey_member_states(
            [m.address for m in current.members], token=self.job_secret.collective_token()
        )
        newest = survey.newest
        self._replicas = {
            "members_compared": survey.members_compared,
            "max_abs_difference": survey.max_abs_difference,
            "versions": survey.versions,
            "final_round": current.round_id,
            "state_restores": self.rendezvous.restores,
            "steps_lost": self.rendezvous.steps_lost,
        }
        log.info(
            "group_state_fetched", version=newest.version, **{k: str(v) for k, v in self._replicas.items()}
        )
        self.versions.observe(newest.version)
        self._group_state = newest

    def _apply_pending_updates(self) -> None:
        """Training is over: every PS applies the pushes its synchronous step still waits for (fewer than
        ``grads_to_wait`` arrived), so the final evaluation and the export see them; once per master."""
        if self.config.allreduce:
            return
        from edl_argo.worker.ps_client import ParameterServerClient

        with self._ps_status_lock:
            if self._ps_status is not None:
                return
            ps = ParameterServerClient(
                self._ps_addresses().split(","), retry_budget_seconds=60, credential=self.credential
            )
            try:
                self._ps_status = ps.status(apply_pending=True)
            finally:
                ps.close()
        applied = sum(s.pending_applied for s in self._ps_status)
        if applied:
            log.info("pending_updates_applied", pushes=applied, versions=[s.version for s in self._ps_status])
        self._on_version(max(s.version for s in self._ps_status))

    def _check_accounting(self, metrics: dict[str, Any]) -> None:
        """Fail the job when what the workers trained does not add up (:mod:`edl_argo.master.ledger`)."""
        accounting = self.dispatcher.accounting()
        problems = self.ledger.epoch_problems(accounting)
        reports = [
            PsReport(ps_id, s.version, s.pushes_refused, s.restored_version)
            for ps_id, s in enumerate(self._ps_status or [])
        ]
        section, ps_problems = self.ledger.ps_updates(accounting, reports)
        metrics["accounting"] = section
        problems += ps_problems
        log.info(
            "accounting_checked",
            minibatches=section["minibatches_trained"],
            ps_versions=[r.version for r in reports],
            updates_lost_to_rollback=section["updates_lost_to_rollback"],
            problems=len(problems),
        )
        if problems:
            raise JobFailedError("; ".join(problems))

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
            "nan_batches_skipped": self.training_loss.nan_batches_skipped,
            "task_requeues": accounting.requeues,
            "relaunches": {
                "worker": self.pods.worker_relaunches,
                "ps": self.pods.ps_relaunches,
                "events": [vars(r) for r in self.pods.relaunches],
            },
            "wall_time_seconds": round(time.time() - started, 3),
            **({"allreduce_replicas": self._replicas} if self._replicas else {}),
        }

    def _sample_batch(self, mode: str) -> Any:
        """The first minibatch of the training data, as ``feed`` makes it for ``mode``."""
        from edl_argo.worker.data import make_batches  # TensorFlow: imported when run, not for --help

        storage = open_storage(self.config.training_data)
        shard = next(iter(self.training_shards))
        records = ShardReader(storage, shard).read(
            0, min(self.config.minibatch_size, self.training_shards[shard])
        )
        return next(iter(make_batches(self.spec, records, mode, len(records))))

    def _sample_features(self) -> Any:
        return self._sample_batch(Mode.EVALUATION)[0]

    def _export(self, metrics: dict[str, Any]) -> None:
        from edl_argo.master.export import model_from_parameter_servers, model_from_state, publish_model
        from edl_argo.worker.ps_client import ParameterServerClient

        if self._group_state is not None:
            model = model_from_state(self.spec, self._group_state.values, self._sample_features())
        else:
            ps = ParameterServerClient(
                self._ps_addresses().split(","),
                retry_budget_seconds=60,
                rpc_timeout_seconds=self.config.rpc_timeout_seconds,
                credential=self.credential,
            )
            try:
                model = model_from_parameter_servers(self.spec, ps, self._sample_features())
            finally:
                ps.close()
        flags = {**self.config.to_json(), **(self.model.flags() if self.model else {})}
        publish_model(self.output, model, metrics, flags, keep_in=self.state_store.storage)


def run_train(args: Any) -> int:
    from edl_argo.master.config import config_from_args

    config = config_from_args(args)
    if args.yaml:
        from edl_argo.master.dry_run import render_train_manifests

        print(render_train_manifests(config), end="")
        return 0
    if config.backend == "local":
        # Local pods are this master's to stop. On Kubernetes a SIGTERM may be a node drain after which
        # Argo retries the master, which then adopts the pods: they stay (the step's exit hook and
        # --master-timeout remove them once the step has ended for good).
        stop_on_sigterm()
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
        return LocalProcessBackend(config.job_name, host=pod_host())
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
