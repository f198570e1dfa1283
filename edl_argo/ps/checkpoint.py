"""Checkpoints of one parameter server's whole state.

A checkpoint is one object, ``ps-{ps_id}/version-{version:010d}.ckpt``, written atomically through
:meth:`Storage.write <edl_argo.storage.base.Storage.write>`: an uncompressed ``.npz`` archive whose entry
``manifest`` (JSON as uint8) names the model version and, for every dense variable, optimizer variable and
embedding table (ids, rows, slot rows, per-table optimizer scalars, initializer seed state), the entry
``a<N>`` that holds its array. Zero-padded versions make key order version order. The newest
:data:`KEEP` checkpoints of a server are kept.

:class:`Checkpointer` writes in a background thread, one checkpoint at a time, so that a parameter server
only holds its lock while it copies its arrays (:meth:`Parameters.snapshot
<edl_argo.ps.parameters.Parameters.snapshot>`), never while it serialises or uploads them.
"""

from __future__ import annotations

import io
import json
import re
import threading
import time
from typing import Any

import numpy as np

from edl_argo.errors import DataFormatError, EdlError
from edl_argo.log import get_logger
from edl_argo.ps.embedding_table import TableArrays
from edl_argo.ps.parameters import ParametersState, TableState
from edl_argo.storage.base import Storage

log = get_logger(__name__)

#: Checkpoints kept per parameter server; older ones are deleted after each save.
KEEP = 3
_FORMAT = 1
_KEY = re.compile(r"^ps-(\d+)/version-(\d{10})\.ckpt$")


def checkpoint_key(ps_id: int, version: int) -> str:
    """The storage key of parameter server ``ps_id``'s checkpoint at ``version``."""
    return f"ps-{ps_id}/version-{version:010d}.ckpt"


def encode_state(state: ParametersState) -> bytes:
    """Serialise a state as described in the module's docstring."""
    arrays: list[np.ndarray] = []

    def ref(array: np.ndarray) -> int:
        arrays.append(np.asarray(array))
        return len(arrays) - 1

    manifest = {
        "format": _FORMAT,
        "version": state.version,
        "dense": {name: ref(value) for name, value in state.dense.items()},
        "dense_optimizer": [ref(value) for value in state.dense_optimizer],
        "tables": {
            name: {
                "dim": table.dim,
                "initializer": table.initializer,
                "dtype": table.dtype,
                "ids": ref(table.arrays.ids),
                "values": ref(table.arrays.values),
                "slots": {slot: ref(value) for slot, value in table.arrays.slots.items()},
                "optimizer": [ref(value) for value in table.optimizer],
                "seed_state": None if table.seed_state is None else ref(table.seed_state),
            }
            for name, table in state.tables.items()
        },
    }
    buffer = io.BytesIO()
    entries = {f"a{i}": array for i, array in enumerate(arrays)}
    np.savez(buffer, manifest=np.frombuffer(json.dumps(manifest).encode("utf-8"), dtype=np.uint8), **entries)
    return buffer.getvalue()


def decode_state(data: bytes, source: str = "checkpoint") -> ParametersState:
    """Parse :func:`encode_state`'s output; :class:`DataFormatError` naming ``source`` if it is not one."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            manifest = json.loads(archive["manifest"].tobytes().decode("utf-8"))
            if manifest.get("format") != _FORMAT:
                raise ValueError(f"unknown format {manifest.get('format')!r}")

            def get(index: int) -> np.ndarray:
                return archive[f"a{index}"]

            return ParametersState(
                version=int(manifest["version"]),
                dense={name: get(i) for name, i in manifest["dense"].items()},
                dense_optimizer=[get(i) for i in manifest["dense_optimizer"]],
                tables={name: _decode_table(table, get) for name, table in manifest["tables"].items()},
            )
    except (ValueError, KeyError, TypeError, OSError, EOFError) as error:
        raise DataFormatError(f"{source} is not a parameter-server checkpoint: {error}") from None


def _decode_table(table: dict[str, Any], get: Any) -> TableState:
    seed = table["seed_state"]
    return TableState(
        dim=int(table["dim"]),
        initializer=str(table["initializer"]),
        dtype=str(table["dtype"]),
        arrays=TableArrays(
            ids=get(table["ids"]),
            values=get(table["values"]),
            slots={slot: get(i) for slot, i in table["slots"].items()},
        ),
        optimizer=[get(i) for i in table["optimizer"]],
        seed_state=None if seed is None else get(seed),
    )


def list_checkpoints(storage: Storage, ps_id: int) -> list[tuple[int, str]]:
    """``(version, key)`` of every checkpoint of ``ps_id``, oldest first."""
    found = []
    for info in storage.list(f"ps-{ps_id}/"):
        match = _KEY.match(info.key)
        if match and int(match.group(1)) == ps_id:
            found.append((int(match.group(2)), info.key))
    return sorted(found)


def save(storage: Storage, ps_id: int, state: ParametersState, keep: int = KEEP) -> str:
    """Write ``state`` atomically, delete all but the newest ``keep`` checkpoints; returns the key."""
    key = checkpoint_key(ps_id, state.version)
    storage.write(key, encode_state(state))
    for _, old in list_checkpoints(storage, ps_id)[:-keep]:
        storage.delete(old)
    return key


def restore_latest(storage: Storage, ps_id: int) -> ParametersState | None:
    """The newest readable checkpoint of ``ps_id``, or None when there is none.

    A checkpoint that cannot be read or parsed is skipped (with a warning) in favour of the next older one.
    """
    for version, key in reversed(list_checkpoints(storage, ps_id)):
        try:
            return decode_state(storage.read(key), storage.describe(key))
        except EdlError as error:
            log.warning("checkpoint_unreadable", key=key, version=version, reason=str(error))
    return None


class Checkpointer:
    """Saves snapshots of one parameter server every ``every`` versions, in the background.

    Contract: :meth:`due` is true when the version has crossed a multiple of ``every`` since the last
    submitted snapshot and no save is running; :meth:`submit` starts saving and returns at once. A save
    that fails is logged (``checkpoint_failed``) and does not stop the server; the next due version
    retries. Not thread-safe: the parameter server calls :meth:`due` and :meth:`submit` under its lock.
    """

    def __init__(self, storage: Storage, ps_id: int, every: int, keep: int = KEEP) -> None:
        if every < 0 or keep < 1:
            raise ValueError(f"checkpoint every {every} versions, keeping {keep}: need every >= 0, keep >= 1")
        self.storage = storage
        self.ps_id = ps_id
        self.every = every
        self.keep = keep
        #: The version of the last snapshot submitted (or restored).
        self.marked_version = 0
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

    def submit(self, state: ParametersState) -> None:
        """Save ``state`` in a background thread (waits for a running save first)."""
        self.wait()
        self.marked_version = state.version
        self._thread = threading.Thread(
            target=self._save, args=(state,), name=f"ps-{self.ps_id}-checkpoint", daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running save, if any; False if it is still running after ``timeout`` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy

    def _save(self, state: ParametersState) -> None:
        start = time.monotonic()
        try:
            key = save(self.storage, self.ps_id, state, self.keep)
        except Exception as error:
            log.error("checkpoint_failed", version=state.version, reason=f"{type(error).__name__}: {error}")
            return
        log.info(
            "checkpoint_saved",
            key=self.storage.describe(key),
            version=state.version,
            seconds=round(time.monotonic() - start, 3),
        )
