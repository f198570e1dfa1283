"""One training job from start to published model: the master's main loop.

It wires the parts together and owns no policy of its own: tasks come from the
:class:`~edl_argo.master.task_dispatcher.TaskDispatcher`, pods from the
:class:`~edl_argo.master.pod_manager.PodManager`, metrics from the
:class:`~edl_argo.master.evaluation.EvaluationService`, the model from
:mod:`~edl_argo.master.export`. It is built from parts already read (the model, the datasets, the saved
state: :mod:`~edl_argo.master.job_parts`) and does no I/O when constructed; ``TrainingJob.load(config)``
reads them and builds it. Its pods' command lines come from :mod:`~edl_argo.master.pod_commands`.

**Failover.** The job's state is saved in its ``--master-state`` (default ``--output``) as it goes
(:mod:`edl_argo.master.state_store`). A master started again for the same job (same ``--job-name`` and
``--output``, e.g. by Argo's retryStrategy, or by hand after it was killed) continues it: it adopts the
pods the old master left running, restores its parts and serves on the same port, so running workers carry
on (:mod:`edl_argo.master.failover`: what is saved, when a job starts afresh instead, and what a worker
whose reply was lost with the old master gets).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from edl_argo.addresses import join_host_port
from edl_argo.collective.membership import survey_member_states
from edl_argo.errors import JobFailedError, StorageError
from edl_argo.flags import pod_host
from edl_argo.log import get_logger
from edl_argo.master.config import TrainConfig
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.failover import MasterParts, own_checkpoint_series, state_to_save, take_over
from edl_argo.master.job_parts import JobParts, default_backend, load_job_parts, sample_batch
from edl_argo.master.ledger import PsReport, TrainingLedger, accounting_failure
from edl_argo.master.metrics import (
    THROUGHPUT_WINDOW_SECONDS,
    JobView,
    MetricsServer,
    PodCounts,
    TrainingBoard,
    count_pods,
    metrics_registry,
)
from edl_argo.master.pod_commands import ps_pod, worker_pod
from edl_argo.master.pod_manager import PodManager, PodPolicy
from edl_argo.master.pod_template import early_pod_template
from edl_argo.master.ps_watch import ParameterServerWatch
from edl_argo.master.registry import register_master, unregister_master
from edl_argo.master.rendezvous import RendezvousManager, clock_round_base
from edl_argo.master.request_checks import RequestBounds
from edl_argo.master.serving import master_server_limits
from edl_argo.master.state_store import (
    DurableMasterServicer,
    GroupCommit,
    commit_wait_seconds,
    save_waiters,
)
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.master.tensorboard_log import EventFileWriter
from edl_argo.master.throughput import ThroughputMeter
from edl_argo.master.training_stats import TrainingLoss, TrainingReport
from edl_argo.master.worker_scaler import WorkerRange, WorkerScaler
from edl_argo.model import Mode, ModelSpec
from edl_argo.pods import PodBackend, PodRole, PodSpec, release_ports
from edl_argo.progress import ProgressReporter
from edl_argo.proto import master_pb2_grpc
from edl_argo.readers import open_data, parse_data_options, worker_spec_json
from edl_argo.rpc.auth import MASTER_IDENTITY, JobSecret, server_interceptor
from edl_argo.rpc.channel import make_server
from edl_argo.rpc.tls import TlsFiles, add_port, load_tls_dir

log = get_logger(__name__)

#: How long workers get to exit on their own after the job is done, before they are deleted.
WORKER_EXIT_GRACE_SECONDS = 15.0


def dataset_shards(url: str, flag: str, data_format: str = "", data_options: str = "") -> dict[str, int]:
    """Shard key -> record count of every shard of the dataset at ``url``; DataFormatError naming ``flag``
    and what is missing if the dataset is incomplete."""
    return open_data(url, data_format, parse_data_options(data_options), what=flag).records


@dataclass
class VersionTracker:
    """The newest model version any worker reported."""

    version: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, version: int) -> int:
        with self._lock:
            self.version = max(self.version, version)
            return self.version


#: An AllreduceStrategy job reclaims a task only after this many collective timeouts (see
#: :func:`task_timeout_floor`).
COLLECTIVE_TIMEOUTS_PER_TASK_TIMEOUT = 2


def task_timeout_floor(config: TrainConfig) -> float:
    """The least time a worker may hold a task before the master reclaims it and replaces the worker.

    ``--min-task-timeout-seconds``, except with AllreduceStrategy: there a member blocked in a collective on a
    hung peer holds its task until the collective times out and the group re-forms without the peer, so its
    task must not time out first (that replaced the healthy member too, and a group that loses every member
    starts again from its last checkpoint, or from scratch). It is at least twice the collective timeout.
    """
    if not config.allreduce:
        return config.min_task_timeout_seconds
    return max(
        config.min_task_timeout_seconds,
        COLLECTIVE_TIMEOUTS_PER_TASK_TIMEOUT * config.collective_timeout_seconds,
    )


class TrainingJob:
    """Runs one job: start the master service and pods, dispatch until done, export, clean up."""

    def __init__(
        self,
        config: TrainConfig,
        parts: JobParts,
        backend: PodBackend,
        job_secret: JobSecret,
        tls: TlsFiles | None = None,
        *,
        save_secret: bool = False,
    ) -> None:
        """A job of ``config`` from its already-read ``parts`` (:func:`load_job_parts`), its pods run by
        ``backend`` with ``job_secret`` (:mod:`edl_argo.rpc.auth`, handed to the backend already), its
        services served over TLS with ``tls`` (:mod:`edl_argo.rpc.tls`; None: plaintext); no I/O here
        (:meth:`load` reads the parts, the TLS files and establishes the secret)."""
        self.config = config
        self.model = parts.model
        self.spec: ModelSpec = parts.spec
        self.training_data = parts.training_data
        self.training_shards = parts.training_data.records
        self.validation_data = parts.validation_data
        self.validation_shards = parts.validation_data.records if parts.validation_data else {}
        self.output = parts.output
        self.state_store = parts.state_store
        self._saved = parts.saved
        self.backend = backend
        self.ps_ports = list(parts.ps_ports)
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
                task_timeout_floor=task_timeout_floor(config),
            ),
            on_evaluation_complete=self.evaluation.round_complete,
        )
        self.evaluation.dispatcher = self.dispatcher
        self._state_writer = GroupCommit(
            self._state, self.state_store.save, wait_seconds=commit_wait_seconds(config.rpc_timeout_seconds)
        )
        self.job_secret = job_secret
        # A new secret is kept beside the state just before the first pod starts: a job refused before
        # then (a taken --metrics-port) leaves nothing behind.
        self._save_secret = save_secret
        self.credential = job_secret.credential(MASTER_IDENTITY)
        self.tls = tls
        self.host = pod_host()
        self.pods: PodManager | None = None
        self.scaler: WorkerScaler | None = None
        self._ps_watch: ParameterServerWatch | None = None
        # AllreduceStrategy: the workers' group, and the trained state fetched from it before they exit.
        self.rendezvous = RendezvousManager(clock_round_base()) if config.allreduce else None
        self._group_state: Any = None
        self._replicas: dict[str, Any] = {}
        self._server: Any = None
        # Parameter servers: their status once every training task is done (pending pushes applied).
        self._ps_status: list[Any] | None = None
        self._ps_status_lock = threading.Lock()
        self._master_address = ""
        self._master_port = 0
        self._started = 0.0
        # Live metrics (edl_argo.master.metrics): read on each scrape, and the TensorBoard scalars.
        self.throughput = ThroughputMeter()
        self.metrics_view = JobView(
            config.job_name,
            dispatcher=lambda: self.dispatcher,
            evaluation=self.evaluation,
            training_loss=self.training_loss,
            throughput=self.throughput,
            model_version=lambda: self.versions.version,
            pod_counts=self._pod_counts,
            last_save=lambda: self._state_writer.last_save,
            saves=lambda: self._state_writer.saves,
        )
        self.metrics_registry = metrics_registry(self.metrics_view)
        self._metrics_server: MetricsServer | None = None
        self._board: TrainingBoard | None = None

    @classmethod
    def load(cls, config: TrainConfig, backend: PodBackend | None = None) -> TrainingJob:
        """Read the job's parts (model, datasets, saved state: :func:`load_job_parts`), establish its
        secret (:func:`establish_job_secret`) and build it; ``backend``: where pods run (default:
        ``config.backend``'s)."""
        # A local job's pod template (this process's: edl_argo.pods.prefork) imports TensorFlow while this
        # process reads the job's parts, unless an earlier job of this process started it.
        template = early_pod_template(config) if backend is None else None
        parts = load_job_parts(config)  # a corrupt state fails here, before any backend or pod exists
        tls = load_tls_dir(config.tls_dir) if config.tls_dir else None
        backend = backend or default_backend(config, template)
        if config.kubernetes is not None and config.kubernetes.tls_secret:
            tls = backend.tls_secret(config.kubernetes.tls_secret)
        job_secret, new = establish_job_secret(config, parts, backend)
        backend.use_job_secret(job_secret)
        return cls(config, parts, backend, job_secret, tls, save_secret=new and not backend.keeps_job_secret)

    # ------------------------------------------------------------------ pod commands

    @property
    def pod_model_def(self) -> str:
        """The ``--model-def`` of the job's pods: the staged bundle of a model in storage, else as given."""
        return self.model.pod_model_def if self.model else self.config.model_def

    def _ps_addresses(self) -> str:
        return ",".join(self.backend.address(PodRole.PS, i) for i in range(self.config.num_ps))

    def ps_spec(self, ps_id: int) -> PodSpec:
        port = self.ps_ports[ps_id]
        return ps_pod(
            self.config, ps_id, port=port, master_address=self._master_address, model_def=self.pod_model_def
        )

    def worker_spec(self, worker_id: int) -> PodSpec:
        ps_addresses = "" if self.config.allreduce else self._ps_addresses()
        return worker_pod(
            self.config,
            worker_id,
            master_address=self._master_address,
            model_def=self.pod_model_def,
            ps_addresses=ps_addresses,
            training_data_spec=worker_spec_json(self.training_data),
        )

    # ------------------------------------------------------------------ lifecycle

    def _on_version(self, version: int) -> None:
        self.evaluation.on_model_version(self.versions.observe(version))

    def _request_bounds(self) -> RequestBounds:
        """What a request to this job's master may carry: ids of the workers its pods run, at most
        ``--max-workers`` workers, and model versions at most the job's minibatches past the newest known."""
        c = self.config
        minibatches = sum(-(-records // c.minibatch_size) for records in self.training_shards.values())
        return RequestBounds(
            is_worker=lambda worker_id: self.pods is None or self.pods.is_worker(worker_id),
            max_workers=c.worker_limit,
            version_tolerance=max(1, minibatches * c.num_epochs),
        )

    def _start_master_service(self, wanted: int) -> None:
        """Serve the master's service on port ``wanted`` (0: any free port)."""
        self._server = make_server(
            limits=master_server_limits(self.config.rpc_timeout_seconds, self.config.worker_limit),
            interceptors=[server_interceptor(self.job_secret, "master")],
        )
        servicer = DurableMasterServicer(
            self.dispatcher,
            self.evaluation,
            {
                TaskType.TRAINING: self.config.training_data,
                TaskType.EVALUATION: self.config.validation_data,
                TaskType.PREDICTION: "",
            },
            datasets={
                TaskType.TRAINING: self.training_data,
                **({TaskType.EVALUATION: self.validation_data} if self.validation_data else {}),
            },
            current_version=lambda: self.versions.version,
            on_version=self._on_version,
            scale_workers=lambda n: self.pods.request_workers(n) if self.pods else n,
            training_loss=self.training_loss,
            rendezvous=self.rendezvous,
            ready_to_finish=lambda: self.rendezvous is None or self._group_state is not None,
            finish_training=self._apply_pending_updates,
            ledger=self.ledger,
            bounds=self._request_bounds(),
            commit=self._state_writer,
            save_waiters=save_waiters(self.config.worker_limit),
            on_training_report=self._training_reported,
        )
        master_pb2_grpc.add_MasterServicer_to_server(servicer, self._server)
        try:
            port = add_port(self._server, join_host_port(self.host, wanted), self.tls)
        except RuntimeError:
            port = 0
        if not port or (wanted and port != wanted):
            raise JobFailedError(
                f"the master cannot serve on {join_host_port(self.host, wanted)}: the port is taken"
            )
        self._master_port = port
        self._server.start()
        self._master_address = self.backend.expose_master(join_host_port(self.host, port))
        register_master(
            self.config.job_name,
            join_host_port(self.host, port),
            self.job_secret,
            tls_dir=self.config.tls_dir,
        )
        log.info(
            "master_started", job=self.config.job_name, address=self._master_address, tls=self.tls is not None
        )

    def run(self) -> dict[str, Any]:
        """Train to completion and publish the model; returns the metrics written to metrics.json."""
        from edl_argo.master.export import ModelNotPublishedError, publish_kept_model  # TensorFlow: see cli

        c = self.config
        kept = publish_kept_model(self.output, self.state_store.storage) if self._saved is not None else None
        if kept is not None:  # an earlier run trained it and could not publish it
            self.state_store.remove()
            log.info("job_succeeded", job=c.job_name, published="kept_model", **kept.get("final_metrics", {}))
            return kept
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
        takeover = take_over(c, self.state_store, self._saved, self.backend, self._parts())
        self.dispatcher = takeover.dispatcher
        self._started = started = takeover.started_at
        self._start_master_service(takeover.master_port(c.master_port))  # where adopted workers expect it
        self.pods = PodManager(
            self.backend,
            PodPolicy(
                c.num_workers,
                c.num_ps,
                c.max_worker_relaunches,
                c.max_ps_relaunches,
                relaunch_backoff_seconds=c.relaunch_backoff_seconds,
            ),
            self.dispatcher,
            self.worker_spec,
            self.ps_spec,
            on_worker_stopped=self.rendezvous.remove if self.rendezvous else None,
        )
        self.scaler = WorkerScaler(
            WorkerRange(
                minimum=c.min_workers,
                maximum=c.growth_limit,
                min_workers_timeout=c.min_workers_timeout,
                window_seconds=c.scale_up_window_seconds,
                min_gain=c.scale_up_min_gain,
            ),
            self.pods,
            self.dispatcher,
            self.throughput,
        )
        progress = ProgressReporter(f"train {c.job_name}")
        try:
            self._start_monitoring()
            if self._save_secret:
                self.state_store.save_secret(self.job_secret)
                self._save_secret = False
            takeover.start_pods(self.pods)
            self._state_writer.start()
            self._state_writer.changed()
            if c.num_ps:
                self._ps_watch = ParameterServerWatch(
                    lambda ps_id: self.backend.address(PodRole.PS, ps_id),
                    c.num_ps,
                    c.rpc_timeout_seconds,
                    credential=self.credential,
                    tls=self.tls,
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
            self._stop_monitoring()
            if self._ps_watch is not None:
                self._ps_watch.close()
            self._state_writer.close()
            self.backend.close(grace_seconds=2.0)
            release_ports(self.host, self.ps_ports)
            self._remove_abandoned_checkpoint_writes()
            self._server.stop(grace=1.0)
            unregister_master(self.config.job_name)

    # ------------------------------------------------------------------ live metrics

    def _start_monitoring(self) -> None:
        """Serve the live metrics on ``--metrics-port`` (if any; ConfigError naming it if taken) and start
        writing the TensorBoard scalars under ``<output>/tensorboard/`` (:mod:`edl_argo.master.metrics`)."""
        if self.config.metrics_port:
            self._metrics_server = MetricsServer(self.metrics_registry, self.host, self.config.metrics_port)
            log.info("metrics_served", job=self.config.job_name, address=self._metrics_server.address)
        self._board = TrainingBoard(self.metrics_view, EventFileWriter(self.output))
        self._board.start()

    def _stop_monitoring(self) -> None:
        """The job is over: stop serving metrics; write the last TensorBoard scalars and upload them."""
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._board is not None:
            self._board.close()

    def _training_reported(self, report: TrainingReport) -> None:
        """An accepted training task report (the servicer's one place for them): its records count in the
        throughput, its loss in TensorBoard."""
        self.throughput.record(report.worker_id, report.records)
        if self._board is not None:
            self._board.training_reported(report)

    def _pod_counts(self) -> dict[str, PodCounts]:
        """The job's pods for the live metrics: the workers as the worker scaler counts them (running,
        pending, wanted: :meth:`PodManager.worker_counts`), and PS ``0 .. num_ps - 1`` in the phases the
        backend lists them in."""
        pods = self.pods
        if pods is None:
            return {}
        workers = pods.worker_counts()
        return {
            PodRole.WORKER.value: PodCounts(
                workers.running, workers.pending, workers.wanted, pods.worker_relaunches
            ),
            PodRole.PS.value: count_pods(
                self.backend.list_pods(),
                PodRole.PS,
                range(self.config.num_ps),
                self.config.num_ps,
                pods.ps_relaunches,
            ),
        }

    # ------------------------------------------------------------------ failover

    def _parts(self) -> MasterParts:
        """The parts whose state is saved (:mod:`edl_argo.master.failover`)."""
        return MasterParts(
            self.dispatcher, self.evaluation, self.versions, self.training_loss, self.ledger, self.rendezvous
        )

    def _state(self) -> dict[str, Any]:
        """What a restarted master continues from (:func:`~edl_argo.master.failover.state_to_save`)."""
        assert self.pods is not None
        return state_to_save(
            self._parts(),
            self.pods,
            started_at=self._started,
            master_port=self._master_port,
            ps_ports=self.ps_ports,
        )

    def _remove_abandoned_checkpoint_writes(self) -> None:
        """Every pod is gone: remove the half-written checkpoints of holders killed mid-write."""
        try:
            removed = sum(series.remove_abandoned_writes() for series in own_checkpoint_series(self.config))
        except StorageError as error:
            log.warning("abandoned_checkpoint_writes_kept", job=self.config.job_name, reason=str(error))
            return
        if removed:
            log.info("abandoned_checkpoint_writes_removed", job=self.config.job_name, objects=removed)

    def _forget_state(self) -> None:
        """The job is over: stop saving its state and remove it."""
        self._state_writer.close()
        self.state_store.remove()

    def _dispatch_until_done(self, progress: ProgressReporter) -> None:
        assert self.pods is not None
        while True:
            events = self.backend.events(timeout=0.5)
            self.pods.handle(events)
            assert self.scaler is not None
            self.scaler.tick()
            if events:
                self._state_writer.changed()
            for _task, worker_id in self.dispatcher.reclaim_timed_out_tasks():
                self.pods.restart_stuck_worker(worker_id)
                self._state_writer.changed()
            if self.ledger.fold_complete_epochs(
                self.dispatcher.accounting(epochs_begun_only=True), time.monotonic()
            ):
                self._state_writer.changed()
            stuck_members = (
                self.rendezvous.stuck(self.config.collective_timeout_seconds) if self.rendezvous else []
            )
            for worker_id in stuck_members:
                self.pods.restart_stuck_worker(worker_id)
                self._state_writer.changed()
            for ps_id in self._ps_watch.silent() if self._ps_watch is not None else ():
                self.pods.restart_stuck_ps(ps_id)
            progress.update(*self.dispatcher.progress(), self._progress_detail())
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

    def _progress_detail(self) -> dict[str, object]:
        """Beside the tasks done on the progress bar and in the progress log lines: the workers as the worker
        scaler counts them, and the records/s the live metrics serve."""
        assert self.pods is not None
        counts = self.pods.worker_counts()
        detail: dict[str, object] = {"workers": counts.running}
        if counts.pending:
            detail["pending"] = counts.pending
        rate = self.throughput.total_records_per_second(THROUGHPUT_WINDOW_SECONDS)
        detail["records_per_second"] = round(rate)
        return detail

    def _fetch_group_state(self) -> None:
        """Read every member's state; keep the newest for the export and record how far replicas differ."""
        assert self.rendezvous is not None
        current = self.rendezvous.current
        survey = survey_member_states(
            [m.address for m in current.members], token=self.job_secret.collective_token()
        )
        self.rendezvous.end_training()
        newest = survey.newest
        self._replicas = {
            "members": len(current.members),
            "members_compared": survey.members_compared,
            "members_left_out": survey.left_out,
            "members_behind": survey.behind,
            "max_abs_difference": survey.max_abs_difference,
            "versions": survey.versions,
            "final_round": current.round_id,
            "state_restores": list(self.rendezvous.restores),
            "steps_lost": self.rendezvous.steps_lost,
        }
        log.info(
            "group_state_fetched", version=newest.version, **{k: str(v) for k, v in self._replicas.items()}
        )
        self.versions.observe(newest.version)
        self._group_state = newest

    def _apply_pending_updates(self) -> None:
        """Training is over: every PS applies the pushes its synchronous step still waits for (fewer than
        ``grads_to_wait`` arrived), so the final evaluation and the export see them; once per master.

        The job's thread and a worker's GetTask may both call it; whichever comes second returns only once
        the first has recorded the version the PS reached (the metrics are written right after)."""
        if self.config.allreduce:
            return
        from edl_argo.worker.ps_client import ParameterServerClient

        with self._ps_status_lock:
            if self._ps_status is not None:
                return
            ps = ParameterServerClient(
                self._ps_addresses().split(","),
                retry_budget_seconds=60,
                credential=self.credential,
                tls=self.tls,
            )
            try:
                status = ps.status(apply_pending=True)
            finally:
                ps.close()
            applied = sum(s.pending_applied for s in status)
            if applied:
                log.info("pending_updates_applied", pushes=applied, versions=[s.version for s in status])
            self._on_version(max(s.version for s in status))
            self._ps_status = status

    def _check_accounting(self, metrics: dict[str, Any]) -> None:
        """Fail the job when what the workers trained does not add up (:mod:`edl_argo.master.ledger`)."""
        metrics["accounting"], problems = self.accounting_section()
        if problems:
            raise JobFailedError(accounting_failure(problems))

    def accounting_section(self) -> tuple[dict[str, Any], list[str]]:
        """What the workers trained against the epochs and the PS's final status (``metrics.json``'s
        ``accounting``), and the problems that fail the job; logged as ``accounting_checked``."""
        accounting = self.dispatcher.accounting()
        problems = self.ledger.epoch_problems(accounting)
        reports = [
            PsReport(
                ps_id,
                s.version,
                s.pushes_refused,
                s.restored_version,
                s.pushes_accepted,
                s.gradient_bytes_accepted,
            )
            for ps_id, s in enumerate(self._ps_status or [])
        ]
        section, ps_problems = self.ledger.ps_updates(accounting, reports)
        problems += ps_problems
        log.info(
            "accounting_checked",
            minibatches=section["minibatches_trained"],
            ps_versions=[r.version for r in reports],
            updates_lost_to_rollback=section["updates_lost_to_rollback"],
            problems=len(problems),
        )
        return section, problems

    def _wait_for_workers(self) -> None:
        assert self.pods is not None and self.scaler is not None
        self.scaler.tick()  # training is over: workers still waiting for room are deleted
        deadline = time.monotonic() + WORKER_EXIT_GRACE_SECONDS
        while self.pods.live_workers and time.monotonic() < deadline:
            # Group members a peer found silent and that have not called since will not exit: delete them.
            for worker_id in self.rendezvous.silent_since_reported() if self.rendezvous else ():
                self.pods.restart_stuck_worker(worker_id)
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
            "steps_skipped_by_loss_scale": self.training_loss.loss_scale_skipped,
            "nan_gradients_skipped": self.training_loss.nan_gradients_skipped,
            "task_requeues": accounting.requeues,
            "relaunches": {
                "worker": self.pods.worker_relaunches,
                "ps": self.pods.ps_relaunches,
                "events": [vars(r) for r in self.pods.relaunches],
            },
            "worker_scaling": self.scaler.summary() if self.scaler is not None else {},
            "wall_time_seconds": round(time.time() - started, 3),
            **({"allreduce_replicas": self._replicas} if self._replicas else {}),
        }

    def _sample_batch(self, mode: str) -> Any:
        return sample_batch(self.config, self.spec, self.training_data, mode)

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
                tls=self.tls,
            )
            try:
                model = model_from_parameter_servers(self.spec, ps, self._sample_features())
            finally:
                ps.close()
        flags = {**self.config.to_json(), **(self.model.flags() if self.model else {})}
        publish_model(self.output, model, metrics, flags, keep_in=self.state_store.storage)


def establish_job_secret(config: TrainConfig, parts: JobParts, backend: PodBackend) -> tuple[JobSecret, bool]:
    """The job's secret: the one an earlier master of the job made (kept by the backend, else beside the
    saved state), or a new one (see :mod:`edl_argo.rpc.auth`); and whether it is new. A backend that keeps
    secrets keeps a new one as it is handed it; else :meth:`TrainingJob.run` saves it beside the state
    before the first pod starts."""
    kept = backend.stored_job_secret()
    if kept is None and parts.saved is not None and not backend.keeps_job_secret:
        kept = parts.state_store.load_secret()
    if kept is not None:
        log.info("job_secret_reused", job=config.job_name)
        return kept, False
    return JobSecret.generate(), True
