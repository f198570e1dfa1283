"""``edl-argo cleanup --job-name JOB``: remove a Kubernetes job's worker and PS pods, Services and
NetworkPolicy and auth Secret once its step has ended for good.

The elastic-train step's exit hook runs it (:mod:`edl_argo.hera.elastic_train`): whether the step
succeeded, failed, was stopped (``argo stop``) or ran out of time, nothing of its job keeps running. It
deletes exactly the objects labelled with the job (:func:`~edl_argo.pods.manifests.job_selector`): the
worker and PS pods (each with its role's grace period, so a PS saves its checkpoint), every Service of the
job (the PSes' and the master's), the NetworkPolicy ``<job>-grpc`` and the auth Secret; never the master's
own pod (the step's, which Argo owns) nor anything else. It then waits, up to ``--timeout`` seconds, until
the pods and Services are gone. With ``--backend local`` (the local pipeline runner) it stops the job's
local pods. Exit status: 0 when nothing of the job is left, 1 when something is, 2 for a
misconfiguration (no API server, a refusal such as a missing RBAC grant). In Argo (``EDL_WORKFLOW_UID`` and
``EDL_NODE_NAME`` set, as the hook's template does) only the objects of the hook's own step go
(label ``edl-argo/step``): a task that shares its job name with another never removes the other's pods.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from edl_argo.errors import ConfigError, JobFailedError
from edl_argo.flags import add_flag, positive_int
from edl_argo.log import get_logger
from edl_argo.pods import manifests

log = get_logger(__name__)

#: ``--timeout`` default: how long the clean-up waits for the job's objects to be gone.
CLEANUP_TIMEOUT_SECONDS = 120
#: Seconds local pods get between SIGTERM and SIGKILL (a PS saves its checkpoint).
LOCAL_GRACE_SECONDS = 10.0


def job_pods(api: Any) -> list[dict[str, Any]]:
    """The job's worker and PS pods (not the master's own pod, which carries the job's labels too)."""
    pods: list[dict[str, Any]] = api.list_pods()["items"]
    return [pod for pod in pods if manifests.pod_key(pod["metadata"].get("labels")) is not None]


def job_objects(api: Any) -> list[str]:
    """``kind/name`` of every worker and PS pod and every Service of the job."""
    pods = [f"pod/{pod['metadata']['name']}" for pod in job_pods(api)]
    return pods + [f"service/{service['metadata']['name']}" for service in api.list_services()]


def objects_of_other_steps(api: Any, step: str) -> list[str]:
    """``kind/name`` of the objects that ``api`` (selecting a job name, whatever the step) lists and that
    belong to another step than ``step`` (their :data:`~edl_argo.pods.manifests.STEP_LABEL` differs). The
    master's own pod, which Argo labels with the job name only, is not one of them."""
    found = [("pod", pod) for pod in job_pods(api)] + [("service", s) for s in api.list_services()]
    return [
        f"{kind}/{obj['metadata']['name']}"
        for kind, obj in found
        if (obj["metadata"].get("labels") or {}).get(manifests.STEP_LABEL, "") != step
    ]


def delete_job_objects(
    api: Any,
    job_name: str,
    auth_secret: str,
    grace_seconds: float | None = None,
    network_policy: bool = True,
) -> None:
    """Ask the API to delete the job's pods (each with ``grace_seconds``, default its role's grace period),
    its Services and (``network_policy``) its NetworkPolicy and its credentials Secret ``auth_secret``. API
    errors are the client's (see :class:`JobApi`)."""
    for pod in job_pods(api):
        key = manifests.pod_key(pod["metadata"].get("labels"))
        assert key is not None
        grace = manifests.GRACE_SECONDS[key[0]] if grace_seconds is None else grace_seconds
        api.delete_pod(pod["metadata"]["name"], pod["metadata"]["uid"], grace)
    for service in api.list_services():
        api.delete_service(service["metadata"]["name"])
    if network_policy:
        api.delete_network_policy(manifests.network_policy_name(job_name))
        api.delete_secret(auth_secret)


