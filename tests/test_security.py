"""Security: pods and steps run as non-root, only a job's own pods reach its gRPC ports, servers bind the
pod's address only, oversized messages are refused, and storage credentials never leak.

What the job's pods run, how they are exposed and what a job writes are checked here; the behaviour of
each piece (manifests, backend, servers) is tested with it elsewhere.
"""

from __future__ import annotations

import io
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import keras
import pytest
import yaml
from s3_stand_in import S3StandIn

from edl_argo import cli, log
from edl_argo.data.commands import digits_records, write_dataset
from edl_argo.errors import ConfigError
from edl_argo.hera.render import render
from edl_argo.master.config import TrainConfig
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.job import TrainingJob
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.pods import LocalProcessBackend, PodRole, PodSpec, find_free_port
from edl_argo.pods.kubernetes import API_URL_ENV, KubernetesBackend
from edl_argo.pods.kubernetes_config import KubernetesConfig, Owner
from edl_argo.pods.manifests import network_policy_manifest, pod_manifest
from edl_argo.proto import master_pb2, master_pb2_grpc, ps_pb2, ps_pb2_grpc, tensor_pb2
from edl_argo.ps.server import PSConfig, serve
from edl_argo.ps.servicer import ParameterServerServicer
from edl_argo.recordio import Compressor
from edl_argo.rpc.channel import MAX_MESSAGE_BYTES, make_server
from edl_argo.storage import open_storage
from tests.engine_helpers import DIGITS_MODEL
from tests.k8s_helpers import ROOT, kubernetes_ps_port, role_rules
from tests.k8s_stand_in import KubernetesStandIn
from tests.manifests import load_documents, validate
from tests.test_argo_templates import container_templates

pytestmark = pytest.mark.timeout(180)

#: What every pod and every Argo step must run with, spelt out (not imported from the code under test).
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
OWNER = Owner("argoproj.io/v1alpha1", "Workflow", "wf-1", "wf-uid-1")


def k8s_config(**settings: Any) -> KubernetesConfig:
    return KubernetesConfig(**{"image": "edl-argo:test", "owner": OWNER, "workflow_name": "wf-1", **settings})


def job_pods(job: str, config: KubernetesConfig) -> list[dict[str, Any]]:
    """A worker and a PS pod of ``job``."""
    worker = PodSpec(PodRole.WORKER, 0, ("edl-argo", "worker"))
    ps = PodSpec(
        PodRole.PS, 0, ("edl-argo", "ps"), port=config.ps_port_of(0), tensor_port=config.tensor_port_of(0)
    )
    return [pod_manifest(job, config, worker), pod_manifest(job, config, ps)]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions In/Exists) selects ``labels``."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        if operator == "Exists" and key not in labels:
            return False
        if operator == "In" and labels.get(key) not in expression["values"]:
            return False
    return True


# ---------------------------------------------------------------------------------------------------
# Non-root pods and steps


def test_job_pods_and_every_argo_step_run_as_non_root_without_privileges() -> None:
    for pod in job_pods("mnist", k8s_config()):
        assert pod["spec"]["securityContext"] == POD_SECURITY, pod["metadata"]["name"]
        assert pod["spec"]["automountServiceAccountToken"] is False
        (container,) = pod["spec"]["containers"]
        assert container["securityContext"] == CONTAINER_SECURITY, pod["metadata"]["name"]
    templates = container_templates()
    assert {t["name"] for t in templates} >= {"elastic-train", "evaluate", "predict", "prepare-digits"}
    for template in templates:
        assert template.get("securityContext") == POD_SECURITY, template["name"]
        assert template["container"].get("securityContext") == CONTAINER_SECURITY, template["name"]


# ---------------------------------------------------------------------------------------------------
# NetworkPolicies


