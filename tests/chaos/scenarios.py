"""Chaos scenarios: one real digits job per trial, with faults injected while it trains.

Every scenario function takes a :class:`ChaosEnv` (the dataset, a folder for the trials, the S3 stand-in)
and a :class:`random.Random`, runs ONE trial and returns a :class:`TrialResult`: whether the job completed,
its final accuracy, the record accounting of its ``metrics.json`` (every epoch's ``records_done_per_epoch``
must equal ``records_per_epoch``) and the faults it injected. A trial that fails (the job fails, hangs or
an injection step times out) is a result with ``completed=False`` and the reason in ``notes``, never an
exception, so a runner can count it and go on.

The master runs in this process (:class:`~edl_argo.master.job.TrainingJob` in a
:class:`~tests.engine_helpers.JobThread`) and the pods are local processes
(:class:`~edl_argo.pods.LocalProcessBackend`, which can kill, pause and resume them), except in
:func:`master_restart`, where the master itself is the victim and runs as an ``edl-argo train``
subprocess. Faults are injected at random *progress points* (fractions of the job's training tasks done)
rather than at random times, so "the middle of training" means the same on a quiet and on a loaded
machine. Each trial writes its log (the pods' lines and the master's events) to ``trial.log`` in its own
folder under :attr:`ChaosEnv.workdir`, and keeps the lines in :attr:`TrialResult.log`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from edl_argo import log
from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.master.task_dispatcher import held_tasks
from edl_argo.pods import LocalProcessBackend, PodRole
from edl_argo.storage import open_storage
from edl_argo.storage.base import join_url
from edl_argo.storage.retry import RETRY_SECONDS_ENV
from edl_argo.storage.trees import open_tree
from edl_argo.worker.ps_client import ParameterServerClient
from tests.chaos.kubernetes import (
    api_environment,
    kubernetes_settings,
    master_flags,
    subprocess_environment,
)
from tests.chaos.pods import KubernetesPods, LocalPods, PodControl, left_behind
from tests.engine_helpers import (
    DIGITS_ACCURACY_FLOOR,
    DIGITS_JOB,
    DIGITS_MODEL,
    JobThread,
    expected_minibatches,
    write_digits_dataset,
)
from tests.k8s_helpers import start_master_pod

if TYPE_CHECKING:
    from tests.k8s_stand_in import KubernetesStandIn
    from tests.s3_stand_in import S3StandIn

#: The pod backends and distribution strategies a scenario can run on.
LOCAL, KUBERNETES = "local", "kubernetes"
PS_STRATEGY, ALLREDUCE = "ParameterServerStrategy", "AllreduceStrategy"

#: The job every trial runs: the engine tests' digits job (10 epochs; the trials in docs/reliability.md
#: ran 8). Fewer epochs save little (start-up and export dominate: 4 epochs ~21 s, 6 ~25 s, 8 ~30 s on a
#: quiet 2-core machine) and leave too small an accuracy margin: 4 epochs measured 0.914-0.983, 6
#: 0.953-0.981, 8 0.964-0.989 there but 0.925 once in CI under load.
#: Trials count one relaunch per fault injected. A relaunch backed off as a crash loop (a replacement
#: killed again) may be dropped when the job ends before its time: backoff is off here, and tested in
#: tests/test_pod_manager.py and tests/test_training_local.py.
CHAOS_JOB: dict[str, Any] = {**DIGITS_JOB, "relaunch_backoff_seconds": 0}
ACCURACY_TARGET = DIGITS_ACCURACY_FLOOR
#: PS checkpoint interval (model versions) where a scenario needs checkpoints.
CHECKPOINT_STEPS = 10
#: ``--min-task-timeout-seconds`` of :func:`hung_worker`: the learnt timeout (5x the longest recent task)
#: then decides, instead of the default 60 s floor.
HUNG_TASK_TIMEOUT_SECONDS = 5
#: ``--min-task-timeout-seconds`` of :func:`ps_kill`: no task times out while the PS restarts, which took
#: over the default 60 s on a loaded machine (both workers were then replaced as stuck, their tasks trained
#: again, and the job's count of updates lost to the rollback became unknown).
PS_KILL_TASK_TIMEOUT_SECONDS = 300
#: ``--num-epochs`` of :func:`scale_1_4_1`: twice the usual job, so that the lone worker has not trained
#: every task by the time the added ones have started. Their start took 17 s on a loaded machine and 30 s
#: under ``make test``, where a lone worker then trained the last 85% of a twice-usual job in 25 s (and 88%
#: of a thrice-usual one once, the added ones starting in 35-40 s): so the lone worker is also paused while
#: they start, for at most :data:`SCALING_PAUSE_SECONDS`; the job's RPC deadline and task timeout are longer
#: (:data:`SCALING_PAUSE_SETTINGS`), so that a call or task it held when paused does not expire.
SCALING_EPOCHS = 2 * CHAOS_JOB["num_epochs"]
SCALING_PAUSE_SECONDS = 60.0
SCALING_PAUSE_SETTINGS = {"rpc_timeout_seconds": 90, "min_task_timeout_seconds": 180}
#: ``EDL_STORAGE_RETRY_SECONDS`` of :func:`s3_outage`; its outages last at most a fifth of it.
S3_RETRY_SECONDS = 60
S3_OUTAGE_SECONDS = (3.0, 8.0)
#: Limits of one trial: the whole job, and each wait inside it (for a progress point, a log line...).
JOB_TIMEOUT_SECONDS = 600.0
STEP_TIMEOUT_SECONDS = 300.0


@dataclass
class TrialResult:
    """The outcome of one trial.

    ``records_lost`` is the sum over the job's epochs of ``|records_per_epoch - records reported|``, the
    records being those the workers reported their input yielded in tasks done (``metrics.json``'s
    ``accounting``; 0 iff no record was lost nor counted twice); ``records_trained_twice`` is the
    job's own count of records handed out again after a fault; ``updates_lost`` the job's own count of
    updates its PS lost when they restarted from a checkpoint (None: unknown). All are None when the job
    did not complete. ``versions_lost`` is set by :func:`ps_kill`: the model version before the kill minus
    the version the PS restored. ``metrics`` is the published ``metrics.json``; ``log`` the trial's log
    lines.
    """

    scenario: str
    completed: bool = False
    accuracy: float | None = None
    records_lost: int | None = None
    records_trained_twice: int | None = None
    wall_seconds: float = 0.0
    faults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    versions_lost: int | None = None
    updates_lost: int | None = None
    backend: str = LOCAL
    strategy: str = PS_STRATEGY
    problems: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict, repr=False)
    log: list[str] = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool:
        """Completed, nothing lost, at least :data:`ACCURACY_TARGET` accuracy, and none of the
        :attr:`problems` found by :func:`check_outcome` (accounting, replicas, things left behind)."""
        return (
            self.completed
            and not self.problems
            and self.records_lost == 0
            and self.accuracy is not None
            and self.accuracy >= ACCURACY_TARGET
        )

    def logged(self, pattern: str) -> list[re.Match[str]]:
        """The matches of ``pattern`` (a regular expression) in the trial's log, one per matching line."""
        compiled = re.compile(pattern)
        return [match for line in self.log if (match := compiled.search(line))]

    def summary(self) -> str:
        """One line for a progress display or an assertion message."""
        state = "passed" if self.passed else "FAILED"
        text = f"{self.scenario}: {state} in {self.wall_seconds:.0f} s, accuracy {self.accuracy}"
        text += f", records lost {self.records_lost}, trained twice {self.records_trained_twice}"
        text += "; faults: " + ("; ".join(self.faults) or "none")
        text += "; problems: " + "; ".join(self.problems) if self.problems else ""
        return text + ("; notes: " + "; ".join(self.notes) if self.notes else "")


