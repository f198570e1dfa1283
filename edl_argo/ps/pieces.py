"""Big dense variables cut into row ranges ("pieces") that parameter servers hold as ordinary variables.

:class:`~edl_argo.ps.partition.DensePlacement` places whole variables, so a variable larger than a PS's
fair share leaves that PS with more than the others (the benchmarks' 25 M-parameter MLP on 2 PS: 1.32
times the mean). :meth:`DensePieces.of` cuts such variables into pieces of rows (below), each a dense
variable of its own to the PS, placed like any other; the PS know nothing of pieces beyond their names.
The workers' client (:mod:`edl_argo.worker.ps_client`) cuts values and gradients into pieces as it pushes
them and joins pieces into whole variables as it reads pulls and push replies (:func:`join`), so nothing
above it sees a piece.

The rule is a function of the variables' names, shapes and dtypes, of which of them may be cut and of the
number of PS alone, so every worker, the master and every PS (after a relaunch or a restore with the same
``--num-ps``) agree on the pieces:

* with one PS, or when whole variables already place within :data:`BALANCED_ENOUGH` of the mean, nothing
  is cut (a cut variable costs the worker a copy when it joins the pieces);
* otherwise every variable that may be cut and holds more than the *target* bytes,
  ``max(MIN_PIECE_BYTES, total / (PIECES_PER_PS * num_ps))``, is cut into ``ceil(bytes / target)`` pieces
  (at most one per row) of equal rows, give or take one: pieces of at most a quarter of a PS's fair share
  pack within about a quarter of it (largest first), and a small model is never shredded.

The *rows* of a variable are those of its value viewed as a matrix of its last axis's width (``value.reshape(
-1, shape[-1])``; a vector's rows are its elements): a matrix's rows along axis 0, and for a convolution's
kernel ``(height, width, in, out)`` its ``height * width * in`` rows of ``out``, so that a 1x1 convolution
can be cut too. A piece is a contiguous range of the variable's memory (a view) and has that matrix's
width.

Which variables may be cut is the caller's: only those whose update is elementwise, so that updating
each piece on its own is updating the variable
(:func:`edl_argo.model.optimizer.updates_elementwise`; never a variable with a constraint, which may
take a norm over axis 0).

A piece of variable ``NAME`` of shape ``(d0, ..., dn)`` holding rows ``[start, stop)`` is named
``NAME#rows<start>-<stop>of<d0>x...x<dn>`` (:attr:`Piece.name`): a client that pulls (the master's, for
export) joins pieces by their names alone.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from edl_argo.ps.partition import DensePlacement
from edl_argo.rpc.rope import aligned_empty

#: Pieces are never smaller than this (bytes), so a small model's variables stay whole.
MIN_PIECE_BYTES = 1 << 20
#: The target piece is this fraction of a PS's fair share: pieces pack within about that much of it.
PIECES_PER_PS = 4
#: Nothing is cut when whole variables place with the largest PS within this factor of the mean.
BALANCED_ENOUGH = 1.1

#: A variable's shape and dtype, all the rule looks at.
Shapes = Mapping[str, tuple[tuple[int, ...], np.dtype]]

_PIECE_NAME = re.compile(r"^(?P<variable>.+)#rows(?P<start>\d+)-(?P<stop>\d+)of(?P<shape>\d+(?:x\d+)*)$")


class MissingPieceError(ValueError):
    """Pieces of a variable that do not make it whole (one is missing, or they overlap)."""


def _rows(shape: tuple[int, ...]) -> int:
    """How many rows a variable of ``shape`` (rank >= 1) has (see the module)."""
    return math.prod(shape[:-1]) if len(shape) > 1 else shape[0]


def _as_rows(value: np.ndarray) -> np.ndarray:
    """``value`` (C-contiguous, rank >= 1) as its rows: a view."""
    return value.reshape(-1, value.shape[-1]) if value.ndim > 1 else value


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of dense variable ``variable`` of shape ``shape`` (see the module)."""

    variable: str
    start: int
    stop: int
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        """The name the PS hold this piece by."""
        return f"{self.variable}#rows{self.start}-{self.stop}of{'x'.join(map(str, self.shape))}"

    @property
    def rows(self) -> int:
        """The rows of the whole variable."""
        return _rows(self.shape)

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """The shape of this piece's value."""
        rows = self.stop - self.start
        return (rows,) if len(self.shape) == 1 else (rows, self.shape[-1])

    @classmethod
    def parse(cls, name: str) -> Piece | None:
        """The piece ``name`` names, or None for the name of a whole variable."""
        match = _PIECE_NAME.match(name)
        if match is None:
            return None
        shape = tuple(int(size) for size in match["shape"].split("x"))
        return cls(match["variable"], int(match["start"]), int(match["stop"]), shape)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class DensePieces:
    """The dense variables of a model as the PS hold them: whole, or cut into pieces (see the module)."""

    #: The pieces of every variable that is cut, in row order, by variable name.
    pieces: Mapping[str, tuple[Piece, ...]]
    #: Where the PS hold what: by the bytes of every whole variable and every piece, by the name they
    #: hold it by (the ``dense_layout`` every PS is told).
    placement: DensePlacement

    @classmethod
    def of(cls, shapes: Shapes, splittable: Collection[str], num_ps: int) -> DensePieces:
        """The pieces of the variables of ``shapes`` (by name), of which ``splittable`` may be cut, on
        ``num_ps`` PS. ValueError for a variable named like a piece."""
        for name in shapes:
            if Piece.parse(name) is not None:
                raise ValueError(f"dense variable {name!r} is named like a piece of a variable")
        whole = {name: _nbytes(shape, dtype) for name, (shape, dtype) in shapes.items()}
        placement = DensePlacement.of(whole, num_ps)
        total = sum(whole.values())
        if num_ps == 1 or max(placement.bytes_per_ps()) <= BALANCED_ENOUGH * total / num_ps:
            return cls({}, placement)
        target = max(MIN_PIECE_BYTES, math.ceil(total / (PIECES_PER_PS * num_ps)))
        pieces: dict[str, tuple[Piece, ...]] = {}
        for name in sorted(set(splittable) & set(shapes)):
            shape, _ = shapes[name]
            if not shape or whole[name] <= target:
                continue
            rows = _rows(shape)
            count = min(rows, math.ceil(whole[name] / target))
            if count < 2:
                continue
            bounds = [index * rows // count for index in range(count + 1)]
            pieces[name] = tuple(Piece(name, a, b, tuple(shape)) for a, b in itertools.pairwise(bounds))
        layout = {name: size for name, size in whole.items() if name not in pieces}
        for name, cut in pieces.items():
            row_bytes = whole[name] // cut[0].rows
            layout.update({piece.name: (piece.stop - piece.start) * row_bytes for piece in cut})
        return cls(pieces, DensePlacement.of(layout, num_ps))

    @property
    def layout(self) -> Mapping[str, int]:
        """The bytes of every whole variable and piece by the name the PS hold it by."""
        return self.placement.layout

    def split(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``values`` by model name as the PS hold them: each cut variable's value replaced by its pieces
        (row views, no copy), the others as they are."""
        held: dict[str, np.ndarray] = {}
        for name, value in values.items():
            cut = self.pieces.get(name)
            if cut is None:
                held[name] = value
                continue
            if np.shape(value) != cut[0].shape:
                raise ValueError(
                    f"dense variable {name!r} has shape {list(np.shape(value))}, "
                    f"its pieces {list(cut[0].shape)}"
                )
            rows = _as_rows(value)
            held.update({piece.name: rows[piece.start : piece.stop] for piece in cut})
        return held


def join(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``values`` by the names the PS hold them by, as values by model name: the pieces of each cut
    variable copied once, in row order, into aligned memory of its own (read-only, like
    :func:`~edl_argo.rpc.rope.read_tensor_rope`'s arrays); the other arrays as they are.

    :class:`MissingPieceError` when the pieces of a variable do not cover its rows exactly once, do not
    agree in its shape or dtype, or come with a whole value of that variable.
    """
    joined: dict[str, np.ndarray] = {}
    cut: dict[str, list[tuple[Piece, np.ndarray]]] = {}
    for name, value in values.items():
        piece = Piece.parse(name)
        if piece is None:
            joined[name] = value
        else:
            cut.setdefault(piece.variable, []).append((piece, value))
    for variable, parts in cut.items():
        if variable in joined:
            raise MissingPieceError(f"dense variable {variable!r} arrived both whole and in pieces")
        joined[variable] = _joined(variable, parts)
    return joined


def _joined(variable: str, parts: list[tuple[Piece, np.ndarray]]) -> np.ndarray:
    parts = sorted(parts, key=lambda part: part[0].start)
    shape, dtype = parts[0][0].shape, parts[0][1].dtype
    rows = _rows(shape)
    covered = 0
    for piece, value in parts:
        if piece.shape != shape:
            raise MissingPieceError(
                f"dense variable {variable!r}: pieces of shapes {list(shape)} and {list(piece.shape)}"
            )
        if piece.start != covered:
            gap = (
                f"rows {covered}-{piece.start}"
                if piece.start > covered
                else f"rows {piece.start}-{covered} twice"
            )
            raise MissingPieceError(f"dense variable {variable!r}: pieces do not cover {gap} of {rows}")
        if value.shape != piece.piece_shape or value.dtype != dtype:
            raise MissingPieceError(
                f"dense variable {variable!r}: piece {piece.name!r} is "
                f"{value.dtype.name}{list(value.shape)}, not {dtype.name}{list(piece.piece_shape)}"
            )
        covered = piece.stop
    if covered != rows:
        raise MissingPieceError(
            f"dense variable {variable!r}: pieces do not cover rows {covered}-{rows} of {rows}"
        )
    whole = np.frombuffer(aligned_empty(_nbytes(shape, dtype)), dtype=dtype).reshape(shape)
    as_rows = _as_rows(whole)
    for piece, value in parts:
        as_rows[piece.start : piece.stop] = value
    whole.flags.writeable = False
    return whole
