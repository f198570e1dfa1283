"""The Kubernetes objects of a job's pods, as plain dicts: what the backend creates and ``--yaml`` prints.

Pure functions of the job name, the :class:`~edl_argo.pods.kubernetes_config.KubernetesConfig` and the
:class:`~edl_argo.pods.base.PodSpec`; no API calls. Conventions:

* Names: pod ``<job>-<role>-<id>`` (``digits-worker-3``), and for PS ``i`` a Service of the same name.
* Labels: ``app.kubernetes.io/name=edl-argo``, ``app.kubernetes.io/instance=<job>``, ``edl-argo/role``,
  ``edl-argo/id``, and ``workflows.argoproj.io/workflow=<workflow>`` inside Argo (``argo logs`` finds the
  pods by it). :func:`job_selector` selects every pod and Service of a job.
* Every object has the config's owner (the Workflow, else the master's pod) as ownerReference.
* The master: the elastic-train step labels its pod :data:`MASTER_POD_LABELS` (``edl-argo/role=master``);
  the master adds the job's instance label itself (:func:`master_labels`: only the master fits a long job
  name to a label, :func:`kubernetes_job_name`) and puts a ClusterIP Service ``<job>-master`` selecting them
  in front of itself (:func:`master_service_manifest`): workers keep its address when Argo replaces its pod.
* Network: one NetworkPolicy per job (``<job>-grpc``, :func:`network_policy_manifest`) admits the job's own
  pods, and nobody else, to the job's gRPC ports.
* Pods: one container ``main`` (the name ``argo logs`` reads) running ``spec.command``,
  ``restartPolicy: Never`` (the master relaunches, Kubernetes does not), no service-account token (pods
  never call the API), non-root (uid and gid 1000, seccomp ``RuntimeDefault``) without privilege
  escalation or capabilities (:data:`POD_SECURITY_CONTEXT`, :data:`CONTAINER_SECURITY_CONTEXT`). Storage
  credentials come from the ``--storage-secret`` Secret via ``secretKeyRef``, never as values. The image is
  pulled with the config's ``imagePullSecrets`` (by default the master's own pod's).
* Credentials: the job's secret lives in the Secret ``<requested job name>-auth`` (:func:`job_auth_secret`,
  :func:`auth_secret_manifest`, owned like the pods): key :data:`SECRET_KEY_JOB` the secret (a PS's
  ``EDL_JOB_SECRET``), :data:`SECRET_KEY_COLLECTIVE` the workers' collective token, and ``worker-<id>`` each
  worker's own token, added before its pod is created (:func:`auth_secret_data`). Pods get them through
  ``secretKeyRef`` (:mod:`edl_argo.rpc.auth`).
* TLS: with ``--tls-secret``, every worker and PS pod mounts that Secret read-only at
  :data:`edl_argo.rpc.tls.POD_TLS_DIR` (:data:`TLS_VOLUME`).
* The master reads no Secret through the API: its own pod (the elastic-train step's) mounts the job's auth
  Secret and the ``--tls-secret`` Secret as optional volumes under ``$``:data:`MASTER_SECRETS_ENV`
  (:func:`read_mounted_job_secret`, :func:`read_mounted_tls`).
* ``--yaml``: :func:`render_job_manifests` renders all of a job's objects as multi-document YAML.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from edl_argo.errors import ConfigError
from edl_argo.pods import kubernetes_config
from edl_argo.pods.base import PodRole, PodSpec
from edl_argo.pods.kubernetes_config import DNS_SUBDOMAIN, KubernetesConfig
from edl_argo.readers.credentials import PASSWORD_ENV as DB_PASSWORD_ENV
from edl_argo.readers.credentials import SECRET_KEY as DB_SECRET_KEY
from edl_argo.rpc import auth, tls

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
ROLE_LABEL = "edl-argo/role"
ID_LABEL = "edl-argo/id"
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
#: The identity of the Argo step that owns the job (:func:`step_identity`); a master never touches objects
#: of its job name that carry another step's identity.
STEP_LABEL = "edl-argo/step"
APP = "edl-argo"
#: ``edl-argo/role`` of the master's pod and Service (not a worker nor a PS: :func:`pod_key` is None).
MASTER_ROLE = "master"
CONTAINER = "main"
PORT_NAME = "grpc"
#: The container port of a PS's tensor port (:mod:`edl_argo.rpc.tensor_port`), which workers dial at the
#: pod's address (no Service).
TENSOR_PORT_NAME = "tensors"

#: The user, group and volume group (fsGroup) every edl-argo container runs as: not root. The image must
#: let uid 1000 read the project and write its working folders (/tmp).
RUN_AS_ID = 1000
#: The pod-level securityContext of every edl-argo pod (the job's pods and the Argo steps): non-root,
#: the runtime's default seccomp profile.
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_ID,
    "runAsGroup": RUN_AS_ID,
    "fsGroup": RUN_AS_ID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
#: The securityContext of every edl-argo container: no privilege escalation, no Linux capabilities.
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}

#: Seconds between SIGTERM and SIGKILL when a pod is deleted: a PS stops serving and saves a checkpoint.
GRACE_SECONDS = {PodRole.WORKER: 10, PodRole.PS: 30}

#: Keys of the ``--storage-secret`` Secret, mounted as the environment variables of the same names. All
#: optional, as in the master's own pod (Argo's template mounts the Secret with ``optional: true``), so
#: the pods see the credentials the master sees: none for public buckets or node/IRSA identities.
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

#: Keys of the job's auth Secret: the job secret, and the workers' collective token (each worker's own token
#: is under its identity, ``worker-<id>``).
SECRET_KEY_JOB = "job-secret"
SECRET_KEY_COLLECTIVE = "collective"

#: The master's pod mounts the Secrets the master reads in ``$EDL_MASTER_SECRETS_DIR`` (the elastic-train
#: step sets it), each in the subfolder named after its volume, below.
MASTER_SECRETS_ENV = kubernetes_config.MASTER_SECRETS_ENV
#: The master's volume of the job's auth Secret (optional: the first master creates the Secret).
MASTER_AUTH_VOLUME = "job-auth"
#: The master's volume of the ``--tls-secret`` Secret.
MASTER_TLS_VOLUME = "tls"

#: The volume of the ``--tls-secret`` Secret in worker and PS pods, mounted read-only at
#: :data:`edl_argo.rpc.tls.POD_TLS_DIR`; its files readable by the owner (root) and the pod's group
#: (``fsGroup``, :data:`RUN_AS_ID`) only.
TLS_VOLUME = "tls"
TLS_FILE_MODE = 0o440

#: Environment variables filled in by Kubernetes (downward API) -> the pod field they hold.
FIELD_ENV = (
    ("POD_IP", "status.podIP"),
    ("EDL_POD_NAME", "metadata.name"),
    ("EDL_POD_UID", "metadata.uid"),
    ("EDL_NAMESPACE", "metadata.namespace"),
)

#: Longest job name: ``<job>-worker-99999`` must stay a 63-character DNS label (it is the hostname).
MAX_JOB_NAME = 63 - len("-worker-99999")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def fit_job_name(job_name: str) -> str:
    """``job_name`` if it has at most :data:`MAX_JOB_NAME` characters, else its beginning and a hash of the
    whole name (``<first 41>-<8 hex>``): the same long name always gives the same short one, so a retried
    master and the step's exit hook find the job's pods."""
    if len(job_name) <= MAX_JOB_NAME:
        return job_name
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
    return f"{job_name[: MAX_JOB_NAME - len(digest) - 1].rstrip('-')}-{digest}"


def kubernetes_job_name(requested: str) -> str:
    """The job's name on Kubernetes for the ``--job-name`` ``requested``: :func:`fit_job_name`, validated.
    The one place that names a job: the master, its pods' labels, its pod's label and its exit hook's
    clean-up all use it, so a long ``<workflow>-<task>`` gives them all the same name."""
    return validate_job_name(fit_job_name(requested))


def validate_job_name(job_name: str) -> str:
    """``job_name`` if it can name Kubernetes pods and Services, else :class:`ConfigError`."""
    if len(job_name) > MAX_JOB_NAME or not _DNS_LABEL.match(job_name):
        raise ConfigError(
            f"--job-name {job_name!r}: on Kubernetes a job name is at most {MAX_JOB_NAME} lower-case"
            " letters, digits and '-', starting with a letter"
        )
    return job_name


def object_name(job_name: str, role: PodRole, pod_id: int) -> str:
    """The Kubernetes name of pod ``pod_id`` of ``role`` (and of a PS's Service): ``<job>-<role>-<id>``."""
    return f"{job_name}-{PodRole(role).value}-{pod_id}"


def job_selector(job_name: str, step: str | None = None) -> str:
    """The label selector of every pod and Service of the job; with a ``step`` (``""``: none), only those of
    that step (:data:`STEP_LABEL` equal to it, or absent for ``""``)."""
    selector = f"{NAME_LABEL}={APP},{INSTANCE_LABEL}={job_name}"
    if step is None:
        return selector
    return f"{selector},{STEP_LABEL}={step}" if step else f"{selector},!{STEP_LABEL}"


_RETRY_SUFFIX = re.compile(r"\(\d+\)$")
_HOOK_SUFFIX = ".onExit"


def step_identity(workflow_uid: str, node_name: str) -> str:
    """The value of :data:`STEP_LABEL` for the Argo step whose node is ``node_name`` (``{{node.name}}``) in
    the workflow ``workflow_uid``; ``""`` outside Argo.

    Stable across the step's retries (``wf.train(1)`` is ``wf.train``) and the same in its exit hook
    (``wf.train.onExit``), distinct for every other task: a hash of the workflow's uid and the task's node.
    """
    if not workflow_uid or not node_name:
        return ""
    node = _RETRY_SUFFIX.sub("", node_name)
    node = node.removesuffix(_HOOK_SUFFIX)
    node = _RETRY_SUFFIX.sub("", node)
    return hashlib.sha256(f"{workflow_uid}/{node}".encode()).hexdigest()[:16]


def pod_labels(job_name: str, config: KubernetesConfig, role: PodRole, pod_id: int) -> dict[str, str]:
    """The labels of a pod or Service of the job."""
    labels = {
        NAME_LABEL: APP,
        INSTANCE_LABEL: job_name,
        ROLE_LABEL: PodRole(role).value,
        ID_LABEL: str(pod_id),
    }
    return labels | _owner_labels(config)


def _owner_labels(config: KubernetesConfig) -> dict[str, str]:
    """The labels that name the job's owners: its workflow and its step."""
    labels = {}
    if config.workflow_name:
        labels[WORKFLOW_LABEL] = config.workflow_name
    if config.step:
        labels[STEP_LABEL] = config.step
    return labels


def pod_key(labels: dict[str, str] | None) -> tuple[PodRole, int] | None:
    """``(role, id)`` from the labels of one of the job's objects; None if they are not ours."""
    labels = labels or {}
    try:
        return PodRole(labels[ROLE_LABEL]), int(labels[ID_LABEL])
    except (KeyError, ValueError):
        return None


def metadata(job_name: str, config: KubernetesConfig, role: PodRole, pod_id: int) -> dict[str, Any]:
    """Name, namespace, labels and ownerReferences of a pod or Service of the job."""
    meta: dict[str, Any] = {
        "name": object_name(job_name, role, pod_id),
        "namespace": config.namespace,
        "labels": pod_labels(job_name, config, role, pod_id),
    }
    return meta | owner_references(config)


def owner_references(config: KubernetesConfig) -> dict[str, Any]:
    """``{"ownerReferences": [the config's owner]}``, or ``{}`` without an owner: metadata of every
    object of the job, so that deleting the owner deletes the job."""
    if config.owner is None:
        return {}
    # No blockOwnerDeletion: that would need permission on the owner's finalizers.
    owner = config.owner
    return {
        "ownerReferences": [
            {"apiVersion": owner.api_version, "kind": owner.kind, "name": owner.name, "uid": owner.uid}
        ]
    }


def pod_manifest(
    job_name: str, config: KubernetesConfig, spec: PodSpec, credentials: bool = True
) -> dict[str, Any]:
    """The Pod that runs ``spec``; with ``credentials``, its credentials come from the job's auth Secret
    (without: a pod of no job, which no master's server serves)."""
    settings = config.role(spec.role.value)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": list(spec.command),
        "env": _env(job_name, config, spec, credentials),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    resources = {k: dict(v) for k, v in (("requests", settings.requests), ("limits", settings.limits)) if v}
    if resources:
        container["resources"] = resources
    ports = [(PORT_NAME, spec.port), (TENSOR_PORT_NAME, spec.tensor_port)]
    if any(number is not None for _, number in ports):
        container["ports"] = [
            {"name": name, "containerPort": number, "protocol": "TCP"} for name, number in ports if number
        ]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": GRACE_SECONDS[spec.role],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "containers": [container],
    }
    priority_class = settings.priority_class
    if spec.opportunistic and config.opportunistic_worker_priority:
        priority_class = config.opportunistic_worker_priority
    if priority_class:
        pod_spec["priorityClassName"] = priority_class
    if config.service_account:
        pod_spec["serviceAccountName"] = config.service_account
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in config.image_pull_secrets]
    if config.node_selector:
        pod_spec["nodeSelector"] = dict(config.node_selector)
    if config.tolerations:
        pod_spec["tolerations"] = [
            {"key": t.key, "operator": "Equal" if t.value else "Exists"}
            | ({"value": t.value} if t.value else {})
            | ({"effect": t.effect} if t.effect else {})
            for t in config.tolerations
        ]
    if config.volumes:
        claims = list(dict.fromkeys(v.claim_name for v in config.volumes))
        pod_spec["volumes"] = [
            {"name": f"volume-{i}", "persistentVolumeClaim": {"claimName": claim}}
            for i, claim in enumerate(claims)
        ]
        container["volumeMounts"] = [
            {"name": f"volume-{claims.index(v.claim_name)}", "mountPath": v.mount_path}
            | ({"subPath": v.sub_path} if v.sub_path else {})
            | ({"readOnly": True} if v.read_only else {})
            for v in config.volumes
        ]
    if config.tls_secret:
        pod_spec.setdefault("volumes", []).append(
            {"name": TLS_VOLUME, "secret": {"secretName": config.tls_secret, "defaultMode": TLS_FILE_MODE}}
        )
        container.setdefault("volumeMounts", []).append(
            {"name": TLS_VOLUME, "mountPath": tls.POD_TLS_DIR, "readOnly": True}
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(job_name, config, spec.role, spec.pod_id),
        "spec": pod_spec,
    }


