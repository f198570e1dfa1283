"""AllreduceStrategy benchmarks: the ring allreduce's bandwidth, a CNN's training throughput with 1 and 2
workers, and how long the group takes to train again after a member is SIGKILLed.

* ``allreduce_throughput`` (:func:`allreduce_throughput`): :class:`~edl_argo.collective.CollectiveGroup`
  allreduces between processes against a plain TCP byte copy around the same ring;
* ``allreduce_cnn`` (:func:`allreduce_cnn`): examples/s of AllreduceStrategy jobs against ``model.fit``,
  with the machinery of :mod:`tests.bench.training`;
* ``allreduce_recovery`` (:func:`allreduce_recovery`): from a SIGKILL to the survivors' next step.

This module imports TensorFlow and the dataset code only inside the two training benchmarks: the throughput
benchmark's member processes (``multiprocessing`` spawn) import this module and need nothing but numpy, gRPC
and the collective code.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import multiprocessing
import os
import re
import signal
import socket
import statistics
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from edl_argo.collective import CollectiveGroup, CollectiveServer
from edl_argo.collective.flags import ALLREDUCE
from edl_argo.collective.transport import PeerConnections
from edl_argo.pods import PodRole
from tests.bench.common import BenchContext, BenchResult, Goal, Stat, ratio_stat

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier

    from tests.bench.training import OurJob

#: The MNIST CNN's trainable parameters (``tests/bench/models/mnist_cnn.py``); a training step allreduces
#: them and two more floats (the examples and the loss).
CNN_PARAMETERS = 1_199_882
VECTOR_LENGTH = CNN_PARAMETERS + 2
VECTOR_BYTES = VECTOR_LENGTH * 4  # float32
MB = 1e6
#: Operations of each kind run untimed twice per member set: to warm up, then to choose the timed count.
CALIBRATION_OPERATIONS = 3
#: How long the parent waits for a member process's answer, and a member for a collective piece.
MEMBER_TIMEOUT = 300.0
#: Target seconds of each timed run of the throughput benchmark (quick mode, full mode).
RING_SECONDS = {True: 1.0, False: 5.0}
#: The two kinds of ring operation the throughput benchmark times.
KIND_ALLREDUCE, KIND_COPY = "allreduce", "copy"
#: ``allreduce_cnn --quick``: minibatches per task (the timed windows and the warm-up are whole tasks).
QUICK_MINIBATCHES_PER_TASK = 2


def _method(benchmark: Callable[..., Any]) -> str:
    """A benchmark function's docstring, as the report's method text."""
    return inspect.cleandoc(benchmark.__doc__ or "")


def _allreduce_job(workers: int, **extra: Any) -> dict[str, Any]:
    """The :class:`TrainConfig` fields of an AllreduceStrategy job with ``workers`` workers."""
    return {"distribution_strategy": ALLREDUCE, "num_ps": 0, "num_workers": workers, **extra}


# ------------------------------------------------------------------------------- allreduce_throughput


def _copy_around_ring(
    right: socket.socket, left: socket.socket, payload: memoryview, buffer: bytearray, count: int
) -> None:
    """Send ``payload`` ``count`` times to the right neighbour while receiving as many bytes from the left
    one into ``buffer`` (the sends run in a thread, so that no member blocks the ring)."""
    failures: list[OSError] = []

    def send() -> None:
        try:
            for _ in range(count):
                right.sendall(payload)
        except OSError as error:
            failures.append(error)

    sender = threading.Thread(target=send, name="ring-copy-send", daemon=True)
    sender.start()
    view = memoryview(buffer)
    for _ in range(count):
        received = 0
        while received < len(view):
            got = left.recv_into(view[received:])
            if not got:
                raise ConnectionError("the left neighbour closed the copy connection")
            received += got
    sender.join()
    if failures:
        raise failures[0]


def _serve_member(rank: int, size: int, pipe: Connection, barrier: Barrier) -> None:
    """One member process's work: listen, connect the rings, then answer ``("run", kind, count)`` requests
    with ``("elapsed", seconds)`` (timed after all members passed ``barrier``) until ``("quit",)``."""
    server = CollectiveServer("127.0.0.1", 0, lambda _round: None)
    peer_connections = PeerConnections()
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[socket.socket] = [listener]
    try:
        pipe.send(("address", server.address, listener.getsockname()[1]))
        _, peers = pipe.recv()
        right = socket.create_connection(("127.0.0.1", peers[(rank + 1) % size][1]))
        connections.append(right)
        left, _ = listener.accept()
        connections.append(left)
        group = CollectiveGroup(
            round_id=1,
            rank=rank,
            members=[(member, address) for member, (address, _port) in enumerate(peers)],
            mailbox=server.mailbox,
            peers=peer_connections,
            round_is_current=lambda: True,
            timeout=MEMBER_TIMEOUT,
        )
        vector = np.full(VECTOR_LENGTH, rank + 1, dtype=np.float32)
        payload = memoryview(vector.view(np.uint8))
        buffer = bytearray(VECTOR_BYTES)
        expected = size * (size + 1) / 2
        while (request := pipe.recv())[0] == "run":
            _, kind, count = request
            barrier.wait(MEMBER_TIMEOUT)
            started = time.perf_counter()
            if kind == KIND_ALLREDUCE:
                for _ in range(count):
                    total = group.allreduce(vector)
            else:
                _copy_around_ring(right, left, payload, buffer, count)
            elapsed = time.perf_counter() - started
            if kind == KIND_ALLREDUCE and not np.all(total == expected):
                raise RuntimeError(f"the allreduce returned a wrong sum (expected {expected} everywhere)")
            pipe.send(("elapsed", elapsed))
    finally:
        for connection in connections:
            connection.close()
        peer_connections.close()
        server.stop()


def _member_main(rank: int, size: int, pipe: Connection, barrier: Barrier) -> None:
    """Entry point of a member process: :func:`_serve_member`, reporting any failure on ``pipe``."""
    try:
        _serve_member(rank, size, pipe, barrier)
    except BaseException as error:
        with contextlib.suppress(OSError):
            pipe.send(("error", f"member {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}"))


class RingMembers:
    """``size`` member processes (``multiprocessing`` spawn) on loopback, each with one
    :class:`CollectiveServer` and :class:`CollectiveGroup` (one round, always current) and two plain TCP
    connections: to its right neighbour and from its left one."""

    def __init__(self, size: int) -> None:
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(size)
        self._pipes: list[Connection] = []
        self._processes: list[Any] = []
        for rank in range(size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_member_main,
                args=(rank, size, theirs, barrier),
                name=f"ring-member-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._pipes.append(ours)
            self._processes.append(process)
        peers = [self._answer(pipe, "address") for pipe in self._pipes]
        for pipe in self._pipes:
            pipe.send(("peers", peers))

    def _answer(self, pipe: Connection, kind: str) -> tuple[Any, ...]:
        if not pipe.poll(MEMBER_TIMEOUT):
            raise RuntimeError(f"a ring member did not answer within {MEMBER_TIMEOUT:.0f} s")
        try:
            message = pipe.recv()
        except EOFError:
            raise RuntimeError("a ring member process died (see its traceback above)") from None
        if message[0] == "error":
            raise RuntimeError(message[1])
        assert message[0] == kind, message
        return tuple(message[1:])

    def run(self, kind: str, count: int) -> list[float]:
        """Every member runs ``count`` operations of ``kind`` at once; the seconds each one took."""
        for pipe in self._pipes:
            pipe.send(("run", kind, count))
        return [self._answer(pipe, "elapsed")[0] for pipe in self._pipes]

    def close(self) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send(("quit",))
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self._pipes:
            pipe.close()


def _measure_ring(ctx: BenchContext, size: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """MB/s per member (mean over the members) of each kind, per repeat; and the operations per repeat."""
    seconds = RING_SECONDS[ctx.quick]
    repeats = 1 if ctx.quick else ctx.repeats
    members = RingMembers(size)
    try:
        counts: dict[str, int] = {}
        for kind in (KIND_ALLREDUCE, KIND_COPY):
            members.run(kind, CALIBRATION_OPERATIONS)  # warm-up: connections, buffers, TCP windows
            per_operation = max(members.run(kind, CALIBRATION_OPERATIONS)) / CALIBRATION_OPERATIONS
            counts[kind] = max(CALIBRATION_OPERATIONS, math.ceil(seconds / per_operation))
        rates: dict[str, list[float]] = {kind: [] for kind in counts}
        for repeat in range(repeats):
            for kind, count in counts.items():
                elapsed = members.run(kind, count)
                rates[kind].append(statistics.mean(VECTOR_BYTES * count / e / MB for e in elapsed))
            ctx.log(
                f"  {size} members, repeat {repeat + 1}/{repeats}: "
                + "  ".join(f"{kind} {rates[kind][-1]:,.0f} MB/s" for kind in counts)
            )
    finally:
        members.close()
    return rates, counts


def allreduce_throughput(ctx: BenchContext) -> BenchResult:
    """For 2 and 3 members, each member a process of its own (``multiprocessing`` spawn) on loopback with
    one ``CollectiveServer`` and one ``CollectiveGroup`` (one round that never ends): every member
    allreduces a float32 vector of 1,199,884 elements (4.8 MB: the MNIST CNN's 1.2 M parameters and the
    two floats a training step adds) again and again. **Ours** is the vector's megabytes (10⁶ bytes) times
    the operations, divided by the seconds they took, averaged over the members. The **copy** baseline runs
    between the same processes in the same run: each member sends the vector's bytes to its right
    neighbour over a plain TCP socket (``sendall``, in a thread) while receiving as many from its left one
    (``recv_into`` into one buffer), MB sent per second and per member. A ring allreduce sends and receives
    2(n−1)/n times the vector per member (reduce-scatter, then all-gather), so an allreduce moving its
    bytes as fast as the copy would reach n / (2(n−1)) of the copy's figure: the *copy bound* column.

    Each kind of operation first runs 3 untimed operations twice (warm-up, then to choose the count that
    takes the target seconds); every timed run starts when all members have passed a barrier. Repeats
    alternate the two kinds.
    """
    result = BenchResult(
        name="allreduce_throughput",
        title="Ring allreduce bandwidth (AllreduceStrategy, loopback)",
        method=_method(allreduce_throughput),
        columns=["members", "transfer", "MB/s per member", "÷ copy", "copy bound", "operations per repeat"],
    )
    for size in (2, 3):
        rates, counts = _measure_ring(ctx, size)
        result.rows += [
            {
                "members": str(size),
                "transfer": "copy: plain TCP ring, `sendall` right, `recv_into` from the left",
                "MB/s per member": Stat.of(rates[KIND_COPY]),
                "÷ copy": "1",
                "copy bound": "1",
                "operations per repeat": str(counts[KIND_COPY]),
            },
            {
                "members": str(size),
                "transfer": "ours: `CollectiveGroup.allreduce` (TCP frames), vector MB per second",
                "MB/s per member": Stat.of(rates[KIND_ALLREDUCE]),
                "÷ copy": ratio_stat(rates[KIND_ALLREDUCE], rates[KIND_COPY]),
                "copy bound": f"{size / (2 * (size - 1)):.2f}",
                "operations per repeat": str(counts[KIND_ALLREDUCE]),
            },
        ]
    repeats = 1 if ctx.quick else ctx.repeats
    result.notes.append(
        f"{repeats} repeat(s) of about {RING_SECONDS[ctx.quick]:g} s per kind and member count; "
        f"{VECTOR_BYTES / MB:.1f} MB per operation. The member processes share this machine's "
        f"{os.cpu_count()} cores with each other and with whatever else runs."
    )
    return result


# ---------------------------------------------------------------------------------------- allreduce_cnn


def allreduce_cnn(ctx: BenchContext) -> BenchResult:
    """The MNIST-style CNN (``tests/bench/models/mnist_cnn.py``, 1.2 M parameters, Adam, batch 64) trained
    by two local AllreduceStrategy jobs, one with 1 worker and one with 2, and by plain ``model.fit`` in a
    child process, taking turns as in the training benchmarks (see *How the training benchmarks measure*
    below): per repeat, a timed window of the 1-worker job, then one of the 2-worker job, then ``fit``.
    With 2 workers both workers' task reports are timed, each worker's rate over its own reports, and the
    job's rate is their sum. A group step trains one minibatch of 64 on every worker, so group steps/s is
    examples/s ÷ (64 × workers); ``fit``'s steps/s is examples/s ÷ 64.
    """
    from tests.bench import training  # TensorFlow: not in the member processes of the throughput benchmark
    from tests.bench.data import write_records

    case = training.CNN
    folder = ctx.folder("allreduce_cnn")
    records = case.records(ctx.quick)
    data = Path(write_records(folder / "data", records))
    timing = training.Timing.of(ctx)
    # Quick mode: shorter tasks, so that the warm-up and the windows (whole tasks) take seconds.
    quick_tasks = {"num_minibatches_per_task": QUICK_MINIBATCHES_PER_TASK} if ctx.quick else {}
    children = {
        kind: training.BaselineChild(kind, case, data, timing.baseline_warmup_steps, folder / f"{kind}.log")
        for kind in ("fit", "fit_tfdata")
    }
    labels = {1: "ours, 1 worker", 2: "ours, 2 workers"}
    with contextlib.ExitStack() as logs:
        jobs = {
            labels[workers]: training.OurJob(
                case,
                data,
                folder,
                logs.enter_context((folder / f"job-{workers}-workers.log").open("a")),
                overrides=_allreduce_job(workers, **quick_tasks),
                name=f"bench-allreduce-cnn-{workers}w",
            )
            for workers in labels
        }
        windows, rates = training.take_turns(ctx, "allreduce_cnn", jobs, children, timing)
    fit_rates, tfdata_rates = rates["fit"], rates["fit_tfdata"]
    result = BenchResult(
        name="allreduce_cnn",
        title=f"AllreduceStrategy training: {case.title}",
        method=_method(allreduce_cnn)
        + f" {len(records):,} distinct training records (repeated as epochs); {len(fit_rates)} repeat(s)"
        + (f"; tasks of {QUICK_MINIBATCHES_PER_TASK} minibatches (quick mode)." if ctx.quick else "."),
        columns=[
            "measurement",
            "examples/s",
            "steps/s",
            "÷ model.fit",
            "÷ fit on tf.data",
            "÷ ours, 1 worker",
            "timed per repeat",
        ],
    )
    for kind, baseline in rates.items():
        result.rows.append(
            {
                "measurement": training.BASELINES[kind],
                "examples/s": Stat.of(baseline),
                "steps/s": Stat.of([rate / training.BATCH for rate in baseline]),
                "÷ model.fit": "1" if kind == "fit" else "",
                "÷ fit on tf.data": "1" if kind == "fit_tfdata" else "",
                "÷ ours, 1 worker": "",
                "timed per repeat": f"{timing.baseline_seconds:g} s",
            }
        )
    one_worker = [w.examples_per_s for w in windows[labels[1]]]
    for workers, label in labels.items():
        ours = [w.examples_per_s for w in windows[label]]
        result.rows.append(
            {
                "measurement": f"{label}, AllreduceStrategy (local job)",
                "examples/s": Stat.of(ours),
                "steps/s": Stat.of([rate / (training.BATCH * workers) for rate in ours]),
                "÷ model.fit": ratio_stat(ours, fit_rates),
                "÷ fit on tf.data": ratio_stat(ours, tfdata_rates),
                "÷ ours, 1 worker": ratio_stat(ours, one_worker) if workers > 1 else "1",
                "timed per repeat": Stat.of([w.seconds for w in windows[label]]).format(0) + " s",
            }
        )
    two_workers = [w.examples_per_s for w in windows[labels[2]]]
    result.goals = [
        Goal(
            "AllreduceStrategy, 1 worker, CNN: ours ≥ 0.9× model.fit", ratio_stat(one_worker, fit_rates), 0.9
        ),
        Goal(
            "AllreduceStrategy, CNN: 2 workers ≥ 0.95× 1 worker (on this 2-core machine)",
            ratio_stat(two_workers, one_worker),
            0.95,
        ),
    ]
    first_steps = ", ".join(
        f"{label} {job.first_report - job.first_resume:.1f} s" for label, job in jobs.items()
    )
    result.notes += [
        "Each job's workers start while the baseline warms up; once a job is let go, its first task (model "
        f"build, first round, tracing) reports after: {first_steps}.",
        "While one job trains, the paused one's workers make idle group steps (an allreduce of zeros, "
        "backing off to one a second). Every process shares this machine's "
        f"{os.cpu_count()} cores and each worker's TensorFlow uses all of them, so on a machine with few "
        "cores two workers cannot train twice as fast as one: the 2-worker figure mostly shows what the "
        "collective costs.",
    ]
    result.notes += [job.breakdown_note(label, windows[label]) for label, job in jobs.items()]
    return result


# ----------------------------------------------------------------------------------- allreduce_recovery


#: The workers' group events the recovery benchmark times, as the backend's log sink receives them.
GROUP_FORMED, ROUND_FIRST_STEP = "group_formed", "round_first_step"
_GROUP_EVENT = re.compile(
    rf"^\[worker-(\d+)\] .*\b({GROUP_FORMED}|{ROUND_FIRST_STEP}) round=(\d+) .*\bworld_size=(\d+)"
)


@dataclass(frozen=True)
class GroupEvent:
    """A worker's ``group_formed`` (it holds the round's state) or ``round_first_step`` (it completed its
    first step in the round) line."""

    #: ``time.perf_counter()`` when the line reached the sink.
    at: float
    event: str
    worker_id: int
    round_id: int
    world_size: int

    def is_step(self) -> bool:
        return self.event == ROUND_FIRST_STEP


class GroupEventSink(io.TextIOBase):
    """A :class:`LocalProcessBackend` log sink: copies every pod line to ``file`` and keeps the workers'
    group events with their arrival times (the backend writes one line per call)."""

    def __init__(self, file: IO[str]) -> None:
        super().__init__()
        self._file = file
        self._lock = threading.Lock()
        self._events: list[GroupEvent] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        arrived = time.perf_counter()
        self._file.write(text)
        match = _GROUP_EVENT.search(text)
        if match is not None:
            event = GroupEvent(arrived, match[2], int(match[1]), int(match[3]), int(match[4]))
            with self._lock:
                self._events.append(event)
        return len(text)

    def flush(self) -> None:
        self._file.flush()

    @property
    def events(self) -> list[GroupEvent]:
        """A copy of the events seen so far, in arrival order."""
        with self._lock:
            return list(self._events)

    def first(self, wanted: Callable[[GroupEvent], bool], start: int) -> GroupEvent | None:
        """The first event from index ``start`` on for which ``wanted`` holds."""
        return next((event for event in self.events[start:] if wanted(event)), None)

    def wait_for(
        self, job: OurJob, wanted: Callable[[GroupEvent], bool], start: int, timeout: float, what: str
    ) -> GroupEvent:
        """The first event from ``start`` on for which ``wanted`` holds, once it arrives."""
        job.wait_until(lambda: self.first(wanted, start) is not None, timeout, what)
        event = self.first(wanted, start)
        assert event is not None
        return event


#: The recovery benchmark's group: workers of the job, and members of a complete round.
GROUP_SIZE = 3


def _wait_for_full_group(job: OurJob, sink: GroupEventSink, start: int, timeout: float) -> set[int]:
    """Wait until every member of the master's current round, a round of :data:`GROUP_SIZE`, has completed
    its first step in it (events from ``start`` on); the members' worker ids."""
    rendezvous = job.job.rendezvous
    assert rendezvous is not None

    def members() -> set[int]:
        stepped: dict[int, set[int]] = defaultdict(set)
        for event in sink.events[start:]:
            if event.is_step() and event.world_size == GROUP_SIZE:
                stepped[event.round_id].add(event.worker_id)
        current = stepped.get(rendezvous.current.round_id, set())
        return current if len(current) == GROUP_SIZE else set()

    job.wait_until(lambda: bool(members()), timeout, f"a group of {GROUP_SIZE} training")
    return members()


