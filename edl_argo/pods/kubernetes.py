"""Pods as Kubernetes pods: the backend of a master that runs as an Argo step (``--backend kubernetes``).

:class:`KubernetesBackend` is the :class:`~edl_argo.pods.base.PodBackend` of that case, composed of:

* :mod:`edl_argo.pods.manifests`: the job's objects as plain dicts (pure builders, no API calls);
* :mod:`edl_argo.pods.kubernetes_api`: the API calls (:class:`~edl_argo.pods.kubernetes_api.JobApi`);
* :mod:`edl_argo.pods.kubernetes_pods`: the record of the job's pods and the queue of their events;
* :mod:`edl_argo.pods.kubernetes_creation`: creating and deleting objects, with retries and deadlines;
* :mod:`edl_argo.pods.kubernetes_watch`: the watch of the job's pods, adoption, and what each change means.

The master talks to the API server with the official ``kubernetes`` client (in-cluster service account,
else ``KUBECONFIG``; ``EDL_KUBERNETES_API=http://host:port`` points it at any API server, for tests): it
needs exactly what ``templates/rbac.yaml`` grants, pods and services (create, get, list, watch, delete),
pods (patch), pods/log (get), networkpolicies (create, delete) and secrets (create, patch, delete: never
get, list or watch, so it reads no Secret of another job or team) in its namespace.

**Network.** On construction the backend creates the job's NetworkPolicy
(:func:`~edl_argo.pods.manifests.network_policy_manifest`, owned like the pods): only the job's own pods
reach its gRPC ports. One that exists (made by an earlier master of the job) is kept; :meth:`close`
deletes it with the pods and Services.

**Objects.** :meth:`KubernetesBackend.start` creates a Pod per :class:`~edl_argo.pods.base.PodSpec` (see
:mod:`edl_argo.pods.manifests`) and, for a PS, first a ClusterIP Service of the same name that selects it
by role and id. The Service outlives the PS's relaunches, so :meth:`~KubernetesBackend.address` of a PS is
``<clusterIP>:<port>``: a virtual IP that does not change and needs no DNS, through which workers reach
whichever incarnation of the PS runs. (A headless Service would hand out pod IPs, which change at every
relaunch and which resolvers cache.) PS ``i`` listens on ``KubernetesConfig.ps_port + i``, so PS ports
differ even when pods share a host, as in the tests. Creation runs on a thread per pod, so
:meth:`~KubernetesBackend.start` returns at once; its retries are described in
:mod:`edl_argo.pods.kubernetes_creation`, the events of the pods in :mod:`edl_argo.pods.kubernetes_watch`.

**Adoption.** On construction the backend lists the job's pods and Services by label: running and
pending pods that an earlier master of the job started (one that crashed and that Argo restarted) are
tracked like its own -- :meth:`~KubernetesBackend.list_pods` lists them, their events arrive (the watch
selects by label, not by creator), :meth:`~KubernetesBackend.delete` and :meth:`~KubernetesBackend.close`
remove them -- and PS addresses come from the existing Services. :meth:`~KubernetesBackend.adopt` returns
them and deletes the finished pods of earlier incarnations (until then they stay, for ``kubectl logs``);
:meth:`~KubernetesBackend.close` deletes every pod and Service of the job and waits until they are gone.

**Credentials.** The job's secret is kept in the Secret ``<requested job name>-auth``
(:func:`~edl_argo.pods.manifests.job_auth_secret`, :func:`~edl_argo.pods.manifests.auth_secret_manifest`,
owned like the pods, so garbage-collected with its Workflow): :meth:`use_job_secret` creates it, and before a
worker's pod is created its own token is added to it under ``worker-<id>`` (a JSON merge patch carrying the
tokens of all the workers being created then: :mod:`~edl_argo.pods.secret_tokens`), which the pod reads
through ``secretKeyRef``. :meth:`close` deletes it with the NetworkPolicy. The master never reads
a Secret through the API: the elastic-train step mounts that Secret into the master's pod as an optional
volume (``$EDL_MASTER_SECRETS_DIR/job-auth``, :attr:`KubernetesConfig.secrets_dir`), empty for the first
master, which creates the Secret, and filled by the kubelet for a restarted master's new pod, from which
:meth:`stored_job_secret` reads it (the pods it adopts hold credentials derived from it). A master that finds
the Secret existing but could not read it stops (:meth:`use_job_secret`): a new secret would lock out the
pods it adopts. With ``--tls-secret``, :meth:`~KubernetesBackend.tls_secret` reads that Secret from its
volume (``$EDL_MASTER_SECRETS_DIR/tls``) for the master's own server and clients, and its pods mount it
read-only (:mod:`edl_argo.rpc.tls`). The master's Role needs ``create``, ``patch`` and ``delete`` on Secrets.

**The master's address.** :meth:`~KubernetesBackend.expose_master` puts a ClusterIP Service ``<job>-master``
(:func:`~edl_argo.pods.manifests.master_service_manifest`) in front of the master when its own pod
(``EDL_POD_NAME``) carries :data:`~edl_argo.pods.manifests.MASTER_POD_LABELS`, as the elastic-train
step's pod does. It first labels that pod with the job (:func:`~edl_argo.pods.manifests.master_labels`,
``patch`` on pods), which the step cannot do itself since only the master fits a long job name to a
label (:func:`~edl_argo.pods.manifests.kubernetes_job_name`). The Service selects whichever pod of the
step runs, so a master that Argo retried in a new pod (with a new IP) is reached at the same
``<clusterIP>:<port>``. The master's own pod is never listed, watched or
deleted as one of the job's pods (its role is ``master``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from edl_argo.addresses import join_host_port, split_host_port
from edl_argo.errors import ConfigError
from edl_argo.pods import manifests
from edl_argo.pods.base import (
    BackendClosedError,
    PodBackend,
    PodEvent,
    PodPhase,
    PodReason,
    PodRole,
    PodSpec,
    PodStatus,
    admit_start,
    pod_name,
)
from edl_argo.pods.cleanup import objects_of_other_steps
from edl_argo.pods.kubernetes_api import (
    API_URL_ENV,
    CONNECTION_ERRORS,
    JobApi,
    load_api_client,
    retry_transient,
)
from edl_argo.pods.kubernetes_config import KubernetesConfig
from edl_argo.pods.kubernetes_creation import JobObjects, StartupCalls
from edl_argo.pods.kubernetes_pods import Incarnation, JobPods, log
from edl_argo.pods.kubernetes_watch import PodWatch
from edl_argo.pods.manifests import render_job_manifests
from edl_argo.pods.request_budget import RequestBudget
from edl_argo.rpc.auth import JobSecret
from edl_argo.rpc.tls import TlsFiles

__all__ = ["API_URL_ENV", "KubernetesBackend", "load_api_client", "render_job_manifests"]

#: How long :meth:`KubernetesBackend.close` waits beyond the grace period for the pods to be gone.
CLOSE_EXTRA_SECONDS = 30.0


class KubernetesBackend(PodBackend):
    """Runs the pods of job ``job_name`` in a Kubernetes namespace (see the module docstring).

    Args:
        job_name: names and labels every object (``<job>-worker-3``); at most
            :data:`~edl_argo.pods.manifests.MAX_JOB_NAME` characters of ``[a-z0-9-]``.
        config: image, namespace, resources, owner, ... of the pods.
        api: the API client; default :func:`load_api_client`. A client passed in is not closed.

    The constructor lists the job's existing pods and Services (adoption) and starts the watch thread;
    throttling (429), server errors (5xx) and lost connections meanwhile are retried with backoff for
    :data:`~edl_argo.pods.kubernetes_creation.START_RETRY_SECONDS` (an API server restarting).

    Raises:
        ConfigError: an invalid job name, no API server configured, one that refuses a request (403 RBAC,
            404 unknown namespace, 422 invalid object), or a job name used by another step.
        JobFailedError: the API server kept failing or could not be reached for START_RETRY_SECONDS.
    """

    keeps_job_secret = True

    def __init__(self, job_name: str, config: KubernetesConfig, api: k8s.ApiClient | None = None) -> None:
        self.job_name = manifests.validate_job_name(job_name)
        self.config = config
        #: The job's auth Secret, and the secret read back from the master pod's volume of it (if any).
        self.auth_secret = manifests.job_auth_secret(self.job_name, config)
        self._stored_secret: JobSecret | None = None
        self._client = api if api is not None else load_api_client()
        self._own_client = api is None
        #: Paces every request of the backend (``--k8s-qps``, ``--k8s-burst``).
        self.budget = RequestBudget(config.k8s_qps, config.k8s_burst)
        self._api = JobApi(
            self._client, config.namespace, manifests.job_selector(job_name, config.step), self.budget
        )
        self._pods = JobPods(self.job_name, config.namespace)
        self._objects = JobObjects(self._api, self._pods)
        self._watch = PodWatch(self._api, self._pods, self._objects.delete_pod)
        self._close_done = False
        self._watch.start(self._start_up())

    # -- PodBackend ------------------------------------------------------------------------------

    def start(self, spec: PodSpec) -> None:
        pods = self._pods
        with pods.lock:
            admit_start(spec, closed=pods.closed, live=pods.pods, ports=pods.ports)
            name = manifests.object_name(self.job_name, spec.role, spec.pod_id)
            pod = pods.pods[(spec.role, spec.pod_id)] = Incarnation(
                spec.role, spec.pod_id, name, spec, creating=True
            )
        if spec.role is PodRole.PS and spec.pod_id not in pods.addresses:
            assert spec.port is not None
            problem = self._objects.create_ps_service(spec.pod_id, spec.port, self.config)
            if problem:
                with pods.lock:
                    pod.creating = False
                    pods.finish(pod, PodPhase.FAILED, PodReason.ERROR, None, problem)
                return
        self._objects.launch(pod, self.config, self.job_secret)

    def stored_job_secret(self) -> JobSecret | None:
        """The secret in the master pod's volume of the job's auth Secret; None without such a volume or
        when it is empty (no earlier master made the Secret before this pod started)."""
        if not self.config.secrets_dir:
            return None
        folder = Path(self.config.secrets_dir) / manifests.MASTER_AUTH_VOLUME
        self._stored_secret = manifests.read_mounted_job_secret(folder, self.auth_secret)
        return self._stored_secret

    def tls_secret(self, name: str) -> TlsFiles:
        """The ``--tls-secret`` Secret ``name`` from the master pod's volume of it; ConfigError naming
        ``--tls-secret`` when there is none (outside the elastic-train step: no
        ``EDL_MASTER_SECRETS_DIR``)."""
        env = manifests.MASTER_SECRETS_ENV
        if not self.config.secrets_dir:
            raise ConfigError(
                f"--tls-secret {name}: the master reads it from its pod's volume of it, at"
                f" ${env}/{manifests.MASTER_TLS_VOLUME} (the elastic-train step mounts it), and {env} is not"
                " set"
            )
        return manifests.read_mounted_tls(Path(self.config.secrets_dir) / manifests.MASTER_TLS_VOLUME, name)

    def use_job_secret(self, secret: JobSecret) -> None:
        """Create the job's auth Secret holding ``secret``; one that exists already must hold it (it was read
        back by :meth:`stored_job_secret`), else ConfigError: the master cannot learn the job's secret."""
        body = manifests.auth_secret_manifest(self.job_name, self.config, secret)
        name = body["metadata"]["name"]
        created = StartupCalls(self.config.namespace)(
            lambda: self._api.create_secret(body), f"create Secret {name}"
        )
        stored = self._stored_secret
        if not created and (stored is None or stored.hex() != secret.hex()):
            folder = Path(self.config.secrets_dir or f"${manifests.MASTER_SECRETS_ENV}")
            raise ConfigError(
                f"Secret {name} of job {self.job_name} exists (an earlier master of the job made it), but"
                f" this master found no job secret in its volume at {folder / manifests.MASTER_AUTH_VOLUME}:"
                " run it in the elastic-train step, which mounts that Secret, or delete the Secret and the"
                " job's pods to start the job afresh"
            )
        super().use_job_secret(secret)

    def adopt(self) -> list[PodStatus]:
        pods = self._pods
        with pods.lock:
            if pods.closed:
                raise BackendClosedError("cannot adopt pods: the backend is closed")
            fresh = [
                pod
                for pod in pods.pods.values()
                if pod.spec is None and not pod.terminal and pod.uid not in pods.returned_uids
            ]
            pods.returned_uids.update(pod.uid for pod in fresh if pod.uid)
            adopted = [PodStatus(pod.role, pod.pod_id, pod.phase) for pod in fresh]
            leftovers, pods.leftovers = pods.leftovers, []
        for name, uid in leftovers:
            log.info("pod_leftover_removed", job=self.job_name, pod=name, uid=uid)
            self._objects.delete_pod(name, uid, 0)
        return sorted(adopted, key=lambda status: (status.role.value, status.pod_id))

    def expose_master(self, address: str) -> str:
        port = split_host_port(address)[1]
        own_pod = os.environ.get("EDL_POD_NAME", "")
        labels = ((self._read_own_pod() or {}).get("metadata") or {}).get("labels") or {}
        step_labels = manifests.MASTER_POD_LABELS
        if any(labels.get(key) != value for key, value in step_labels.items()):
            log.info(
                "master_service_skipped",
                job=self.job_name,
                pod=own_pod or "none",
                reason="the master's pod does not carry "
                + ",".join(f"{k}={v}" for k, v in step_labels.items()),
            )
            return address
        self._label_own_pod(own_pod, labels)
        body = manifests.master_service_manifest(self.job_name, self.config, port)
        service, problem = self._objects.ensure_master_service(body, self.config.pod_creation_timeout)
        if service is None:
            log.warning("master_service_failed", job=self.job_name, error=problem)
            return address
        stable = join_host_port(service["spec"]["clusterIP"], port)
        log.info("master_service", job=self.job_name, service=body["metadata"]["name"], address=stable)
        return stable

    def delete(
        self, role: PodRole, pod_id: int, *, reason: str = PodReason.DELETED, grace_seconds: float = 5.0
    ) -> None:
        with self._pods.lock:
            pod = self._pods.pods.get((role, pod_id))
            if pod is None or pod.terminal:
                return
            if pod.delete_reason is None:
                pod.delete_reason = reason
                log.info("pod_delete", job=self.job_name, pod=pod.name, reason=reason, grace_s=grace_seconds)
            uid = pod.uid
        if uid is not None:  # else its creator deletes it once created, or never creates it
            self._objects.delete_pod(pod.name, uid, grace_seconds)

    def events(self, timeout: float | None = None) -> list[PodEvent]:
        return self._pods.take(timeout)

    def address(self, role: PodRole, pod_id: int) -> str:
        if role is not PodRole.PS:
            raise ValueError(f"{pod_name(role, pod_id)} does not listen on a port")
        with self._pods.lock:
            address = self._pods.addresses.get(pod_id)
        if address is None:
            name = manifests.object_name(self.job_name, role, pod_id)
            try:
                address = self._pods.remember_service(self._api.read_service(name))
            except ApiException as error:
                if error.status != 404:
                    raise
            if address is None:
                raise KeyError(f"{pod_name(role, pod_id)} has no Service {name}, so it has no address")
        return address

    def list_pods(self) -> list[PodStatus]:
        return self._pods.statuses()

    def close(self, *, grace_seconds: float = 5.0) -> None:
        pods = self._pods
        with pods.lock:
            if self._close_done:
                return
            pods.closed = True
            for pod in pods.pods.values():
                if not pod.terminal and pod.delete_reason is None:
                    pod.delete_reason = PodReason.DELETED
        self._objects.stop()
        deadline = time.monotonic() + max(grace_seconds, 1.0) + CLOSE_EXTRA_SECONDS
        remaining = self._objects.delete_job(grace_seconds, deadline, self.auth_secret, pods.all_terminal)
        while not pods.all_terminal() and time.monotonic() < deadline:
            time.sleep(0.05)  # the watch reports the last terminal events
        self._watch.stop()
        with pods.lock:
            for pod in pods.pods.values():
                pods.finish(pod, PodPhase.DELETED, PodReason.DELETED, None, "deleted when the backend closed")
            self._close_done = True
        pods.queue.close()
        if remaining:
            log.warning("pods_left_after_close", job=self.job_name, objects=",".join(remaining))
        if self._own_client:
            self._client.close()

    # -- start-up --------------------------------------------------------------------------------

    def _start_up(self) -> str:
        """What the constructor asks the API (see the module docstring): refuse another step's job name,
        adopt the job's Services and pods, read the master's own pod, create the NetworkPolicy. Returns the
        pods' resourceVersion. Failures as :class:`~edl_argo.pods.kubernetes_creation.StartupCalls` says."""
        config = self.config
        starting = StartupCalls(config.namespace)
        any_step = JobApi(self._client, config.namespace, manifests.job_selector(self.job_name), self.budget)
        others = starting(
            lambda: objects_of_other_steps(any_step, config.step), "list the job's pods and services"
        )
        if others:
            raise ConfigError(
                f"--job-name {self.job_name}: namespace {config.namespace} holds {', '.join(others)} of"
                f" another step of that job name (label {manifests.STEP_LABEL}); give each training task its"
                " own job name"
            )
        for service in starting(self._api.list_services, "list services"):
            self._pods.remember_service(service)
        resource_version = starting(self._watch.relist, "list pods")
        own_pod = self._read_own_pod()
        if not config.image_pull_secrets and own_pod is not None:
            secrets = (own_pod.get("spec") or {}).get("imagePullSecrets") or []
            names = tuple(secret["name"] for secret in secrets if secret.get("name"))
            self.config = dataclasses.replace(config, image_pull_secrets=names)
        policy = manifests.network_policy_manifest(self.job_name, self.config)
        starting(
            lambda: self._api.create_network_policy(policy),
            f"create NetworkPolicy {policy['metadata']['name']}",
        )
        return resource_version

    def _label_own_pod(self, own_pod: str, labels: dict[str, str]) -> None:
        """Label the master's pod ``own_pod`` (now labelled ``labels``) with the job
        (:func:`~edl_argo.pods.manifests.master_labels`), so the job's Service and NetworkPolicy select it.

        Raises:
            ConfigError: the API refuses (the service account lacks ``patch`` on pods): unlabelled, the
                master would be out of its workers' reach.
        """
        wanted = manifests.master_labels(self.job_name)
        if all(labels.get(key) == value for key, value in wanted.items()):
            return
        StartupCalls(self.config.namespace)(
            lambda: self._api.label_pod(own_pod, wanted), f"label the master's pod {own_pod}"
        )
        log.info("master_pod_labelled", job=self.job_name, pod=own_pod)

    def _read_own_pod(self) -> dict[str, Any] | None:
        """The master's own pod (``EDL_POD_NAME``), whose labels and imagePullSecrets the job uses; None
        outside a pod or if it cannot be read (logged)."""
        own_pod = os.environ.get("EDL_POD_NAME", "")
        if not own_pod:
            return None
        try:
            pod: dict[str, Any] = retry_transient(
                lambda: self._api.read_pod(own_pod), "read the master's pod", time.monotonic() + 30
            )
            return pod
        except (ApiException, *CONNECTION_ERRORS) as error:
            log.warning("master_pod_unreadable", job=self.job_name, pod=own_pod, error=str(error))
            return None