@dataclass
class ChaosEnv:
    """Where trials run. ``data`` holds the digits dataset (``train/``, ``test/``, see
    :func:`write_digits_dataset`); each trial gets a folder of its own under ``workdir``. ``s3`` is
    needed by :func:`s3_outage` only, ``kubernetes`` (the stand-in cluster) by the trials on the
    Kubernetes backend. With ``echo``, trial logs are also copied to ``sys.stderr``."""

    data: Path
    workdir: Path
    s3: S3StandIn | None = None
    echo: bool = False
    kubernetes: KubernetesStandIn | None = None

    def cluster(self) -> KubernetesStandIn:
        if self.kubernetes is None:
            raise ValueError("a Kubernetes trial needs the stand-in cluster (ChaosEnv.kubernetes)")
        return self.kubernetes

    def new_trial(self, scenario: str) -> tuple[Path, str]:
        """A fresh folder for one trial of ``scenario`` and the job name to use (the folder's name)."""
        job_name = f"chaos-{scenario.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
        folder = self.workdir / job_name
        folder.mkdir(parents=True)
        return folder, job_name


def chaos_config(data: str, output: str, job_name: str, **overrides: Any) -> TrainConfig:
    """The :data:`CHAOS_JOB` on the dataset at URL ``data`` (its ``train`` and ``test``), with
    ``overrides`` (which may name the training and validation data themselves: tables of a database)."""
    settings = {
        "model_def": DIGITS_MODEL,
        "training_data": join_url(data, "train"),
        "validation_data": join_url(data, "test"),
        **CHAOS_JOB,
        **overrides,
    }
    return TrainConfig(output=output, job_name=job_name, **settings)


