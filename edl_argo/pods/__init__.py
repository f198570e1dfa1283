"""Starting, watching and removing the pods (workers, parameter servers) of a job.

The master uses only :class:`PodBackend`; :class:`LocalProcessBackend` runs pods as child processes.
"""

from edl_argo.pods.base import (
    BackendClosedError,
    PodBackend,
    PodEvent,
    PodExistsError,
    PodPhase,
    PodReason,
    PodRole,
    PodSpec,
    PodStatus,
    pod_name,
)
from edl_argo.pods.event_queue import EventQueue
from edl_argo.pods.local import LocalProcessBackend
from edl_argo.pods.ports import find_free_port, release_ports

__all__ = [
    "BackendClosedError",
    "EventQueue",
    "LocalProcessBackend",
    "PodBackend",
    "PodEvent",
    "PodExistsError",
    "PodPhase",
    "PodReason",
    "PodRole",
    "PodSpec",
    "PodStatus",
    "find_free_port",
    "pod_name",
    "release_ports",
]
