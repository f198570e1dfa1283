"""TLS on the job's gRPC services (``edl_argo.rpc.tls``): a job trains over it end to end, a plaintext client
and a client that trusts another CA are refused, bad files are one-line errors, and on Kubernetes the
``--tls-secret`` Secret reaches the master as a volume of its pod (never through the API) and the pods as a
read-only volume."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import keras
import numpy as np
import pytest
import yaml

from edl_argo import cli, log
from edl_argo.errors import ConfigError
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.job import TrainingJob
from edl_argo.master.pod_commands import ps_pod, worker_pod
from edl_argo.master.registry import register_master
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.pods.kubernetes import API_URL_ENV, KubernetesBackend
from edl_argo.pods.kubernetes_config import KubernetesConfig
from edl_argo.pods.manifests import MASTER_SECRETS_ENV, MASTER_TLS_VOLUME, render_job_manifests
from edl_argo.proto import master_pb2, master_pb2_grpc
from edl_argo.ps.server import start_server
from edl_argo.ps.servicer import ParameterServerServicer
from edl_argo.rpc import auth, tls
from edl_argo.rpc import tensor_port as tensor_port_module
from edl_argo.rpc.auth import JobSecret
from edl_argo.rpc.channel import call_with_retry, make_channel, make_server
from edl_argo.rpc.health import ping
from edl_argo.rpc.master_watch import MasterWatch
from edl_argo.worker.ps_client import ParameterServerClient
from tests.engine_helpers import JobThread, assert_no_record_lost, digits_config
from tests.k8s_helpers import MASTER_USER_AGENT, kubernetes_ps_port, role_rules
from tests.k8s_stand_in import KubernetesStandIn
from tests.test_pods_kubernetes import FLAGS, parse_train

pytestmark = pytest.mark.timeout(120)

SECRET = JobSecret.generate()
#: What three epochs of the digits job reach at least (0.975 in the run measured; chance is 0.1).
TRAINED_ACCURACY = 0.85


def openssl(*arguments: str) -> None:
    subprocess.run(["openssl", *arguments], check=True, capture_output=True, timeout=60)


def certificate(folder: Path, *, name: str = tls.SERVER_NAME, ca: Path | None = None) -> Path:
    """``folder`` with ``tls.crt`` and ``tls.key``: a certificate naming ``DNS:name`` (and 127.0.0.1),
    self-signed, or signed by the CA folder ``ca`` (whose ``tls.crt`` is then copied as ``ca.crt``)."""
    folder.mkdir(parents=True)
    signer = ["-CA", str(ca / tls.CERT_FILE), "-CAkey", str(ca / tls.KEY_FILE)] if ca else []
    openssl(
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-days", "1", "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name},IP:127.0.0.1"),
        *signer,
        *("-keyout", str(folder / tls.KEY_FILE), "-out", str(folder / tls.CERT_FILE)),
    )
    if ca:
        (folder / tls.CA_FILE).write_bytes((ca / tls.CERT_FILE).read_bytes())
    return folder


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """TLS folders: ``self-signed`` (the job's), ``stranger`` (another self-signed one, naming edl-argo
    too), ``misnamed`` (self-signed, naming another host), ``ca`` and ``signed`` (a certificate it signed,
    with ca.crt)."""
    root = tmp_path_factory.mktemp("tls")
    made = {
        "self-signed": certificate(root / "self-signed"),
        "stranger": certificate(root / "stranger"),
        "misnamed": certificate(root / "misnamed", name="elsewhere.example"),
        "ca": certificate(root / "ca", name="edl-argo-test-ca"),
    }
    made["signed"] = certificate(root / "signed", ca=made["ca"])
    return made


@pytest.fixture
def ps_over_tls(certificates: dict[str, Path]) -> Iterator[str]:
    """A parameter server of this job serving TLS with the self-signed certificate: its address."""
    servicer = ParameterServerServicer(lambda: keras.optimizers.SGD(0.1), jit_compile=False)
    files = tls.load_tls_dir(str(certificates["self-signed"]))
    server, port = start_server(servicer, "127.0.0.1", 0, SECRET, "ps-0", tls=files)
    yield f"127.0.0.1:{port}"
    server.stop(None)


def refusal(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        ping(channel, 10)
    return raised.value


def test_a_tls_server_answers_a_client_that_trusts_its_certificate_by_the_fixed_name(
    certificates: dict[str, Path], ps_over_tls: str
) -> None:
    files = tls.load_tls_dir(str(certificates["self-signed"]))
    ping(make_channel(ps_over_tls, SECRET.credential("worker-0"), files), 10)
    # Whatever address is dialled: the name checked is edl-argo's, not the address's.
    ping(
        make_channel(ps_over_tls.replace("127.0.0.1", "localhost"), SECRET.credential("worker-0"), files), 10
    )


def test_a_plaintext_client_is_refused_by_a_tls_server(ps_over_tls: str) -> None:
    error = refusal(make_channel(ps_over_tls, SECRET.credential("worker-0")))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()


def test_a_tls_parameter_server_speaks_tls_on_its_tensor_port_too(
    certificates: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker trusting the certificate pushes and pulls over the tensor port, in TLS; a plaintext hello
    gets no answer; a worker trusting another CA never sends its credential there (it falls back to gRPC,
    which refuses it in turn)."""
    files = tls.load_tls_dir(str(certificates["self-signed"]))
    servicer = ParameterServerServicer(lambda: keras.optimizers.SGD(0.1), jit_compile=False)
    server, port = start_server(servicer, "127.0.0.1", 0, SECRET, "ps-0", tls=files, tensor_port=0)
    try:
        client = ParameterServerClient(
            [f"127.0.0.1:{port}"], credential=SECRET.credential("worker-0"), tls=files
        )
        weights = np.ones((256, 256), np.float32)
        assert client.push_model({"w": weights}, [])
        _, versions, _ = client.pull_dense([-1])
        assert client.push_gradients({"w": weights}, {}, versions).accepted and servicer.version == 1
        idle = client._tensor_ports[0]._idle  # the connections the calls used, kept for the next ones
        assert idle and all(isinstance(sock, ssl.SSLSocket) for sock in idle)
        client.close()

        host, tensor_port = servicer.tensor_port.rsplit(":", 1)
        with socket.create_connection((host, int(tensor_port)), timeout=10) as plain:
            plain.sendall(tensor_port_module.hello("worker-0", SECRET.token("worker-0")))
            plain.settimeout(10)
            answer = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := plain.recv(4096):
                    answer += chunk
            assert not answer.startswith(tensor_port_module.FRAME_MAGIC), answer[:40]

        warnings: list[dict] = []
        monkeypatch.setattr(
            tensor_port_module.log, "warning", lambda event, **f: warnings.append({"event": event, **f})
        )
        stranger = tls.load_tls_dir(str(certificates["stranger"]))
        locate = lambda _timeout: servicer.tensor_port  # noqa: E731
        port_client = tensor_port_module.TensorPort(
            "ps-0", locate, SECRET.credential("worker-0"), stranger.client_context()
        )
        assert port_client.connection(time.monotonic() + 10) is None
        assert [w["event"] for w in warnings] == ["ps_tensor_port_unreachable"]
        assert "CERTIFICATE_VERIFY_FAILED" in warnings[0]["reason"], warnings
    finally:
        server.stop(None)


