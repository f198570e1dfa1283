"""Task dispatch: get-task + report-task-result pairs per second against the master's real gRPC service.

The servers run in child processes (a master is its own process; sharing this process would make the
clients and the server fight over one GIL): ``python -m tests.bench.dispatch --serve master|trivial``
prints ``PORT <n>`` and serves until killed.

* ``master``: :class:`MasterServicer` over a :class:`TaskDispatcher` with plenty of one-record tasks
  (a 100,000-record shard, 10,000 epochs) and an :class:`EvaluationService` without validation shards, on
  the project's :func:`make_server` (ThreadPoolExecutor of 8).
* ``trivial``: the baseline, a generic Python gRPC handler ``Empty → Empty`` on the same kind of server.

Clients: N threads in this process, each with its own channel (as separate workers have), loop as workers
do: one ``GetTask`` at the start, then per task a ``ReportTaskResult(success, get_next_task)`` whose
answer carries the next task; a *pair* is one task handed out and reported, one call. Against the trivial
server a pair is one ``Empty`` call. Pairs completed in a timed window (after a warm-up) give pairs/s. The
two servers are measured in alternating windows, so each ratio compares neighbours in time. CPU per pair:
the server process's user + system time (``/proc``) and this process's (the clients') over the window, per
pair; on two cores, their sum near 2 × 10⁶ / pairs/s means the machine, not waiting, is the limit.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc

from edl_argo.proto import master_pb2, master_pb2_grpc, tensor_pb2
from edl_argo.rpc.channel import make_channel, make_server
from tests.bench.common import (
    BenchContext,
    BenchResult,
    Goal,
    Stat,
    kill_group,
    process_cpu_seconds,
    ratio_stat,
    start_announcing_child,
)

GOAL_PAIRS_PER_S = 2000.0
_TRIVIAL_METHOD = "/edl_bench.Trivial/Call"


def serve(kind: str) -> None:
    """Serve ``kind`` (``master`` or ``trivial``) on a free loopback port until killed."""
    server = make_server()
    if kind == "master":
        from edl_argo import log
        from edl_argo.master.evaluation import EvaluationService
        from edl_argo.master.servicer import MasterServicer
        from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType

        log.configure("INFO")  # as `edl-argo train` does
        dispatcher = TaskDispatcher(
            {"data-00000": 100_000}, DispatcherConfig(records_per_task=1, num_epochs=10_000)
        )
        evaluation = EvaluationService(dict, {}, 0, dispatcher=dispatcher)
        urls = {TaskType.TRAINING: "file:///bench/train", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
        servicer = MasterServicer(dispatcher, evaluation, urls, current_version=lambda: 0)
        master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    else:
        handler = grpc.unary_unary_rpc_method_handler(
            lambda request, context: tensor_pb2.Empty(),
            request_deserializer=tensor_pb2.Empty.FromString,
            response_serializer=tensor_pb2.Empty.SerializeToString,
        )
        service, method = _TRIVIAL_METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    server.wait_for_termination()


class ServerProcess:
    """A ``--serve`` child process and its address."""

    def __init__(self, kind: str, log: IO[bytes]) -> None:
        self.kind = kind
        self.process, words = start_announcing_child(
            "tests.bench.dispatch", ["--serve", kind], log, what=f"{kind} server"
        )
        self.address = f"127.0.0.1:{words[0]}"

    def cpu_seconds(self) -> float:
        """User + system CPU time the server process has used so far (Linux ``/proc``)."""
        return process_cpu_seconds(self.process.pid)

    def close(self) -> None:
        kill_group(self.process)


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Window:
    """One timed window: pairs per second and CPU microseconds per pair in the server and the clients."""

    pairs_per_s: float
    server_cpu_us: float
    client_cpu_us: float


def _pair_function(kind: str, channel: grpc.Channel, worker_id: int) -> Callable[[], None]:
    """One task reported with the next one fetched (master) or one Empty call (trivial) on ``channel``."""
    if kind == "trivial":
        call = channel.unary_unary(
            _TRIVIAL_METHOD,
            request_serializer=tensor_pb2.Empty.SerializeToString,
            response_deserializer=tensor_pb2.Empty.FromString,
        )
        empty = tensor_pb2.Empty()

        def trivial_pair() -> None:
            call(empty)

        return trivial_pair

    stub = master_pb2_grpc.MasterStub(channel)
    held = [stub.GetTask(master_pb2.GetTaskRequest(worker_id=worker_id))]

    def master_pair() -> None:
        response = held[0]
        if response.kind != master_pb2.GetTaskResponse.TASK:
            raise RuntimeError(f"the master answered {response.kind}, not TASK: out of tasks?")
        report = master_pb2.ReportTaskResultRequest(
            worker_id=worker_id, task_id=response.task.task_id, success=True, get_next_task=True
        )
        answer = stub.ReportTaskResult(report)
        if not answer.accepted:
            raise RuntimeError(f"the master refused the report of task {response.task.task_id}")
        held[0] = answer.next_task

    return master_pair


def measure_pairs(server: ServerProcess, threads: int, warmup: float, window: float) -> Window:
    """Pairs per second from ``threads`` client threads (one channel each) in a ``window``-second window."""
    kind, address = server.kind, server.address
    stop = threading.Event()
    counts = [0] * threads
    errors: list[BaseException] = []
    channels = [make_channel(address) for _ in range(threads)]

    def loop(number: int) -> None:
        pair = _pair_function(kind, channels[number], worker_id=number)
        try:
            while not stop.is_set():
                pair()
                counts[number] += 1
        except BaseException as error:  # surfaced below
            errors.append(error)
            stop.set()

    workers = [threading.Thread(target=loop, args=(n,), daemon=True) for n in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(warmup)
    before, started = sum(counts), time.perf_counter()
    server_cpu, client_cpu = server.cpu_seconds(), _own_cpu_seconds()
    time.sleep(window)
    after, ended = sum(counts), time.perf_counter()
    server_cpu, client_cpu = server.cpu_seconds() - server_cpu, _own_cpu_seconds() - client_cpu
    stop.set()
    for worker in workers:
        worker.join()
    for channel in channels:
        channel.close()
    if errors:
        raise RuntimeError(f"{kind} client failed: {errors[0]!r}") from errors[0]
    pairs = max(after - before, 1)
    return Window(pairs / (ended - started), server_cpu / pairs * 1e6, client_cpu / pairs * 1e6)


def dispatch(ctx: BenchContext) -> BenchResult:
    """Get-task + report pairs/s against the real master service and a trivial Python gRPC server."""
    folder = ctx.folder("dispatch")
    repeats = 2 if ctx.quick else 5
    window = 0.5 if ctx.quick else 3.0
    result = BenchResult(
        name="dispatch",
        title="Task dispatch over gRPC (loopback)",
        method=(__doc__ or "").split("\n\n", 1)[1].strip(),
        columns=[
            "client threads",
            "server",
            "pairs/s",
            "÷ trivial",
            "server CPU µs/pair",
            "client CPU µs/pair",
        ],
    )
    log_path: Path = folder / "servers.log"
    with log_path.open("ab") as log:
        servers = [ServerProcess("trivial", log), ServerProcess("master", log)]
        try:
            for threads in (8, 1):
                windows: dict[str, list[Window]] = {"trivial": [], "master": []}
                for _ in range(repeats):
                    for server in servers:
                        windows[server.kind].append(measure_pairs(server, threads, min(0.5, window), window))
                rates = {kind: [w.pairs_per_s for w in measured] for kind, measured in windows.items()}
                for kind, measured in windows.items():
                    result.rows.append(
                        {
                            "client threads": str(threads),
                            "server": kind,
                            "pairs/s": Stat.of(rates[kind]),
                            "÷ trivial": ratio_stat(rates[kind], rates["trivial"])
                            if kind == "master"
                            else "1",
                            "server CPU µs/pair": Stat.of([w.server_cpu_us for w in measured]),
                            "client CPU µs/pair": Stat.of([w.client_cpu_us for w in measured]),
                        }
                    )
                if threads == 8:
                    result.goals.append(
                        Goal(
                            "dispatch: ≥ 2,000 pairs/s with 8 client threads",
                            Stat.of(rates["master"]),
                            GOAL_PAIRS_PER_S,
                        )
                    )
        finally:
            for server in servers:
                server.close()
    result.notes.append(
        f"{repeats} windows of {window:g} s per server and thread count, alternating servers."
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a server for the dispatch benchmark")
    parser.add_argument("--serve", choices=["master", "trivial"], required=True)
    serve(parser.parse_args(argv).serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