@dataclass(frozen=True)
class Recovery:
    """One kill of the recovery benchmark; times in seconds from the kill."""

    victim: int
    survivors_formed: float
    survivors_step: float
    survivors_world_size: int
    replacement_step: float


def _kill_one(job: OurJob, sink: GroupEventSink, start: int, victim_rank: int) -> tuple[Recovery, int]:
    """Wait for a complete group (events from ``start`` on) that trains, SIGKILL the member at
    ``victim_rank``, and time what follows. Returns the timings and the index of the first event after the
    kill."""
    members = _wait_for_full_group(job, sink, start, 900.0)
    reports = len(job.control.reports)
    job.wait_until(lambda: len(job.control.reports) > reports, 300.0, "a task of the group")
    assert job.job.rendezvous is not None
    victim = job.job.rendezvous.current.members[victim_rank].worker_id
    survivors = members - {victim}
    after_kill = len(sink.events)
    killed_at = time.perf_counter()
    job.job.backend.kill(PodRole.WORKER, victim, signal.SIGKILL)
    formed = sink.wait_for(
        job,
        lambda e: e.event == GROUP_FORMED and e.worker_id in survivors,
        after_kill,
        300.0,
        "the survivors' new round",
    )
    step = sink.wait_for(
        job, lambda e: e.is_step() and e.worker_id in survivors, after_kill, 300.0, "a survivor's step"
    )
    joined = sink.wait_for(
        job, lambda e: e.is_step() and e.worker_id not in members, after_kill, 900.0, "the replacement's step"
    )
    recovery = Recovery(
        victim,
        formed.at - killed_at,
        step.at - killed_at,
        step.world_size,
        joined.at - killed_at,
    )
    return recovery, after_kill


