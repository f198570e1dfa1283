"""Training throughput (examples/s, batch 64) of our local job against ``model.fit`` and TF's PS strategy.

Per model, two things run side by side, and take turns so that only one of them trains at any time:

* two baseline child processes (:mod:`tests.bench.train_baselines`): plain ``model.fit``, and TF's
  ``ParameterServerStrategy`` (in-process cluster, 1 worker + 1 PS), each built and warmed up once;
* ours: one local :class:`~edl_argo.master.job.TrainingJob` (master in this process, PS and worker as child
  processes) with 1 worker, synchronous SGD (``grads_to_wait`` 1), minibatch 64, 8 minibatches per task.
  For the CNN and the digits MLP also the same job with asynchronous SGD and ``--pipelined`` (the push
  and its reply run while the next minibatch computes), which takes its turn after the synchronous one.

Each repeat is: our job trains for a timed window of at least the target seconds, then is paused and the
children measure ``fit`` and TF PS for a few seconds each, one after the other. Ratios pair the windows of
one repeat.

How ours is timed: the job's :class:`TaskDispatcher` is wrapped (:class:`ControlledDispatcher`, bench code
only, installed before ``run()`` so the master service and pod manager use it). It timestamps every
successful training-task report; a worker runs its tasks strictly one after another, so the records of
the tasks it reported in a window divided by the time from its report just before the window to its last
report in it is its training rate with everything included: asking for a task, the ranged read, ``feed``,
every pull / compute / push step and the report. With several workers (the AllreduceStrategy benchmark),
tasks run concurrently and the job's rate is the sum of the workers' rates, each timed that way. To pause,
the wrapper answers ``WAIT`` to ``GetTask`` (the tasks in flight finish first); a worker's first task after
a resume is not timed (it includes the worker's polling delay). Warm-up: the first window starts only
after two tasks of every worker and three seconds of reports, which covers process start-up, the
TensorFlow import, the model build, the first PushModel, ``tf.function`` tracing and the PS's first
(XLA-compiled) update. At the end the wrapper answers ``DONE`` and reports the
job finished, so the job stops early and cleanly; publishing the model is skipped (not training).
"""

from __future__ import annotations

import dataclasses
import json
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

from edl_argo.collective.flags import ALLREDUCE
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
from tests.bench.step_breakdown import CountersTap, breakdown, breakdown_note

BATCH = 64
MINIBATCHES_PER_TASK = 8
MODELS = ROOT / "tests" / "bench" / "models"
#: Warm-up of our job before the first timed window: at least this many task reports and seconds of them.
WARMUP_TASKS = 2
WARMUP_SECONDS = 3.0
#: A baseline's step longer than this is a stall of the shared machine: the measurement is taken again
#: (:meth:`BaselineChild.measure_rate`). Seen once: `fit` of the LSTM read 280 examples/s (26 steps in 6 s)
#: in a repeat where it read 8,116 and 8,926 in the others. `fit`'s own slow steps stay in its figure: at
#: 1 s, ResNet-BN's `fit` was measured again twice in one run (steps of 1.0 s, 3,514 and 3,506 examples/s),
#: and read lower the second time (3,392 and 3,342); the big MLP's steps are 0.1 s.
STALL_SECONDS = 2.0
#: The baseline children (:mod:`tests.bench.train_baselines` kinds) and their rows.
BASELINES = {
    "fit": "`model.fit` (one process, numpy in memory)",
    "fit_tfdata": "`model.fit` on tf.data: RecordIO read and decoded every epoch, parallel map, prefetch",
    "tf_ps": "TF `ParameterServerStrategy`, 1 worker + 1 PS in one process",
}


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
    #: ``(label, TrainConfig overrides)``: more of our jobs measured next to the synchronous one (a row of
    #: the table each, and a note with its ratio to ``fit``).
    variants: tuple[tuple[str, dict[str, Any]], ...] = ()
    #: ``(ceiling in %, text)``: the worker's input wait must stay at most this share of its step.
    input_wait_goal: tuple[float, str] | None = None
    #: A variant's label -> ``(threshold, text)``: that variant ÷ ``fit`` must reach the threshold.
    variant_goals: dict[str, tuple[float, str]] = field(default_factory=dict)
    #: A variant's label -> ``(ceiling, text)``: the gradient bytes its busiest PS accepted over the mean of
    #: its PS (the job's own count, ``metrics.json``'s ``accounting``) must stay at most the ceiling.
    ps_balance_goals: dict[str, tuple[float, str]] = field(default_factory=dict)


