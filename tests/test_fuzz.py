"""Fuzzing (issue 24): structure-aware random requests to every gRPC method of a live training job's master
and parameter server while it trains, and Hypothesis on the tensor and collective frame decoders.

A short run (until every method was called :data:`MIN_CALLS_PER_METHOD` times, at most ``EDL_FUZZ_SECONDS``,
default 60 s, or until the 8-epoch job's training ends) is part of ``make test``; ``make fuzz`` runs the long
one (``EDL_FUZZ_FULL=1``, docs/fuzzing.md). Every run has a fixed
seed (``EDL_FUZZ_SEED``, default 24). The live-job run passes when no server crashed (INTERNAL, UNKNOWN, or
gone while its job runs: see :mod:`tests.fuzz.harness` for UNAVAILABLE) or hung (a call past its deadline),
the job replaced no PS, the PS's resident memory stayed under twice what it was before, and the job then
finished with exact record accounting and the parameter servers' versions the ledger expects (the master
fails the job otherwise); the long run also asserts the digits accuracy bar. ``EDL_FUZZ_REPORT=path``
writes the run's numbers as JSON.

What the fuzzer leaves alone, because a real peer may legitimately do it: sending a valid synchronous push
(its requests carry a version the PS must refuse: negative, or 2**40 and above), and calls that act as one
of the job's own workers (worker ids are taken from outside the job's: below 0 or 10**6 and above).
``ScaleWorkers`` is left out of the live run: a valid count legitimately scales the job.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edl_argo.collective.transport import (
    FLAG_FOUND,
    BufferFrames,
    FrameError,
    FrameHeader,
    FrameKind,
    read_state,
)
from edl_argo.master.job import TrainingJob
from edl_argo.pods import LocalProcessBackend
from edl_argo.proto import collective_pb2, master_pb2, ps_pb2, tensor_pb2
from edl_argo.rpc.auth import ADMIN_IDENTITY, JobSecret, pod_identity
from edl_argo.rpc.channel import make_channel, make_server
from edl_argo.rpc.health import PING_METHOD, add_health_service
from edl_argo.rpc.ps_layout import TENSOR_PORT_METHODS
from edl_argo.rpc.tensors import TensorDecodeError, from_tensor
from tests.engine_helpers import (
    DIGITS_ACCURACY_FLOOR,
    JobThread,
    assert_no_record_lost,
    digits_config,
    read_metrics,
)
from tests.fuzz import harness
from tests.fuzz.harness import TENSOR_PORT_PREFIX, FuzzReport, Method, fuzz, pod_processes, rss_bytes
from tests.fuzz.messages import MessageFuzzer
from tests.tcp_proxy import SilentProxy

SECONDS = float(os.environ.get("EDL_FUZZ_SECONDS", "60"))
SEED = int(os.environ.get("EDL_FUZZ_SEED", "24"))
#: The long run (make fuzz) sets this: it also asserts the accuracy bar of a full digits job.
FULL = os.environ.get("EDL_FUZZ_FULL", "") == "1"
MAX_REQUESTS = int(os.environ.get("EDL_FUZZ_REQUESTS", "1000000"))
#: Epochs of the long run's job: fuzzing stops when training does, so the job must outlast the requests.
FULL_EPOCHS = int(os.environ.get("EDL_FUZZ_EPOCHS", "300"))

pytestmark = pytest.mark.timeout(int(SECONDS) * 3 + 600)


def _foreign_worker(request: Message, fuzzer: MessageFuzzer) -> None:
    """A worker id no worker of the job has."""
    if "worker_id" in request.DESCRIPTOR.fields_by_name:
        request.worker_id = fuzzer.rng.choice(
            [-1, -(2**31), 10**6, 10**6 + fuzzer.rng.randrange(10**6), 2**31 - 1]
        )


def _refusable_push(request: Message, fuzzer: MessageFuzzer) -> None:
    """A push version a synchronous PS must refuse whatever else the push holds."""
    assert isinstance(request, ps_pb2.PushGradientsRequest)
    request.version = fuzzer.rng.choice([-1, -(2**63), 2**40, 2**62, 2**62 + 1, 2**63 - 1])


PS_METHODS = [
    Method("/edl_argo.ParameterServer/PushModel", ps_pb2.Model),
    Method("/edl_argo.ParameterServer/PullDenseParameters", ps_pb2.PullDenseParametersRequest),
    Method("/edl_argo.ParameterServer/PullEmbeddingVectors", ps_pb2.PullEmbeddingVectorsRequest),
    Method("/edl_argo.ParameterServer/PullEmbeddingVectorsBatch", ps_pb2.PullEmbeddingVectorsBatchRequest),
    Method("/edl_argo.ParameterServer/PullEmbeddingTable", ps_pb2.PullEmbeddingTableRequest),
    Method("/edl_argo.ParameterServer/PushGradients", ps_pb2.PushGradientsRequest, _refusable_push),
    Method("/edl_argo.ParameterServer/GetStatus", ps_pb2.GetStatusRequest),
    Method(
        "/edl_argo.ParameterServerChunks/PushGradients",
        ps_pb2.PushGradientsRequest,
        _refusable_push,
        chunked=True,
    ),
    Method(
        "/edl_argo.ParameterServerChunks/PullDenseParameters", ps_pb2.PullDenseParametersRequest, chunked=True
    ),
    Method(
        f"{TENSOR_PORT_PREFIX}PushGradients", ps_pb2.PushGradientsRequest, _refusable_push, tensor_port=True
    ),
    Method(f"{TENSOR_PORT_PREFIX}PullDenseParameters", ps_pb2.PullDenseParametersRequest, tensor_port=True),
]
MASTER_METHODS = [
    Method(f"/edl_argo.Master/{name}", request, _foreign_worker)
    for name, request in [
        ("GetTask", master_pb2.GetTaskRequest),
        ("ReportTaskResult", master_pb2.ReportTaskResultRequest),
        ("ReportEvaluationOutputs", master_pb2.ReportEvaluationOutputsRequest),
        ("ReportVersion", master_pb2.ReportVersionRequest),
        ("Rendezvous", master_pb2.RendezvousRequest),
        ("ReportCollectiveFailure", master_pb2.ReportCollectiveFailureRequest),
    ]
]
#: The live run leaves this method out (module docstring): a valid count legitimately scales the job.
NOT_FUZZED = {"/edl_argo.Master/ScaleWorkers"}
#: Every fuzzed method is called at least this often in the short run, which stops once each was. Methods
#: are drawn among the least called so far, so 110 requests to the PS (11 methods) and 60 to the master (6)
#: reach it; a run that ends first (its job done, or EDL_FUZZ_SECONDS passed) fails it.
MIN_CALLS_PER_METHOD = 10


def service_methods(*services: Any) -> set[str]:
    """The paths (``/package.Service/Method``) of every method of the gRPC ``services`` (descriptors)."""
    return {f"/{service.full_name}/{method.name}" for service in services for method in service.methods}


def rarely_called(report: FuzzReport, methods: list[Method], floor: int) -> dict[str, int]:
    """The ``methods`` that ``report`` counts fewer than ``floor`` calls of, with their counts."""
    counts = {method.path: report.by_method[method.path] for method in methods}
    return {path: count for path, count in counts.items() if count < floor}


def test_the_fuzzer_covers_every_method_of_both_services_and_flags_one_called_too_rarely() -> None:
    master = master_pb2.DESCRIPTOR.services_by_name["Master"]
    ps = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    ps_chunks = ps_pb2.DESCRIPTOR.services_by_name["ParameterServerChunks"]
    fuzzed = [method.path for method in (*PS_METHODS, *MASTER_METHODS)]
    assert len(fuzzed) == len(set(fuzzed))
    on_tensor_port = {f"{TENSOR_PORT_PREFIX}{name}" for name in TENSOR_PORT_METHODS}
    assert set(fuzzed) == service_methods(master, ps, ps_chunks) - NOT_FUZZED | on_tensor_port
    report = FuzzReport()
    for method in PS_METHODS[1:]:
        for _ in range(MIN_CALLS_PER_METHOD):
            report.record(method.path, grpc.StatusCode.OK, "", 0.0, 30.0, False)
    assert rarely_called(report, PS_METHODS, MIN_CALLS_PER_METHOD) == {PS_METHODS[0].path: 0}
    report.record(PS_METHODS[0].path, grpc.StatusCode.OK, "", 0.0, 30.0, False)
    assert rarely_called(report, PS_METHODS, MIN_CALLS_PER_METHOD) == {PS_METHODS[0].path: 1}


def test_fuzzing_a_live_job_crashes_and_hangs_no_server_and_changes_nothing_it_trains(
    digits_data: Path, tmp_path: Path
) -> None:
    output = tmp_path / "out"
    # The short run stops fuzzing once every method was called often enough: on a loaded machine (three
    # test processes on two cores) that took 30 s and more, while the job must still be training.
    overrides = {"num_epochs": FULL_EPOCHS} if FULL else {"num_epochs": 8, "num_workers": 1}
    config = digits_config(digits_data, output, **overrides)
    job = JobThread(TrainingJob.load(config)).start()
    job.wait_until(lambda: job.job.dispatcher.progress()[0] > 0, 600, "the first task done")
    ps_address = f"127.0.0.1:{job.job.ps_ports[0]}"
    assert isinstance(job.job.backend, LocalProcessBackend)
    ps_pids = pod_processes(job.job.backend.pods_dir, "ps-0")
    rss_before = sum(rss_bytes(pid) for pid in ps_pids)
    names = ["dense", "dense/kernel", "conv2d/kernel", "emb", "accuracy", "logits", ps_address]
    stop = threading.Event()
    reports: list[FuzzReport] = []

    errors: list[BaseException] = []

    secret = job.job.job_secret
    stranger = JobSecret.generate()  # another job's

    def credential(request: Message) -> tuple[tuple[str, str], ...]:
        """An insider's credential: the identity of the worker the request names (or the operator's);
        one request in ten carries another job's, which every server must refuse."""
        worker_id = getattr(request, "worker_id", None)
        identity = pod_identity("worker", worker_id) if worker_id is not None else ADMIN_IDENTITY
        issuer = stranger if zlib.crc32(request.SerializeToString()) % 10 == 0 else secret
        return issuer.credential(identity).metadata()

    def run(address: str, methods: list[Method], seed: int) -> None:
        def covered(report: FuzzReport) -> bool:
            return not rarely_called(report, methods, MIN_CALLS_PER_METHOD)

        try:
            with make_channel(address) as channel:
                report = fuzz(
                    channel,
                    methods,
                    seed,
                    SECONDS,
                    MAX_REQUESTS // 2,
                    names,
                    stop,
                    metadata=credential,
                    enough=None if FULL else covered,
                )
                reports.append(report)
        except BaseException as error:  # the fuzzer's own bug: surfaced below
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(ps_address, PS_METHODS, SEED)),
        threading.Thread(target=run, args=(job.job._master_address, MASTER_METHODS, SEED + 1)),
    ]
    for thread in threads:
        thread.start()

    rss_during: list[int] = []

    def watch() -> None:
        """Sample the PS's memory while the fuzzers run, and stop fuzzing once training is done: the job
        then stops its PS, which refuses connections (and ends: its memory is measured before)."""
        while job._thread.is_alive() and not all(not thread.is_alive() for thread in threads):
            rss_during.append(sum(rss_bytes(pid) for pid in ps_pids))
            done, total = job.job.dispatcher.progress()
            if total and done >= total:
                break
            time.sleep(0.2)
        stop.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for thread in threads:
        thread.join(SECONDS + 300)
    watcher.join(30)
    rss_after = max(rss_during, default=0)
    result = job.join(1800)
    report = FuzzReport()
    for part in reports:
        report.merge(part)
    metrics = read_metrics(output)
    accuracy = metrics["final_metrics"].get("accuracy")
    numbers = {
        "seed": SEED,
        "seconds": SECONDS,
        "requests": report.requests,
        "by_method": dict(report.by_method),
        "codes": dict(report.codes),
        "crashes": report.crashes[:20],
        "hangs": report.hangs[:20],
        "dropped_connections": report.dropped[:20],
        "relaunches": metrics["relaunches"],
        "ps_rss_before": rss_before,
        "ps_rss_after": rss_after,
        "accuracy": accuracy,
        "records_per_epoch": metrics["records_per_epoch"],
        "records_done_per_epoch": metrics["records_done_per_epoch"],
        "model_version": metrics["model_version"],
    }
    if os.environ.get("EDL_FUZZ_REPORT"):
        Path(os.environ["EDL_FUZZ_REPORT"]).write_text(json.dumps(numbers, indent=2) + "\n")
    assert not errors, errors
    assert len(reports) == 2, numbers
    assert not rarely_called(report, [*PS_METHODS, *MASTER_METHODS], MIN_CALLS_PER_METHOD), numbers
    assert not report.crashes, report.crashes[:10]
    assert not report.hangs, report.hangs[:10]
    assert report.codes["UNAUTHENTICATED"] > 0, numbers  # another job's calls are refused
    # A PS that died (or left the master's pings unanswered) and was started again answers again too.
    assert metrics["relaunches"]["ps"] == 0, numbers
    assert rss_during and rss_after <= 2 * rss_before, numbers
    assert result["status"] == "succeeded", result
    assert_no_record_lost(metrics)
    assert 0 < metrics["model_version"] < 2**40, numbers  # the versions the PS counted
    if FULL:
        assert accuracy >= DIGITS_ACCURACY_FLOOR, numbers


