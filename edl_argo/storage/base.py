"""The storage interface every part of edl-argo reads and writes through.

A :class:`Storage` is rooted at a URL (a local folder, or ``s3://bucket/prefix``). Keys are relative,
``/``-separated paths below that root. Implementations guarantee:

* **Atomic writes.** A reader sees either the previous content of a key or the whole new content, never a
  partial object. :meth:`Storage.put_tree` publishes a whole directory (a model, say) as a new version
  beside the previous one, then switches to it with one atomic write (:mod:`edl_argo.storage.trees`): a
  reader finds the previous tree or the new one, complete, and a publish that fails or is killed at any
  point leaves the previous tree readable.
* **Bounded retries.** Transient failures (connection reset, 5xx, throttling) are retried with backoff
  within a fixed budget, then raised as :class:`~edl_argo.errors.StorageError` naming the URL.
* **No secrets in messages.** Errors and logs name URLs and keys, never credentials.
* **Keys stay below the root.** Keys are normalised by :func:`normalize_key`; a key with ``.`` or ``..``
  segments is rejected, so a key can never address anything outside the root.

A missing object raises :class:`ObjectNotFoundError` (a :class:`~edl_argo.errors.StorageError`); every
other failure (denied, unreachable, missing bucket) raises a plain ``StorageError``, so that
:meth:`Storage.exists` answers ``False`` only when the object is really absent.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

from edl_argo.errors import StorageError

#: The key :meth:`Storage.check_reachable` asks about (it need not exist).
REACHABILITY_PROBE_KEY = "model"


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object (file): its key relative to the storage root and its size in bytes."""

    key: str
    size: int
    #: What identifies this content of the object, to pin it: the ETag on S3; size, modification time and
    #: inode of a local file. Rewriting the object changes it. Empty when unknown; not compared by ``==``.
    version: str = field(default="", compare=False)


class ObjectNotFoundError(StorageError):
    """No object exists at the key (the location itself is reachable and readable)."""


class ObjectChangedError(StorageError):
    """The object is no longer the version a reader pinned (it was replaced or rewritten)."""


