"""The master's share of a new AllreduceStrategy round after a member leaves (issue 34, part 4):
``python -m tests.scale.rendezvous_rounds [--members 64 256]`` prints a markdown table.

In this process, over the master's real service and gRPC on loopback (no job secret: the calls are the
rendezvous's own cost): ``--members`` workers join a :class:`RendezvousManager` (each join makes a new round,
as pods arriving one by one do), one leaves (:meth:`RendezvousManager.remove`, as its pod's FAILED event
does), and every remaining member makes the call that tells it of the new round: a watch call
(``Rendezvous`` with ``watch``, what a member's background thread sends every
:data:`~edl_argo.collective.membership.WATCH_SECONDS`), from 8 client threads. Measured: the joins, and
from the leave to the last member's answer naming the new round, the time and the master's CPU; the size
of one answer. Not measured: what the members do then (broadcast of the state over the ring), which needs
the workers' TensorFlow; a member learns of the round within one watch period (1 s) or sooner, from a
peer of the new round or a collective operation that fails.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.rendezvous import RendezvousManager
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.proto import master_pb2, master_pb2_grpc
from edl_argo.rpc.channel import make_server

CLIENT_THREADS = 8


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(members: int) -> tuple[float, float, float, int]:
    """Seconds for ``members`` joins; seconds and CPU seconds (this process: server and clients) from a
    leave to every remaining member knowing the new round; bytes of one answer."""
    dispatcher = TaskDispatcher({"s": 1}, DispatcherConfig(records_per_task=1, num_epochs=1))
    rendezvous = RendezvousManager()
    urls = {TaskType.TRAINING: "file:///d", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
    servicer = MasterServicer(
        dispatcher,
        EvaluationService(dict, {}, 0, dispatcher=dispatcher),
        urls,
        lambda: 0,
        rendezvous=rendezvous,
    )
    server = make_server(max_workers=CLIENT_THREADS)
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with (
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
            ThreadPoolExecutor(CLIENT_THREADS) as pool,
        ):
            stub = master_pb2_grpc.MasterStub(channel)

            def call(worker: int, watch: bool) -> master_pb2.RendezvousResponse:
                request = master_pb2.RendezvousRequest(worker_id=worker, address=f"10.0.0.1:{20000 + worker}")
                request.watch = watch
                return stub.Rendezvous(request, timeout=30)

            started = time.perf_counter()
            for worker in range(members):
                call(worker, False)
            joined = time.perf_counter() - started
            before = rendezvous.current.round_id
            started, cpu = time.perf_counter(), _cpu()
            rendezvous.remove(0, "Killed")
            answers = list(pool.map(lambda worker: call(worker, True), range(1, members)))
            seconds, cpu_seconds = time.perf_counter() - started, _cpu() - cpu
    finally:
        server.stop(None)
    if any(answer.round_id != before + 1 or len(answer.members) != members - 1 for answer in answers):
        raise RuntimeError("a member was not told of the new round")
    return joined, seconds, cpu_seconds, answers[0].ByteSize()


def rows(sizes: list[int]) -> Iterator[str]:
    yield "| members | joins, s | leave → every member has the new round, ms | CPU ms | bytes per answer |"
    yield "|---|---|---|---|---|"
    for members in sizes:
        joined, seconds, cpu_seconds, size = measure(members)
        yield f"| {members} | {joined:.2f} | {seconds * 1e3:.1f} | {cpu_seconds * 1e3:.1f} | {size:,} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--members", type=int, nargs="+", default=[64, 256])
    for line in rows(parser.parse_args(argv).members):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
