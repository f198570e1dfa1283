"""How the master runs its pods on Kubernetes: the ``--backend kubernetes`` flags and what they make.

:mod:`edl_argo.settings.table` declares the flags (of ``edl-argo train``); :func:`kubernetes_config_from_args`
validates them into a :class:`KubernetesConfig` (a :class:`~edl_argo.errors.ConfigError` names the flag
at fault, on one line). Some settings come from the master's environment, which the Argo template sets:

* ``EDL_WORKFLOW_NAME`` / ``EDL_WORKFLOW_UID`` (``{{workflow.name}}``, ``{{workflow.uid}}``): the
  Workflow that owns every pod and Service the master creates, so deleting the workflow deletes the job;
  pods are also labelled ``workflows.argoproj.io/workflow`` so ``argo logs`` finds them.
* Otherwise ``EDL_POD_NAME`` / ``EDL_POD_UID`` (downward API ``metadata.name``/``metadata.uid``): the
  master's own pod is the owner. With neither, pods have no owner and outlive a master that dies.
* ``EDL_NAMESPACE`` (downward API ``metadata.namespace``): the master's own namespace, that of its owner;
  ``--namespace`` naming another is refused, since an owner must be in its dependents' namespace.
* ``EDL_NODE_NAME`` (``{{node.name}}``) with ``EDL_WORKFLOW_UID``: the step that owns the job; its objects
  are labelled ``edl-argo/step`` with a hash of both, and the master touches no object of its job name
  labelled for another step.
* ``EDL_MASTER_SECRETS_DIR``: where the master's pod mounts the Secrets the master reads (its job's auth
  Secret, the ``--tls-secret`` Secret): it reads none through the API.
* ``EDL_S3_ENDPOINT`` and ``AWS_REGION`` are passed on to the pods as plain values; the credentials never
  are (see ``--storage-secret``).

The ``--master-*`` resource and priority flags are validated and recorded in ``flags.json`` only: the
master's own pod is created by Argo from its template, not by the master.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from edl_argo.errors import ConfigError
from edl_argo.pods.request_budget import DEFAULT_BURST, DEFAULT_QPS

#: The folder where the master's pod mounts the Secrets it reads (:attr:`KubernetesConfig.secrets_dir`).
MASTER_SECRETS_ENV = "EDL_MASTER_SECRETS_DIR"
#: The namespace of the pod's service account, when running in a cluster.
SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
#: ``--worker-resource-request gpu=1`` means this resource.
GPU_RESOURCE = "nvidia.com/gpu"
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
ROLES = ("worker", "ps", "master")

#: A Kubernetes object name (Secrets, namespaces, ...): a DNS subdomain, at most 253 characters.
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: A label key, taint key or resource name: ``[prefix/]name``.
_QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class RoleSettings:
    """Resources and scheduling priority of the pods of one role (treat the dicts as read-only)."""

    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    priority_class: str = ""


@dataclass(frozen=True)
class Owner:
    """The object that owns the job's pods and Services (Kubernetes garbage-collects them with it)."""

    api_version: str
    kind: str
    name: str
    uid: str


@dataclass(frozen=True)
class Toleration:
    """``KEY[=VALUE][:EFFECT]`` (kubectl taint syntax): operator Equal with a value, else Exists."""

    key: str
    value: str = ""
    effect: str = ""


@dataclass(frozen=True)
class Volume:
    """A PersistentVolumeClaim mounted into every worker and PS container."""

    claim_name: str
    mount_path: str
    sub_path: str = ""
    read_only: bool = False