def clean_up(
    api: Any, any_step: Any, job_name: str, step: str, timeout_seconds: float, auth_secret: str
) -> list[str]:
    """Delete the objects of the job's ``step`` (``api`` selects them; ``any_step`` selects the job name
    whatever the step) and wait until they are gone; returns what is left after the timeout. The
    NetworkPolicy and the auth Secret ``auth_secret``, which carry the job name only, stay while another
    step's objects use that name."""
    from edl_argo.pods.kubernetes_api import retry_transient

    deadline = time.monotonic() + timeout_seconds
    found = retry_transient(lambda: job_objects(api), "list the job's objects", deadline)
    others = retry_transient(lambda: objects_of_other_steps(any_step, step), "list other steps", deadline)
    if others:
        log.warning(
            "network_policy_kept", job=job_name, reason="used by another step", objects=",".join(others)
        )
    retry_transient(
        lambda: delete_job_objects(api, job_name, auth_secret, network_policy=not others),
        "delete the job's objects",
        deadline,
    )
    remaining = found
    while remaining and time.monotonic() < deadline:
        time.sleep(0.5)
        remaining = retry_transient(lambda: job_objects(api), "list the job's objects", deadline)
    log.info(
        "job_cleaned_up" if not remaining else "job_cleanup_incomplete",
        job=job_name,
        deleted=",".join(sorted(set(found) - set(remaining))) or "none",
        remaining=",".join(remaining) or "none",
    )
    return remaining


def clean_up_local(job_name: str) -> int:
    """The local backend's clean-up: stop the job's pods that still run on this machine (the ones under
    ``$EDL_RUN_DIR/pods/<job>``), as its master would have."""
    from edl_argo.pods.local import LocalProcessBackend

    backend = LocalProcessBackend(job_name)
    stopped = backend.adopt()
    backend.close(grace_seconds=LOCAL_GRACE_SECONDS)
    log.info("job_cleaned_up", job=job_name, deleted=",".join(p.name for p in stopped) or "none")
    print(f"job {job_name}: nothing left on this machine")
    return 0


def run_cleanup(args: argparse.Namespace) -> int:
    if args.backend == "local":
        return clean_up_local(args.job_name)
    job_name = manifests.kubernetes_job_name(args.job_name)
    auth_secret = manifests.auth_secret_name(args.job_name)  # named as the master named it
    from kubernetes.client.rest import ApiException

    from edl_argo.pods.kubernetes_api import CONNECTION_ERRORS, JobApi, api_message, load_api_client
    from edl_argo.pods.kubernetes_config import namespace_from_flag, step_from_env
    from edl_argo.pods.request_budget import DEFAULT_BURST, DEFAULT_QPS, RequestBudget

    budget = RequestBudget(DEFAULT_QPS, DEFAULT_BURST)  # the master's default budget, shared by both
    namespace = namespace_from_flag(args.namespace)
    step = step_from_env(os.environ)
    client = load_api_client()
    try:
        api = JobApi(client, namespace, manifests.job_selector(job_name, step), budget)
        any_step = JobApi(client, namespace, manifests.job_selector(job_name), budget)
        remaining = clean_up(api, any_step, job_name, step, args.timeout, auth_secret)
    except ApiException as error:
        raise ConfigError(
            f"cleanup of job {job_name} in namespace {namespace}: {api_message(error)} (the step's service"
            " account needs templates/rbac.yaml)"
        ) from None
    except CONNECTION_ERRORS as error:
        raise JobFailedError(f"cleanup of job {job_name}: cannot reach the Kubernetes API: {error}") from None
    finally:
        client.close()
    if remaining:
        raise JobFailedError(
            f"cleanup of job {job_name}: still there after {args.timeout} s: {', '.join(remaining)}"
        )
    print(f"job {job_name}: nothing left in namespace {namespace}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cleanup",
        help="delete a Kubernetes job's pods, Services and NetworkPolicy (the training step's exit hook)",
    )
    add_flag(parser, "--job-name", required=True, help="the job whose objects go")
    add_flag(parser, "--backend", choices=["kubernetes", "local"], default="kubernetes", help="its backend")
    add_flag(
        parser, "--namespace", default="", help="its namespace (default: this pod's own, else 'default')"
    )
    add_flag(
        parser,
        "--timeout",
        type=positive_int,
        default=CLEANUP_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"how long to wait for the objects to be gone (default {CLEANUP_TIMEOUT_SECONDS})",
    )
    add_flag(parser, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(run=run_cleanup)
