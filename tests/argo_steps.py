"""Rendered Argo workflows read as Argo reads them: a task's template (embedded or by ``templateRef``), the
values of its input parameters, and the master's pod of an elastic-train task as Argo creates it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edl_argo.hera import STEPS
from edl_argo.pipeline.variables import substitute

#: The label Argo adds to every pod of a workflow (its name).
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"


def step_template(task: Mapping[str, Any], templates: Mapping[str, Any]) -> dict[str, Any]:
    """The template ``task`` (or a hook) runs: one of ``templates`` (the workflow's), or the installed
    WorkflowTemplate's that its ``templateRef`` names."""
    ref = task.get("templateRef")
    if ref is None:
        return dict(templates[task["template"]])
    step = next(s for s in STEPS if (s.workflow_template, s.name) == (ref["name"], ref["template"]))
    return step.template_model().model_dump(by_alias=True, exclude_none=True)


def training_tasks(manifest: Mapping[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(task, template) of every task of the manifest's DAGs that runs ``edl-argo train``."""
    templates = {t["name"]: t for t in manifest["spec"]["templates"]}
    found = []
    for dag in (t for t in manifest["spec"]["templates"] if "dag" in t):
        for task in dag["dag"]["tasks"]:
            template = step_template(task, templates)
            if template.get("container", {}).get("command", [])[:2] == ["edl-argo", "train"]:
                found.append((task, template))
    return found


def parameter_values(task: Mapping[str, Any], template: Mapping[str, Any]) -> dict[str, str]:
    """The task's input parameters by name, as given by its arguments, else the template's defaults."""
    given = {p["name"]: p["value"] for p in task.get("arguments", {}).get("parameters", [])}
    defaults = {p["name"]: p.get("default") for p in template["inputs"]["parameters"]}
    return defaults | given


def task_scope(
    task: Mapping[str, Any], template: Mapping[str, Any], workflow: Mapping[str, str]
) -> dict[str, str]:
    """The variables Argo fills in when it runs ``task``: the ``workflow`` variables (``workflow.name``,
    ...) and ``inputs.parameters.*``, the arguments themselves filled in from ``workflow``."""
    scope = dict(workflow)
    for name, value in parameter_values(task, template).items():
        scope[f"inputs.parameters.{name}"] = substitute(value or "", workflow, f"parameter {name}")
    return scope


def argo_pod(
    task: Mapping[str, Any], template: Mapping[str, Any], workflow: Mapping[str, str]
) -> dict[str, Any]:
    """The pod Argo creates for ``task`` (what edl-argo relies on): its labels (the template's, filled in,
    and Argo's workflow label), its main container's command line and plain environment variables, and its
    Secret volumes by name (``secretName`` filled in; an expression tag ``{{=...}}`` is left as it is: this
    module does not evaluate Argo's expressions) with their ``mountPath``."""
    scope = task_scope(task, template, workflow)
    where = template["name"]
    labels = substitute(template.get("metadata", {}).get("labels", {}), scope, where)
    labels[WORKFLOW_LABEL] = workflow["workflow.name"]
    container = template["container"]
    argv = substitute(container["command"] + container.get("args", []), scope, where)
    # Argo's node of the task: <workflow>.<task>, the workflow itself for a single-step submit.
    node = ".".join(filter(None, (workflow["workflow.name"], task.get("name"))))
    env_scope = scope | {"node.name": node}
    env = {
        e["name"]: substitute(e["value"], env_scope, where) for e in container.get("env", []) if "value" in e
    }
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    volumes = {}
    for volume in template.get("volumes", []):
        secret = dict(volume["secret"])
        if not secret["secretName"].startswith("{{="):
            secret["secretName"] = substitute(secret["secretName"], scope, where)
        volumes[volume["name"]] = {"secret": secret, "mountPath": mounts.get(volume["name"])}
    return {"metadata": {"labels": labels}, "argv": argv, "env": env, "volumes": volumes}


def argo_pod_manifest(
    task: Mapping[str, Any], template: Mapping[str, Any], workflow: Mapping[str, str], pod_name: str
) -> dict[str, Any]:
    """The Pod Argo creates for ``task`` as a Kubernetes object (what the stand-in can run): ``pod_name``,
    the labels of :func:`argo_pod`, the Workflow (``workflow.name``, ``workflow.uid``) as its controlling
    owner, the template's service account, and its main container ``main``: the image, the command line of
    :func:`argo_pod` (Argo runs it under its executor, which this leaves out), the environment as the
    template declares it (plain values filled in, downward-API ``valueFrom`` entries as they are) and the
    ports. Volumes are left out: a test mounts them itself (``KubernetesStandIn.mount_secret``)."""
    rendered = argo_pod(task, template, workflow)
    container = template["container"]
    scope = task_scope(task, template, workflow)
    env = []
    for entry in container.get("env", []):
        if "value" in entry:
            env.append({"name": entry["name"], "value": rendered["env"][entry["name"]]})
        else:
            env.append(dict(entry))
    owner = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "name": workflow["workflow.name"],
        "uid": workflow["workflow.uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "labels": rendered["metadata"]["labels"],
            "ownerReferences": [owner],
        },
        "spec": {
            "serviceAccountName": template.get("serviceAccountName", "default"),
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": substitute(container["image"], scope, template["name"]),
                    "command": rendered["argv"],
                    "env": env,
                    "ports": [dict(p) for p in container.get("ports", [])],
                }
            ],
        },
    }
