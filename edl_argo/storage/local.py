"""Storage in a local (or mounted network) folder.

Keys map to files below the root folder; "directories" exist only as parents of files. Atomicity comes from
``rename``: every write goes to a temporary sibling (a name starting with :data:`TEMP_PREFIX`) that is
fsynced and then renamed over the target; so :meth:`~edl_argo.storage.Storage.put_tree` switches to a new tree
version by renaming its pointer file into place (:mod:`edl_argo.storage.trees`). Temporary names never appear
in :meth:`LocalStorage.list`. A writer killed mid-write leaves its temporary behind;
:meth:`LocalStorage.remove_abandoned_writes` removes them once no writer is left. Deleting a file also
removes the folders it leaves empty (up to the root), so pruned versions leave no empty folders.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from edl_argo.errors import StorageError
from edl_argo.storage.base import (
    ObjectInfo,
    ObjectNotFoundError,
    Storage,
    check_range,
    normalize_key,
    normalize_prefix,
)

__all__ = ["TEMP_PREFIX", "LocalStorage"]

#: Name prefix of in-progress files and directories; never listed.
TEMP_PREFIX = ".edl-tmp-"


def _temp_sibling(path: Path, tag: str = "") -> Path:
    return path.with_name(f"{TEMP_PREFIX}{tag}{path.name}-{uuid.uuid4().hex[:12]}")


def _os_error(path: Path, exc: OSError, *, writing: bool = False) -> StorageError:
    """The StorageError of ``exc``, met reading (or ``writing``) ``path``: there is no file below a file, and
    none can be written there."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, (NotADirectoryError, FileExistsError)) and writing:  # its folder, or one above
        above = next((folder for folder in path.parents if folder.is_file()), None)
        if above is not None:
            return StorageError(f"cannot write {path}: {above} is a file, not a folder")
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return ObjectNotFoundError(f"no file at {path}")
    return StorageError(f"cannot access {path}: {reason}")


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse fsync on directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _version(st: os.stat_result) -> str:
    """The version token of a file: its size, modification time and inode (a rename-over makes a new one)."""
    return f"{st.st_size}-{st.st_mtime_ns}-{st.st_ino}"


