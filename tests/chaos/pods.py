"""What a chaos trial does to a job's pods, on either backend, and what it checks the job left behind.

:class:`LocalPods` acts on :class:`~edl_argo.pods.LocalProcessBackend` processes; :class:`KubernetesPods`
on the pods of the Kubernetes stand-in (``tests/k8s_stand_in``): signals go to the pod's processes as a
kubelet's would, deletions through the API with the official client (as ``kubectl delete``), evictions as
the scheduler's preemption. Both find what a finished job left behind: processes carrying its
``EDL_JOB_NAME`` and, on Kubernetes, pods, Services and NetworkPolicies with its instance label.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Protocol

from kubernetes import client as k8s

from edl_argo.pods import LocalProcessBackend, PodRole
from tests.k8s_helpers import job_selector
from tests.k8s_stand_in import KubernetesStandIn

#: How long a finished job's pods and objects may take to go (graceful deletions) before they count as
#: left behind.
CLEANUP_SECONDS = 30.0
#: The Kubernetes objects a job creates and must delete.
JOB_RESOURCES = ("pods", "services", "networkpolicies")


class PodControl(Protocol):
    """The faults a trial injects into one job's pods. ``signal`` raises KeyError for a pod not running."""

    job_name: str

    def signal(self, role: PodRole, pod_id: int, sig: int) -> None: ...

    def delete(self, role: PodRole, pod_id: int) -> None: ...

    def evict(self, role: PodRole, pod_id: int) -> None: ...

    def leftovers(self) -> list[str]: ...

    def remove_leftovers(self) -> None: ...


class LocalPods:
    """A local job's pods (processes). Deleting and evicting a pod are a SIGKILL here: no API to ask."""

    def __init__(self, backend: LocalProcessBackend, job_name: str) -> None:
        self.backend = backend
        self.job_name = job_name

    def signal(self, role: PodRole, pod_id: int, sig: int) -> None:
        self.backend.kill(role, pod_id, sig)

    def delete(self, role: PodRole, pod_id: int) -> None:
        self.backend.kill(role, pod_id, signal.SIGKILL)

    def evict(self, role: PodRole, pod_id: int) -> None:
        self.backend.kill(role, pod_id, signal.SIGKILL)

    def leftovers(self) -> list[str]:
        return [f"process {pid} ({command})" for pid, command in job_processes(self.job_name)]

    def remove_leftovers(self) -> None:
        kill_job_processes(self.job_name)


class KubernetesPods:
    """A job's pods on the stand-in cluster."""

    def __init__(self, cluster: KubernetesStandIn, job_name: str, namespace: str = "default") -> None:
        self.cluster = cluster
        self.job_name = job_name
        self.namespace = namespace

    def pod(self, role: PodRole, pod_id: int) -> str:
        return f"{self.job_name}-{role.value}-{pod_id}"

    def signal(self, role: PodRole, pod_id: int, sig: int) -> None:
        self.cluster.kill(self.pod(role, pod_id), sig, self.namespace)

    def delete(self, role: PodRole, pod_id: int) -> None:
        with self.cluster.api_client() as api:
            k8s.CoreV1Api(api).delete_namespaced_pod(self.pod(role, pod_id), self.namespace)

    def evict(self, role: PodRole, pod_id: int) -> None:
        try:
            self.cluster.evict(self.pod(role, pod_id), self.namespace)
        except KeyError:
            raise KeyError(f"{self.pod(role, pod_id)} does not exist") from None

    def leftovers(self) -> list[str]:
        found = [
            f"{resource[:-1]} {obj['metadata']['name']}"
            for resource in JOB_RESOURCES
            for obj in self.cluster.objects(resource, job_selector(self.job_name), self.namespace)
        ]
        return found + [f"process {pid} ({command})" for pid, command in job_processes(self.job_name)]

    def remove_leftovers(self) -> None:
        for resource in JOB_RESOURCES:
            for obj in self.cluster.objects(resource, job_selector(self.job_name), self.namespace):
                with contextlib.suppress(Exception):
                    self.cluster.delete(resource, obj["metadata"]["name"], self.namespace)
        kill_job_processes(self.job_name)


def left_behind(pods: PodControl, seconds: float = CLEANUP_SECONDS) -> list[str]:
    """What the finished job of ``pods`` still has after at most ``seconds`` (empty: nothing); whatever
    it is is then removed, so that one trial's leftovers do not disturb the next."""
    deadline = time.monotonic() + seconds
    while (found := pods.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if found:
        pods.remove_leftovers()
    return found


def job_processes(job_name: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the live processes whose environment has ``EDL_JOB_NAME=job_name``
    (every pod process of the job, on either backend)."""
    marker = f"\0EDL_JOB_NAME={job_name}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in b"\0" + (entry / "environ").read_bytes():
                continue
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] != "Z":  # a zombie is gone, only not yet reaped
            found.append((int(entry.name), command.strip()[:120]))
    return found


def kill_job_processes(job_name: str) -> None:
    """SIGKILL every process :func:`job_processes` finds."""
    for pid, _ in job_processes(job_name):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