#: Asynchronous SGD with ``--pipelined``: the push and its reply run while the next minibatch computes.
ASYNC_PIPELINED = (
    "ours: local job, 1 worker + 1 PS, async, `--pipelined`",
    {"use_async": True, "pipelined": True},
)


CNN = ModelCase(
    name="training_cnn",
    title="MNIST-style CNN (Conv32-Conv64-MaxPool-Dense128-Dense10, 1.2 M params, Adam)",
    model_def=MODELS / "mnist_cnn.py",
    num_ps=1,
    records=lambda quick: mnist_like_records(1024 if quick else 8192),
    goals=(("fit", 0.8, "CNN: ours ≥ 0.8× model.fit"),),
    variants=(ASYNC_PIPELINED,),
    input_wait_goal=(5.0, "CNN: worker waits for input < 5% of its step (%)"),
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
    goals=(("fit", 0.2, "digits MLP: ours ≥ 0.2× model.fit"),),
    variants=(ASYNC_PIPELINED,),
)
#: AllreduceStrategy with one worker (no PS): the same job's other strategy.
ALLREDUCE_ONE_WORKER = (
    "ours: local job, AllreduceStrategy, 1 worker",
    {"distribution_strategy": ALLREDUCE, "num_ps": 0, "num_workers": 1},
)
DENSE_SUITE = MODELS / "dense_suite.py"


#: The same job with 2 PS: with Adam, the big MLP's kernels in pieces spread over both
#: (:mod:`edl_argo.ps.pieces`).
TWO_PS = ("ours: local job, 1 worker + 2 PS, sync (big kernels in pieces)", {"num_ps": 2})


def _suite_case(
    factory: str,
    title: str,
    ps_goal: float,
    more_variants: tuple[tuple[str, dict[str, Any]], ...] = (),
    **extra: Any,
) -> ModelCase:
    """A model of the dense suite (``dense_suite.py:FACTORY``), both strategies against ``fit``, and
    ``more_variants`` of our job."""
    return ModelCase(
        name=f"suite_{factory}",
        title=title,
        model_def=Path(f"{DENSE_SUITE}:{factory}"),
        num_ps=1,
        records=lambda quick: digits_train_records(),
        goals=(("fit", ps_goal, f"{factory}: ours (1 worker + 1 PS, sync) ≥ {ps_goal}× model.fit"),),
        variants=(ALLREDUCE_ONE_WORKER, *more_variants),
        variant_goals={
            ALLREDUCE_ONE_WORKER[0]: (0.9, f"{factory}: ours (AllreduceStrategy) ≥ 0.9× model.fit")
        },
        **extra,
    )


BIG_MLP = _suite_case(
    "big_mlp",
    "big dense MLP (64→4096→4096→2048→10, 25.4 M params, Adam)",
    0.5,
    more_variants=(TWO_PS,),
    ps_balance_goals={TWO_PS[0]: (1.2, "big_mlp, 2 PS: gradient bytes of the busiest PS ÷ the mean ≤ 1.2")},
)
SUITE = (
    BIG_MLP,
    _suite_case(
        "resnet_bn", "ResNet-style CNN with BatchNormalization (2 residual blocks, 291 k params, Adam)", 0.8
    ),
    _suite_case(
        "transformer",
        "Transformer encoder (2 blocks, 4 heads, LayerNormalization, dropout, 69 k params, Adam)",
        0.8,
    ),
    _suite_case("lstm", "LSTM(128) → LSTM(128) over the image's rows (203 k params, Adam)", 0.8),
)