def test_the_job_policy_admits_the_jobs_own_pods_to_their_ports_only() -> None:
    config = k8s_config(namespace="ml")
    policy = network_policy_manifest("mnist", config)
    validate(policy)  # a NetworkPolicy as the API knows it, no unknown field
    assert policy["metadata"]["name"] == "mnist-grpc" and policy["metadata"]["namespace"] == "ml"
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}  # pods of this namespace only: no namespaceSelector, no ipBlock
    ours, theirs = job_pods("mnist", config), job_pods("other", config)
    for pod in ours:
        labels = pod["metadata"]["labels"]
        assert selects(spec["podSelector"], labels) and selects(source["podSelector"], labels)
        assert pod["metadata"]["ownerReferences"] == policy["metadata"]["ownerReferences"]
    for pod in theirs:
        labels = pod["metadata"]["labels"]
        assert not selects(spec["podSelector"], labels) and not selects(source["podSelector"], labels)
    ps_ports = [p["name"] for p in ours[1]["spec"]["containers"][0]["ports"]]
    assert ps_ports == ["grpc", "tensors"]  # its gRPC port and its tensor port
    assert rule["ports"] == [{"protocol": "TCP", "port": port} for port in ps_ports]


def test_the_namespace_denies_ingress_to_every_edl_argo_pod_by_default() -> None:
    (policy,) = load_documents(ROOT / "templates" / "network-policy.yaml")
    validate(policy)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and not spec.get("ingress")  # selected, nothing admitted
    for pod in job_pods("mnist", k8s_config()) + job_pods("other", k8s_config()):
        assert selects(spec["podSelector"], pod["metadata"]["labels"])
    assert not selects(spec["podSelector"], {"app": "minio"})  # not every pod of the namespace


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubernetesStandIn]:
    with KubernetesStandIn(tmp_path_factory.mktemp("k8s")) as server:
        yield server


def test_the_backend_creates_the_job_policy_keeps_it_across_masters_and_deletes_it(
    stand_in: KubernetesStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_URL_ENV, stand_in.url)
    stand_in.enforce_rules(role_rules())
    job = f"net-{uuid.uuid4().hex[:6]}"
    config = k8s_config(ps_port=kubernetes_ps_port(), owner=None, workflow_name="")
    first = KubernetesBackend(job, config)
    (created,) = stand_in.objects("networkpolicies", f"app.kubernetes.io/instance={job}")
    assert created["spec"] == network_policy_manifest(job, config)["spec"]
    successor = KubernetesBackend(job, config)  # a restarted master: the policy exists, and is kept
    assert [
        p["metadata"]["uid"] for p in stand_in.objects("networkpolicies", f"app.kubernetes.io/instance={job}")
    ] == [created["metadata"]["uid"]]
    successor.close(grace_seconds=1)
    first.close(grace_seconds=1)
    assert stand_in.objects("networkpolicies", f"app.kubernetes.io/instance={job}") == []

    without = [r for r in role_rules() if "networkpolicies" not in r["resources"]]
    stand_in.enforce_rules(without)
    with pytest.raises(
        ConfigError, match=f"cannot create NetworkPolicy {job}-grpc in namespace default: 403"
    ):
        KubernetesBackend(job, config)
    stand_in.enforce_rules(role_rules())


# ---------------------------------------------------------------------------------------------------
# Servers: bound to the pod's address, message-size limits


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


def port_held_elsewhere(pod_address: str, elsewhere: str) -> tuple[int, socket.socket]:
    """A port free on ``pod_address``, and a socket bound (not listening) to the same port on ``elsewhere``:
    while it is held, a connection to ``elsewhere`` at that port is refused whatever else runs on the machine
    (no other program can listen there, and no outgoing connection can take it as its own port and connect
    to itself), and a server binding the port on every address fails."""
    for _ in range(20):
        port = find_free_port(pod_address)
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            held.bind((elsewhere, port))
        except OSError:
            held.close()
            continue
        return port, held
    raise AssertionError(f"no port free on both {pod_address} and {elsewhere}")