# --------------------------------------------------------------------------------------------- logs


class LogTap:
    """A trial's log: the backend's pod lines (it is the backend's ``log_sink``) and, inside
    :meth:`master_events`, the in-process master's events. Lines go to ``path`` (and to ``sys.stderr``
    with ``echo``) and are kept for :meth:`search`. Thread-safe."""

    def __init__(self, path: Path, *, echo: bool = False) -> None:
        self._file = path.open("a", encoding="utf-8")
        self._echo = echo
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        self._record(text, echo=self._echo)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def _record(self, text: str, *, echo: bool) -> None:
        with self._lock:
            self._lines.extend(text.splitlines())
            self._file.write(text if text.endswith("\n") else text + "\n")
            if echo:
                sys.stderr.write(text)

    @property
    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def search(self, pattern: str, start: int = 0) -> re.Match[str] | None:
        """The last match of ``pattern`` in lines ``start`` onwards, or None."""
        compiled = re.compile(pattern)
        for line in reversed(self.lines[start:]):
            if match := compiled.search(line):
                return match
        return None

    @contextlib.contextmanager
    def master_events(self) -> Iterator[None]:
        """Also record the events this process logs (the in-process master's), formatted as on stderr.
        They are not echoed: :func:`edl_argo.log.configure` already sends them to stderr."""
        log.configure()
        logger = logging.getLogger("edl_argo")
        handler = _TapHandler(self)
        handler.setFormatter(next((h.formatter for h in logger.handlers if h.formatter), None))
        logger.addHandler(handler)
        try:
            yield
        finally:
            logger.removeHandler(handler)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _TapHandler(logging.Handler):
    def __init__(self, tap: LogTap) -> None:
        super().__init__()
        self._tap = tap

    def emit(self, record: logging.LogRecord) -> None:
        self._tap._record(self.format(record), echo=False)


# --------------------------------------------------------------------------------------------- trials


