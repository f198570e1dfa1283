"""``edl-argo cleanup --job-name JOB``: remove a Kubernetes job's worker and PS pods, Services and
NetworkPolicy once its step has ended for good.

The elastic-train step's exit hook runs it (:mod:`edl_argo.hera.elastic_train`): whether the step
succeeded, failed, was stopped (``argo stop``) or ran out of time, nothing of its job keeps running. It
deletes exactly the objects labelled with the job (:func:`~edl_argo.pods.manifests.job_selector`): the
worker and PS pods (each with its role's grace period, so a PS saves its checkpoint), every Service of the
job (the PSes' and the master's) and the NetworkPolicy ``<job>-grpc``; never the master's own pod (the
step's, which Argo owns) nor anything else. It then waits, up to ``--timeout`` seconds, until the pods and
Services are gone. With ``--backend local`` (the local pipeline runner) it stops the job's local pods.
Exit status: 0 when nothing of the job is left, 1 when something is, 2 for a
misconfiguration (no API server, a refusal such as a missing RBAC grant).
"""

from __future__ import annotations

import argparse
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


def delete_job_objects(api: Any, job_name: str, grace_seconds: float | None = None) -> None:
    """Ask the API to delete the job's pods (each with ``grace_seconds``, default its role's grace period),
    its Services and its NetworkPolicy. API errors are the client's (see :class:`JobApi`)."""
    for pod in job_pods(api):
        key = manifests.pod_key(pod["metadata"].get("labels"))
        assert key is not None
        grace = manifests.GRACE_SECONDS[key[0]] if grace_seconds is None else grace_seconds
        api.delete_pod(pod["metadata"]["name"], pod["metadata"]["uid"], grace)
    for service in api.list_services():
        api.delete_service(service["metadata"]["name"])
    api.delete_network_policy(manifests.network_policy_name(job_name))


def clean_up(api: Any, job_name: str, timeout_seconds: float) -> list[str]:
    """Delete the job's objects and wait until they are gone; returns what is left after the timeout."""
    from edl_argo.pods.kubernetes_api import retry_transient

    deadline = time.monotonic() + timeout_seconds
    found = retry_transient(lambda: job_objects(api), "list the job's objects", deadline)
    retry_transient(lambda: delete_job_objects(api, job_name), "delete the job's objects", deadline)
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
    job_name = manifests.validate_job_name(manifests.fit_job_name(args.job_name))
    from kubernetes.client.rest import ApiException

    from edl_argo.pods.kubernetes_api import CONNECTION_ERRORS, JobApi, api_message, load_api_client
    from edl_argo.pods.kubernetes_config import namespace_from_flag

    namespace = namespace_from_flag(args.namespace)
    client = load_api_client()
    try:
        api = JobApi(client, namespace, manifests.job_selector(job_name))
        remaining = clean_up(api, job_name, args.timeout)
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