def allreduce_recovery(ctx: BenchContext) -> BenchResult:
    """One local AllreduceStrategy job with 3 workers (``--collective-timeout-seconds`` at its default, 60:
    a dead member is noticed by its neighbours' refused connections and by the master's pod event, not by a
    timeout) trains without pause. Once all three members have completed their first step of the same round
    (their ``round_first_step`` lines) and a task was reported after that, one member is SIGKILLed
    (``LocalProcessBackend.kill``; a different rank each time), and the benchmark times, from the kill, the
    arrival at the backend's log sink (a sink object of the benchmark's) of:

    * **survivors' round**: the first ``group_formed`` line of a surviving worker: the group noticed the
      loss, formed a new round and agreed on its state;
    * **survivors' step**: the next ``round_first_step`` line of a surviving worker: it also completed a
      step in that round (the figure the benchmark is about);
    * **replacement's step**: the first ``round_first_step`` line of the worker the master started in the
      victim's place (process start, TensorFlow import, model build, joining, the state pull).

    The sink receives each line within 0.05 s of its writing (the backend polls the pods' output). The next
    kill waits for the replacement to have joined.
    """
    from tests.bench import training  # TensorFlow: not in the member processes of the throughput benchmark
    from tests.bench.data import write_records

    case = training.DIGITS if ctx.quick else training.CNN
    kills = 1 if ctx.quick else 3
    folder = ctx.folder("allreduce_recovery")
    data = Path(write_records(folder / "data", case.records(ctx.quick)))
    recoveries: list[Recovery] = []
    with (folder / "job.log").open("a") as file:
        sink = GroupEventSink(file)
        job = training.OurJob(
            case,
            data,
            folder,
            sink,
            overrides=_allreduce_job(GROUP_SIZE, log_level="INFO"),
            name="bench-allreduce-recovery",
        )
        try:
            job.start()
            job.control.resume()
            start = 0
            for kill in range(kills):
                recovery, start = _kill_one(job, sink, start, victim_rank=(kill + 1) % GROUP_SIZE)
                recoveries.append(recovery)
                ctx.log(
                    f"  kill {kill + 1}/{kills} (worker {recovery.victim}): survivors' round after "
                    f"{recovery.survivors_formed:.2f} s, step after {recovery.survivors_step:.2f} s, "
                    f"replacement's step after {recovery.replacement_step:.1f} s"
                )
        finally:
            job.stop()
    measures = {
        "kill → survivors' round (`group_formed`)": [r.survivors_formed for r in recoveries],
        "kill → survivors' step (`round_first_step`)": [r.survivors_step for r in recoveries],
        "kill → replacement's step (`round_first_step`)": [r.replacement_step for r in recoveries],
    }
    return BenchResult(
        name="allreduce_recovery",
        title=f"AllreduceStrategy recovery after a SIGKILL: {case.title}, 3 workers",
        method=_method(allreduce_recovery),
        columns=["measure", "seconds", "kills"],
        rows=[
            {"measure": measure, "seconds": Stat.of(values), "kills": str(kills)}
            for measure, values in measures.items()
        ],
        notes=[
            f"Model file `{case.model_def.name}`, batch 64. The survivors' first step after each kill was in "
            f"a group of {', '.join(str(r.survivors_world_size) for r in recoveries)} workers."
        ],
    )