@dataclass(frozen=True)
class KubernetesConfig:
    """Everything the Kubernetes backend needs besides the job name and the pods' commands."""

    image: str
    namespace: str = "default"
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets for pulling the image; empty: those of the master's own pod (the backend reads them)."""
    service_account: str = ""
    worker: RoleSettings = field(default_factory=RoleSettings)
    ps: RoleSettings = field(default_factory=RoleSettings)
    master: RoleSettings = field(default_factory=RoleSettings)
    opportunistic_worker_priority: str = ""
    """PriorityClass of opportunistic workers (:attr:`PodSpec.opportunistic
    <edl_argo.pods.base.PodSpec.opportunistic>`); ``""``: ``worker``'s."""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    volumes: tuple[Volume, ...] = ()
    db_secret: str = ""
    """Secret whose key ``password`` worker pods get as ``EDL_DB_PASSWORD`` (optional ``secretKeyRef``)."""
    storage_secret: str = ""
    """Secret holding ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` (and optionally
    ``AWS_SESSION_TOKEN``) under those key names; pods read them with ``secretKeyRef``."""
    tls_secret: str = ""
    """Secret of type ``kubernetes.io/tls`` the gRPC services serve TLS with (``--tls-secret``); mounted
    read-only into worker and PS pods at :data:`edl_argo.rpc.tls.POD_TLS_DIR`; the master reads it from the
    volume its own pod mounts (see :attr:`secrets_dir`)."""
    auth_secret: str = ""
    """The name of the job's auth Secret, ``<requested job name>-auth``
    (:func:`~edl_argo.pods.manifests.auth_secret_name` of ``--job-name`` as given, which the elastic-train
    step can compute and mount, unlike the fitted job name); ``""``: that of the job's name."""
    secrets_dir: str = ""
    """The folder where the master's own pod mounts the Secrets the master reads
    (``$EDL_MASTER_SECRETS_DIR``, which the elastic-train step sets): the job's auth Secret in
    ``job-auth/``, the ``--tls-secret`` Secret in ``tls/`` (each an optional volume); ``""``: none is
    mounted. The master never reads a Secret through the API (its Role has no ``get`` on Secrets)."""
    storage_endpoint: str = ""
    storage_region: str = ""
    workflow_name: str = ""
    step: str = ""
    """The identity of the Argo step that owns the job (``manifests.step_identity``); ``""`` outside Argo."""
    owner: Owner | None = None
    ps_port: int = 2222
    """PS ``i`` listens on ``ps_port + i`` (distinct ports, so PSes may share a host, as in tests), and
    serves its tensor port on :data:`TENSOR_PORT_OFFSET` more."""
    collective_port: int = 2230
    """AllreduceStrategy: the port of every worker's collective service (each pod has its own address)."""
    pod_creation_timeout: float = 300.0
    """How long creating a pod is retried (quota, admission errors) before it is reported FAILED."""
    k8s_qps: float = DEFAULT_QPS
    """The request budget on the Kubernetes API (``--k8s-qps``): requests a second on average at most."""
    k8s_burst: int = DEFAULT_BURST
    """The request budget's burst (``--k8s-burst``): requests that may be sent at once."""

    def role(self, role: str) -> RoleSettings:
        """The settings of ``"worker"``, ``"ps"`` or ``"master"``."""
        settings: RoleSettings = getattr(self, role)
        return settings

    def ps_port_of(self, ps_id: int) -> int:
        """The port PS ``ps_id`` listens on and its Service exposes."""
        return self.ps_port + ps_id

    def tensor_port_of(self, ps_id: int) -> int:
        """The port of PS ``ps_id``'s tensor port (:mod:`edl_argo.rpc.tensor_port`), which its workers dial
        at the pod's own address."""
        return self.ps_port_of(ps_id) + TENSOR_PORT_OFFSET


#: A PS's tensor port is this many ports above its gRPC port.
TENSOR_PORT_OFFSET = 100


def last_tensor_port(ps_port: int, num_ps: int) -> int:
    """The tensor port of the last of ``num_ps`` PS whose gRPC ports start at ``ps_port``."""
    return ps_port + num_ps - 1 + TENSOR_PORT_OFFSET


def highest_ps_port(num_ps: int) -> int:
    """The highest ``--ps-port`` with which each of ``num_ps`` PS has a tensor port (at most 65535)."""
    return 65535 - last_tensor_port(0, num_ps)


def kubernetes_config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> KubernetesConfig:
    """The validated configuration of ``args`` and the master's environment ``environ`` (default: ours).

    Raises:
        ConfigError: one line naming the flag or environment variable at fault.
    """
    env = os.environ if environ is None else environ
    if not args.image:
        raise ConfigError("--image is required with --backend kubernetes (the worker and PS image)")
    num_ps = getattr(args, "num_ps", 1)
    if (last_port := last_tensor_port(args.ps_port, num_ps)) > 65535:
        raise ConfigError(
            f"--ps-port {args.ps_port}: the last PS's tensor port would be {last_port}, past 65535"
        )
    namespace = namespace_from_flag(args.namespace)
    owner = owner_from_env(env)
    _check_owner_namespace(namespace, owner, own_namespace(env))
    return KubernetesConfig(
        image=args.image,
        namespace=namespace,
        image_pull_policy=args.image_pull_policy,
        image_pull_secrets=tuple(_dns_name(name, "--image-pull-secret") for name in args.image_pull_secret),
        service_account=_dns_name(args.service_account, "--service-account"),
        worker=_role_settings(args, "worker"),
        ps=_role_settings(args, "ps"),
        master=_role_settings(args, "master"),
        opportunistic_worker_priority=_dns_name(
            args.opportunistic_worker_pod_priority, "--opportunistic-worker-pod-priority"
        ),
        node_selector=_labels(parse_key_values(args.node_selector, "--node-selector"), "--node-selector"),
        tolerations=tuple(parse_toleration(text) for text in args.toleration),
        volumes=_unique_mounts(tuple(parse_volume(text) for text in args.volume)),
        storage_secret=_dns_name(args.storage_secret, "--storage-secret"),
        db_secret=_dns_name(args.db_secret, "--db-secret"),
        tls_secret=_dns_name(args.tls_secret, "--tls-secret"),
        auth_secret=_auth_secret(args),
        secrets_dir=env.get(MASTER_SECRETS_ENV, ""),
        storage_endpoint=env.get("EDL_S3_ENDPOINT", ""),
        storage_region=env.get("AWS_REGION", ""),
        workflow_name=env.get("EDL_WORKFLOW_NAME", ""),
        step=step_from_env(env),
        owner=owner,
        ps_port=args.ps_port,
        pod_creation_timeout=float(args.pod_creation_timeout),
        k8s_qps=float(args.k8s_qps),
        k8s_burst=int(args.k8s_burst),
    )