def _remove(path: Path) -> None:
    """Remove a file or directory tree if it exists (a path below a regular file does not)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            path.unlink()


class LocalStorage(Storage):
    """Objects as files below ``root``; ``url`` (default: ``root``) is how messages name the root.

    The root need not exist: it reads as empty and is created by the first write.
    """

    def __init__(self, root: str | Path, *, url: str | None = None) -> None:
        self.root = Path(root).expanduser()
        self.url = url if url is not None else str(root)

    def _path(self, key: str, *, allow_empty: bool = False) -> Path:
        key = normalize_key(key, allow_empty=allow_empty)
        return self.root / key if key else self.root

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # Walk only the deepest directory that can hold matches; "a/b" matches "a/b.txt" and "a/b/c".
        rel = normalize_prefix(prefix)
        start = self._path(rel.rsplit("/", 1)[0] if "/" in rel else "", allow_empty=True)
        try:
            found = [info for info in self._walk(start) if info.key.startswith(rel)]
        except OSError as exc:
            raise _os_error(start, exc) from exc
        return sorted(found, key=lambda info: info.key)

    def check_reachable(self) -> None:
        """The root is a folder, or can be made one: no part of its path is a file, and its nearest existing
        folder can be looked into."""
        for folder in (self.root, *self.root.parents):
            try:
                mode = folder.stat().st_mode
            except (FileNotFoundError, NotADirectoryError):
                if folder.is_symlink():
                    raise StorageError(
                        f"{folder} is a link to {os.readlink(folder)}, which is not there"
                    ) from None
                continue  # not there yet: its parent decides
            except OSError as exc:
                raise _os_error(folder, exc) from exc
            if not stat.S_ISDIR(mode):
                raise StorageError(f"{folder} is a file, not a folder")
            return

    def _walk(self, directory: Path) -> Iterator[ObjectInfo]:
        """Every non-temporary file below ``directory``; nothing if it is missing."""
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if entry.name.startswith(TEMP_PREFIX):
                continue
            try:
                if entry.is_dir():
                    yield from self._walk(Path(entry.path))
                elif entry.is_file():
                    st = entry.stat()
                    yield ObjectInfo(
                        Path(entry.path).relative_to(self.root).as_posix(), st.st_size, _version(st)
                    )
            except FileNotFoundError:
                continue  # removed while listing

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except OSError as exc:
            raise _os_error(path, exc) from exc
        if not path.is_file():
            raise ObjectNotFoundError(f"no file at {path} (it is a directory)")
        return ObjectInfo(normalize_key(key), st.st_size, _version(st))

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._read(key, offset, length, None)

    def read_version(self, key: str, offset: int = 0, length: int | None = None, *, version: str) -> bytes:
        return self._read(key, offset, length, version)

    def _read(self, key: str, offset: int, length: int | None, version: str | None) -> bytes:
        """Read from the opened file; with ``version``, ObjectChangedError unless it is that version."""
        check_range(offset, length)
        path = self._path(key)
        try:
            with path.open("rb") as f:
                if version is not None:
                    self._check_version(key, _version(os.fstat(f.fileno())), version)  # the file read below
                f.seek(offset)
                return f.read(-1 if length is None else length)
        except IsADirectoryError:
            raise ObjectNotFoundError(f"no file at {path} (it is a directory)") from None
        except OSError as exc:
            raise _os_error(path, exc) from exc

    def write(self, key: str, data: bytes) -> None:
        self._replace(key, lambda f: f.write(data))

    def write_file(self, key: str, path: Path) -> None:
        def copy(target: BinaryIO) -> None:
            try:
                with Path(path).open("rb") as source:
                    shutil.copyfileobj(source, target, 1 << 20)
            except OSError as exc:
                raise StorageError(f"cannot read local file {path}: {exc.strerror or exc}") from exc

        self._replace(key, copy)

    def _replace(self, key: str, fill: Callable[[BinaryIO], object]) -> None:
        """Atomically replace the file of ``key`` with a temporary sibling that ``fill`` writes."""
        path = self._path(key)
        tmp = _temp_sibling(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with self._create(tmp) as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            _remove(tmp)
            if isinstance(exc, OSError):
                raise _os_error(path, exc, writing=True) from exc
            raise
        _fsync_dir(path.parent)

    @staticmethod
    def _create(tmp: Path) -> BinaryIO:
        """Open the new file ``tmp``; its folder is made again if a delete removed it as empty meanwhile."""
        try:
            return tmp.open("wb")
        except FileNotFoundError:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            return tmp.open("wb")

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # no such file
            return
        except OSError as exc:
            # Linux reports unlink() on a directory as EISDIR, macOS as EPERM.
            if not (exc.errno == errno.EPERM and path.is_dir()):
                raise _os_error(path, exc) from exc
            return
        self._remove_empty_parents(path.parent)

    def _remove_empty_parents(self, folder: Path) -> None:
        """Remove ``folder`` and its parents below the root while they are empty."""
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone, or not ours to remove): stop there
                return
            folder = folder.parent

    def remove_abandoned_writes(self, folder: str) -> int:
        directory = self._path(folder, allow_empty=True)
        try:
            abandoned = [entry.path for entry in os.scandir(directory) if entry.name.startswith(TEMP_PREFIX)]
        except (FileNotFoundError, NotADirectoryError):
            return 0
        except OSError as exc:
            raise _os_error(directory, exc) from exc
        for path in abandoned:
            _remove(Path(path))
        return len(abandoned)

    def download(self, key: str, path: Path) -> None:
        src = self._path(key)
        try:
            shutil.copyfile(src, path)
        except IsADirectoryError:
            raise ObjectNotFoundError(f"no file at {src} (it is a directory)") from None
        except OSError as exc:
            raise _os_error(src, exc) from exc
