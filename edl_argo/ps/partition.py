"""Which parameter server owns which parameter.

Workers and parameter servers both import these functions, so the placement they compute must not depend
on the process: dense variables are placed by a CRC-32 of their name (Python's ``hash()`` is salted per
process and must never be used here), embedding rows by their id modulo the number of parameter servers.
Changing either rule changes where every existing checkpoint's parameters live.
"""

from __future__ import annotations

import zlib

import numpy as np


def _check_num_ps(num_ps: int) -> None:
    if num_ps < 1:
        raise ValueError(f"num_ps must be at least 1, got {num_ps}")


def dense_owner(name: str, num_ps: int) -> int:
    """The id (``0 <= id < num_ps``) of the parameter server that owns the dense variable ``name``.

    Stable across processes, machines and Python versions: ``zlib.crc32(name.encode("utf-8")) % num_ps``.
    """
    _check_num_ps(num_ps)
    return zlib.crc32(name.encode("utf-8")) % num_ps


def embedding_owner(ids: np.ndarray, num_ps: int) -> np.ndarray:
    """The owning parameter server of each embedding id, as an int64 array shaped like ``ids``.

    Ids are taken as int64; negative ids are placed by the floor modulo (``np.mod``), so every id has
    an owner in ``[0, num_ps)``.
    """
    _check_num_ps(num_ps)
    return np.mod(np.asarray(ids, dtype=np.int64), num_ps)


def partition_ids(ids: np.ndarray, num_ps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split a 1-D batch of ids by owner.

    Returns ``num_ps`` pairs ``(positions, owned_ids)``: entry ``p`` holds the int64 positions in ``ids``
    of the ids parameter server ``p`` owns, in their original order, and those ids
    (``owned_ids == ids[positions]``). Entries of parameter servers that own none of the ids are empty.
    Scattering each server's answer back to ``positions`` restores the batch's order.
    """
    flat = np.asarray(ids, dtype=np.int64)
    if flat.ndim != 1:
        raise ValueError(f"ids must be one-dimensional, got shape {flat.shape}")
    owners = embedding_owner(flat, num_ps)
    order = np.argsort(owners, kind="stable")
    bounds = np.cumsum(np.bincount(owners, minlength=num_ps))[:-1]
    return [(positions, flat[positions]) for positions in np.split(order, bounds)]