def _auth_secret(args: argparse.Namespace) -> str:
    """The job's auth Secret, named after ``--job-name`` as given (``""`` without one: the job then gets a
    short generated name, whose Secret is named after it)."""
    from edl_argo.pods.manifests import auth_secret_name

    job_name: str = getattr(args, "job_name", "")
    return auth_secret_name(job_name) if job_name else ""


def step_from_env(env: Mapping[str, str]) -> str:
    """The owning step's identity from ``EDL_WORKFLOW_UID`` and ``EDL_NODE_NAME`` (``{{node.name}}``, which
    the elastic-train template and its exit hook set); ``""`` without them."""
    from edl_argo.pods.manifests import step_identity

    return step_identity(env.get("EDL_WORKFLOW_UID", ""), env.get("EDL_NODE_NAME", ""))


def owner_from_env(env: Mapping[str, str]) -> Owner | None:
    """The Workflow named by ``EDL_WORKFLOW_NAME``/``_UID``, else the pod named by ``EDL_POD_NAME``/``_UID``.

    Raises:
        ConfigError: a name without its uid.
    """
    for prefix, api_version, kind in (
        ("EDL_WORKFLOW", "argoproj.io/v1alpha1", "Workflow"),
        ("EDL_POD", "v1", "Pod"),
    ):
        name, uid = env.get(f"{prefix}_NAME", ""), env.get(f"{prefix}_UID", "")
        if name and not uid:
            raise ConfigError(f"{prefix}_NAME is set but {prefix}_UID is not: the owner needs both")
        if name:
            return Owner(api_version, kind, name, uid)
    return None


def own_namespace(env: Mapping[str, str]) -> str:
    """The master's own namespace, where its owner (its Workflow, its pod) lives: ``EDL_NAMESPACE`` (the
    downward API's ``metadata.namespace``, which the elastic-train template sets), else its service
    account's; ``""`` outside a cluster."""
    if env.get("EDL_NAMESPACE"):
        return env["EDL_NAMESPACE"]
    if SERVICE_ACCOUNT_NAMESPACE_FILE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE_FILE.read_text().strip()
    return ""


def _check_owner_namespace(namespace: str, owner: Owner | None, home: str) -> None:
    """Refuse pods in ``namespace`` owned by ``owner``, which lives in ``home``: Kubernetes' garbage
    collector deletes a dependent whose owner is in another namespace (it finds no such owner).

    Raises:
        ConfigError: one line naming ``--namespace``.
    """
    if owner is None or not home or namespace == home:
        return
    raise ConfigError(
        f"--namespace {namespace}: the job's pods would be owned by {owner.kind} {owner.name} in namespace"
        f" {home}, and Kubernetes deletes pods whose owner is in another namespace; leave --namespace out"
        f" or run the step in namespace {namespace}"
    )


def parse_resources(text: str, flag: str) -> dict[str, str]:
    """``"cpu=2,memory=2048Mi,gpu=1"`` -> ``{"cpu": "2", "memory": "2048Mi", "nvidia.com/gpu": "1"}``.

    Raises:
        ConfigError: a malformed pair, an invalid quantity, or a fractional extended resource (GPU).
    """
    resources: dict[str, str] = {}
    for name, quantity in parse_key_values(text, flag).items():
        name = GPU_RESOURCE if name == "gpu" else name
        if not _QUALIFIED_NAME.match(name):
            raise ConfigError(f"{flag}: {name!r} is not a resource name (cpu, memory, gpu, vendor/name)")
        try:
            value = parse_quantity(quantity)
        except ValueError:
            raise ConfigError(f"{flag}: {name}={quantity} is not a quantity (e.g. 2, 500m, 2048Mi)") from None
        if value < 0:
            raise ConfigError(f"{flag}: {name}={quantity} is negative")
        if "/" in name and value != int(value):
            raise ConfigError(f"{flag}: {name}={quantity} must be a whole number")
        resources[name] = quantity
    return resources