def wait_for(condition: Callable[[], bool], what: str, *, alive: Callable[[], bool] = lambda: True) -> None:
    """Poll ``condition`` until it holds; AssertionError after :data:`STEP_TIMEOUT_SECONDS` or once
    ``alive()`` is false (the thing that should bring the condition about has ended)."""
    deadline = time.monotonic() + STEP_TIMEOUT_SECONDS
    while not condition():
        if not alive():
            raise AssertionError(f"the job ended before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@dataclass
class Trial:
    """A running in-process trial, as its fault injector sees it."""

    job: TrainingJob
    thread: JobThread
    tap: LogTap
    rng: random.Random
    result: TrialResult
    pods: PodControl

    def live_workers(self) -> list[int]:
        return self.job.pods.live_workers if self.job.pods is not None else []

    def progress(self) -> float:
        return self.thread.progress_fraction()

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        self.thread.wait_until(condition, STEP_TIMEOUT_SECONDS, what)

    def wait_for_progress(self, fraction: float) -> None:
        self.wait_for(lambda: self.progress() >= fraction, f"{fraction:.0%} of the training tasks")

    def wait_for_log(self, pattern: str, what: str, start: int = 0) -> re.Match[str]:
        """The last line of the log matching ``pattern`` from line ``start`` on, once there is one."""
        self.wait_for(lambda: self.tap.search(pattern, start) is not None, what)
        match = self.tap.search(pattern, start)
        assert match is not None
        return match

    def fault(self, description: str) -> None:
        """Record an injected fault (``at NN%`` of the tasks is added)."""
        self.result.faults.append(f"{description} at {self.progress():.0%}")

    def remove_worker(self, how: str) -> int:
        """Delete (``how="delete"``) or evict (``"evict"``) a random running worker's pod; its id."""
        deadline = time.monotonic() + STEP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            workers = self.live_workers()
            if workers:
                worker = self.rng.choice(workers)
                with contextlib.suppress(KeyError, ApiException):  # just started or just gone: again
                    getattr(self.pods, how)(PodRole.WORKER, worker)
                    return worker
            time.sleep(0.05)
        raise AssertionError(f"found no worker to {how}")

    @contextlib.contextmanager
    def paused_worker(self, worker: int) -> Iterator[None]:
        """Worker ``worker`` SIGSTOPped for the ``with`` block, SIGCONTinued after it however it ends."""
        self.pods.signal(PodRole.WORKER, worker, signal.SIGSTOP)
        try:
            yield
        finally:
            self.pods.signal(PodRole.WORKER, worker, signal.SIGCONT)

    def signal_worker(self, sig: int, pick: Callable[[int], bool] = lambda _worker: True) -> int:
        """Send ``sig`` to a random running worker; returns its id. With ``pick``, the worker must also
        satisfy ``pick(worker_id)`` *after* the signal (e.g. a paused worker holding a task); workers
        that do not are sent SIGCONT and another draw is made."""
        deadline = time.monotonic() + STEP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            workers = self.live_workers()
            if workers:
                worker = self.rng.choice(workers)
                try:
                    self.pods.signal(PodRole.WORKER, worker, sig)
                except KeyError:  # started a moment ago, or just exited: draw again
                    pass
                else:
                    if pick(worker):
                        return worker
                    with contextlib.suppress(KeyError):
                        self.pods.signal(PodRole.WORKER, worker, signal.SIGCONT)
            time.sleep(0.05)
        raise AssertionError(f"found no worker to send {signal.Signals(sig).name}")


Injector = Callable[[Trial], None]


def run_in_process(
    scenario: str,
    env: ChaosEnv,
    rng: random.Random,
    inject: Injector,
    *,
    backend: str = LOCAL,
    data: str = "",
    output: str = "",
    **overrides: Any,
) -> TrialResult:
    """Run one :data:`CHAOS_JOB` (with ``overrides``) on ``data`` (default: :attr:`ChaosEnv.data`) into
    ``output`` (default: the trial's folder), the master in this process and its pods on ``backend``
    (:data:`LOCAL` or :data:`KUBERNETES`: the stand-in cluster, reached through the official client),
    calling ``inject`` while it trains; see the module docstring."""
    folder, job_name = env.new_trial(scenario)
    if backend == KUBERNETES:
        cluster = env.cluster()
        overrides = {"backend": KUBERNETES, "kubernetes": kubernetes_settings(cluster, job_name), **overrides}
    config = chaos_config(data or str(env.data), output or str(folder / "output"), job_name, **overrides)
    result = TrialResult(scenario, backend=backend, strategy=config.distribution_strategy)
    tap = LogTap(folder / "trial.log", echo=env.echo)
    pods: PodControl
    if backend == KUBERNETES:
        pods, environment = KubernetesPods(cluster, job_name), api_environment(cluster)
        cluster.cluster.log_sink = tap.write
    else:
        pods, environment = LocalPods(LocalProcessBackend(job_name, log_sink=tap), job_name), {}
    thread: JobThread | None = None
    started = time.monotonic()
    try:
        with tap.master_events(), _environment(environment):
            try:
                job = TrainingJob.load(config, pods.backend if isinstance(pods, LocalPods) else None)
                thread = JobThread(job).start()
                inject(Trial(thread.job, thread, tap, rng, result, pods))
                thread.join(JOB_TIMEOUT_SECONDS)
                result.wall_seconds = time.monotonic() - started
                read_outcome(result, config)
            except Exception as error:
                result.wall_seconds = time.monotonic() - started
                result.notes.append(_describe(error))
                _stop(thread)
            result.problems += [f"left behind: {thing}" for thing in left_behind(pods)]
    finally:
        if backend == KUBERNETES:
            cluster.cluster.log_sink = None
        result.log = tap.lines
        tap.close()
    result.problems += members_suspected_after_they_finished(result.log)
    return result


def members_suspected_after_they_finished(log: list[str]) -> list[str]:
    """AllreduceStrategy: members that a peer reported as silent in a collective after their pod had
    finished (the master had kept them in the round: the peer waited the collective timeout for them)."""
    finished: set[str] = set()
    problems = []
    for line in log:
        if match := re.search(r"worker_finished worker=(\d+)", line):
            finished.add(match[1])
        elif (match := re.search(r"collective_failure_reported .*suspect=(\d+)", line)) and match[
            1
        ] in finished:
            problems.append(f"worker {match[1]} was still a member of a round after its pod finished")
    return problems


def _stop(thread: JobThread | None) -> None:
    """End a failed trial: its pods are deleted, so its master fails to replace them and returns."""
    if thread is not None:
        with contextlib.suppress(Exception):
            thread.job.backend.close(grace_seconds=0)
        with contextlib.suppress(Exception):
            thread.join(60)


def read_outcome(result: TrialResult, config: TrainConfig) -> None:
    """Fill ``result`` from the job's published ``metrics.json`` and check the accounting there
    (:func:`check_outcome`)."""
    output = open_storage(config.output)
    metrics = json.loads(output.read(open_tree(output, "model").file_key("metrics.json")))
    per_epoch = metrics["records_per_epoch"]
    accounting = metrics["accounting"]
    reported = accounting["records_reported_per_epoch"]
    result.metrics = metrics
    result.completed = metrics.get("status") == "succeeded"
    result.accuracy = metrics["final_metrics"]["accuracy"]
    result.records_lost = sum(abs(per_epoch - reported.get(str(e), 0)) for e in range(config.num_epochs))
    result.records_trained_twice = metrics["records_trained_twice"]
    servers = accounting["parameter_servers"]
    unknown = not servers or any(ps["updates_lost_to_rollback"] is None for ps in servers)
    result.updates_lost = None if unknown else accounting["updates_lost_to_rollback"]
    result.problems += check_outcome(metrics, expected_minibatches(config))


def check_outcome(metrics: dict[str, Any], minibatches: int) -> list[str]:
    """What is wrong in a successful job's ``metrics.json``, counted from the workers' reports: the
    minibatches of the tasks done against the ``minibatches`` the dataset makes (a lost or doubled
    minibatch shows here), each PS that never restarted at exactly the updates expected, and, with
    AllreduceStrategy, replicas that are not bit-identical at the end or a member of the final round whose
    state the master could not compare (a member that joined after the last step, behind the newest state
    of its lineage, is not compared: it took no part in the steps since)."""
    problems = []
    accounting = metrics["accounting"]
    if accounting["minibatches_trained"] != minibatches:
        problems.append(
            f"accounting: the workers trained {accounting['minibatches_trained']} minibatches in the tasks "
            f"done, the dataset makes {minibatches}"
        )
    for ps in accounting["parameter_servers"]:
        expected = ps["updates_expected"]
        low, high = (expected, expected) if isinstance(expected, int) else expected
        if ps["restored_from_version"] < 0 and not low <= ps["model_version"] <= high:
            problems.append(
                f"accounting: PS {ps['ps']} at version {ps['model_version']}, expected {expected}"
            )
    replicas = metrics.get("allreduce_replicas")
    behind = [] if replicas is None else replicas.get("members_behind", [])
    if replicas is not None and replicas["members_compared"] + len(behind) != replicas["members"]:
        problems.append(
            f"replicas: {replicas['members_compared']} of the final round's {replicas['members']} members "
            f"compared; left out: {replicas['members_left_out']}"
        )
    if replicas is not None and replicas["max_abs_difference"] != 0.0:
        problems.append(
            f"replicas differ: {replicas['members_compared']} compared, max |difference| "
            f"{replicas['max_abs_difference']}"
        )
    return problems


# --------------------------------------------------------------------------------------------- scenarios


def baseline(env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL, **overrides: Any) -> TrialResult:
    """No fault: the reference wall time."""
    return run_in_process("baseline", env, rng, lambda _trial: None, backend=backend, **overrides)


def worker_kills(env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL, **job: Any) -> TrialResult:
    """1-3 random workers lost, each at a random point between 10% and 85% of the tasks: SIGKILLed on
    the local backend; on Kubernetes each pod is, at random, deleted through the API or evicted
    (preempted by the scheduler). ``job``: :func:`run_in_process`'s ``data`` and job settings (another
    data format and the model that reads it)."""

    def inject(trial: Trial) -> None:
        for point in sorted(rng.uniform(0.10, 0.85) for _ in range(rng.randint(1, 3))):
            trial.wait_for_progress(point)
            if backend == LOCAL:
                worker = trial.signal_worker(signal.SIGKILL)
                trial.fault(f"SIGKILL worker-{worker}")
            else:
                how = rng.choice(("delete", "evict"))
                worker = trial.remove_worker(how)
                trial.fault(f"{how} worker-{worker}")

    return run_in_process("worker_kills", env, rng, inject, backend=backend, **job)


def ps_kill(env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL) -> TrialResult:
    """The PS SIGKILLed (Kubernetes: its pod deleted through the API) at a random point between 20% and
    80% of the tasks; it restarts from its newest checkpoint. Versions lost = the newest model version
    before the kill (reported by a worker or checkpointed by the PS, which is paused while it is read)
    minus the version the PS restored."""
    saved = r"\[(?:\S+-)?ps-0\] .* checkpoint_saved .*version=(\d+)"

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.20, 0.80))
        # The PS's version right before the kill, asked of the PS itself while the workers are paused (the
        # master's own figure lags: workers report versions only now and then). A push already sent when
        # they stopped is applied within the pause.
        workers = trial.job.pods.live_workers if trial.job.pods is not None else []
        for worker_id in workers:
            with contextlib.suppress(KeyError):  # a worker that ended meanwhile
                trial.pods.signal(PodRole.WORKER, worker_id, signal.SIGSTOP)
        try:
            time.sleep(1.0)  # the pushes in flight arrive (not a wait for a result: the status is read next)
            before = _ps_version(trial.job)
            trial.pods.signal(PodRole.PS, 0, signal.SIGSTOP)
        finally:
            for worker_id in workers:
                with contextlib.suppress(KeyError):
                    trial.pods.signal(PodRole.WORKER, worker_id, signal.SIGCONT)
        time.sleep(0.5)  # lets the backend copy the PS's last log lines (not a wait for a result)
        checkpointed = trial.tap.search(saved)
        before = max(before, int(checkpointed[1]) if checkpointed else 0)
        kill_line = len(trial.tap.lines)
        if backend == LOCAL:
            trial.pods.signal(PodRole.PS, 0, signal.SIGKILL)
            trial.fault(f"SIGKILL ps-0 (model version {before})")
        else:
            trial.pods.signal(PodRole.PS, 0, signal.SIGKILL)  # a deleted pod's SIGTERM would save its state
            trial.pods.delete(PodRole.PS, 0)
            trial.fault(f"SIGKILL and delete pod ps-0 (model version {before})")
        restored = trial.wait_for_log(
            r"\[(?:\S+-)?ps-0\] .* ps_restored version=(\d+)", "ps-0 to restore", kill_line
        )
        trial.result.versions_lost = before - int(restored[1])

    return run_in_process(
        "ps_kill",
        env,
        rng,
        inject,
        backend=backend,
        checkpoint_steps=CHECKPOINT_STEPS,
        min_task_timeout_seconds=PS_KILL_TASK_TIMEOUT_SECONDS,
    )


