"""Ring allreduce (sum), independent of how bytes travel.

With ``n`` members the vector is cut into ``n`` segments. In ``n - 1`` *reduce-scatter* steps each member
sends one segment to its right neighbour and adds the segment it receives from its left one, so that
afterwards member ``r`` holds the complete sum of segment ``(r + 1) % n``; in ``n - 1`` *all-gather* steps the
complete segments travel once around the ring. Every member sends and receives ``2 (n - 1) / n`` times the
vector, whatever ``n`` is, and each segment's sum is computed by exactly one member and copied to the others,
so every member ends with bit-identical results.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: ``exchange(step, outgoing)``: send ``outgoing`` to the right neighbour as ring step ``step`` and return
#: what the left neighbour sent as the same step. Raises to abort the operation.
Exchange = Callable[[int, np.ndarray], np.ndarray]


def segment_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, end)`` ranges covering ``range(length)``; sizes differ by at most 1."""
    edges = np.linspace(0, length, parts + 1).round().astype(np.int64)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(parts)]


def ring_allreduce(vector: np.ndarray, rank: int, size: int, exchange: Exchange) -> np.ndarray:
    """The element-wise sum of every member's ``vector`` (1-D, same length and dtype everywhere).

    ``vector`` is not modified. With one member it is returned as a copy.
    """
    if vector.ndim != 1:
        raise ValueError(f"ring_allreduce takes a 1-D vector, got shape {vector.shape}")
    result = np.array(vector, copy=True)
    if size == 1:
        return result
    segments = segment_bounds(len(result), size)

    def view(index: int) -> np.ndarray:
        start, end = segments[index % size]
        return result[start:end]

    for step in range(size - 1):  # reduce-scatter
        received = exchange(step, view(rank - step))
        np.add(view(rank - step - 1), received, out=view(rank - step - 1))
    for step in range(size - 1):  # all-gather
        received = exchange(size - 1 + step, view(rank + 1 - step))
        view(rank - step)[:] = received
    return result