def service_manifest(job_name: str, config: KubernetesConfig, ps_id: int, port: int) -> dict[str, Any]:
    """The ClusterIP Service that gives PS ``ps_id`` an address that survives its relaunches."""
    selector = {
        k: v
        for k, v in pod_labels(job_name, config, PodRole.PS, ps_id).items()
        if k not in (WORKFLOW_LABEL, STEP_LABEL)
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job_name, config, PodRole.PS, ps_id),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


#: The labels the elastic-train step gives its pod: it is an edl-argo master, of no job yet. They do not
#: name the job: a job name is only known for sure once the master has fitted it (:func:`fit_job_name`),
#: and the requested one (``<workflow>-<task>``) may be too long for a label value.
MASTER_POD_LABELS = {NAME_LABEL: APP, ROLE_LABEL: MASTER_ROLE}


def master_labels(job_name: str) -> dict[str, str]:
    """The labels of the master's pod once the master has labelled it with its job (the step's
    :data:`MASTER_POD_LABELS` and the job's name), which its Service and the job's NetworkPolicy select."""
    return MASTER_POD_LABELS | {INSTANCE_LABEL: job_name}


def master_service_name(job_name: str) -> str:
    """``<job>-master``: the name of the master's Service."""
    return f"{job_name}-{MASTER_ROLE}"