def _ps_version(job: TrainingJob) -> int:
    """PS 0's model version now, asked with the master's credential."""
    ps = ParameterServerClient(
        [job.backend.address(PodRole.PS, 0)], retry_budget_seconds=10, credential=job.credential
    )
    try:
        return int(ps.status()[0].version)
    finally:
        ps.close()


def s3_outage(env: ChaosEnv, rng: random.Random) -> TrialResult:
    """Dataset, checkpoints, master state and model on the S3 stand-in, which is stopped for a few seconds
    (well within the storage retry budget, ``EDL_STORAGE_RETRY_SECONDS``) at a random point between 20%
    and 70% of the tasks, then restarted on the same port with the same data."""
    s3 = env.s3
    if s3 is None:
        raise ValueError("the s3_outage scenario needs the S3 stand-in (ChaosEnv.s3)")
    s3.start()
    bucket = f"chaos-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(bucket)
    data, output = f"s3://{bucket}/data", f"s3://{bucket}/output"

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.20, 0.70))
        outage = rng.uniform(*S3_OUTAGE_SECONDS)
        trial.fault(f"S3 stand-in down for {outage:.1f} s")
        s3.stop()
        try:
            time.sleep(outage)  # the length of the fault, not a wait for a result
        finally:
            s3.start()

    with _environment({**s3.env(), RETRY_SECONDS_ENV: str(S3_RETRY_SECONDS), "AWS_SESSION_TOKEN": None}):
        write_digits_dataset(open_storage(data))
        return run_in_process(
            "s3_outage", env, rng, inject, data=data, output=output, checkpoint_steps=CHECKPOINT_STEPS
        )