# ------------------------------------------------------------------------------------------ our job


class TaskReport(NamedTuple):
    """One successful training-task report, as :class:`ControlledDispatcher` saw it."""

    #: ``time.perf_counter()`` when the report arrived.
    at: float
    records: int
    worker_id: int
    task_id: int = -1


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
        #: Every successful training report, in arrival order.
        self.reports: list[TaskReport] = []

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
                self.reports.append(TaskReport(time.perf_counter(), self._sizes[task_id], worker_id, task_id))
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
    """A :class:`TrainingJob` that does not publish the model at the end (not part of training), and whose
    accounting does not fail it: the benchmark stops it in the middle of an epoch (of 100,000), so what it
    trained cannot add up to whole epochs. The accounting is kept, for the PS's counts."""

    def _export(self, metrics: dict[str, Any]) -> None:
        pass

    def _check_accounting(self, metrics: dict[str, Any]) -> None:
        metrics["accounting"], _ = self.accounting_section()


@dataclass
class Window:
    """One timed stretch of our job."""

    #: The sum of every worker's rate (records of its timed tasks ÷ the time they took).
    examples_per_s: float
    #: The longest worker's timed stretch.
    seconds: float
    records: int
    #: The tasks timed.
    task_ids: tuple[int, ...] = ()


def _latest_report_per_worker(reports: Sequence[TaskReport]) -> dict[int, int]:
    """The index of each worker's last report in ``reports``."""
    return {report.worker_id: i for i, report in enumerate(reports)}


def _first_report_per_worker(reports: Sequence[TaskReport], start: int) -> dict[int, int]:
    """The index of each worker's first report in ``reports[start:]``."""
    first: dict[int, int] = {}
    for i, report in enumerate(reports[start:]):
        first.setdefault(report.worker_id, start + i)
    return first


def timed_window(reports: Sequence[TaskReport], starts: dict[int, int]) -> Window:
    """Each worker's rate from its report at ``starts[worker]`` to its last one, summed over the workers.

    A worker runs its tasks one after another, so the records of the tasks it reported after its start
    report, divided by the time from that report to its last one, is its training rate; workers train at
    the same time, so the job's rate is the sum.
    """
    rate, longest, records = 0.0, 0.0, 0
    task_ids: list[int] = []
    for worker, start in starts.items():
        mine = [report for report in reports[start:] if report.worker_id == worker]
        elapsed = mine[-1].at - mine[0].at
        done = sum(report.records for report in mine[1:])
        rate += done / elapsed
        longest = max(longest, elapsed)
        records += done
        task_ids += [report.task_id for report in mine[1:]]
    return Window(rate, longest, records, tuple(task_ids))