def test_a_parameter_server_listens_on_the_pod_address_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "127.0.0.2")
    grpc_port, grpc_elsewhere = port_held_elsewhere("127.0.0.2", "127.0.0.1")
    tensor_port, tensor_elsewhere = port_held_elsewhere("127.0.0.2", "127.0.0.1")
    config = PSConfig(port=grpc_port, tensor_port=tensor_port)
    assert config.host == "127.0.0.2"
    server = serve(config, optimizer_factory=sgd)
    try:
        assert server.tensor_port is not None
        assert server.tensor_port.port == tensor_port  # bound beside the held socket: not on every address
        socket.create_connection(("127.0.0.2", tensor_port), timeout=10).close()
        with pytest.raises(ConnectionRefusedError):  # its tensor port too
            socket.create_connection(("127.0.0.1", tensor_port), timeout=10).close()
        request = ps_pb2.PullDenseParametersRequest(version=-1)

        def pull(host: str, timeout: float) -> ps_pb2.PullDenseParametersResponse:
            with grpc.insecure_channel(f"{host}:{config.port}") as channel:
                return ps_pb2_grpc.ParameterServerStub(channel).PullDenseParameters(request, timeout=timeout)

        assert not pull("127.0.0.2", 10).initialized  # it answers there ...
        with pytest.raises(grpc.RpcError) as refused:
            pull("127.0.0.1", 2)  # ... and nothing listens on the other addresses of the machine
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
        grpc_elsewhere.close()
        tensor_elsewhere.close()


def ps_server() -> tuple[
    grpc.Server, int, Callable[[grpc.Channel], None], Callable[[grpc.Channel, bytes], Any]
]:
    server = make_server()
    ps_pb2_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(sgd, jit_compile=False), server)

    def valid(channel: grpc.Channel) -> None:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        assert (
            stub.PullDenseParameters(ps_pb2.PullDenseParametersRequest(version=-1), timeout=10).version == 0
        )

    def oversized(channel: grpc.Channel, content: bytes) -> Any:
        tensor = tensor_pb2.Tensor(name="w", dtype="uint8", shape=[len(content)], content=content)
        request = ps_pb2.PushGradientsRequest(gradients=ps_pb2.Model(dense_parameters=[tensor]))
        return ps_pb2_grpc.ParameterServerStub(channel).PushGradients(request, timeout=60)

    return server, server.add_insecure_port("127.0.0.1:0"), valid, oversized