def test_a_client_trusting_another_ca_or_a_server_of_another_name_fails_with_a_clear_error(
    certificates: dict[str, Path], ps_over_tls: str
) -> None:
    stranger = tls.load_tls_dir(str(certificates["stranger"]))
    error = refusal(make_channel(ps_over_tls, SECRET.credential("worker-0"), stranger))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in (error.details() or ""), error.details()
    # A server whose certificate does not name edl-argo is refused, even by a client that trusts it.
    misnamed = tls.load_tls_dir(str(certificates["misnamed"]))
    servicer = ParameterServerServicer(lambda: keras.optimizers.SGD(0.1), jit_compile=False)
    server, port = start_server(servicer, "127.0.0.1", 0, SECRET, "ps-0", tls=misnamed)
    try:
        error = refusal(make_channel(f"127.0.0.1:{port}", SECRET.credential("worker-0"), misnamed))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "Hostname Verification Check failed" in (error.details() or ""), error.details()
    finally:
        server.stop(None)


def test_a_worker_trusting_another_ca_logs_why_it_cannot_reach_the_server(
    certificates: dict[str, Path], ps_over_tls: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a pod with the wrong ca.crt logs while it retries: the handshake's reason, not a bare code."""
    log.configure("INFO")
    stranger = tls.load_tls_dir(str(certificates["stranger"]))
    channel = make_channel(ps_over_tls, SECRET.credential("worker-0"), stranger)
    with pytest.raises(grpc.RpcError):
        call_with_retry(lambda timeout: ping(channel, timeout), f"ps-0 {ps_over_tls}", budget_seconds=1.0)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "peer_unavailable" in line]
    assert "CERTIFICATE_VERIFY_FAILED" in line, line