# -- the harness's verdicts ---------------------------------------------------------------------------


def test_a_dropped_connection_is_no_crash_and_a_server_gone_while_its_job_runs_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that answers nothing for a while (paused, starved of CPU, a silent network path) has its
    connections dropped by the client's keepalive, and the call in flight fails UNAVAILABLE: counted as a
    dropped connection once the server accepts a connection again. A server that stopped is a crash, unless
    its job ended (``stop``)."""
    monkeypatch.setattr(harness, "RECONNECT_SECONDS", 3.0)
    ping = [Method(PING_METHOD, master_pb2.GetTaskRequest, mutate=False)]
    server = make_server(2)
    add_health_service(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = SilentProxy(f"127.0.0.1:{port}")
    stop = threading.Event()
    try:
        # Keepalive as the project's channels have it (edl_argo.rpc.channel), within a second, not 10 + 5 s.
        keepalive = [
            ("grpc.keepalive_time_ms", 500),
            ("grpc.keepalive_timeout_ms", 500),
            ("grpc.http2.ping_timeout_ms", 500),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        with grpc.insecure_channel(proxy.address, options=keepalive) as channel:
            threading.Timer(1.0, proxy.go_silent).start()
            threading.Timer(1.5, proxy.resume).start()  # for new connections: the silent one stays broken
            dropped = fuzz(channel, ping, SEED, 6.0, 10**9, stop=stop, timeout=5.0)
        assert not dropped.crashes and not dropped.hangs, dropped
        assert dropped.codes["UNAVAILABLE"] == len(dropped.dropped) >= 1, dropped
        assert dropped.codes["OK"] > 1, dropped
    finally:
        proxy.close()
        server.stop(None)
    with make_channel(f"127.0.0.1:{port}") as channel:
        gone = fuzz(channel, ping, SEED, 5.0, 10**9, stop=stop, timeout=5.0)
        assert gone.codes["UNAVAILABLE"] == len(gone.crashes) >= 1 and "server gone" in gone.crashes[0], gone
        threading.Timer(1.0, stop.set).start()
        ended = fuzz(channel, ping, SEED, 5.0, 10**9, stop=stop, timeout=5.0)
        assert ended.requests == 0 and not ended.crashes, ended


# -- decoders ------------------------------------------------------------------------------------------

_SHAPES = st.lists(
    st.one_of(st.integers(0, 4), st.sampled_from([-1, 2**31, 2**62, 2**63 - 1, -(2**63)])), max_size=70
)


@settings(max_examples=int(SECONDS * 25), deadline=None, derandomize=True, database=None)
@given(
    dtype=st.one_of(st.sampled_from(["float32", "int64", "bool", "float16"]), st.text(max_size=12)),
    shape=_SHAPES,
    content=st.binary(max_size=256),
)
def test_the_tensor_decoder_refuses_every_malformed_tensor_cleanly(
    dtype: str, shape: list[int], content: bytes
) -> None:
    message = tensor_pb2.Tensor(name="t", dtype=dtype, shape=shape, content=content)
    try:
        value = from_tensor(message)
    except TensorDecodeError as error:
        assert "'t'" in str(error)
        return
    assert value.nbytes == len(content) and list(value.shape) == shape


def _frame(kind: int, payload: bytes, flags: int = 0, size: int | None = None) -> bytes:
    header = FrameHeader(kind=kind, flags=flags, payload_bytes=len(payload) if size is None else size)
    return header.pack() + payload


@st.composite
def _state_frames(draw: st.DrawFn) -> bytes:
    """A state response as a peer sends it, its manifest drawn at random and its data frames cut and sized
    at random (often right, sometimes not)."""
    variables = [
        tensor_pb2.Tensor(
            name=f"v{i}",
            dtype=draw(st.sampled_from(["float32", "int64", "object", "float64"])),
            shape=draw(st.lists(st.sampled_from([0, 1, 2, 3, -1, 2**40]), max_size=3)),
        )
        for i in range(draw(st.integers(0, 3)))
    ]
    manifest = collective_pb2.ModelState(
        round_id=draw(st.integers(-(2**63), 2**63 - 1)),
        version=draw(st.integers(-(2**63), 2**63 - 1)),
        variables=variables,
        lineage_rounds=draw(st.lists(st.integers(-5, 5), max_size=3)),
        lineage_versions=draw(st.lists(st.integers(-5, 5), max_size=3)),
    ).SerializeToString()
    if draw(st.booleans()):
        manifest = draw(st.binary(max_size=64))
    frames = [_frame(FrameKind.STATE_RESPONSE, manifest, flags=draw(st.sampled_from([0, FLAG_FOUND])))]
    for _ in range(draw(st.integers(0, 4))):
        data = draw(st.binary(max_size=48))
        size = draw(st.one_of(st.none(), st.integers(0, 2**32)))
        kind = draw(st.sampled_from([FrameKind.STATE_DATA, FrameKind.PIECE, 0, 255]))
        frames.append(_frame(kind, data, size=size))
    blob = b"".join(frames)
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(blob)))
        blob = blob[:cut] + draw(st.binary(max_size=8))
    return blob


@settings(
    max_examples=int(SECONDS * 25),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=_state_frames())
def test_the_collective_frame_decoder_refuses_every_malformed_state_cleanly(data: bytes) -> None:
    try:
        state = read_state(BufferFrames(data, "fuzz"), "fuzz")
    except FrameError:
        return
    if state is not None:
        assert all(isinstance(v, np.ndarray) for v in state.values)