@dataclass
class OurJob:
    """One local job run in a background thread, paused between timed windows."""

    case: ModelCase
    data: Path
    workdir: Path
    #: The backend's log sink (every pod's output lines).
    log: IO[str]
    #: :class:`TrainConfig` fields that differ from the PS job of the module docstring (e.g. more workers,
    #: AllreduceStrategy).
    overrides: dict[str, Any] = field(default_factory=dict)
    #: The job's name (default: ``bench-`` and the case's name).
    name: str = ""
    job: TrainingJob = field(init=False)
    control: ControlledDispatcher = field(init=False)
    error: BaseException | None = None
    #: What the job returned once stopped (``metrics.json``'s content), None before or if it failed.
    metrics: dict[str, Any] | None = None
    #: When the job was first resumed, and when its first task report came (``time.perf_counter()``).
    first_resume: float = 0.0
    first_report: float = 0.0

    def __post_init__(self) -> None:
        name = self.name or f"bench-{self.case.name.replace('_', '-')}"
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
        config = dataclasses.replace(config, **self.overrides)
        self.job = _BenchJob.load(config, backend=LocalProcessBackend(name, log_sink=self.log))
        self.control = ControlledDispatcher(self.job.dispatcher)
        self.job.dispatcher = self.control  # type: ignore[assignment]
        self.tap = CountersTap(self.job.ledger)
        self.job.ledger = self.tap  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._run, name=f"{name}-master", daemon=True)

    def _run(self) -> None:
        try:
            self.metrics = self.job.run()
        except BaseException as error:  # surfaced by the waits
            self.error = error

    def start(self) -> None:
        self._thread.start()

    def breakdown_note(self, label: str, windows: Sequence[Window]) -> str:
        """The workers' time per step in ``windows`` (:mod:`tests.bench.step_breakdown`)."""
        task_ids = [task_id for window in windows for task_id in window.task_ids]
        steps = sum(window.records for window in windows) // BATCH
        return breakdown_note(label, breakdown(self.tap, task_ids, steps))

    def ps_balance(self) -> tuple[list[int], float] | None:
        """Once stopped, with several PS: the gradient bytes each PS accepted and the busiest ÷ the mean,
        from the job's own accounting; None otherwise."""
        accounting = (self.metrics or {}).get("accounting", {})
        rows = accounting.get("parameter_servers", [])
        if len(rows) < 2 or "gradient_bytes_max_over_mean" not in accounting:
            return None
        return [row["gradient_bytes_accepted"] for row in rows], accounting["gradient_bytes_max_over_mean"]

    def input_wait_percents(self, windows: Sequence[Window]) -> list[float]:
        """Per window, the share of the workers' step spent waiting for input, in percent."""
        shares = []
        for window in windows:
            per_step = breakdown(self.tap, window.task_ids, max(1, window.records // BATCH))
            shares.append(100.0 * per_step["input"] / (sum(per_step.values()) or 1.0))
        return shares

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Return once ``condition()`` holds; raise if the job ends first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.error is not None or not self._thread.is_alive():
                raise RuntimeError(f"our {self.case.name} job ended while waiting for {what}: {self.error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"our {self.case.name} job: timed out waiting for {what}")
            time.sleep(0.05)

    def window(self, seconds: float, first: bool, timeout: float = 900.0) -> Window:
        """Resume, time at least ``seconds`` of every worker's training (after the warm-up or each worker's
        first task), pause; see :func:`timed_window`."""
        reports = self.control.reports
        workers = self.job.config.num_workers
        mark = len(reports)
        self.control.resume()
        if first:
            self.first_resume = time.perf_counter()

            def warmed_up() -> bool:
                counts = Counter(report.worker_id for report in list(reports))
                return len(counts) >= workers and min(counts.values()) >= WARMUP_TASKS

            self.wait_until(warmed_up, timeout, "the first task reports")
            self.first_report = reports[0].at
            self.wait_until(
                lambda: reports[-1].at - self.first_report >= WARMUP_SECONDS, timeout, "the warm-up tasks"
            )
            starts = _latest_report_per_worker(list(reports))  # each worker's last warm-up report
        else:
            self.wait_until(
                lambda: len(_first_report_per_worker(list(reports), mark)) >= workers,
                timeout,
                "every worker's first task after resuming",
            )
            starts = _first_report_per_worker(list(reports), mark)

        def long_enough() -> bool:
            latest = _latest_report_per_worker(list(reports))
            return all(reports[latest[w]].at - reports[i].at >= seconds for w, i in starts.items())

        self.wait_until(long_enough, timeout, "a timed window")
        self.control.pause()
        self.wait_until(lambda: self.control.idle, timeout, "the tasks in flight")
        return timed_window(list(reports), starts)

    def stop(self, timeout: float = 120.0) -> None:
        """End the job (DONE to the workers) and wait for its clean-up."""
        self.control.stop()
        if self._thread.ident is None:  # never started
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.job.backend.close(grace_seconds=2.0)


# ------------------------------------------------------------------------------------ the baselines


class BaselineChild:
    """One :mod:`tests.bench.train_baselines` process: ``kind`` is ``fit`` or ``tf_ps``."""

    def __init__(
        self,
        kind: str,
        case: ModelCase,
        data: Path,
        warmup_steps: int,
        log_path: Path,
        more_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], object] | None = None,
    ) -> None:
        """``more_args``: more flags of :mod:`tests.bench.train_baselines`; ``env``: the child's environment
        (default :func:`~tests.bench.common.child_env`); ``preexec_fn``: run in the child before it starts
        (:mod:`tests.bench.cpu_limit` moves it into a cgroup)."""
        self.kind = kind
        #: (examples/s, longest step in s) of each measurement :meth:`measure_rate` took again.
        self.stalls: list[tuple[float, float]] = []
        #: Per measurement :meth:`measure_rate` kept, the epoch boundaries its window crossed: (how many,
        #: their steps' seconds in all, examples/s with them counted in); none for a baseline without epochs.
        self.epoch_boundaries: list[tuple[int, float, float]] = []
        self._log_path = log_path
        self._log = log_path.open("ab")
        command = ["-m", "tests.bench.train_baselines", "--kind", kind, "--model-def", str(case.model_def)]
        command += ["--data", str(data), "--warmup-steps", str(warmup_steps), *more_args]
        self.process = subprocess.Popen(
            [sys.executable, *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
            env=env or child_env(),
            start_new_session=True,
            preexec_fn=preexec_fn,
        )

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the {self.kind} baseline process did not answer; {tail(self._log_path)}")
        return json.loads(line)

    def wait_ready(self, timeout: float = 900.0) -> dict[str, Any]:
        """Its ``ready`` line, once it has warmed up."""
        return self._answer(timeout)

    def measure(self, seconds: float, timeout: float = 600.0) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"measure {seconds}\n".encode())
        self.process.stdin.flush()
        return self._answer(timeout)

    def measure_rate(self, seconds: float, log: Callable[[str], None]) -> float:
        """Examples/s over about ``seconds``; measured once more when one of its steps took longer than
        :data:`STALL_SECONDS` (the machine stalled, not ``fit``): the second measurement is kept, whatever
        it reads, and the stall listed in :attr:`stalls`, which the report prints. Our job's windows are not
        measured again: they are 22 s long, where a stall of seconds moves the figure by a fraction, not by
        the factor it took from a 6 s baseline window."""
        answer = self.measure(seconds)
        longest = float(answer.get("longest_step_s", 0.0))
        if longest > STALL_SECONDS:
            rate = answer["examples_per_s"]
            log(f"    {self.kind}: one step took {longest:.1f} s ({rate:,.0f} ex/s): measured again")
            self.stalls.append((rate, longest))
            answer = self.measure(seconds)
        if "epoch_boundaries" in answer:
            self.epoch_boundaries.append(
                (
                    int(answer["epoch_boundaries"]),
                    float(answer["epoch_boundary_s"]),
                    float(answer["examples_per_s_with_epochs"]),
                )
            )
        return float(answer["examples_per_s"])

    def close(self) -> None:
        kill_group(self.process)
        self._log.close()


# ---------------------------------------------------------------------------------------- benchmark


@dataclass(frozen=True)
class Timing:
    """How long the windows of :func:`take_turns` last."""

    #: Seconds of each baseline measurement.
    baseline_seconds: float
    #: At least this many seconds of every job window.
    target_seconds: float
    #: Untimed steps of each baseline child before it reports ready.
    baseline_warmup_steps: int

    @classmethod
    def of(cls, ctx: BenchContext) -> Timing:
        return cls(1.5, 3.0, 5) if ctx.quick else cls(6.0, 22.0, 20)


def take_turns(
    ctx: BenchContext,
    label: str,
    jobs: dict[str, OurJob],
    children: dict[str, BaselineChild],
    timing: Timing,
) -> tuple[dict[str, list[Window]], dict[str, list[float]]]:
    """Start ``jobs`` paused (their start-up overlaps the baselines' warm-up, their training does not),
    wait for ``children``, then per repeat: one timed window of each job, then each baseline's measurement,
    one after the other. Returns the windows by job and the baselines' examples/s by kind; stops the jobs
    and closes the children in any case."""
    repeats = 1 if ctx.quick else ctx.repeats
    windows: dict[str, list[Window]] = {name: [] for name in jobs}
    rates: dict[str, list[float]] = {kind: [] for kind in children}
    try:
        for job in jobs.values():
            job.start()
        ctx.log(f"  {label}: warming up the baselines")
        for child in children.values():
            child.wait_ready()
        for repeat in range(repeats):
            for name, job in jobs.items():
                ctx.log(f"  {label} repeat {repeat + 1}/{repeats}: {name}")
                windows[name].append(job.window(timing.target_seconds, first=repeat == 0))
            ctx.log(f"  {label} repeat {repeat + 1}/{repeats}: baselines")
            for kind, child in children.items():
                rates[kind].append(child.measure_rate(timing.baseline_seconds, ctx.log))
            ctx.log(
                "    "
                + "  ".join(
                    f"{name} {measured[-1].examples_per_s:,.0f} ex/s ({measured[-1].seconds:.1f} s)"
                    for name, measured in windows.items()
                )
                + "".join(f"  {kind} {measured[-1]:,.0f}" for kind, measured in rates.items())
            )
    finally:
        for job in jobs.values():
            job.stop()
        for child in children.values():
            child.close()
    return windows, rates


def run_case(ctx: BenchContext, case: ModelCase) -> BenchResult:
    """Measure ``case`` (see the module docstring) and tabulate the ratios."""
    folder = ctx.folder(case.name)
    records = case.records(ctx.quick)
    data = Path(write_records(folder / "data", records))
    timing = Timing.of(ctx)
    children = {
        kind: BaselineChild(kind, case, data, timing.baseline_warmup_steps, folder / f"{kind}.log")
        for kind in BASELINES
    }
    with (folder / "job.log").open("a") as job_log:
        job = OurJob(case, data, folder, job_log)
        variants = {
            label: OurJob(case, data, folder, job_log, overrides=overrides, name=f"bench-{case.name}-{index}")
            for index, (label, overrides) in enumerate(case.variants, start=1)
        }
        windows, rates = take_turns(ctx, case.name, {"ours": job, **variants}, children, timing)
    result = _tabulate(case, records, windows["ours"], rates, job, timing.baseline_seconds)
    for kind, child in children.items():
        if child.stalls:
            stalls = ", ".join(
                f"{rate:,.0f} examples/s with a step of {step:.1f} s" for rate, step in child.stalls
            )
            result.notes.append(
                f"{BASELINES[kind]}: measured again after a stall of the machine ({stalls}); "
                "the second measurement is the one shown."
            )
    ours = [w.examples_per_s for w in windows["ours"]]
    for kind, child in children.items():
        note = epoch_boundaries_note(BASELINES[kind], child.epoch_boundaries, ours)
        if note:
            result.notes.append(note)
    for label, variant in variants.items():
        measured = [w.examples_per_s for w in windows[label]]
        result.rows.append(
            {
                "measurement": label,
                "examples/s": Stat.of(measured),
                "ours ÷ this": ratio_stat(ours, measured),
                "timed per repeat": Stat.of([w.seconds for w in windows[label]]).format(0) + " s",
            }
        )
        versus_fit = ratio_stat(measured, rates["fit"])
        result.notes.append(f"{label} ÷ `model.fit`: {versus_fit.format(2)}.")
        if label in case.variant_goals:
            threshold, text = case.variant_goals[label]
            result.goals.append(Goal(text, versus_fit, threshold))
        result.notes.append(variant.breakdown_note(label, windows[label]))
    for label, each in {"ours": job, **variants}.items():
        balance = each.ps_balance()
        if balance is not None:
            shares, max_over_mean = balance
            result.notes.append(
                f"{label}: gradient bytes each PS accepted over the whole job (its own count): "
                f"{', '.join(f'{b / 1e9:.3f} GB' for b in shares)}; busiest ÷ mean {max_over_mean:.3f}."
            )
            if label in case.ps_balance_goals:
                ceiling, text = case.ps_balance_goals[label]
                result.goals.append(Goal(text, Stat.of([max_over_mean]), ceiling, at_most=True))
        elif label in case.ps_balance_goals:
            raise RuntimeError(f"{label}: the job ended without its accounting ({each.error!r})")
    return result


def epoch_boundaries_note(
    title: str, boundaries: Sequence[tuple[int, float, float]], ours: Sequence[float]
) -> str:
    """What the epoch boundaries a ``fit`` baseline's windows crossed cost it (they are left out of its
    figure: see :class:`tests.bench.train_baselines._StepTimer`), and ours ÷ that baseline with them counted
    in; "" when its windows crossed none."""
    count = sum(n for n, _, _ in boundaries)
    if not count:
        return ""
    seconds = [s / n for n, s, _ in boundaries if n]
    mean = sum(s for _, s, _ in boundaries) / count
    with_epochs = [rate for _, _, rate in boundaries]
    return (
        f"{title}: its figures are its steady state; the steps that crossed an epoch boundary ({count} in "
        f"its timed windows, {mean:.3f} s each on average, the slowest window's {max(seconds):.3f} s) are "
        f"left out. Counted in, it reads {Stat.of(with_epochs).format(0)} examples/s, and ours ÷ that is "
        f"{ratio_stat(ours, with_epochs).format(2)}."
    )


def _tabulate(
    case: ModelCase,
    records: list[bytes],
    ours: list[Window],
    baselines: dict[str, list[float]],
    job: OurJob,
    baseline_seconds: float,
) -> BenchResult:
    rates = [w.examples_per_s for w in ours]
    vs = {kind: ratio_stat(rates, baselines[kind]) for kind in BASELINES}
    result = BenchResult(
        name=case.name,
        title=f"Training: {case.title}",
        method=(
            f"Model file `{case.model_def.relative_to(ROOT)}`, {len(records):,} distinct training records "
            f"(repeated as epochs), batch 64; {len(ours)} repeats, each one window of our job then "
            f"{baseline_seconds:g} s of each baseline. "
            "See *How the training benchmarks measure* below."
        ),
        columns=["measurement", "examples/s", "ours ÷ this", "timed per repeat"],
    )
    per_repeat = f"{baseline_seconds:g} s"
    result.rows = [
        {
            "measurement": BASELINES[kind],
            "examples/s": Stat.of(baselines[kind]),
            "ours ÷ this": vs[kind],
            "timed per repeat": per_repeat,
        }
        for kind in BASELINES
    ]
    result.rows += [
        {
            "measurement": f"ours: local job, 1 worker + {case.num_ps} PS, sync",
            "examples/s": Stat.of(rates),
            "ours ÷ this": "1",
            "timed per repeat": Stat.of([w.seconds for w in ours]).format(0) + " s",
        },
    ]
    result.goals = [Goal(text, vs[key], threshold) for key, threshold, text in case.goals]
    if case.input_wait_goal is not None:
        ceiling, text = case.input_wait_goal
        result.goals.append(Goal(text, Stat.of(job.input_wait_percents(ours)), ceiling, at_most=True))
    result.notes.append(
        "Our job's PS and worker processes start while the baselines warm up; once the job is let go, its "
        f"first task (model build, first PushModel, tracing, first update) reports after "
        f"{job.first_report - job.first_resume:.1f} s."
    )
    result.notes.append(job.breakdown_note("ours", ours))
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


def _suite_benchmark(case: ModelCase) -> Callable[[BenchContext], BenchResult]:
    def benchmark(ctx: BenchContext) -> BenchResult:
        return run_case(ctx, case)

    benchmark.__doc__ = f"Training throughput of the dense suite's {case.title}, both strategies."
    return benchmark


#: The dense suite's benchmarks by name (``suite_big_mlp``, ...).
SUITE_BENCHMARKS = {case.name: _suite_benchmark(case) for case in SUITE}