def master_service_dns_address(job_name: str, config: KubernetesConfig, port: int) -> str:
    """``<job>-master.<namespace>.svc:<port>``: the DNS form of the master's Service address."""
    return f"{master_service_name(job_name)}.{config.namespace}.svc:{port}"


def master_service_manifest(job_name: str, config: KubernetesConfig, port: int) -> dict[str, Any]:
    """The ClusterIP Service in front of the master serving on ``port``: its address stays when Argo
    replaces the master's pod, so the workers' ``--master-addr`` stays valid."""
    labels = master_labels(job_name) | _owner_labels(config)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": master_service_name(job_name),
            "namespace": config.namespace,
            "labels": labels,
            **owner_references(config),
        },
        "spec": {
            "type": "ClusterIP",
            "selector": master_labels(job_name),
            "ports": [{"name": PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def network_policy_name(job_name: str) -> str:
    """The name of the job's NetworkPolicy: ``<job>-grpc``."""
    return f"{job_name}-{PORT_NAME}"


def network_policy_manifest(job_name: str, config: KubernetesConfig) -> dict[str, Any]:
    """The NetworkPolicy that lets the job's own pods, and only them, reach the job's ports.

    It selects every pod labelled with the job (``app.kubernetes.io/name=edl-argo``,
    ``app.kubernetes.io/instance=<job>``: its workers and parameter servers, and its master when the Argo
    step labels its pod so) and admits TCP to their container ports named ``grpc`` (the port a PS or the
    master serves on, whatever its number) and ``tensors`` (a PS's tensor port) from pods with the same two
    labels. NetworkPolicies are additive: under the namespace's default-deny-ingress for edl-argo pods
    (``templates/network-policy.yaml``) this is the only way in; on a cluster whose network plugin does not
    enforce policies it changes nothing.
    """
    job_labels = {NAME_LABEL: APP, INSTANCE_LABEL: job_name}
    labels = job_labels | _owner_labels(config)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(job_name),
            "namespace": config.namespace,
            "labels": labels,
            **owner_references(config),
        },
        "spec": {
            "podSelector": {"matchLabels": dict(job_labels)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": dict(job_labels)}}],
                    "ports": [{"protocol": "TCP", "port": name} for name in (PORT_NAME, TENSOR_PORT_NAME)],
                }
            ],
        },
    }


