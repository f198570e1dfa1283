"""TEST-ONLY: the stand-in's object store (the etcd part): objects, resourceVersions, the event history.

Every change gets the next resourceVersion (one counter for all objects, as etcd's revision) and is
appended to a bounded history that watches read. A watch may resume from any version not older than the
history: older than that it gets 410 Gone, as from a real API server after compaction.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.k8s_stand_in.selectors import Requirement, matches

#: ``(resource, namespace, name)``: where an object lives.
ObjectKey = tuple[str, str, str]


@dataclass(frozen=True)
class StoredEvent:
    """One change: ``type`` ADDED, MODIFIED or DELETED; ``obj`` is a snapshot taken at the change."""

    resource_version: int
    type: str
    resource: str
    namespace: str
    obj: dict[str, Any]
    time: float


class Gone(Exception):
    """The requested resourceVersion is older than the history (HTTP 410)."""


class ObjectStore:
    """Objects by key, and the history of their changes. Use :attr:`lock` around compound operations;
    :attr:`changed` is notified after every change (and by :meth:`expire_watches`)."""

    def __init__(self, history: int = 10_000) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._objects: dict[ObjectKey, dict[str, Any]] = {}
        self._history: deque[StoredEvent] = deque(maxlen=history)
        self._revision = 0
        self._compacted = 0
        #: Incremented by :meth:`expire_watches`; a watch that sees it change ends.
        self.watch_generation = 0
        #: Every change ever made (never compacted), for tests and benchmarks.
        self.journal: list[StoredEvent] = []

    @property
    def revision(self) -> int:
        return self._revision

    def get(self, key: ObjectKey) -> dict[str, Any] | None:
        """The live object (mutate it only under :attr:`lock`, then :meth:`put` it)."""
        return self._objects.get(key)

    def items(
        self, resource: str, namespace: str | None = None
    ) -> Iterator[tuple[ObjectKey, dict[str, Any]]]:
        for key, obj in list(self._objects.items()):
            if key[0] == resource and (namespace is None or key[1] == namespace):
                yield key, obj

    def list(
        self, resource: str, namespace: str, selector: list[Requirement]
    ) -> tuple[list[dict[str, Any]], int]:
        """Copies of the matching objects, and the revision they are at."""
        with self.lock:
            found = [
                copy.deepcopy(obj)
                for _, obj in self.items(resource, namespace)
                if matches(selector, obj["metadata"].get("labels"))
            ]
            return found, self._revision

    def put(self, key: ObjectKey, obj: dict[str, Any], event_type: str) -> dict[str, Any]:
        """Store ``obj`` (ADDED or MODIFIED) at the next revision; returns a copy."""
        with self.lock:
            self._objects[key] = obj
            return self._record(key, obj, event_type)

    def remove(self, key: ObjectKey) -> dict[str, Any] | None:
        """Delete the object at ``key`` (a DELETED event); returns a copy, None if there was none."""
        with self.lock:
            obj = self._objects.pop(key, None)
            return None if obj is None else self._record(key, obj, "DELETED")

    def events_after(self, revision: int) -> list[StoredEvent]:
        """The changes after ``revision``, oldest first. Raises :class:`Gone` if some are forgotten."""
        with self.lock:
            if revision < self._compacted:
                raise Gone(f"too old resource version: {revision} ({self._compacted})")
            return [e for e in self._history if e.resource_version > revision]

    def compact(self) -> None:
        """Forget the history: a watch resuming from any earlier version gets 410 Gone."""
        with self.lock:
            self._history.clear()
            self._compacted = self._revision

    def expire_watches(self) -> None:
        """End every open watch (as a real API server does at its watch timeout)."""
        with self.changed:
            self.watch_generation += 1
            self.changed.notify_all()

    def _record(self, key: ObjectKey, obj: dict[str, Any], event_type: str) -> dict[str, Any]:
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        snapshot = copy.deepcopy(obj)
        if len(self._history) == self._history.maxlen:
            self._compacted = self._history[0].resource_version
        event = StoredEvent(self._revision, event_type, key[0], key[1], snapshot, time.time())
        self._history.append(event)
        self.journal.append(event)
        self.changed.notify_all()
        return copy.deepcopy(snapshot)
