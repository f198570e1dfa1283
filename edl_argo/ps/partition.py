"""Which parameter server owns which parameter.

Workers and parameter servers both import these rules, so the placement they compute must not depend on
the process, the machine or the order in which a model lists its variables:

* dense variables (trainable and non-trainable) by their sizes (:class:`DensePlacement`): each PS holds
  about as many bytes as the others;
* embedding rows by their id modulo the number of parameter servers.

Changing either rule changes where every existing checkpoint's parameters live.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def _check_num_ps(num_ps: int) -> None:
    if num_ps < 1:
        raise ValueError(f"num_ps must be at least 1, got {num_ps}")


@dataclass(frozen=True)
class DensePlacement:
    """Which parameter server holds each dense variable of a model.

    Built by :meth:`of` from the model's *layout*, the bytes of each of its dense variables by name: the
    variables, largest first (equal sizes by name), each go to the PS that holds the fewest bytes so far
    (the lowest id among equals), a greedy bin packing. The placement is a function of the layout and the
    number of PS alone, so every worker and PS that knows the layout computes the same one, in any
    process and after any relaunch or restore of the same model with the same ``--num-ps``. Whole
    variables are placed: a variable larger than a PS's fair share leaves the others less to balance,
    unless the workers cut it into pieces first (:mod:`edl_argo.ps.pieces`), which the layout then names.
    """

    num_ps: int
    #: Bytes of every dense variable, by name.
    layout: Mapping[str, int]
    #: The PS id of every dense variable, by name.
    owners: Mapping[str, int]

    @classmethod
    def of(cls, layout: Mapping[str, int], num_ps: int) -> DensePlacement:
        """The placement of the variables of ``layout`` (name: bytes, each ``>= 0``) on ``num_ps`` PS."""
        _check_num_ps(num_ps)
        for name, size in layout.items():
            if size < 0:
                raise ValueError(f"dense variable {name!r} has a negative size, {size} bytes")
        loads = [(0, ps_id) for ps_id in range(num_ps)]  # a heap of (bytes held, PS id)
        owners: dict[str, int] = {}
        for name, size in sorted(layout.items(), key=lambda item: (-item[1], item[0])):
            held, ps_id = heapq.heappop(loads)
            owners[name] = ps_id
            heapq.heappush(loads, (held + size, ps_id))
        return cls(num_ps, dict(layout), owners)

    def owner(self, name: str) -> int:
        """The id of the PS that holds ``name``; KeyError for a name the layout does not have."""
        return self.owners[name]

    def held_by(self, ps_id: int) -> set[str]:
        """The names of the variables PS ``ps_id`` holds."""
        return {name for name, owner in self.owners.items() if owner == ps_id}

    def bytes_per_ps(self) -> list[int]:
        """The bytes each PS holds, in id order."""
        loads = [0] * self.num_ps
        for name, owner in self.owners.items():
            loads[owner] += self.layout[name]
        return loads

    def split(self, values: Mapping[str, T]) -> list[dict[str, T]]:
        """``values`` (by variable name) cut into one mapping per PS, in id order."""
        by_owner: list[dict[str, T]] = [{} for _ in range(self.num_ps)]
        for name, value in values.items():
            by_owner[self.owners[name]][name] = value
        return by_owner


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
