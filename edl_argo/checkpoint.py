"""Versioned checkpoints of one model holder, saved in the background and restored newest first.

A holder (a parameter server, the AllreduceStrategy group) keeps a :class:`CheckpointSeries`: one object
per saved version, ``<name>/version-{version:010d}.ckpt`` under a :class:`~edl_argo.storage.base.Storage`
(zero-padded versions make key order version order), each written atomically by ``Storage.write``. The
newest :data:`KEEP` are kept. What a checkpoint holds is the holder's business: the series stores bytes,
and :class:`Checkpointer` takes an ``encode`` function.

:class:`Checkpointer` writes in a background thread, one checkpoint at a time, so a holder only spends the
time to copy its state (the snapshot it submits), never the time to serialise or upload it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from edl_argo.errors import ConfigError, EdlError
from edl_argo.log import get_logger
from edl_argo.storage.base import Storage

log = get_logger(__name__)

#: Checkpoints kept per series; older ones are deleted after each save.
KEEP = 3
_VERSION_KEY = re.compile(r"^version-(\d{10})\.ckpt$")

Decoded = TypeVar("Decoded")


class Versioned(Protocol):
    """A snapshot of a holder's state: it knows the model version it is."""

    @property
    def version(self) -> int: ...


Snapshot = TypeVar("Snapshot", bound=Versioned)


def open_checkpoint_storage(checkpoint_dir: str | None, checkpoint_steps: int) -> Storage | None:
    """The storage of ``--checkpoint-dir`` (None without one); a :class:`ConfigError` for
    ``--checkpoint-steps`` without a ``--checkpoint-dir``."""
    if not checkpoint_dir:
        if checkpoint_steps > 0:
            raise ConfigError("--checkpoint-steps needs --checkpoint-dir: where should checkpoints go?")
        return None
    from edl_argo.storage import open_storage

    return open_storage(checkpoint_dir)


class CheckpointSeries:
    """The checkpoints named ``name`` in ``storage`` (e.g. ``ps-0``, ``allreduce``)."""

    def __init__(self, storage: Storage, name: str, keep: int = KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep {keep} checkpoints: need at least 1")
        self.storage = storage
        self.name = name
        self.keep = keep

    def key(self, version: int) -> str:
        """The storage key of the checkpoint at ``version``."""
        return f"{self.name}/version-{version:010d}.ckpt"

    def list(self) -> list[tuple[int, str]]:
        """``(version, key)`` of every checkpoint of the series, oldest first."""
        prefix = f"{self.name}/"
        found = []
        for info in self.storage.list(prefix):
            match = _VERSION_KEY.match(info.key[len(prefix) :]) if info.key.startswith(prefix) else None
            if match:
                found.append((int(match.group(1)), info.key))
        return sorted(found)

    def save(self, version: int, data: bytes) -> str:
        """Write ``data`` as the checkpoint at ``version`` (atomically), delete all but the newest
        :attr:`keep`; returns the key."""
        key = self.key(version)
        self.storage.write(key, data)
        for _, old in self.list()[: -self.keep]:
            self.storage.delete(old)
        return key

    def clear(self) -> int:
        """Delete every checkpoint of the series (only keys named like one: nothing else in the folder is
        touched); returns how many were deleted."""
        keys = [key for _, key in self.list()]
        for key in keys:
            self.storage.delete(key)
        return len(keys)

    def remove_abandoned_writes(self) -> int:
        """Remove the half-written checkpoints of writers killed mid-write (only once no holder of the
        series is running); returns how many were removed."""
        return self.storage.remove_abandoned_writes(self.name)

    def newest(self, decode: Callable[[bytes, str], Decoded]) -> Decoded | None:
        """The newest checkpoint that ``decode(data, url)`` accepts, or None when there is none.

        A checkpoint that cannot be read or that ``decode`` refuses (an :class:`EdlError`, e.g. a
        ``DataFormatError`` naming the URL) is skipped with a warning in favour of the next older one.
        """
        for version, key in reversed(self.list()):
            try:
                return decode(self.storage.read(key), self.storage.describe(key))
            except EdlError as error:
                log.warning("checkpoint_unreadable", key=key, version=version, reason=str(error))
        return None


class Checkpointer(Generic[Snapshot]):
    """Saves snapshots into ``series`` every ``every`` versions, in the background.

    Contract: :meth:`due` is true when the version has crossed a multiple of ``every`` since the last
    submitted snapshot and no save is running; :meth:`submit` starts saving ``encode(snapshot)`` and
    returns at once. A save that fails is logged (``checkpoint_failed``) and does not stop the holder; the
    next due version retries. Not thread-safe: the holder calls :meth:`due` and :meth:`submit` from one
    thread, or under its own lock.
    """

    def __init__(self, series: CheckpointSeries, every: int, encode: Callable[[Snapshot], bytes]) -> None:
        if every < 0:
            raise ValueError(f"checkpoint every {every} versions: need every >= 0")
        self.series = series
        self.every = every
        self._encode = encode
        #: The version of the last snapshot submitted (or restored).
        self.marked_version = 0
        #: The version of the last snapshot saved by this checkpointer (None: none yet).
        self.saved_version: int | None = None
        self._thread: threading.Thread | None = None

    def mark(self, version: int) -> None:
        """Record that the state at ``version`` is saved already (after a restore)."""
        self.marked_version = version

    @property
    def busy(self) -> bool:
        """Whether a save is running."""
        return self._thread is not None and self._thread.is_alive()

    def due(self, version: int) -> bool:
        """Whether a snapshot at ``version`` should be submitted now."""
        return self.every > 0 and not self.busy and version // self.every > self.marked_version // self.every

    def submit(self, snapshot: Snapshot) -> None:
        """Save ``snapshot`` in a background thread (waits for a running save first)."""
        self.wait()
        self.marked_version = snapshot.version
        self._thread = threading.Thread(
            target=self._save, args=(snapshot,), name=f"{self.series.name}-checkpoint", daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running save, if any; False if it is still running after ``timeout`` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy

    def _save(self, snapshot: Snapshot) -> None:
        start = time.monotonic()
        try:
            key = self.series.save(snapshot.version, self._encode(snapshot))
        except Exception as error:
            log.error(
                "checkpoint_failed", version=snapshot.version, reason=f"{type(error).__name__}: {error}"
            )
            return
        self.saved_version = snapshot.version
        log.info(
            "checkpoint_saved",
            key=self.series.storage.describe(key),
            version=snapshot.version,
            seconds=round(time.monotonic() - start, 3),
        )
