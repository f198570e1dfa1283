"""Training throughput (examples/s, batch 64) of our local job against ``model.fit`` and TF's PS strategy.

Per model, two things run side by side, and take turns so that only one of them trains at any time:

* two baseline child processes (:mod:`tests.bench.train_baselines`): plain ``model.fit``, and TF's
  ``ParameterServerStrategy`` (in-process cluster, 1 worker + 1 PS), each built and warmed up once;
* ours: one local :class:`~edl_argo.master.job.TrainingJob` (master in this process, PS and worker as child
  processes) with 1 worker, synchronous SGD (``grads_to_wait`` 1), minibatch 64, 8 minibatches per task.

Each repeat is: our job trains for a timed window of at least the target seconds, then is paused and the
children measure ``fit`` and TF PS for a few seconds each, one after the other. Ratios pair the windows of
one repeat.

How ours is timed: the job's :class:`TaskDispatcher` is wrapped (:class:`ControlledDispatcher`, bench code
only, installed before ``run()`` so the master service and pod manager use it). It timestamps every
successful training-task report; with one worker, tasks run strictly one after another, so the records of
the tasks reported in a window divided by the time from the report just before the window to the last
report in it is the training rate with everything included: asking for a task, the ranged read, ``feed``,
every pull / compute / push step and the report. To pause, the wrapper answers ``WAIT`` to ``GetTask`` (the
task in flight finishes first); the first task after a resume is not timed (it includes the worker's
polling delay). Warm-up: the first window starts only after two tasks and three seconds of reports, which
covers process start-up, the TensorFlow import, the model build, the first PushModel, ``tf.function``
tracing and the PS's first (XLA-compiled) update. At the end the wrapper answers ``DONE`` and reports the
job finished, so the job stops early and cleanly; publishing the model is skipped (not training).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.master.task_dispatcher import DONE, WAIT, TaskAssignment, TaskDispatcher, TaskType
from edl_argo.pods import LocalProcessBackend
from tests.bench.common import (
    ROOT,
    BenchContext,
    BenchResult,
    Goal,
    Stat,
    child_env,
    kill_group,
    ratio_stat,
    tail,
)
from tests.bench.data import ctr_train_records, digits_train_records, mnist_like_records, write_records

BATCH = 64
MINIBATCHES_PER_TASK = 8
MODELS = ROOT / "tests" / "bench" / "models"
#: Warm-up of our job before the first timed window: at least this many task reports and seconds of them.
WARMUP_TASKS = 2
WARMUP_SECONDS = 3.0


@dataclass(frozen=True)
class ModelCase:
    """One model of the training benchmark."""

    name: str
    title: str
    model_def: Path
    num_ps: int
    #: ``records(quick)``: the training records (our job runs as many epochs over them as it needs).
    records: Callable[[bool], list[bytes]]
    #: ``(baseline key, threshold, text)``: ours ÷ that baseline must reach the threshold.
    goals: tuple[tuple[str, float, str], ...] = ()


CNN = ModelCase(
    name="training_cnn",
    title="MNIST-style CNN (Conv32-Conv64-MaxPool-Dense128-Dense10, 1.2 M params, Adam)",
    model_def=MODELS / "mnist_cnn.py",
    num_ps=1,
    records=lambda quick: mnist_like_records(1024 if quick else 8192),
    goals=(("fit", 0.8, "CNN: ours ≥ 0.8× model.fit"),),
)
CTR = ModelCase(
    name="training_ctr",
    title="CTR: 26 × (100k × 16) embeddings + Dense64 (41.6 M params, Adam); ours with 2 PS",
    model_def=ROOT / "examples" / "model_zoo" / "ctr.py",
    num_ps=2,
    records=lambda quick: ctr_train_records(2048 if quick else 20_000),
    goals=(
        ("fit", 1.0, "CTR: ours ≥ 1.0× model.fit"),
        ("tf_ps", 2.0, "CTR: ours ≥ 2× TF ParameterServerStrategy"),
    ),
)
DIGITS = ModelCase(
    name="training_digits",
    title="digits MLP (64→64→10, 4.8 k params, SGD with momentum)",
    model_def=MODELS / "digits_mlp.py",
    num_ps=1,
    records=lambda quick: digits_train_records(),
)


# ------------------------------------------------------------------------------------------ our job


class ControlledDispatcher:
    """Stands in for a job's :class:`TaskDispatcher` (see the module docstring): everything passes through,
    successful training reports are timestamped, and the benchmark can pause, resume and stop the job."""

    def __init__(self, inner: TaskDispatcher) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._paused = True  # until the benchmark resumes it
        self._stopped = False
        self._sizes: dict[int, int] = {}
        self._in_flight: set[int] = set()
        #: ``(time.perf_counter(), records)`` of every successful training report.
        self.reports: list[tuple[float, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def finished(self) -> bool:
        return self._stopped or self._inner.finished

    def get_task(self, worker_id: int) -> TaskAssignment:
        with self._lock:
            if self._stopped:
                return DONE
            if self._paused:
                return WAIT
            assignment = self._inner.get_task(worker_id)
            if assignment.task is not None:
                self._in_flight.add(assignment.task.task_id)
                if assignment.task.type is TaskType.TRAINING:
                    self._sizes[assignment.task.task_id] = assignment.task.num_records
            return assignment

    def report(self, task_id: int, worker_id: int, success: bool, *args: Any, **kwargs: Any) -> bool:
        accepted = self._inner.report(task_id, worker_id, success, *args, **kwargs)
        with self._lock:
            self._in_flight.discard(task_id)
            if accepted and success and task_id in self._sizes:
                self.reports.append((time.perf_counter(), self._sizes[task_id]))
        return accepted

    def resume(self) -> None:
        with self._lock:
            self._paused = False

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    @property
    def idle(self) -> bool:
        """No task handed out and not reported yet."""
        with self._lock:
            return not self._in_flight


class _BenchJob(TrainingJob):
    """A :class:`TrainingJob` that does not publish the model at the end (not part of training)."""

    def _export(self, metrics: dict[str, Any]) -> None:
        pass


@dataclass
class Window:
    """One timed stretch of our job."""

    examples_per_s: float
    seconds: float
    records: int


@dataclass
class OurJob:
    """One local job run in a background thread, paused between timed windows."""

    case: ModelCase
    data: Path
    workdir: Path
    log: IO[str]
    job: TrainingJob = field(init=False)
    control: ControlledDispatcher = field(init=False)
    error: BaseException | None = None
    #: When the job was first resumed, and when its first task report came (``time.perf_counter()``).
    first_resume: float = 0.0
    first_report: float = 0.0

    def __post_init__(self) -> None:
        name = f"bench-{self.case.name.replace('_', '-')}"
        config = TrainConfig(
            model_def=str(self.case.model_def),
            training_data=str(self.data),
            output=str(self.workdir / name),
            num_epochs=100_000,  # epochs are created lazily; the benchmark stops the job
            minibatch_size=BATCH,
            num_minibatches_per_task=MINIBATCHES_PER_TASK,
            num_workers=1,
            num_ps=self.case.num_ps,
            grads_to_wait=1,
            job_name=name,
            log_level="WARNING",
        )
        self.job = _BenchJob(config, backend=LocalProcessBackend(name, log_sink=self.log))
        self.control = ControlledDispatcher(self.job.dispatcher)
        self.job.dispatcher = self.control  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._run, name=f"{name}-master", daemon=True)

    def _run(self) -> None:
        try:
            self.job.run()
        except BaseException as error:  # surfaced by the waits
            self.error = error

    def start(self) -> None:
        self._thread.start()

    def _wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.error is not None or not self._thread.is_alive():
                raise RuntimeError(f"our {self.case.name} job ended while waiting for {what}: {self.error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"our {self.case.name} job: timed out waiting for {what}")
            time.sleep(0.05)

    def window(self, seconds: float, first: bool, timeout: float = 900.0) -> Window:
        """Resume, time at least ``seconds`` of training (after the warm-up or the first task), pause."""
        reports = self.control.reports
        mark = len(reports)
        self.control.resume()
        if first:
            self.first_resume = time.perf_counter()
            self._wait(lambda: len(reports) >= WARMUP_TASKS, timeout, "the first task reports")
            self.first_report = reports[0][0]
            self._wait(
                lambda: reports[-1][0] - self.first_report >= WARMUP_SECONDS, timeout, "the warm-up tasks"
            )
            mark = len(reports) - 1
        else:
            self._wait(lambda: len(reports) > mark, timeout, "the first task after resuming")
        self._wait(lambda: reports[-1][0] - reports[mark][0] >= seconds, timeout, "a timed window")
        self.control.pause()
        self._wait(lambda: self.control.idle, timeout, "the task in flight")
        window = reports[mark:]
        elapsed = window[-1][0] - window[0][0]
        records = sum(n for _, n in window[1:])
        return Window(records / elapsed, elapsed, records)

    def stop(self, timeout: float = 120.0) -> None:
        """End the job (DONE to the worker) and wait for its clean-up."""
        self.control.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.job.backend.close(grace_seconds=2.0)


# ------------------------------------------------------------------------------------ the baselines


class BaselineChild:
    """One :mod:`tests.bench.train_baselines` process: ``kind`` is ``fit`` or ``tf_ps``."""

    def __init__(self, kind: str, case: ModelCase, data: Path, warmup_steps: int, log_path: Path) -> None:
        self.kind = kind
        self._log_path = log_path
        self._log = log_path.open("ab")
        command = ["-m", "tests.bench.train_baselines", "--kind", kind, "--model-def", str(case.model_def)]
        command += ["--data", str(data), "--warmup-steps", str(warmup_steps)]
        self.process = subprocess.Popen(
            [sys.executable, *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
            env=child_env(),
            start_new_session=True,
        )

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the {self.kind} baseline process did not answer; {tail(self._log_path)}")
        return json.loads(line)

    def wait_ready(self, timeout: float = 900.0) -> None:
        self._answer(timeout)

    def measure(self, seconds: float, timeout: float = 600.0) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"measure {seconds}\n".encode())
        self.process.stdin.flush()
        return self._answer(timeout)

    def close(self) -> None:
        kill_group(self.process)
        self._log.close()


# ---------------------------------------------------------------------------------------- benchmark


def run_case(ctx: BenchContext, case: ModelCase) -> BenchResult:
    """Measure ``case`` (see the module docstring) and tabulate the ratios."""
    folder = ctx.folder(case.name)
    records = case.records(ctx.quick)
    data = Path(write_records(folder / "data", records))
    repeats = 1 if ctx.quick else ctx.repeats
    baseline_seconds = 1.5 if ctx.quick else 6.0
    target_seconds = 3.0 if ctx.quick else 22.0
    ours: list[Window] = []
    fit: list[float] = []
    tf_ps: list[float] = []
    warmup = 5 if ctx.quick else 20
    children = {
        kind: BaselineChild(kind, case, data, warmup, folder / f"{kind}.log") for kind in ("fit", "tf_ps")
    }
    with (folder / "job.log").open("a") as job_log:
        job = OurJob(case, data, folder, job_log)
        try:
            job.start()  # paused: its start-up overlaps the baselines' warm-up, its training does not
            ctx.log(f"  {case.name}: warming up the baselines")
            for child in children.values():
                child.wait_ready()
            for repeat in range(repeats):
                ctx.log(f"  {case.name} repeat {repeat + 1}/{repeats}: our job")
                ours.append(job.window(target_seconds, first=repeat == 0))
                ctx.log(f"  {case.name} repeat {repeat + 1}/{repeats}: baselines")
                fit.append(children["fit"].measure(baseline_seconds)["examples_per_s"])
                tf_ps.append(children["tf_ps"].measure(baseline_seconds)["examples_per_s"])
                ctx.log(
                    f"    ours {ours[-1].examples_per_s:,.0f} ex/s ({ours[-1].seconds:.1f} s)  "
                    f"fit {fit[-1]:,.0f}  tf_ps {tf_ps[-1]:,.0f}"
                )
        finally:
            job.stop()
            for child in children.values():
                child.close()
    return _tabulate(case, records, ours, fit, tf_ps, job, baseline_seconds)


def _tabulate(
    case: ModelCase,
    records: list[bytes],
    ours: list[Window],
    fit: list[float],
    tf_ps: list[float],
    job: OurJob,
    baseline_seconds: float,
) -> BenchResult:
    rates = [w.examples_per_s for w in ours]
    vs = {"fit": ratio_stat(rates, fit), "tf_ps": ratio_stat(rates, tf_ps)}
    result = BenchResult(
        name=case.name,
        title=f"Training: {case.title}",
        method=(
            f"Model file `{case.model_def.relative_to(ROOT)}`, {len(records):,} distinct training records "
            f"(repeated as epochs), batch 64; {len(ours)} repeats, each one window of our job then "
            f"{baseline_seconds:g} s of `fit` and {baseline_seconds:g} s of TF PS. "
            "See *How the training benchmarks measure* below."
        ),
        columns=["measurement", "examples/s", "ours ÷ this", "timed per repeat"],
    )
    per_repeat = f"{baseline_seconds:g} s"
    result.rows = [
        {
            "measurement": "`model.fit` (one process, numpy in memory)",
            "examples/s": Stat.of(fit),
            "ours ÷ this": vs["fit"],
            "timed per repeat": per_repeat,
        },
        {
            "measurement": "TF `ParameterServerStrategy`, 1 worker + 1 PS in one process",
            "examples/s": Stat.of(tf_ps),
            "ours ÷ this": vs["tf_ps"],
            "timed per repeat": per_repeat,
        },
        {
            "measurement": f"ours: local job, 1 worker + {case.num_ps} PS, sync",
            "examples/s": Stat.of(rates),
            "ours ÷ this": "1",
            "timed per repeat": Stat.of([w.seconds for w in ours]).format(0) + " s",
        },
    ]
    result.goals = [Goal(text, vs[key], threshold) for key, threshold, text in case.goals]
    result.notes.append(
        "Our job's PS and worker processes start while the baselines warm up; once the job is let go, its "
        f"first task (model build, first PushModel, tracing, first update) reports after "
        f"{job.first_report - job.first_resume:.1f} s."
    )
    return result


def training_cnn(ctx: BenchContext) -> BenchResult:
    """Training throughput of the MNIST-style CNN."""
    return run_case(ctx, CNN)


def training_ctr(ctx: BenchContext) -> BenchResult:
    """Training throughput of the CTR model."""
    return run_case(ctx, CTR)


def training_digits(ctx: BenchContext) -> BenchResult:
    """Training throughput of the digits MLP."""
    return run_case(ctx, DIGITS)
