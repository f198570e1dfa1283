"""The storage interface every part of edl-argo reads and writes through.

A :class:`Storage` is rooted at a URL (a local folder, or ``s3://bucket/prefix``). Keys are relative,
``/``-separated paths below that root. Implementations guarantee:

* **Atomic writes.** A reader sees either the previous content of a key or the whole new content, never a
  partial object. :meth:`Storage.put_tree` publishes a whole directory (a SavedModel, say) so that a reader
  either finds it complete or not at all; a failed upload leaves nothing behind.
* **Bounded retries.** Transient failures (connection reset, 5xx, throttling) are retried with backoff
  within a fixed budget, then raised as :class:`~edl_argo.errors.StorageError` naming the URL.
* **No secrets in messages.** Errors and logs name URLs and keys, never credentials.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object (file): its key relative to the storage root and its size in bytes."""

    key: str
    size: int


class Storage(abc.ABC):
    """Read, list and atomically write objects under one root URL."""

    #: The root URL, as given by the user (used in messages).
    url: str

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects whose key starts with ``prefix`` (recursively), sorted by key."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size of one object; :class:`StorageError` naming the URL if it does not exist."""

    @abc.abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` of an object (to its end when ``length`` is None).

        On object storage this is one ranged GET. Reading past the end returns what exists.
        """

    @abc.abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Atomically create or replace one object."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; removing a missing object is not an error."""

    @abc.abstractmethod
    def put_tree(self, local_dir: Path, key: str) -> None:
        """Publish the local directory ``local_dir`` under ``key``, all or nothing.

        Any previous tree at ``key`` is replaced. Readers check :meth:`tree_complete` before using it.
        """

    @abc.abstractmethod
    def get_tree(self, key: str, local_dir: Path) -> None:
        """Download the complete tree at ``key`` into ``local_dir`` (created if needed)."""

    def exists(self, key: str) -> bool:
        """Whether an object exists at ``key``."""
        from edl_argo.errors import StorageError

        try:
            self.stat(key)
        except StorageError:
            return False
        return True

    def tree_complete(self, key: str) -> bool:
        """Whether a tree published by :meth:`put_tree` is complete at ``key``."""
        return self.exists(_join(key, TREE_COMPLETE_MARKER))

    def describe(self, key: str = "") -> str:
        """The full URL of ``key``, for messages."""
        return _join(self.url, key) if key else self.url


#: Written last by :meth:`Storage.put_tree`; its presence means the tree is complete.
TREE_COMPLETE_MARKER = "_COMPLETE"


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)