def auth_secret_name(requested_job_name: str) -> str:
    """The name of the Secret holding the credentials of the job ``--job-name requested_job_name`` (as given,
    before :func:`fit_job_name`, so that the elastic-train step can mount it by the same name):
    ``<requested>-auth``.

    Raises:
        ConfigError: naming ``--job-name``, when that is no Secret name (a DNS subdomain of at most 253
            characters: :func:`kubernetes_job_name` checks only the beginning of a long name).
    """
    name = f"{requested_job_name}-auth"
    if len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        raise ConfigError(
            f"--job-name {requested_job_name!r}: the job's Secret {name[:80]!r} would not be a valid"
            " Kubernetes name (at most 248 lower-case letters, digits, '-' and '.')"
        )
    return name


def job_auth_secret(job_name: str, config: KubernetesConfig) -> str:
    """The name of job ``job_name``'s auth Secret: the config's (named after the requested job name), else
    :func:`auth_secret_name` of ``job_name``."""
    return config.auth_secret or auth_secret_name(job_name)


def auth_secret_data(values: dict[str, str]) -> dict[str, str]:
    """``values`` as a Secret's ``data`` (base64)."""
    return {key: base64.b64encode(value.encode()).decode() for key, value in values.items()}


def auth_secret_manifest(job_name: str, config: KubernetesConfig, secret: auth.JobSecret) -> dict[str, Any]:
    """The job's auth Secret (:func:`job_auth_secret`): the job's secret and the workers' collective token
    (never rendered by ``--yaml``: it holds the credential)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": job_auth_secret(job_name, config),
            "namespace": config.namespace,
            "labels": {NAME_LABEL: APP, INSTANCE_LABEL: job_name} | _owner_labels(config),
            **owner_references(config),
        },
        "data": auth_secret_data(
            {SECRET_KEY_JOB: secret.hex(), SECRET_KEY_COLLECTIVE: secret.collective_token().hex()}
        ),
    }


def read_mounted_job_secret(folder: Path, secret_name: str) -> auth.JobSecret | None:
    """The job secret in ``folder``, the master pod's optional volume of the job's auth Secret
    ``secret_name`` (key :data:`SECRET_KEY_JOB` as a file); None when the volume holds none (the Secret did
    not exist when the pod started). ConfigError, naming the file, when the file holds no job secret."""
    path = folder / SECRET_KEY_JOB
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} (Secret {secret_name}): unreadable ({error})") from None
    return auth.JobSecret.from_hex(text, f"{path} (key {SECRET_KEY_JOB} of Secret {secret_name})")


def read_mounted_tls(folder: Path, name: str) -> tls.TlsFiles:
    """The certificate, key and CA of the ``kubernetes.io/tls`` Secret ``name`` (``--tls-secret``) in
    ``folder``, the master pod's optional volume of it; ConfigError naming ``--tls-secret``, the Secret and
    the key at fault (an empty volume: there is no such Secret)."""
    where = f"Secret {name}"
    if not (folder / tls.CERT_FILE).exists() and not (folder / tls.KEY_FILE).exists():
        raise ConfigError(
            f"--tls-secret {name}: there is no such Secret in the job's namespace (the master's volume of it,"
            f" {folder}, is empty)"
        )
    for key in (tls.CERT_FILE, tls.KEY_FILE):
        if not (folder / key).exists():
            raise ConfigError(
                f"--tls-secret {name}: {where} has no {key} (make it with kubectl create secret tls)"
            )
    files = {
        key: (folder / key).read_bytes()
        for key in (tls.CERT_FILE, tls.KEY_FILE, tls.CA_FILE)
        if (folder / key).exists()
    }
    return tls.TlsFiles.from_pem(
        files[tls.CERT_FILE], files[tls.KEY_FILE], files.get(tls.CA_FILE) or None, where, "--tls-secret"
    )


def service_dns_address(job_name: str, config: KubernetesConfig, ps_id: int) -> str:
    """``<job>-ps-<id>.<namespace>.svc:<port>``: the DNS form of a PS's Service address (for ``--yaml``)."""
    name = object_name(job_name, PodRole.PS, ps_id)
    return f"{name}.{config.namespace}.svc:{config.ps_port_of(ps_id)}"