def master_server() -> tuple[
    grpc.Server, int, Callable[[grpc.Channel], None], Callable[[grpc.Channel, bytes], Any]
]:
    dispatcher = TaskDispatcher({"shard": 10}, DispatcherConfig(records_per_task=5, num_epochs=1))
    evaluation = EvaluationService(dict, {}, 0, dispatcher=dispatcher)
    urls = {TaskType.TRAINING: "data", TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
    server = make_server()
    master_pb2_grpc.add_MasterServicer_to_server(
        MasterServicer(dispatcher, evaluation, urls, current_version=lambda: 0), server
    )

    def valid(channel: grpc.Channel) -> None:
        response = master_pb2_grpc.MasterStub(channel).GetTask(
            master_pb2.GetTaskRequest(worker_id=0), timeout=10
        )
        assert response.kind == master_pb2.GetTaskResponse.TASK

    def oversized(channel: grpc.Channel, content: bytes) -> Any:
        labels = tensor_pb2.Tensor(name="labels", dtype="uint8", shape=[len(content)], content=content)
        request = master_pb2.ReportEvaluationOutputsRequest(worker_id=0, task_id=1, labels=labels)
        return master_pb2_grpc.MasterStub(channel).ReportEvaluationOutputs(request, timeout=60)

    return server, server.add_insecure_port("127.0.0.1:0"), valid, oversized


@pytest.mark.parametrize("make", [ps_server, master_server], ids=["ps", "master"])
def test_an_oversized_message_is_refused_and_the_server_goes_on(make: Callable[..., Any]) -> None:
    server, port, valid, oversized = make()
    server.start()
    # A client that would send anything: the limit is the server's.
    options = [("grpc.max_send_message_length", -1)]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                oversized(channel, bytes(MAX_MESSAGE_BYTES + 1))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
            valid(channel)
    finally:
        server.stop(None)


# ---------------------------------------------------------------------------------------------------
# Credentials


def test_storage_credentials_appear_in_no_log_argument_manifest_template_or_output(
    s3_env: str, s3_server: S3StandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job whose data and output live in S3: the key id and the secret are in its environment only, as are
    the job's own credentials."""
    secrets = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    train, test = digits_records(0.2, 0)
    data = open_storage(f"{s3_env}/data")
    write_dataset(data, "train", train[:256], 2, Compressor.NONE, overwrite=False)
    write_dataset(data, "test", test[:64], 1, Compressor.NONE, overwrite=False)
    config = TrainConfig(
        model_def=DIGITS_MODEL,
        training_data=f"{s3_env}/data/train",
        validation_data=f"{s3_env}/data/test",
        output=f"{s3_env}/out",
        job_name=f"creds-{uuid.uuid4().hex[:6]}",
        minibatch_size=32,
        num_minibatches_per_task=4,
        num_workers=1,
        num_ps=1,
        checkpoint_steps=2,
        log_level="DEBUG",
    )
    pod_output = io.StringIO()
    backend = LocalProcessBackend(config.job_name, log_sink=pod_output)
    commands: list[tuple[str, ...]] = []
    start = backend.start

    def recording_start(spec: PodSpec) -> None:
        commands.append(spec.command)
        start(spec)

    backend.start = recording_start  # type: ignore[method-assign]
    log.configure("DEBUG")
    try:
        capsys.readouterr()
        job = TrainingJob.load(config, backend=backend)
        job.run()
        master_output = capsys.readouterr()
    finally:
        log.configure("INFO")

    argv = [
        "train", "--model-def", DIGITS_MODEL, "--training-data", config.training_data,
        "--output", config.output, "--job-name", "preview", "--backend", "kubernetes",
        "--image", "edl-argo:1", "--storage-secret", "s3-creds", "--yaml",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    manifests = capsys.readouterr().out
    assert {d["kind"] for d in yaml.safe_load_all(manifests)} == {"NetworkPolicy", "Service", "Pod"}
    pipeline = ROOT / "examples" / "pipelines" / "digits_pipeline.py"
    assert cli.main(["pipeline", "render", str(pipeline), "-p", f"data={s3_env}/data"]) == 0
    workflow = capsys.readouterr().out
    templates = "".join(render(ROOT / "components").values())

    bucket, prefix = s3_env.removeprefix("s3://").split("/", 1)
    client = s3_server.client()
    outputs = {
        item.object_name: client.get_object(bucket, item.object_name).read()
        for item in client.list_objects(bucket, prefix=f"{prefix}/out/", recursive=True)
    }
    assert f"{prefix}/out/model/_edl-tree.json" in outputs and any("/checkpoints/" in key for key in outputs)
    assert len(commands) >= 2 and "ps_started" in pod_output.getvalue()
    assert "job_succeeded" in master_output.err

    places: dict[str, str | bytes] = {
        "master log": master_output.out + master_output.err,
        "pod logs": pod_output.getvalue(),
        "pod arguments": "\n".join(" ".join(command) for command in commands),
        "--yaml manifests": manifests,
        "rendered workflow": workflow,
        "rendered templates": templates,
        **{f"output {key}": content for key, content in outputs.items()},
    }
    # ... and so do the job's own credentials (its secret, the workers' tokens, the collective token).
    secrets["job secret"] = job.job_secret.hex()
    secrets["worker-0 token"] = job.job_secret.token("worker-0")
    secrets["collective token"] = job.job_secret.collective_token().hex()
    for name, value in secrets.items():
        leaks = [
            place
            for place, text in places.items()
            if (value.encode() if isinstance(text, bytes) else value) in text
        ]
        assert not leaks, f"{name} appears in {leaks}"
