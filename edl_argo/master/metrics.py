"""Live metrics of a training job: Prometheus text on ``--metrics-port``, TensorBoard scalars under
``<output>/tensorboard/``.

**Prometheus.** :class:`JobCollector` reads the job's parts (:class:`JobView`) on each scrape: nothing runs
between scrapes and nothing is kept but what the parts hold. It is registered in a registry of its own
(:func:`metrics_registry`), not prometheus_client's global one, and :class:`MetricsServer` serves that
registry with prometheus_client's HTTP server on the pod's address (:func:`edl_argo.flags.pod_host`) until
the job ends. Every metric is named ``edl_...`` and labelled ``job`` (``--job-name``); what each means is
in docs/operations.md ("Monitoring a job") and in its ``HELP`` line.

**TensorBoard.** :class:`TrainingBoard` writes scalars through an
:class:`~edl_argo.master.tensorboard_log.EventFileWriter`: ``loss`` for every training task report the
master accepts (at the model version the worker reported after it), and every
:data:`SAMPLE_INTERVAL_SECONDS` ``records_per_second`` and ``workers`` at the newest model version,
``epoch_loss`` of each epoch once all its records are trained (at step = the epoch, 0-based), and
``evaluation/<metric>`` of each evaluation at the model version it evaluated. It uploads the files every
:data:`UPLOAD_INTERVAL_SECONDS` and when the job ends, failed or not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edl_argo.addresses import join_host_port
from edl_argo.errors import ConfigError
from edl_argo.log import get_logger
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.state_store import SaveRecord
from edl_argo.master.task_dispatcher import TaskDispatcher
from edl_argo.master.tensorboard_log import EventFileWriter
from edl_argo.master.throughput import ThroughputMeter
from edl_argo.master.training_stats import TrainingLoss, TrainingReport
from edl_argo.pods import PodPhase, PodRole, PodStatus

log = get_logger(__name__)

#: The window of the records-per-second rates (:class:`~edl_argo.master.throughput.ThroughputMeter`).
THROUGHPUT_WINDOW_SECONDS = 60.0
#: A scrape that sends no request within this long is dropped (the metrics port is open to any client).
REQUEST_TIMEOUT_SECONDS = 10.0
#: How long the metrics server gets to stop.
STOP_TIMEOUT_SECONDS = 5.0
#: How often the TensorBoard scalars that are samples (records per second, workers) are written.
SAMPLE_INTERVAL_SECONDS = 10.0
#: How often the TensorBoard event files are uploaded while the job runs.
UPLOAD_INTERVAL_SECONDS = 30.0


@dataclass(frozen=True)
class PodCounts:
    """The pods of one role: ``running`` (their process runs), ``pending`` (started, not running yet),
    ``wanted`` (how many the job is to run now) and ``relaunches`` (replacements started so far)."""

    running: int
    pending: int
    wanted: int
    relaunches: int = 0


def count_pods(
    statuses: Iterable[PodStatus], role: PodRole, ids: Collection[int], wanted: int, relaunches: int
) -> PodCounts:
    """The :class:`PodCounts` of the pods ``ids`` of ``role`` in a backend's ``statuses``
    (:meth:`~edl_argo.pods.PodBackend.list_pods`): running those listed as RUNNING, pending those listed
    in any other phase that is not terminal; a pod not listed counts as neither."""
    phases = [s.phase for s in statuses if s.role is role and s.pod_id in ids]
    running = sum(1 for phase in phases if phase is PodPhase.RUNNING)
    pending = sum(1 for phase in phases if phase is not PodPhase.RUNNING and not phase.is_terminal)
    return PodCounts(running, pending, wanted, relaunches)


@dataclass
class JobView:
    """What the live metrics read, each time they are read. Callables stand for what the master replaces
    or works out while it runs (the dispatcher after a failover, the pods)."""

    job_name: str
    dispatcher: Callable[[], TaskDispatcher]
    evaluation: EvaluationService
    training_loss: TrainingLoss
    throughput: ThroughputMeter
    #: The newest model version a worker reported (:class:`~edl_argo.master.job.VersionTracker`).
    model_version: Callable[[], int]
    #: Role (``"worker"``, ``"ps"``) -> its pods.
    pod_counts: Callable[[], Mapping[str, PodCounts]]
    #: The newest save of the master's state and how many completed
    #: (:class:`~edl_argo.master.state_store.GroupCommit`).
    last_save: Callable[[], SaveRecord | None]
    saves: Callable[[], int]


class JobCollector(Collector):
    """The ``edl_*`` metrics of one job, read from a :class:`JobView` on each :meth:`collect`."""

    def __init__(self, view: JobView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view
        job = {"job": view.job_name}
        yield from self._tasks(view, job)
        records = sum(view.dispatcher().accounting(epochs_begun_only=True).records_done_per_epoch.values())
        yield _counter(
            "records_trained", "records of training tasks completed (each task once)", job, records
        )
        rates = view.throughput.records_per_second(THROUGHPUT_WINDOW_SECONDS)
        window = f"over the last {THROUGHPUT_WINDOW_SECONDS:g} s"
        yield _gauge(
            "records_per_second",
            f"records trained per second by all workers, {window}",
            job,
            sum(rates.values()),
        )
        per_worker = GaugeMetricFamily(
            "edl_worker_records_per_second",
            f"records trained per second by one worker, {window} (workers that reported a task in it)",
            labels=["job", "worker"],
        )
        for worker_id, rate in sorted(rates.items()):
            per_worker.add_metric([view.job_name, str(worker_id)], rate)
        yield per_worker
        yield from self._pods(view, job)
        yield _gauge(
            "model_version",
            "the newest model version a worker reported to the master",
            job,
            view.model_version(),
        )
        yield from self._loss(view, job)
        yield from self._evaluation(view, job)
        yield from self._state_saves(view, job)

    def _tasks(self, view: JobView, job: dict[str, str]) -> Iterator[Metric]:
        counts = view.dispatcher().task_counts()
        families = {
            "created": GaugeMetricFamily(
                "edl_tasks_created", "tasks known so far (training: every epoch's)", labels=["job", "type"]
            ),
            "queued": GaugeMetricFamily(
                "edl_tasks_queued", "tasks waiting for a worker", labels=["job", "type"]
            ),
            "running": GaugeMetricFamily("edl_tasks_running", "tasks a worker holds", labels=["job", "type"]),
            "done": CounterMetricFamily(
                "edl_tasks_done", "tasks completed (each task once)", labels=["job", "type"]
            ),
            "failed": CounterMetricFamily(
                "edl_tasks_failed",
                "failed task reports (a task failing twice counts twice)",
                labels=["job", "type"],
            ),
        }
        for task_type, count in counts.items():
            for name, family in families.items():
                family.add_metric([job["job"], task_type.value], getattr(count, name))
        yield from families.values()

    def _pods(self, view: JobView, job: dict[str, str]) -> Iterator[Metric]:
        pods = GaugeMetricFamily(
            "edl_pods",
            "pods by role and phase (running; pending: started, not running yet)",
            labels=["job", "role", "phase"],
        )
        wanted = GaugeMetricFamily("edl_pods_wanted", "pods the job is to run now", labels=["job", "role"])
        relaunches = CounterMetricFamily(
            "edl_pod_relaunches", "pods replaced after they stopped", labels=["job", "role"]
        )
        for role, counts in sorted(view.pod_counts().items()):
            pods.add_metric([job["job"], role, "running"], counts.running)
            pods.add_metric([job["job"], role, "pending"], counts.pending)
            wanted.add_metric([job["job"], role], counts.wanted)
            relaunches.add_metric([job["job"], role], counts.relaunches)
        yield from (pods, wanted, relaunches)

    def _loss(self, view: JobView, job: dict[str, str]) -> Iterator[Metric]:
        latest = view.training_loss.latest
        if latest is not None:
            yield _gauge("training_loss", "mean loss of the training task reported last", job, latest)
        per_epoch = GaugeMetricFamily(
            "edl_epoch_training_loss",
            "minibatch-weighted mean training loss of an epoch so far (epochs 0-based)",
            labels=["job", "epoch"],
        )
        for epoch, loss in view.training_loss.per_epoch().items():
            per_epoch.add_metric([job["job"], str(epoch)], loss)
        yield per_epoch

    def _evaluation(self, view: JobView, job: dict[str, str]) -> Iterator[Metric]:
        history = list(view.evaluation.history)
        yield _counter("evaluations", "evaluation rounds completed", job, len(history))
        if not history:
            return
        latest = history[-1]
        yield _gauge(
            "evaluation_model_version",
            "the model version the latest evaluation evaluated",
            job,
            latest.model_version,
        )
        metrics = GaugeMetricFamily(
            "edl_evaluation_metric", "a metric of the latest evaluation", labels=["job", "metric"]
        )
        for name, value in sorted(latest.metrics.items()):
            metrics.add_metric([job["job"], name], value)
        yield metrics

    def _state_saves(self, view: JobView, job: dict[str, str]) -> Iterator[Metric]:
        yield _counter(
            "state_saves", "saves of the master's state (for failover) completed", job, view.saves()
        )
        save = view.last_save()
        if save is not None:
            yield _gauge(
                "state_save_timestamp_seconds",
                "when the latest save of the master's state completed",
                job,
                save.at,
            )
            yield _gauge(
                "state_save_duration_seconds",
                "how long the latest save of the master's state took",
                job,
                save.seconds,
            )


def _gauge(name: str, documentation: str, labels: dict[str, str], value: float) -> Metric:
    family = GaugeMetricFamily(f"edl_{name}", documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, documentation: str, labels: dict[str, str], value: float) -> Metric:
    family = CounterMetricFamily(f"edl_{name}", documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def metrics_registry(view: JobView) -> CollectorRegistry:
    """A registry of its own holding the job's :class:`JobCollector`."""
    registry = CollectorRegistry()
    registry.register(JobCollector(view))
    return registry