def _env(job_name: str, config: KubernetesConfig, spec: PodSpec, credentials: bool) -> list[dict[str, Any]]:
    """The container's environment; later entries replace earlier ones of the same name."""
    values = {
        **spec.env,
        "EDL_JOB_NAME": job_name,
        "EDL_POD_ROLE": spec.role.value,
        "EDL_POD_ID": str(spec.pod_id),
        "PYTHONUNBUFFERED": "1",
    }
    if config.storage_endpoint:
        values["EDL_S3_ENDPOINT"] = config.storage_endpoint
    if config.storage_region:
        values["AWS_REGION"] = config.storage_region
    env: dict[str, dict[str, Any]] = {name: {"name": name, "value": value} for name, value in values.items()}
    for name, path in FIELD_ENV:
        env[name] = {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
    if config.storage_secret:
        for name in SECRET_KEYS:
            ref = {"name": config.storage_secret, "key": name, "optional": True}
            env[name] = {"name": name, "valueFrom": {"secretKeyRef": ref}}
    if config.db_secret and spec.role is PodRole.WORKER:  # the pods that read the data
        ref = {"name": config.db_secret, "key": DB_SECRET_KEY, "optional": True}
        env[DB_PASSWORD_ENV] = {"name": DB_PASSWORD_ENV, "valueFrom": {"secretKeyRef": ref}}
    if not credentials:
        return list(env.values())
    identity = auth.pod_identity(spec.role.value, spec.pod_id)
    env[auth.IDENTITY_ENV] = {"name": auth.IDENTITY_ENV, "value": identity}
    keys = (
        {auth.SECRET_ENV: SECRET_KEY_JOB}
        if spec.role is PodRole.PS
        else {auth.TOKEN_ENV: identity, auth.COLLECTIVE_ENV: SECRET_KEY_COLLECTIVE}
    )
    for name, key in keys.items():
        ref = {"name": job_auth_secret(job_name, config), "key": key}
        env[name] = {"name": name, "valueFrom": {"secretKeyRef": ref}}
    return list(env.values())


def render_job_manifests(
    job_name: str, config: KubernetesConfig, specs: Sequence[PodSpec], *, master_port: int = 0
) -> str:
    """The NetworkPolicy, Services and Pods that a backend starting ``specs`` creates, as multi-document
    YAML (for ``--yaml``); with a ``master_port``, the master's Service too."""
    validate_job_name(job_name)
    documents: list[dict[str, Any]] = [network_policy_manifest(job_name, config)]
    if master_port:
        documents.append(master_service_manifest(job_name, config, master_port))
    for spec in specs:
        if spec.role is PodRole.PS:
            assert spec.port is not None
            documents.append(service_manifest(job_name, config, spec.pod_id, spec.port))
        documents.append(pod_manifest(job_name, config, spec))
    return yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)
