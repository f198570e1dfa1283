"""Published trees (a model, predictions, a pipeline artifact): a new version beside the previous one, then
one small pointer object that names the current version, replaced by a single atomic write.

Layout of the tree at ``key``::

    key/_edl-tree.json                   the pointer, written last, in one atomic write (a PUT; a rename)
    key/v-20261125T143900Z-1a2b3c4d/...  the files of one published version, never rewritten

The pointer is JSON::

    {"format": "edl-argo-tree", "version": 1, "current": "v-20261125T143900Z-1a2b3c4d",
     "created": "2026-11-25T14:39:00Z", "files": {"model.keras": 29311, "saved_model/saved_model.pb": 8113}}

``files`` names every file of the version (paths relative to its folder) with its size.

**Guarantee.** Writing the pointer is the one switch from the previous tree to the new one. Until it is
written the previous tree is untouched, so a publish that fails or is killed at any point leaves the
previous tree readable (or, if there was none, no tree); once it is written, readers get the new tree.
**Pruning**, only after the switch: the previous version is kept (a reader that opened it just before the
switch can finish), every other version folder below ``key`` is deleted (older versions and what killed
publishes left). A publish that fails deletes what it wrote (best effort: the next publish prunes the rest).
Two writers of one tree must not run at the same time (the second would prune the first's version).

**Older trees.** A tree published by edl-argo before pointers (its files directly in ``key/``, then a
``_COMPLETE`` marker) is read as it is while no pointer exists. The first publish over it keeps those files
as the previous version; the next one deletes them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edl_argo.errors import StorageError
from edl_argo.log import get_logger
from edl_argo.storage.base import (
    TREE_COMPLETE_MARKER,
    ObjectNotFoundError,
    Storage,
    join_url,
    normalize_key,
    tree_files,
)
from edl_argo.storage.versions import VERSION_FOLDER, new_version_folder, objects_by_version, utc_now

__all__ = [
    "POINTER_NAME",
    "PublishedTree",
    "download_tree",
    "open_tree",
    "publish_tree",
    "remove_tree",
    "tree_complete",
]

log = get_logger(__name__)

#: The pointer's name in the tree's folder.
POINTER_NAME = "_edl-tree.json"
POINTER_FORMAT = "edl-argo-tree"
POINTER_VERSION = 1


@dataclass(frozen=True)
class PublishedTree:
    """The current version of the tree at ``key``: its files (relative path -> size) below ``folder``.

    ``current`` is the version folder's name, or "" for a tree published by older edl-argo (``folder`` is
    then ``key`` itself).
    """

    key: str
    folder: str
    current: str
    files: dict[str, int]

    def file_key(self, rel: str) -> str:
        """The storage key of the tree's file ``rel``."""
        return join_url(self.folder, rel)

    def pointer_bytes(self) -> bytes:
        document = {
            "format": POINTER_FORMAT,
            "version": POINTER_VERSION,
            "current": self.current,
            "created": utc_now(),
            "files": self.files,
        }
        return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode()


def _pointer_key(key: str) -> str:
    return join_url(key, POINTER_NAME)


def read_pointer(storage: Storage, key: str) -> PublishedTree | None:
    """The tree the pointer at ``key`` names; None if there is no pointer. StorageError naming the pointer's
    URL if it is not a valid pointer."""
    pointer = _pointer_key(key)
    try:
        data = storage.read(pointer)
    except ObjectNotFoundError:
        return None
    try:
        document: Any = json.loads(data)
        current = document["current"]
        files = document["files"]
        valid = (
            document.get("format") == POINTER_FORMAT
            and document.get("version") == POINTER_VERSION
            and isinstance(current, str)
            and VERSION_FOLDER.match(current) is not None
            and isinstance(files, dict)
            and all(isinstance(size, int) and size >= 0 for size in files.values())
        )
        if valid:
            files = {normalize_key(rel, allow_empty=False): size for rel, size in files.items()}
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, StorageError):
        valid = False
    if not valid:
        raise StorageError(
            f"{storage.describe(pointer)} is not a valid tree pointer (expected JSON naming a version folder "
            "v-<time>-<hex> and its files): publish the tree again"
        )
    return PublishedTree(key, join_url(key, current), current, files)


def open_tree(storage: Storage, key: str) -> PublishedTree:
    """The current version of the tree at ``key``: the one its pointer names, or an older edl-argo's tree
    read as it is. ObjectNotFoundError naming the URL if there is no complete tree."""
    tree = normalize_key(key)
    found = read_pointer(storage, tree)
    if found is not None:
        return found
    if not storage.exists(join_url(tree, TREE_COMPLETE_MARKER)):
        raise ObjectNotFoundError(
            f"no complete tree at {storage.describe(tree)} (no {POINTER_NAME} pointer, "
            f"nor a {TREE_COMPLETE_MARKER} marker of an older edl-argo)"
        )
    prefix = tree + "/" if tree else ""
    files = {}
    for info in storage.list(prefix):
        rel = normalize_key(info.key[len(prefix) :], allow_empty=False)
        if rel != TREE_COMPLETE_MARKER and not _in_version_folder(rel):  # not a newer publish's, killed
            files[rel] = info.size
    return PublishedTree(tree, tree, "", files)


