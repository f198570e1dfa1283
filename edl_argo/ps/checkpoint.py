"""Checkpoints of one parameter server's whole state.

Parameter server ``ps_id`` keeps the :class:`~edl_argo.checkpoint.CheckpointSeries` ``ps-{ps_id}``
(objects ``ps-{ps_id}/version-{version:010d}.ckpt``, the newest three kept). A checkpoint is an
uncompressed ``.npz`` archive whose entry ``manifest`` (JSON as uint8) names the model version and, for
every dense variable, optimizer variable (slots and EMA averages included), non-trainable variable and
embedding table (ids, rows, slot rows, per-table optimizer scalars, initializer seed state), the entry
``a<N>`` that holds its array, the dense variables' constraints (JSON) and the model's dense layout (the
bytes of every dense variable of the model, which places them on the PS).

:func:`ps_checkpointer` writes in a background thread, so that a parameter server only holds its lock
while it copies its arrays (:meth:`Parameters.snapshot <edl_argo.ps.parameters.Parameters.snapshot>`),
never while it serialises or uploads them.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from edl_argo.checkpoint import Checkpointer, CheckpointSeries
from edl_argo.errors import DataFormatError
from edl_argo.ps.embedding_table import TableArrays
from edl_argo.ps.parameters import ParametersState, TableState
from edl_argo.storage.base import Storage

_FORMAT = 1


def ps_checkpoints(storage: Storage, ps_id: int) -> CheckpointSeries:
    """The checkpoints of parameter server ``ps_id`` in ``storage``."""
    return CheckpointSeries(storage, f"ps-{ps_id}")


def ps_checkpointer(storage: Storage, ps_id: int, every: int) -> Checkpointer[ParametersState]:
    """Saves parameter server ``ps_id``'s snapshots every ``every`` versions, in the background."""
    return Checkpointer(ps_checkpoints(storage, ps_id), every, encode_state)


def restore_latest(storage: Storage, ps_id: int) -> ParametersState | None:
    """The newest readable checkpoint of ``ps_id``, or None when there is none (unreadable ones skipped)."""
    return ps_checkpoints(storage, ps_id).newest(decode_state)


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
        "non_trainable": {name: ref(value) for name, value in state.non_trainable.items()},
        "constraints": state.constraints,
        "layout": state.layout,
        "tables": {
            name: {
                "dim": table.dim,
                "initializer": table.initializer,
                "constraint": table.constraint,
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
                # Absent from checkpoints written before non-trainable state and constraints lived on the PS.
                non_trainable={name: get(i) for name, i in manifest.get("non_trainable", {}).items()},
                constraints={str(k): str(v) for k, v in manifest.get("constraints", {}).items()},
                # Absent from checkpoints written while dense variables were placed by name.
                layout={str(k): int(v) for k, v in manifest.get("layout", {}).items()},
            )
    except (ValueError, KeyError, TypeError, OSError, EOFError) as error:
        raise DataFormatError(f"{source} is not a parameter-server checkpoint: {error}") from None


def _decode_table(table: dict[str, Any], get: Any) -> TableState:
    seed = table["seed_state"]
    return TableState(
        dim=int(table["dim"]),
        initializer=str(table["initializer"]),
        constraint=str(table.get("constraint", "")),
        dtype=str(table["dtype"]),
        arrays=TableArrays(
            ids=get(table["ids"]),
            values=get(table["values"]),
            slots={slot: get(i) for slot, i in table["slots"].items()},
        ),
        optimizer=[get(i) for i in table["optimizer"]],
        seed_state=None if seed is None else get(seed),
    )