def scale_1_4_1(
    env: ChaosEnv,
    rng: random.Random,
    *,
    backend: str = LOCAL,
    resume_when: Callable[[Iterable[bool]], bool] = all,
    **overrides: Any,
) -> TrialResult:
    """One worker, scaled to 4 at a random point between 5% and 20% of the tasks, and back to 1 at a
    random point between 50% and 75% (and at least 10% of the tasks after the added workers started).

    The job is long enough (:data:`SCALING_EPOCHS`) for the added workers to start before it ends on a
    loaded machine (their TensorFlow start-up took 30 s under ``make test``'s load): a trial where they did
    not fails as such, since it could not scale them down. The lone worker is paused while they start (see
    :data:`SCALING_EPOCHS`), until ``resume_when`` (``all`` or ``any``) of them have started or for at most
    :data:`SCALING_PAUSE_SECONDS`."""

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.05, 0.20))
        pods = trial.job.pods
        assert pods is not None, "the job runs but has no pod manager"
        (lone,) = trial.live_workers()
        pods.scale_workers(4)
        added = sorted(set(trial.live_workers()) - {lone})
        trial.fault(f"scaled 1 -> 4 (added workers {added})")

        def started(worker: int) -> bool:
            return trial.tap.search(rf"worker_started worker={worker}\b") is not None

        # On a cluster the added pods start on their own nodes; here they share two cores with the lone
        # worker, which trained the rest of the job while they imported TensorFlow under make test's load.
        # Pausing it (for less than the job's RPC deadline and task timeout) stands in for that.
        with trial.paused_worker(lone):
            deadline = time.monotonic() + SCALING_PAUSE_SECONDS
            while not resume_when(map(started, added)) and time.monotonic() < deadline:
                time.sleep(0.1)
        trial.wait_for(lambda: all(map(started, added)), f"the added workers {added} to start")
        started_at = trial.progress()
        assert started_at < 0.90, f"the added workers started only at {started_at:.0%} of the tasks"
        trial.wait_for_progress(min(0.90, max(rng.uniform(0.50, 0.75), trial.progress() + 0.10)))
        pods.scale_workers(1)
        trial.fault("scaled 4 -> 1")
        trial.wait_for(lambda: len(trial.live_workers()) == 1, "one worker again")

    name = overrides.pop("scenario", "scale_1_4_1")
    overrides.setdefault("num_epochs", SCALING_EPOCHS)
    overrides.update(SCALING_PAUSE_SETTINGS)
    return run_in_process(name, env, rng, inject, backend=backend, num_workers=1, **overrides)