class Storage(abc.ABC):
    """Read, list and atomically write objects under one root URL."""

    #: The root URL, as given by the user (used in messages).
    url: str

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects whose key starts with ``prefix`` (recursively), sorted by key."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size of one object; :class:`ObjectNotFoundError` naming the URL if it does not exist."""

    @abc.abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` of an object (to its end when ``length`` is None).

        On object storage this is one ranged GET. Reading past the end returns what exists (possibly
        ``b""``); a missing object raises :class:`ObjectNotFoundError`. Negative values raise ValueError.
        """

    def read_version(self, key: str, offset: int = 0, length: int | None = None, *, version: str) -> bytes:
        """Like :meth:`read`, but only from the content ``version`` (an :attr:`ObjectInfo.version` that
        :meth:`stat` or :meth:`list` reported): :class:`ObjectChangedError` naming the URL if the object was
        replaced since. This default costs a :meth:`stat` before and after the read; backends that learn
        the version with the read itself override it."""
        self._check_version(key, self.stat(key).version, version)
        data = self.read(key, offset, length)
        self._check_version(key, self.stat(key).version, version)
        return data

    def _check_version(self, key: str, found: str, pinned: str) -> None:
        if found != pinned:
            raise ObjectChangedError(
                f"{self.describe(key)} changed since it was pinned (version {pinned}, now {found})"
            )

    @abc.abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Atomically create or replace one object."""

    def write_file(self, key: str, path: Path) -> None:
        """Atomically create or replace one object with the content of the local file ``path``.

        Backends stream the file (memory does not grow with its size); this default reads it whole.
        StorageError naming ``path`` if it cannot be read.
        """
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read local file {path}: {exc.strerror or exc}") from exc
        self.write(key, data)

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; removing a missing object is not an error."""

    def download(self, key: str, path: Path) -> None:
        """Write the content of object ``key`` to the local file ``path`` (replaced if it exists).

        Backends stream it (memory does not grow with its size); this default reads it whole.
        """
        data = self.read(key)
        try:
            Path(path).write_bytes(data)
        except OSError as exc:
            raise StorageError(f"cannot write local file {path}: {exc.strerror or exc}") from exc

    def put_tree(self, local_dir: Path, key: str) -> None:
        """Publish the local directory ``local_dir`` as the new version of the tree at ``key``.

        Its files go into a fresh version folder beside the previous tree, then one pointer object naming
        that folder is written atomically: the switch. If it fails (StorageError) or is killed at any point,
        the previous tree at ``key`` (or none) is what readers get, untouched. After the switch the previous
        version is kept and older ones are deleted. ``key`` must not be empty. See
        :mod:`edl_argo.storage.trees`.
        """
        from edl_argo.storage.trees import publish_tree

        publish_tree(self, local_dir, key)

    def get_tree(self, key: str, local_dir: Path) -> None:
        """Download the current version of the tree at ``key`` into ``local_dir`` (created if needed).

        ``key`` may be empty: the storage root itself is the tree (a model URL opened directly). A tree
        published by older edl-argo (files and a ``_COMPLETE`` marker, no pointer) is read as it is; the
        marker itself is not copied. Raises :class:`ObjectNotFoundError` if there is no complete tree at
        ``key``. A failed download may leave some files in ``local_dir``.
        """
        from edl_argo.storage.trees import download_tree

        download_tree(self, key, local_dir)

    def remove_tree(self, key: str) -> None:
        """Delete the tree at ``key``, unpublishing it first (its pointer or marker), then its files."""
        from edl_argo.storage.trees import remove_tree

        remove_tree(self, key)

    def remove_abandoned_writes(self, folder: str) -> int:
        """Remove what writers killed mid-write left directly in ``folder`` (never a published object);
        returns how many were removed. Call it only when no writer to ``folder`` is left. Object stores
        publish an object in one request, so by default there is nothing to remove."""
        return 0

    def exists(self, key: str) -> bool:
        """Whether an object exists at ``key``. Failures other than "not found" raise StorageError."""
        try:
            self.stat(key)
        except ObjectNotFoundError:
            return False
        return True

    def check_reachable(self) -> None:
        """Reach the storage now, so that a command fails before its work and not after it: a missing
        bucket, a denial, an unreachable endpoint or a local root that is a file raise the one-line
        :class:`~edl_argo.errors.StorageError` a write would meet later. Writes nothing."""
        self.exists(REACHABILITY_PROBE_KEY)

    def tree_complete(self, key: str) -> bool:
        """Whether a tree published by :meth:`put_tree` (or by older edl-argo) is complete at ``key``."""
        from edl_argo.storage.trees import tree_complete

        return tree_complete(self, key)

    def describe(self, key: str = "") -> str:
        """The full URL of ``key``, for messages."""
        return join_url(self.url, key) if key else self.url


#: Written last by edl-argo's :meth:`Storage.put_tree` before version pointers; its presence means such an
#: older tree is complete (it is still read as it is).
TREE_COMPLETE_MARKER = "_COMPLETE"


def join_url(url: str, *parts: str) -> str:
    """``url`` and ``parts`` joined with single slashes; empty parts are skipped.

    ``join_url("s3://b/p/", "a", "/c")`` is ``"s3://b/p/a/c"``. Works for keys, paths and URLs alike.
    """
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate((url, *parts)) if p)


def normalize_key(key: str, *, allow_empty: bool = True) -> str:
    """``key`` without leading, trailing or doubled slashes; StorageError if it could leave the root.

    Keys may not contain ``.`` or ``..`` segments, backslashes or NUL characters. The empty key (the
    root itself) is rejected unless ``allow_empty``.
    """
    segments = [s for s in key.split("/") if s]
    if any(s in (".", "..") for s in segments) or "\\" in key or "\0" in key:
        raise StorageError(
            f"invalid storage key {key!r}: keys are relative '/'-separated paths without '.' or '..'"
        )
    if not segments and not allow_empty:
        raise StorageError("invalid storage key '': a key naming an object or a tree is required")
    return "/".join(segments)


def normalize_prefix(prefix: str) -> str:
    """A :meth:`Storage.list` prefix normalised like a key, keeping a trailing ``/`` if it has one."""
    rel = normalize_key(prefix)
    return rel + "/" if rel and prefix.endswith("/") else rel


def check_range(offset: int, length: int | None) -> None:
    """ValueError unless ``offset >= 0`` and ``length`` is None or ``>= 0`` (a caller's bug, not input)."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError(f"invalid byte range offset={offset} length={length}")


def tree_files(local_dir: Path) -> list[tuple[str, Path]]:
    """The files below ``local_dir`` as sorted ``(relative key, path)`` pairs, for :meth:`Storage.put_tree`.

    Everything that is not a directory counts as a file (a dangling symlink too, so that it fails loudly
    when read rather than vanishing from the tree). StorageError if ``local_dir`` is not a directory.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise StorageError(f"cannot publish {root}: not a directory")
    return sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*") if not p.is_dir())