def test_a_certificate_signed_by_a_ca_is_trusted_through_ca_crt(certificates: dict[str, Path]) -> None:
    signed = tls.load_tls_dir(str(certificates["signed"]))
    assert signed.ca == (certificates["ca"] / tls.CERT_FILE).read_bytes()
    servicer = ParameterServerServicer(lambda: keras.optimizers.SGD(0.1), jit_compile=False)
    server, port = start_server(servicer, "127.0.0.1", 0, SECRET, "ps-0", tls=signed)
    try:
        ping(make_channel(f"127.0.0.1:{port}", SECRET.credential("worker-0"), signed), 10)
    finally:
        server.stop(None)


def test_bad_tls_files_are_one_line_errors_naming_the_file_and_the_setting(
    certificates: dict[str, Path], tmp_path: Path
) -> None:
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / tls.CERT_FILE).write_bytes((certificates["self-signed"] / tls.CERT_FILE).read_bytes())
    key = (certificates["stranger"] / tls.KEY_FILE).read_bytes()
    (mixed / tls.KEY_FILE).write_bytes(key)
    cases = {
        str(tmp_path / "absent"): f"--tls-dir {tmp_path / 'absent'}: not a folder",
        str(mixed): f"--tls-dir: tls.key of {mixed} does not match its tls.crt",
    }
    for folder, message in cases.items():
        with pytest.raises(ConfigError) as raised:
            tls.load_tls_dir(folder)
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
        assert key.decode() not in str(raised.value)
    (mixed / tls.KEY_FILE).unlink()
    with pytest.raises(ConfigError, match=f"^--tls-dir: {mixed / tls.KEY_FILE} is missing$"):
        tls.load_tls_dir(str(mixed))
    (mixed / tls.KEY_FILE).mkdir()  # unreadable as a file (mode bits would not stop root)
    with pytest.raises(ConfigError, match=f"^--tls-dir: {mixed / tls.KEY_FILE} is unreadable"):
        tls.load_tls_dir(str(mixed))
    # The pods' commands: a missing file ends them with that line, exit 2, no traceback.
    absent = str(tmp_path / "absent")
    for role in (["worker", "--worker-id", "0", "--master-addr", "127.0.0.1:1"], ["ps"]):
        done = subprocess.run(
            [sys.executable, "-m", "edl_argo.cli", *role, "--model-def", "m.py", "--tls-dir", absent],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, auth.SECRET_ENV: SECRET.hex()},
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().endswith(
            f"--tls-dir {absent}: not a folder (it holds tls.crt, tls.key, ca.crt)"
        )
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_each_backend_names_its_tls_files_its_own_way() -> None:
    with pytest.raises(ConfigError, match=r"^--tls-secret names a Kubernetes Secret: it needs --backend"):
        parse_train([*FLAGS[: FLAGS.index("--backend")], "--tls-secret", "job-tls"])
    with pytest.raises(ConfigError, match=r"^--tls-dir is for --backend local"):
        parse_train([*FLAGS, "--tls-dir", "/etc/tls"])
    with pytest.raises(ConfigError, match=r"^--tls-secret 'Bad_Name': not a valid Kubernetes name"):
        parse_train([*FLAGS, "--tls-secret", "Bad_Name"])