def hung_worker(env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL) -> TrialResult:
    """A random worker holding a task SIGSTOPped at a random point between 20% and 70% of the tasks and
    left stopped: the dispatcher must reclaim its task on timeout (the learnt one: 5x the longest recent
    task, with a low ``--min-task-timeout-seconds``) and the master replace the worker."""

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.20, 0.70))
        dispatcher = trial.job.dispatcher

        def holds_a_task(worker: int) -> bool:
            return any(entry["worker_id"] == worker for entry in held_tasks(dispatcher.snapshot()))

        worker = trial.signal_worker(signal.SIGSTOP, holds_a_task)
        trial.fault(f"SIGSTOP worker-{worker}")
        trial.wait_for(lambda: dispatcher.accounting().requeues["timeout"] > 0, "the task to time out")

    return run_in_process(
        "hung_worker", env, rng, inject, backend=backend, min_task_timeout_seconds=HUNG_TASK_TIMEOUT_SECONDS
    )


def master_restart(
    env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL, strategy: str = PS_STRATEGY
) -> TrialResult:
    """The master (``edl-argo train`` as a subprocess) SIGKILLed at a random point between 20% and 70% of
    the tasks, and the same command run again after 0-3 s, as Argo's retry would: the new master restores
    the state of ``OUTPUT/master/state.json`` and adopts the running pods (with AllreduceStrategy the
    adopted workers re-form their group and go on from the state they hold)."""
    folder, job_name = env.new_trial("master_restart")
    strategy_overrides = {"distribution_strategy": ALLREDUCE, "num_ps": 0} if strategy == ALLREDUCE else {}
    config = chaos_config(str(env.data), str(folder / "output"), job_name, **strategy_overrides)
    progress_file = folder / "progress"
    command = [str(Path(sys.executable).parent / "edl-argo"), "train", *_train_flags(config)]
    environ = dict(os.environ)
    pods: PodControl
    if backend == KUBERNETES:
        command += master_flags()
        environ = subprocess_environment(env.cluster())
        pods = KubernetesPods(env.cluster(), job_name)
    else:
        pods = LocalPods(LocalProcessBackend(job_name), job_name)
    # EDL_WARM=0: the master is SIGKILLed, so it must not be a warm server's client (tests/conftest.py).
    environ.update(ARGO_PROGRESS_FILE=str(progress_file), EDL_NO_PROGRESS_BAR="1", EDL_WARM="0")
    log_path = folder / "trial.log"
    result = TrialResult("master_restart", backend=backend, strategy=strategy)
    masters: list[subprocess.Popen[bytes]] = []

    def start_master() -> subprocess.Popen[bytes]:
        if backend == KUBERNETES:  # a new pod of the step: it mounts the job's auth Secret as it is now
            environ.update(start_master_pod(env.cluster(), job_name, folder / "master-secrets"))
        with log_path.open("ab") as sink:
            masters.append(
                subprocess.Popen(command, env=environ, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink)
            )
        return masters[-1]

    started = time.monotonic()
    try:
        first = start_master()
        point = rng.uniform(0.20, 0.70)
        wait_for(
            lambda: _progress(progress_file) >= point,
            f"{point:.0%} of the tasks",
            alive=lambda: first.poll() is None,
        )
        first.kill()
        first.wait()
        result.faults.append(f"SIGKILL master at {_progress(progress_file):.0%}")
        time.sleep(rng.uniform(0.0, 3.0))  # the restart delay being simulated, not a wait for a result
        second = start_master()
        status = second.wait(JOB_TIMEOUT_SECONDS)
        result.wall_seconds = time.monotonic() - started
        if status != 0:
            raise AssertionError(f"the restarted master exited with status {status}")
        read_outcome(result, config)
    except Exception as error:
        result.wall_seconds = time.monotonic() - started
        result.notes.append(_describe(error))
        tail = log_path.read_text(errors="replace").splitlines()[-5:] if log_path.exists() else []
        result.notes += tail
    finally:
        for master in masters:
            if master.poll() is None:
                master.kill()
                master.wait()
        result.problems += [f"left behind: {thing}" for thing in left_behind(pods)]
        result.log = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    result.problems += members_suspected_after_they_finished(result.log)
    return result