def parse_key_values(text: str, flag: str) -> dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``; ``""`` -> ``{}``.

    Raises:
        ConfigError: an item without ``=``, an empty key or a repeated key.
    """
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"{flag}: {item!r} is not KEY=VALUE")
        if key in pairs:
            raise ConfigError(f"{flag}: {key} is given twice")
        pairs[key] = value
    return pairs


def parse_toleration(text: str) -> Toleration:
    """``--toleration KEY[=VALUE][:EFFECT]``, e.g. ``nvidia.com/gpu:NoSchedule``, ``pool=ml:NoExecute``."""
    rest, _, effect = text.strip().rpartition(":") if ":" in text else (text.strip(), "", "")
    key, _, value = rest.partition("=")
    if not _QUALIFIED_NAME.match(key) or not _LABEL_VALUE.match(value):
        raise ConfigError(f"--toleration {text!r}: expected KEY[=VALUE][:EFFECT] with a valid taint key")
    if effect and effect not in TAINT_EFFECTS:
        raise ConfigError(
            f"--toleration {text!r}: effect {effect!r} is not one of {', '.join(TAINT_EFFECTS)}"
        )
    return Toleration(key, value, effect)


def parse_volume(text: str) -> Volume:
    """``--volume "claim_name=data,mount_path=/data[,sub_path=x][,read_only=true]"``."""
    flag = f"--volume {text!r}"
    fields = parse_key_values(text, flag)
    unknown = set(fields) - {"claim_name", "mount_path", "sub_path", "read_only"}
    if unknown:
        raise ConfigError(
            f"{flag}: unknown key {sorted(unknown)[0]!r} (claim_name, mount_path, sub_path, read_only)"
        )
    claim, mount = fields.get("claim_name", ""), fields.get("mount_path", "")
    if not claim or not mount:
        raise ConfigError(f"{flag}: needs claim_name=... and mount_path=...")
    _dns_name(claim, flag)
    if not mount.startswith("/"):
        raise ConfigError(f"{flag}: mount_path {mount!r} must be absolute")
    read_only = fields.get("read_only", "false").lower()
    if read_only not in ("true", "false"):
        raise ConfigError(f"{flag}: read_only must be true or false")
    return Volume(claim, mount, fields.get("sub_path", ""), read_only == "true")


def parse_quantity(quantity: str) -> Decimal:
    """A Kubernetes quantity (``2``, ``500m``, ``2048Mi``) as a number; ValueError if it is not one."""
    from kubernetes.utils import parse_quantity as parse  # the client is slow to import: only when needed

    value: Decimal = parse(quantity)
    return value


def _role_settings(args: argparse.Namespace, role: str) -> RoleSettings:
    request_flag, limit_flag = f"--{role}-resource-request", f"--{role}-resource-limit"
    requests = parse_resources(getattr(args, f"{role}_resource_request"), request_flag)
    limits = parse_resources(getattr(args, f"{role}_resource_limit"), limit_flag)
    for name, quantity in requests.items():
        if "/" in name:  # Kubernetes requires extended resources (GPUs) to have limit == request
            limits.setdefault(name, quantity)
            if parse_quantity(limits[name]) != parse_quantity(quantity):
                raise ConfigError(f"{limit_flag}: {name} must equal its request ({quantity}) for a GPU")
        elif name in limits and parse_quantity(limits[name]) < parse_quantity(quantity):
            raise ConfigError(f"{limit_flag}: {name}={limits[name]} is below its request {quantity}")
    priority = _dns_name(getattr(args, f"{role}_pod_priority"), f"--{role}-pod-priority")
    return RoleSettings(requests, limits, priority)


def namespace_from_flag(flag_value: str) -> str:
    """``--namespace``'s value, else the namespace of this pod's service account, else ``default``."""
    namespace = flag_value
    if not namespace and SERVICE_ACCOUNT_NAMESPACE_FILE.is_file():
        namespace = SERVICE_ACCOUNT_NAMESPACE_FILE.read_text().strip()
    return _dns_name(namespace or "default", "--namespace")


def _dns_name(name: str, flag: str) -> str:
    if name and (len(name) > 253 or not DNS_SUBDOMAIN.match(name)):
        raise ConfigError(
            f"{flag} {name!r}: not a valid Kubernetes name (lower-case letters, digits, '-', '.')"
        )
    return name


def _labels(labels: dict[str, str], flag: str) -> dict[str, str]:
    for key, value in labels.items():
        if not _QUALIFIED_NAME.match(key) or not _LABEL_VALUE.match(value) or len(value) > 63:
            raise ConfigError(f"{flag}: {key}={value} is not a valid label")
    return labels


def _unique_mounts(volumes: tuple[Volume, ...]) -> tuple[Volume, ...]:
    paths = [v.mount_path for v in volumes]
    for path in paths:
        if paths.count(path) > 1:
            raise ConfigError(f"--volume: mount_path {path} is used twice")
    return volumes
