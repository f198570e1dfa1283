"""Helpers shared by the tests and benchmarks that run the Kubernetes backend against the stand-in."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import yaml

from edl_argo.master.config import TrainConfig
from edl_argo.pods import find_free_port
from edl_argo.pods.kubernetes_config import KubernetesConfig, Owner, RoleSettings, highest_ps_port
from edl_argo.pods.manifests import MASTER_AUTH_VOLUME, MASTER_SECRETS_ENV, auth_secret_name
from tests.engine_helpers import digits_config

ROOT = Path(__file__).resolve().parents[1]

#: ``(API group, resource, verb)`` the master needs, per the issue: nothing beyond this.
MASTER_RULES = (
    {("", "pods", verb) for verb in ("create", "get", "list", "watch", "delete", "patch")}
    | {("", "services", verb) for verb in ("create", "get", "list", "watch", "delete")}
    | {("", "pods/log", "get")}
    | {("networking.k8s.io", "networkpolicies", verb) for verb in ("create", "delete")}
    # The job's own auth Secret: created, a worker's token added, deleted; never read (no get, list, watch).
    | {("", "secrets", verb) for verb in ("create", "patch", "delete")}
)
#: What Argo's executor, in the same pod, needs to report the step's outputs.
ARGO_EXECUTOR_RULES = {("argoproj.io", "workflowtaskresults", verb) for verb in ("create", "patch")}
#: The User-Agent of the master's API client (``edl_argo.pods.kubernetes.load_api_client``).
MASTER_USER_AGENT = "edl-argo/"
#: The most PS a test's Kubernetes job runs (:func:`kubernetes_ps_port` leaves room for their tensor ports).
MOST_PS_OF_A_TEST_JOB = 4


def kubernetes_ps_port() -> int:
    """A free port for the PS of a test's Kubernetes job (``KubernetesConfig.ps_port``, ``--ps-port``) with
    room above it for every PS's port and tensor port."""
    return find_free_port(highest=highest_ps_port(MOST_PS_OF_A_TEST_JOB))


def role_rules() -> list[dict[str, Any]]:
    """The rules of the Role in ``templates/rbac.yaml``."""
    documents = yaml.safe_load_all((ROOT / "templates" / "rbac.yaml").read_text())
    rules: list[dict[str, Any]] = next(d for d in documents if d["kind"] == "Role")["rules"]
    return rules


def job_selector(job_name: str, role: str = "") -> str:
    """The label selector of a job's objects (of one role)."""
    selector = f"app.kubernetes.io/instance={job_name}"
    return f"{selector},edl-argo/role={role}" if role else selector


def start_master_pod(cluster: Any, job_name: str, folder: Path) -> dict[str, str]:
    """What a new pod of the elastic-train step's master gets from the kubelet on the stand-in ``cluster``:
    ``folder`` holding its volume of the job's auth Secret, as it is now (empty before the first master
    creates the Secret); returns the environment that names it (``EDL_MASTER_SECRETS_DIR``)."""
    shutil.rmtree(folder, ignore_errors=True)
    cluster.mount_secret(auth_secret_name(job_name), folder / MASTER_AUTH_VOLUME)
    return {MASTER_SECRETS_ENV: str(folder)}


def stand_in_digits_config(
    cluster: Any,
    data: Path,
    output: Path,
    *,
    worker: RoleSettings | None = None,
    ps: RoleSettings | None = None,
    opportunistic_worker_priority: str = "",
    **overrides: Any,
) -> TrainConfig:
    """A digits job (:func:`~tests.engine_helpers.digits_config`) of a new Workflow on the stand-in
    ``cluster``, configured as the elastic-train step's master configures it; the master must reach the
    stand-in through ``EDL_KUBERNETES_API`` (``edl_argo.pods.kubernetes.API_URL_ENV``)."""
    name = f"wf-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": name}}
    workflow = cluster.create("workflows", body)
    settings = KubernetesConfig(
        image="edl-argo:test",
        worker=worker or RoleSettings({"cpu": "1", "memory": "1Gi"}, {"memory": "2Gi"}, "low"),
        ps=ps or RoleSettings({"cpu": "1", "memory": "1Gi"}, {}, "high"),
        opportunistic_worker_priority=opportunistic_worker_priority,
        storage_secret="storage",
        workflow_name=name,
        owner=Owner("argoproj.io/v1alpha1", "Workflow", name, workflow["metadata"]["uid"]),
        ps_port=kubernetes_ps_port(),
        collective_port=find_free_port(),
    )
    return digits_config(
        data, output, job_name=f"digits-{name[3:]}", backend="kubernetes", kubernetes=settings, **overrides
    )
