"""Authenticated job traffic: every port of a job refuses callers without the job's credential, a worker
cannot act as another, and no credential shows in a log, an argument list, a manifest or a pod record."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import keras
import numpy as np
import pytest

from edl_argo import cli
from edl_argo.collective import CollectiveServer
from edl_argo.collective.state import GroupState, Lineage
from edl_argo.collective.transport import PeerConnection, request_state
from edl_argo.errors import ConfigError
from edl_argo.log import configure as configure_logging
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.registry import register_master
from edl_argo.master.rendezvous import RendezvousManager
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.state_store import SECRET_KEY, MasterStateStore
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.pods import LocalProcessBackend, PodPhase, PodRole, PodSpec, find_free_port
from edl_argo.pods.kubernetes import API_URL_ENV, KubernetesBackend
from edl_argo.pods.kubernetes_config import KubernetesConfig
from edl_argo.pods.manifests import MASTER_AUTH_VOLUME, auth_secret_name, pod_manifest
from edl_argo.proto import master_pb2, master_pb2_grpc, ps_pb2, ps_pb2_grpc
from edl_argo.ps.server import start_server
from edl_argo.ps.servicer import ParameterServerServicer
from edl_argo.rpc import auth
from edl_argo.rpc.auth import ClientCredential, JobSecret, server_interceptor
from edl_argo.rpc.channel import make_channel, make_server
from edl_argo.rpc.health import add_health_service, ping
from edl_argo.storage import LocalStorage
from tests.k8s_helpers import MASTER_USER_AGENT, kubernetes_ps_port, role_rules
from tests.k8s_stand_in import KubernetesStandIn

pytestmark = pytest.mark.timeout(120)

#: This job's secret, and another job's.
SECRET = JobSecret.generate()
OTHER = JobSecret.generate()
#: Every credential of this job, as text that must never appear in logs, manifests or records.
LEAKABLE = [SECRET.hex(), SECRET.token("worker-0"), SECRET.token("worker-1"), SECRET.collective_token().hex()]


def outsiders(address: str) -> dict[str, grpc.Channel]:
    """Channels of callers that are not of this job."""
    return {
        "no credential": grpc.insecure_channel(address),
        "a wrong token": make_channel(address, ClientCredential("worker-0", "0" * 64)),
        "another job's worker": make_channel(address, OTHER.credential("worker-0")),
        "another job's admin": make_channel(address, OTHER.credential(auth.ADMIN_IDENTITY)),
        "this job's token under another name": make_channel(
            address, ClientCredential("worker-1", SECRET.token("worker-0"))
        ),
    }


def assert_refused(call: Callable[[], Any], code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as error:
        call()
    assert error.value.code() == code, error.value.details()
    return error.value.details() or ""


@pytest.fixture
def master() -> Iterator[tuple[str, TaskDispatcher]]:
    """An AllreduceStrategy master service with this job's secret: 2 training tasks."""
    evaluation = EvaluationService(lambda: {}, {}, 0)
    evaluation.dispatcher = dispatcher = TaskDispatcher(
        {"train": 20}, DispatcherConfig(records_per_task=10, num_epochs=1)
    )
    urls = {TaskType.TRAINING: "train", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
    server = make_server(4, interceptors=[server_interceptor(SECRET, "master")])
    servicer = MasterServicer(
        dispatcher,
        evaluation,
        urls,
        current_version=lambda: 0,
        scale_workers=lambda n: n,
        rendezvous=RendezvousManager(),
    )
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    add_health_service(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", dispatcher
    server.stop(None)


def master_calls(stub: master_pb2_grpc.MasterStub) -> dict[str, Callable[[], Any]]:
    """One call of every master method that names worker 0."""
    return {
        "GetTask": lambda: stub.GetTask(master_pb2.GetTaskRequest(worker_id=0), timeout=10),
        "ReportTaskResult": lambda: stub.ReportTaskResult(
            master_pb2.ReportTaskResultRequest(worker_id=0, task_id=1, fatal=True, error_message="x"),
            timeout=10,
        ),
        "ReportVersion": lambda: stub.ReportVersion(
            master_pb2.ReportVersionRequest(worker_id=0, model_version=1), timeout=10
        ),
        "Rendezvous": lambda: stub.Rendezvous(
            master_pb2.RendezvousRequest(worker_id=0, address="127.0.0.1:1"), timeout=10
        ),
        "ReportCollectiveFailure": lambda: stub.ReportCollectiveFailure(
            master_pb2.ReportCollectiveFailureRequest(worker_id=0, round_id=1, suspect_worker_id=1),
            timeout=10,
        ),
        "ScaleWorkers": lambda: stub.ScaleWorkers(master_pb2.ScaleWorkersRequest(num_workers=1), timeout=10),
    }


def test_the_master_refuses_every_caller_not_of_the_job_and_logs_each_peer_once(
    master: tuple[str, TaskDispatcher], capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging()
    address, dispatcher = master
    for who, channel in outsiders(address).items():
        for rpc, call in master_calls(master_pb2_grpc.MasterStub(channel)).items():
            details = assert_refused(call, grpc.StatusCode.UNAUTHENTICATED)
            assert "master" in details, (who, rpc)
        assert_refused(lambda channel=channel: ping(channel, 10), grpc.StatusCode.UNAUTHENTICATED)
    assert dispatcher.oldest_held_task(0) is None and not dispatcher.finished  # nothing reached the service
    err = capsys.readouterr().err
    refusals = [line for line in err.splitlines() if "call_unauthenticated" in line]
    assert len(refusals) == 1 and "service=master" in refusals[0] and "peer=ipv4:127.0.0.1" in refusals[0]
    assert not any(secret in err for secret in LEAKABLE)
    # The job's own worker is served.
    worker = master_pb2_grpc.MasterStub(make_channel(address, SECRET.credential("worker-0")))
    assert worker.GetTask(master_pb2.GetTaskRequest(worker_id=0), timeout=10).task.task_id > 0


def test_a_worker_cannot_act_as_another_worker_nor_steer_the_job(
    master: tuple[str, TaskDispatcher], capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging()
    address, dispatcher = master
    victim = master_pb2_grpc.MasterStub(make_channel(address, SECRET.credential("worker-0")))
    held = victim.GetTask(master_pb2.GetTaskRequest(worker_id=0), timeout=10).task
    impostor = master_pb2_grpc.MasterStub(make_channel(address, SECRET.credential("worker-1")))
    for rpc, call in master_calls(impostor).items():
        details = assert_refused(call, grpc.StatusCode.PERMISSION_DENIED)
        assert rpc in details and "worker-1" in details
    # Worker 0 still holds its task, the fatal report did not end the job, nobody joined a group as it.
    assert dispatcher.held_task(held.task_id, 0) is not None and not dispatcher.finished
    for call in master_calls(impostor).values():  # the same denials again are not logged again
        assert_refused(call, grpc.StatusCode.PERMISSION_DENIED)
    assert capsys.readouterr().err.count("call_denied") == len(master_calls(impostor))
    # An operator holding the secret may scale the job; worker 0 may act as itself.
    admin = master_pb2_grpc.MasterStub(make_channel(address, SECRET.credential(auth.ADMIN_IDENTITY)))
    assert admin.ScaleWorkers(master_pb2.ScaleWorkersRequest(num_workers=3), timeout=10).num_workers == 3
    report = master_pb2.ReportTaskResultRequest(worker_id=0, task_id=held.task_id, success=True)
    assert victim.ReportTaskResult(report, timeout=10).accepted


def test_a_parameter_server_refuses_every_caller_not_of_the_job() -> None:
    servicer = ParameterServerServicer(lambda: keras.optimizers.SGD(0.1), jit_compile=False)
    server, port = start_server(servicer, "127.0.0.1", 0, SECRET, "ps-0")
    address = f"127.0.0.1:{port}"
    try:
        for channel in outsiders(address).values():
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            for call in (
                lambda stub=stub: stub.PushModel(ps_pb2.Model(), timeout=10),
                lambda stub=stub: stub.PullDenseParameters(ps_pb2.PullDenseParametersRequest(), timeout=10),
                lambda channel=channel: ping(channel, 10),
            ):
                assert "ps-0" in assert_refused(call, grpc.StatusCode.UNAUTHENTICATED)
        assert servicer.version == 0
        for identity in ("worker-0", auth.MASTER_IDENTITY):
            channel = make_channel(address, SECRET.credential(identity))
            ping(channel, 10)
        stub = ps_pb2_grpc.ParameterServerStub(make_channel(address, SECRET.credential("worker-0")))
        assert stub.PushModel(ps_pb2.Model(), timeout=10).accepted  # the first push: no outsider's got in
    finally:
        server.stop(None)


def test_a_process_presents_the_credential_of_its_environment() -> None:
    worker_env = SECRET.pod_env("worker", 3)
    assert auth.SECRET_ENV not in worker_env  # a worker never holds the secret
    credential = auth.credential_from_env(worker_env)
    assert credential == SECRET.credential("worker-3")
    assert auth.collective_token_from_env(worker_env) == SECRET.collective_token()
    assert auth.credential_from_env(SECRET.pod_env("ps", 0)) == SECRET.credential("ps-0")
    assert auth.credential_from_env({auth.SECRET_ENV: SECRET.hex()}) == SECRET.credential("admin")
    assert auth.credential_from_env({}) is None
    assert not any(s in repr(credential) + repr(SECRET) + str(SECRET) for s in LEAKABLE)


# ---------------------------------------------------------------------------------------------------
# The collective port


def _state(_round_id: int) -> GroupState:
    return GroupState(1, 7, [np.arange(4, dtype=np.float32)], Lineage.origin(1, 7))


def test_the_collective_port_serves_no_state_and_takes_no_piece_without_the_job_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging()
    asked: list[int] = []

    def provider(round_id: int) -> GroupState:
        asked.append(round_id)
        return _state(round_id)

    server = CollectiveServer("127.0.0.1", 0, provider, token=SECRET.collective_token())
    try:
        real = SECRET.collective_token()
        # The last refused token differs from the job's in its last byte only, whatever that byte is (a fixed
        # b"x" equalled the random token's own last byte once in 256 runs, and the test then failed).
        near = real[:31] + bytes([real[31] ^ 0x01])
        for token in (None, OTHER.collective_token(), bytes(32), near):
            with pytest.raises(OSError):
                request_state(server.address, -1, 5, token=token or bytes(32))
            connection = PeerConnection(server.address, token=token or bytes(32))
            with contextlib.suppress(OSError):  # sent, or cut off by the server first
                connection.send_piece((1, 0, 0), 0, np.ones(4, np.float32), timeout=5).result(10)
            time.sleep(0.2)
            connection.close()
        host, port = server.address.rsplit(":", 1)
        with (
            socket.create_connection((host, int(port)), timeout=20) as raw,  # says nothing: cut off
            contextlib.suppress(ConnectionResetError),  # a reset is a close too
        ):
            assert raw.recv(1) == b""
        assert asked == [] and server.mailbox.take((1, 0, 0), 0.5, lambda: None) is None
        refusals = [
            line for line in capsys.readouterr().err.splitlines() if "collective_unauthenticated" in line
        ]
        assert len(refusals) == 1 and "peer=127.0.0.1" in refusals[0]
        state = request_state(server.address, -1, 5, token=SECRET.collective_token())
        assert state is not None and state.version == 7 and asked == [-1]
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------
# Handing credentials to pods


def test_local_pods_get_their_own_credentials_and_no_record_or_argument_holds_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(auth.SECRET_ENV, OTHER.hex())  # the master's own environment is not inherited
    dump = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
    backend = LocalProcessBackend("auth", pods_dir=tmp_path / "pods")
    backend.use_job_secret(SECRET)
    try:
        for role, pod_id in ((PodRole.WORKER, 0), (PodRole.PS, 0)):
            out = tmp_path / f"{role.value}.json"
            port = find_free_port() if role is PodRole.PS else None
            backend.start(PodSpec(role, pod_id, (sys.executable, "-c", dump, str(out)), port=port))
        deadline = time.monotonic() + 60
        done: set[PodRole] = set()
        while len(done) < 2:
            assert time.monotonic() < deadline
            done |= {e.role for e in backend.events(timeout=0.5) if e.phase is PodPhase.SUCCEEDED}
    finally:
        backend.close(grace_seconds=1)
    worker = json.loads((tmp_path / "worker.json").read_text())
    ps = json.loads((tmp_path / "ps.json").read_text())
    assert auth.credential_from_env(worker) == SECRET.credential("worker-0")
    assert auth.SECRET_ENV not in worker
    assert auth.secret_from_env(ps) is not None and auth.secret_from_env(ps).hex() == SECRET.hex()
    for record in (tmp_path / "pods").rglob("*"):
        if (record.is_file() and not record.name.endswith(".json")) or record.name == "pod.json":
            text = record.read_text(errors="replace")
            assert not any(s in text for s in LEAKABLE), record


def test_a_pod_manifest_refers_to_the_secret_and_holds_no_credential() -> None:
    config = KubernetesConfig(image="img")
    for role in (PodRole.WORKER, PodRole.PS):
        manifest = pod_manifest("job", config, PodSpec(role, 2, ("edl-argo", role.value), port=2222))
        env = {e["name"]: e for e in manifest["spec"]["containers"][0]["env"]}
        assert env[auth.IDENTITY_ENV]["value"] == f"{role.value}-2"
        refs = {
            name: e["valueFrom"]["secretKeyRef"]
            for name, e in env.items()
            if "secretKeyRef" in e.get("valueFrom", {})
            and e["valueFrom"]["secretKeyRef"]["name"] == "job-auth"
        }
        expected = (
            {auth.SECRET_ENV: "job-secret"}
            if role is PodRole.PS
            else {auth.TOKEN_ENV: "worker-2", auth.COLLECTIVE_ENV: "collective"}
        )
        assert {name: ref["key"] for name, ref in refs.items()} == expected
        assert not any(s in json.dumps(manifest) for s in LEAKABLE)


def test_the_master_state_keeps_the_secret_for_a_restart_readable_by_its_owner_only(tmp_path: Path) -> None:
    store = MasterStateStore(LocalStorage(tmp_path), "job", {})
    assert store.load_secret() is None
    store.save_secret(SECRET)
    assert stat.S_IMODE(os.stat(tmp_path / SECRET_KEY).st_mode) == 0o600
    kept = store.load_secret()
    assert kept is not None and kept.hex() == SECRET.hex()
    store.remove()
    assert store.load_secret() is None


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubernetesStandIn]:
    with KubernetesStandIn(tmp_path / "k8s") as server:
        server.enforce_rules(role_rules())  # templates/rbac.yaml is enough
        monkeypatch.setenv(API_URL_ENV, server.url)
        yield server


def test_on_kubernetes_the_secret_lives_in_a_secret_the_master_owns_and_a_restart_reads_from_its_volume(
    stand_in: KubernetesStandIn, tmp_path: Path
) -> None:
    """The master reads no Secret through the API (its Role has no ``get`` on Secrets): a restarted master
    finds the job's secret in the optional volume of ``<job>-auth`` that its pod mounts."""
    job = f"a-{uuid.uuid4().hex[:6]}"
    dump = "import json, os, sys; print('ENV=' + json.dumps(dict(os.environ)), flush=True)"

    def master_pod(folder: str) -> KubernetesConfig:
        """The config of a master whose pod starts now: the kubelet fills its volume of ``<job>-auth``."""
        stand_in.mount_secret(auth_secret_name(job), tmp_path / folder / MASTER_AUTH_VOLUME)
        return KubernetesConfig(image="img", ps_port=ps_port, secrets_dir=str(tmp_path / folder))

    ps_port = kubernetes_ps_port()
    first = KubernetesBackend(job, master_pod("first"))
    assert first.stored_job_secret() is None  # no Secret yet: an empty volume
    first.use_job_secret(SECRET)
    first.start(PodSpec(PodRole.WORKER, 4, (sys.executable, "-c", dump)))
    deadline = time.monotonic() + 60
    while not any(e.phase is PodPhase.SUCCEEDED for e in first.events(timeout=0.5)):
        assert time.monotonic() < deadline
    secret = stand_in.objects("secrets", f"app.kubernetes.io/instance={job}")
    assert [s["metadata"]["name"] for s in secret] == [auth_secret_name(job)]
    assert set(secret[0]["data"]) == {"job-secret", "collective", "worker-4"}
    log = stand_in.cluster.pod_log("default", f"{job}-worker-4", None)
    env = json.loads(next(line for line in log.splitlines() if line.startswith("ENV="))[4:])
    assert auth.credential_from_env(env) == SECRET.credential("worker-4") and auth.SECRET_ENV not in env
    assert auth.collective_token_from_env(env) == SECRET.collective_token()
    manifest = stand_in.pod(f"{job}-worker-4")
    assert not any(s in json.dumps(manifest) for s in LEAKABLE)
    # A restarted master (a new backend of the job, in a new pod) finds the same secret in its volume.
    second = KubernetesBackend(job, master_pod("second"))
    kept = second.stored_job_secret()
    assert kept is not None and kept.hex() == SECRET.hex()
    second.use_job_secret(kept)  # the Secret is there already: kept as it is
    second.close(grace_seconds=1)
    first.close(grace_seconds=1)
    assert stand_in.objects("secrets", f"app.kubernetes.io/instance={job}") == []
    calls = [c for c in stand_in.calls if c.user_agent.startswith(MASTER_USER_AGENT)]
    assert {c.verb for c in calls if c.resource == "secrets"} == {"create", "patch", "delete"}


def test_a_master_that_cannot_read_the_existing_secret_of_its_job_is_a_one_line_error(
    stand_in: KubernetesStandIn, tmp_path: Path
) -> None:
    """A master started again outside a pod that mounts ``<job>-auth`` (its volume empty) cannot learn the
    job's secret: making a new one would lock out the pods it adopts, so it stops, naming the Secret."""
    job = f"a-{uuid.uuid4().hex[:6]}"
    config = KubernetesConfig(image="img", ps_port=kubernetes_ps_port(), secrets_dir=str(tmp_path / "empty"))
    first = KubernetesBackend(job, config)
    first.use_job_secret(SECRET)
    second = KubernetesBackend(job, config)
    try:
        assert second.stored_job_secret() is None
        with pytest.raises(ConfigError, match=f"^Secret {auth_secret_name(job)} of job {job} exists") as err:
            second.use_job_secret(OTHER)
        assert "\n" not in str(err.value) and str(tmp_path / "empty") in str(err.value)
        assert not any(s in str(err.value) for s in LEAKABLE)
        (kept,) = stand_in.objects("secrets", f"app.kubernetes.io/instance={job}")
        assert kept["data"]["job-secret"] == base64.b64encode(SECRET.hex().encode()).decode()
    finally:
        second.close(grace_seconds=1)
        first.close(grace_seconds=1)


def test_scale_authenticates_with_the_secret_its_local_master_registered(
    master: tuple[str, TaskDispatcher],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, _ = master
    monkeypatch.setenv("EDL_RUN_DIR", str(tmp_path))
    for name in auth.CREDENTIAL_ENV:
        monkeypatch.delenv(name, raising=False)
    register_master("scaled", address)  # an entry without the secret: the call is refused
    assert cli.main(["scale", "scaled", "--workers", "3"]) != 0
    assert "did not accept the request: master: no credential" in capsys.readouterr().err
    register_master("scaled", address, SECRET)
    entry = tmp_path / "jobs" / "scaled.json"
    assert stat.S_IMODE(os.stat(entry).st_mode) == 0o600
    assert cli.main(["scale", "scaled", "--workers", "3"]) == 0
    assert "target workers 3" in capsys.readouterr().out
    monkeypatch.setenv(auth.IDENTITY_ENV, "worker-0")  # a worker's credential may not steer the job
    monkeypatch.setenv(auth.TOKEN_ENV, SECRET.token("worker-0"))
    assert cli.main(["scale", "scaled", "--workers", "3"]) != 0
    assert "worker-0 cannot act as admin" in capsys.readouterr().err