def _in_version_folder(rel: str) -> bool:
    folder, separator, _ = rel.partition("/")
    return bool(separator) and VERSION_FOLDER.match(folder) is not None


def tree_complete(storage: Storage, key: str) -> bool:
    """Whether a complete tree (a pointer, or an older edl-argo's marker) is at ``key``."""
    tree = normalize_key(key)
    return storage.exists(_pointer_key(tree)) or storage.exists(join_url(tree, TREE_COMPLETE_MARKER))


def download_tree(storage: Storage, key: str, local_dir: Path) -> PublishedTree:
    """Download the current version of the tree at ``key`` into ``local_dir`` (created if needed).

    ObjectNotFoundError if there is no complete tree; StorageError naming the file if one is missing or
    has another size than the pointer says. A failed download may leave some files in ``local_dir``.
    """
    tree = open_tree(storage, key)
    for rel, size in sorted(tree.files.items()):
        target = Path(local_dir) / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create {target.parent}: {exc.strerror or exc}") from exc
        storage.download(tree.file_key(rel), target)
        if target.stat().st_size != size:
            raise StorageError(
                f"{storage.describe(tree.file_key(rel))} has {target.stat().st_size} bytes, the tree's "
                f"pointer says {size}: it changed after it was published"
            )
    return tree


def publish_tree(storage: Storage, local_dir: Path, key: str) -> PublishedTree:
    """Publish the files below ``local_dir`` as the new version of the tree at ``key`` (see the module
    docstring): upload them into a fresh version folder, write the pointer, then prune.

    StorageError (the previous tree untouched) if an upload or the pointer's write fails; a failure to
    prune is only logged, since the new tree stands.
    """
    tree = normalize_key(key, allow_empty=False)
    files = tree_files(local_dir)
    try:
        previous: PublishedTree | None = open_tree(storage, tree)
    except ObjectNotFoundError:
        previous = None
    except StorageError as error:  # an unreadable pointer is replaced; no version is pruned
        log.warning("tree_pointer_unreadable", url=storage.describe(tree), error=str(error))
        previous = PublishedTree(tree, tree, "?", {})
    current = new_version_folder()
    new = PublishedTree(tree, join_url(tree, current), current, {})
    written: list[str] = []
    try:
        for rel, path in files:
            written.append(new.file_key(rel))
            storage.write_file(new.file_key(rel), path)
            new.files[rel] = _size(path)
        storage.write(_pointer_key(tree), new.pointer_bytes())
    except Exception:
        _delete_best_effort(storage, reversed(written))
        raise
    _prune(storage, tree, new, previous)
    return new


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise StorageError(f"cannot read local file {path}: {exc.strerror or exc}") from exc


def _delete_best_effort(storage: Storage, keys: Any) -> None:
    """Delete ``keys``, stopping at the first failure (a store in trouble is not retried key after key)."""
    for key in keys:
        try:
            storage.delete(key)
        except StorageError as error:
            log.warning("tree_cleanup_failed", url=storage.describe(key), error=str(error))
            return


def _prune(storage: Storage, tree: str, new: PublishedTree, previous: PublishedTree | None) -> None:
    """After the switch to ``new``: delete every version folder but ``new``'s and ``previous``'s, and an
    older edl-argo's files once they are no longer the previous version."""
    if previous is not None and previous.current == "?":
        return  # which version the unreadable pointer named is unknown: keep them all
    keep = {new.current, previous.current if previous else ""}
    try:
        stale = [
            info.key
            for folder, infos in objects_by_version(storage, tree).items()
            if folder not in keep
            for info in infos
        ]
        if previous is not None and previous.current:  # an older edl-argo's tree is two versions back
            prefix = tree + "/"
            for info in storage.list(prefix):
                rel = info.key[len(prefix) :]
                if rel != POINTER_NAME and not _in_version_folder(rel):
                    stale.append(info.key)
        for key in sorted(stale, key=lambda k: not k.endswith(TREE_COMPLETE_MARKER)):  # a marker first
            storage.delete(key)
    except StorageError as error:  # the new tree stands; the next publish prunes what is left
        log.warning("tree_prune_failed", url=storage.describe(tree), error=str(error))


def remove_tree(storage: Storage, key: str) -> None:
    """Delete the tree at ``key``: its pointer (or marker) first, so that it is never seen half removed."""
    tree = normalize_key(key, allow_empty=False)
    storage.delete(_pointer_key(tree))
    storage.delete(join_url(tree, TREE_COMPLETE_MARKER))
    for info in storage.list(tree + "/"):
        storage.delete(info.key)