# --------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for None, remove) environment variables, for this process and the pods it starts."""
    saved = {name: os.environ.get(name) for name in values}
    _apply(values)
    try:
        yield
    finally:
        _apply(saved)


def _apply(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _describe(error: BaseException) -> str:
    """``Type: message (at file:line)``, the line where it was raised, for a trial's notes."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def _train_flags(config: TrainConfig) -> list[str]:
    """The ``edl-argo train`` flags of ``config``'s job (those :data:`CHAOS_JOB` and the paths set)."""
    values = {
        "model_def": config.model_def,
        "training_data": config.training_data,
        "validation_data": config.validation_data,
        "output": config.output,
        "job_name": config.job_name,
        "distribution_strategy": config.distribution_strategy,
        **{name: getattr(config, name) for name in CHAOS_JOB},
    }
    flags: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif name == "num_ps" and value == 0:
            continue  # AllreduceStrategy: no PS (--num-ps takes a positive count, its default is ignored)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def _progress(progress_file: Path) -> float:
    """The fraction of training tasks done, from the master's ``ARGO_PROGRESS_FILE`` (``N/M``)."""
    try:
        done, total = progress_file.read_text().split("/")
        return int(done) / int(total) if int(total) else 0.0
    except (OSError, ValueError):
        return 0.0