def test_a_local_job_trains_over_tls_and_refuses_plaintext_callers(
    digits_data: Path, tmp_path: Path, certificates: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = certificates["self-signed"]
    # Three epochs: enough to show the model trained (chance is 0.1), in a third of the usual time.
    config = digits_config(digits_data, tmp_path / "job", tls_dir=str(folder), num_epochs=3)
    job = TrainingJob.load(config)
    key = (folder / tls.KEY_FILE).read_text()
    for spec in (
        worker_pod(config, 0, master_address="m:1", model_def="m.py", ps_addresses="p:1"),
        ps_pod(config, 0, port=3000, master_address="m:1", model_def="m.py"),
    ):
        assert spec.command[spec.command.index("--tls-dir") + 1] == str(folder), spec.command
        assert key not in json.dumps(spec.command)
    thread = JobThread(job).start()
    thread.wait_until(lambda: bool(job._master_address), 60, "the master to serve")
    plaintext = make_channel(job._master_address, job.job_secret.credential("admin"))
    with plaintext, pytest.raises(grpc.RpcError) as raised:
        master_pb2_grpc.MasterStub(plaintext).ScaleWorkers(
            master_pb2.ScaleWorkersRequest(num_workers=2), timeout=10
        )
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    # An operator's `edl-argo scale` finds the TLS folder in the job's registry entry.
    monkeypatch.setenv(auth.SECRET_ENV, job.job_secret.hex())
    assert cli.main(["scale", config.job_name, "--workers", "2"]) == 0
    metrics = thread.join(120)
    assert metrics["final_metrics"]["accuracy"] >= TRAINED_ACCURACY
    assert_no_record_lost(metrics)


@pytest.fixture
def master_over_tls(certificates: dict[str, Path]) -> Iterator[str]:
    """A master service of this job serving TLS with the self-signed certificate: its address."""
    evaluation = EvaluationService(lambda: {}, {}, 0)
    evaluation.dispatcher = dispatcher = TaskDispatcher(
        {"train": 20}, DispatcherConfig(records_per_task=10, num_epochs=1)
    )
    urls = {TaskType.TRAINING: "train", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
    servicer = MasterServicer(
        dispatcher, evaluation, urls, current_version=lambda: 0, scale_workers=lambda n: n
    )
    server = make_server(4, interceptors=[auth.server_interceptor(SECRET, "master")])
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    port = tls.add_port(server, "127.0.0.1:0", tls.load_tls_dir(str(certificates["self-signed"])))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_scale_reaches_a_tls_master_with_the_certificate_alone_or_the_registered_folder(
    certificates: dict[str, Path],
    master_over_tls: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An operator needs no key: tls.crt (or ca.crt) is what a client trusts. A local job's registry entry
    holds its folder's path, never a file's content."""
    monkeypatch.setenv("EDL_RUN_DIR", str(tmp_path))
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.hex())
    certificate_only = tmp_path / "operator"
    certificate_only.mkdir()
    (certificate_only / tls.CERT_FILE).write_bytes((certificates["self-signed"] / tls.CERT_FILE).read_bytes())
    given = ["--master-addr", master_over_tls, "--workers", "3"]
    assert cli.main(["scale", "secured", *given]) != 0  # plaintext: refused at the handshake
    assert cli.main(["scale", "secured", *given, "--tls-dir", str(certificate_only)]) == 0
    assert "target workers 3" in capsys.readouterr().out
    register_master("secured", master_over_tls, SECRET, tls_dir=str(certificates["self-signed"]))
    entry = (tmp_path / "jobs" / "secured.json").read_text()
    assert json.loads(entry)["tls_dir"] == str(certificates["self-signed"])
    assert (certificates["self-signed"] / tls.KEY_FILE).read_text() not in entry
    assert cli.main(["scale", "secured", "--workers", "2"]) == 0
    assert "target workers 2" in capsys.readouterr().out


def test_a_relative_tls_dir_reaches_the_pods_as_an_absolute_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/tmp")
    config = parse_train([*FLAGS[: FLAGS.index("--backend")], "--tls-dir", "certs"])
    command = worker_pod(config, 0, master_address="m:1", model_def="m.py", ps_addresses="p:1").command
    assert command[command.index("--tls-dir") + 1] == "/tmp/certs"


def test_the_master_watch_of_a_pod_reaches_a_tls_master_only_over_tls(
    certificates: dict[str, Path], ps_over_tls: str
) -> None:
    lost: list[str] = []
    files = tls.load_tls_dir(str(certificates["self-signed"]))
    secure = MasterWatch(ps_over_tls, 1.5, lambda: lost.append("tls"), tls=files).start()
    plain = MasterWatch(ps_over_tls, 1.5, lambda: lost.append("plaintext")).start()
    try:
        deadline = time.monotonic() + 20
        while "plaintext" not in lost and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        secure.close()
        plain.close()
    assert lost == ["plaintext"]


# ---------------------------------------------------------------------------------------------------
# Kubernetes


def tls_secret_body(name: str, folder: Path, keys: tuple[str, ...] = (tls.CERT_FILE, tls.KEY_FILE)) -> dict:
    data = {key: base64.b64encode((folder / key).read_bytes()).decode() for key in keys}
    return {"metadata": {"name": name}, "type": "kubernetes.io/tls", "data": data}


def test_the_manifests_mount_the_tls_secret_read_only_into_worker_and_ps_pods(
    certificates: dict[str, Path],
) -> None:
    config = parse_train([*FLAGS, "--tls-secret", "job-tls"])
    assert config.kubernetes.tls_secret == "job-tls"
    specs = [
        ps_pod(config, 0, port=3000, master_address="m:1", model_def="m.py"),
        worker_pod(config, 0, master_address="m:1", model_def="m.py", ps_addresses="p:1"),
    ]
    documents = list(yaml.safe_load_all(render_job_manifests("mnist", config.kubernetes, specs)))
    pods = [d for d in documents if d["kind"] == "Pod"]
    assert sorted(p["metadata"]["labels"]["edl-argo/role"] for p in pods) == ["ps", "worker"]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["tls"] == {"name": "tls", "secret": {"secretName": "job-tls", "defaultMode": 0o440}}
        (container,) = pod["spec"]["containers"]
        assert {"name": "tls", "mountPath": tls.POD_TLS_DIR, "readOnly": True} in container["volumeMounts"]
        assert len(container["volumeMounts"]) == 3  # the two --volume mounts stay
        command = container["command"]
        assert command[command.index("--tls-dir") + 1] == tls.POD_TLS_DIR
    key = (certificates["self-signed"] / tls.KEY_FILE).read_text()
    assert key not in json.dumps(documents)
    plain = parse_train(FLAGS)
    specs = [worker_pod(plain, 0, master_address="m:1", model_def="m.py", ps_addresses="p:1")]
    documents = list(yaml.safe_load_all(render_job_manifests("mnist", plain.kubernetes, specs)))
    (pod,) = [d for d in documents if d["kind"] == "Pod"]
    assert "--tls-dir" not in pod["spec"]["containers"][0]["command"]
    assert all(v["name"] != "tls" for v in pod["spec"]["volumes"])


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubernetesStandIn]:
    with KubernetesStandIn(tmp_path_factory.mktemp("k8s")) as server:
        server.enforce_rules(role_rules())  # templates/rbac.yaml: no verb beyond it
        yield server


def test_the_master_reads_the_tls_secret_from_its_pods_volume_never_through_the_api(
    stand_in: KubernetesStandIn,
    certificates: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The elastic-train step mounts the ``--tls-secret`` Secret (optional) into the master's pod; its Role
    has no ``get`` on Secrets. A missing Secret or key is a one-line error naming the Secret."""
    monkeypatch.setenv(API_URL_ENV, stand_in.url)
    name = f"tls-{uuid.uuid4().hex[:6]}"
    stand_in.create(
        "secrets", tls_secret_body(name, certificates["signed"], (tls.CERT_FILE, tls.KEY_FILE, tls.CA_FILE))
    )
    stand_in.create("secrets", tls_secret_body(f"{name}-nokey", certificates["signed"], (tls.CERT_FILE,)))
    secrets_dir = tmp_path / "master"
    config = KubernetesConfig(image="img", ps_port=kubernetes_ps_port(), secrets_dir=str(secrets_dir))
    backend = KubernetesBackend(f"t-{uuid.uuid4().hex[:8]}", config)

    def mounted(secret: str) -> str:
        """The master's pod started with the step's volume of Secret ``secret``."""
        shutil.rmtree(secrets_dir / MASTER_TLS_VOLUME, ignore_errors=True)
        stand_in.mount_secret(secret, secrets_dir / MASTER_TLS_VOLUME)
        return secret

    try:
        files = backend.tls_secret(mounted(name))
        assert files.certificate == (certificates["signed"] / tls.CERT_FILE).read_bytes()
        assert files.ca == (certificates["ca"] / tls.CERT_FILE).read_bytes()
        assert str(files.key) not in repr(files) and "BEGIN" not in repr(files)
        with pytest.raises(
            ConfigError, match=f"^--tls-secret {name}-nokey: Secret {name}-nokey has no tls.key"
        ):
            backend.tls_secret(mounted(f"{name}-nokey"))
        with pytest.raises(ConfigError, match=f"^--tls-secret {name}-gone: there is no such Secret") as gone:
            backend.tls_secret(mounted(f"{name}-gone"))
        assert "\n" not in str(gone.value)
    finally:
        backend.close(grace_seconds=1)
    outside = KubernetesBackend(
        f"t-{uuid.uuid4().hex[:8]}", KubernetesConfig(image="img", ps_port=kubernetes_ps_port())
    )
    try:
        with pytest.raises(ConfigError, match=f"^--tls-secret {name}: .*{MASTER_SECRETS_ENV} is not set"):
            outside.tls_secret(name)
    finally:
        outside.close(grace_seconds=1)
    calls = [
        c for c in stand_in.calls if c.user_agent.startswith(MASTER_USER_AGENT) and c.name.startswith(name)
    ]
    assert calls == []