class MetricsServer:
    """prometheus_client's HTTP server for ``registry`` on ``host:port`` (any path answers the metrics),
    on a daemon thread until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        """Serve now; :class:`~edl_argo.errors.ConfigError` naming ``--metrics-port`` if the port is taken."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as error:
            raise ConfigError(
                f"--metrics-port {port}: cannot serve metrics on {join_host_port(host, port)}"
                f" ({error.strerror or error}); choose another port, or 0 for none"
            ) from None
        # A client that connects and sends nothing must not hold a thread for ever.
        handler = self._server.RequestHandlerClass
        self._server.RequestHandlerClass = type(
            "TimedHandler", (handler,), {"timeout": REQUEST_TIMEOUT_SECONDS}
        )
        self.address = join_host_port(host, self._server.server_port)

    def close(self) -> None:
        """Stop serving (a scrape in progress may still be answered); idempotent."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(STOP_TIMEOUT_SECONDS)


class TrainingBoard:
    """The job's TensorBoard scalars (see the module docstring), written by ``writer``.

    :meth:`training_reported` takes the accepted training task reports; :meth:`start` starts the thread that
    samples and uploads; :meth:`close` writes a last sample, uploads and stops. ``clock`` paces the thread
    (default :func:`time.monotonic`)."""

    def __init__(
        self,
        view: JobView,
        writer: EventFileWriter,
        *,
        sample_interval: float = SAMPLE_INTERVAL_SECONDS,
        upload_interval: float = UPLOAD_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._view = view
        self._writer = writer
        self._sample_interval = sample_interval
        self._upload_interval = upload_interval
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorboard", daemon=True)
        self._sample_lock = threading.Lock()
        self._evaluations_written = 0
        self._epochs_written: set[int] = set()

    def training_reported(self, report: TrainingReport) -> None:
        """Write the ``loss`` of an accepted training task report (none for a task of no trained step)."""
        if report.steps > 0:
            self._writer.scalar("loss", report.mean_loss, report.model_version)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> None:
        """Write the scalars that are read rather than reported: records per second and running workers,
        evaluations and epoch losses not written yet."""
        view = self._view
        with self._sample_lock:
            step = view.model_version()
            rate = view.throughput.total_records_per_second(THROUGHPUT_WINDOW_SECONDS)
            self._writer.scalar("records_per_second", rate, step)
            workers = view.pod_counts().get(PodRole.WORKER.value)
            if workers is not None:
                self._writer.scalar("workers", workers.running, step)
            history = list(view.evaluation.history)
            for record in history[self._evaluations_written :]:
                for name, value in sorted(record.metrics.items()):
                    self._writer.scalar(f"evaluation/{name}", value, record.model_version)
            self._evaluations_written = len(history)
            accounting = view.dispatcher().accounting(epochs_begun_only=True)
            losses = view.training_loss.per_epoch()
            for epoch, done in sorted(accounting.records_done_per_epoch.items()):
                complete = done == accounting.records_per_epoch and epoch in losses
                if complete and epoch not in self._epochs_written:
                    self._writer.scalar("epoch_loss", losses[epoch], epoch)
                    self._epochs_written.add(epoch)

    def close(self) -> None:
        """Stop the thread, write a last sample and upload everything; what fails is logged, never raised
        (the job's own outcome stands)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample_logging_bugs()
        if self._writer.close():
            log.info("tensorboard_written", url=self._writer.url)

    def _sample_logging_bugs(self) -> None:
        try:
            self.sample()
        except Exception:  # a bug of the master's: the job goes on without this sample
            log.error("tensorboard_sample_failed", exc_info=True)

    def _run(self) -> None:
        uploaded = self._clock()
        while not self._stop.wait(self._sample_interval):
            self._sample_logging_bugs()
            if self._clock() - uploaded >= self._upload_interval:
                self._writer.upload()
                uploaded = self._clock()
