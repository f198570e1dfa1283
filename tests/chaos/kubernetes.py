"""How a chaos trial's master reaches the Kubernetes stand-in: the backend settings of an Argo step's
master (a Workflow owns the job's objects) for an in-process master, the ``edl-argo train`` flags and
environment for a master run as a subprocess (``master_restart``)."""

from __future__ import annotations

import os

from edl_argo.pods import find_free_port
from edl_argo.pods.kubernetes import API_URL_ENV
from edl_argo.pods.kubernetes_config import KubernetesConfig, Owner
from tests.k8s_helpers import kubernetes_ps_port
from tests.k8s_stand_in import KubernetesStandIn

#: The image the job's pods name (the stand-in runs their commands with this interpreter).
IMAGE = "edl-argo:chaos"
#: What an Argo step's pod sets that a master run from a test must not take from the test's environment.
STEP_ENV = ("EDL_POD_NAME", "EDL_POD_UID", "EDL_WORKFLOW_NAME", "EDL_WORKFLOW_UID", "POD_IP")


def kubernetes_settings(cluster: KubernetesStandIn, job_name: str) -> KubernetesConfig:
    """The backend settings of ``job_name``, whose objects a new Workflow on ``cluster`` owns."""
    body = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": f"wf-{job_name}"}}
    workflow = cluster.create("workflows", body)
    name = workflow["metadata"]["name"]
    return KubernetesConfig(
        image=IMAGE,
        workflow_name=name,
        owner=Owner("argoproj.io/v1alpha1", "Workflow", name, workflow["metadata"]["uid"]),
        ps_port=kubernetes_ps_port(),
        collective_port=find_free_port(),
    )


def api_environment(cluster: KubernetesStandIn) -> dict[str, str | None]:
    """The environment variables that point a master at ``cluster`` (None: removed)."""
    return {API_URL_ENV: cluster.url, **dict.fromkeys(STEP_ENV)}


def master_flags() -> list[str]:
    """The ``edl-argo train`` flags of a master on the stand-in (with :func:`api_environment`)."""
    return ["--backend", "kubernetes", "--image", IMAGE, "--ps-port", str(kubernetes_ps_port())]


def subprocess_environment(cluster: KubernetesStandIn) -> dict[str, str]:
    """This process's environment with :func:`api_environment` applied, for a master subprocess."""
    environ = dict(os.environ)
    for name, value in api_environment(cluster).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ
