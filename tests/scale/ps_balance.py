"""How evenly dense variables spread over parameter servers (issue 34, part 6): ``python -m
tests.scale.ps_balance [--output FILE]``.

Builds Keras applications' ResNet50, a Transformer encoder and the benchmarks' 25 M-parameter MLP without
weights (nothing downloaded), takes the dense variables the PS hold (trainable and non-trainable, name,
shape and dtype; an ``Embedding`` table's rows are placed by id instead), and places them on 2 to 100
parameter servers as the PS do with an elementwise optimizer such as Adam (big trainable variables cut into
pieces of rows first, :mod:`edl_argo.ps.pieces`), as they do whole (with any other optimizer, and before
pieces: :class:`edl_argo.ps.partition.DensePlacement`, by size) and as they did before that (a CRC-32 of
the name). Prints a markdown table per model: the largest PS's bytes over the mean (1.0 is perfect
balance) under each rule, the largest single variable over the mean (a floor no placement of whole
variables can go below), and how many variables the first rule cuts into how many pieces.
"""

from __future__ import annotations

import argparse
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PS_COUNTS = (2, 4, 8, 10, 16, 32, 64, 100)


@dataclass(frozen=True)
class Variable:
    """A dense variable as the placement rules see it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool

    @property
    def nbytes(self) -> int:
        import numpy as np

        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def variables_of(model: object) -> list[Variable]:
    """Every dense variable of a built Keras model, by its unique path. ``Embedding`` layers are left out:
    the PS serve them as tables whose rows are placed by id."""
    import keras

    embedded = {
        id(v)
        for layer in model.layers
        if isinstance(layer, keras.layers.Embedding)
        for v in layer.weights  # type: ignore[attr-defined]
    }
    return [
        Variable(str(v.path), tuple(v.shape), str(v.dtype), bool(v.trainable))
        for v in model.weights  # type: ignore[attr-defined]
        if id(v) not in embedded
    ]


def resnet50() -> list[Variable]:
    import keras

    return variables_of(keras.applications.ResNet50(weights=None))


def transformer_encoder(
    layers: int = 6, width: int = 512, heads: int = 8, vocabulary: int = 32_000
) -> list[Variable]:
    import keras

    tokens = keras.Input(shape=(128,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, width)(tokens)
    for _ in range(layers):
        attended = keras.layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = keras.layers.LayerNormalization()(x + attended)
        hidden = keras.layers.Dense(4 * width, activation="relu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(hidden))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x))
    return variables_of(keras.Model(tokens, outputs))


def big_mlp() -> list[Variable]:
    from tests.bench.models.dense_suite import big_mlp as build

    return variables_of(build())


def in_pieces(variables: Sequence[Variable], num_ps: int) -> tuple[list[int], int, int]:
    """Bytes per PS as the PS place dense variables with an elementwise optimizer (trainable variables
    without a constraint may be cut; these models have none), the variables cut and their pieces."""
    import numpy as np

    from edl_argo.ps.pieces import DensePieces

    shapes = {v.name: (v.shape, np.dtype(v.dtype)) for v in variables}
    pieces = DensePieces.of(shapes, {v.name for v in variables if v.trainable}, num_ps)
    cut = sum(len(p) for p in pieces.pieces.values())
    return pieces.placement.bytes_per_ps(), len(pieces.pieces), cut


def by_size(variables: Sequence[Variable], num_ps: int) -> list[int]:
    """Bytes per PS as the PS place whole dense variables."""
    from edl_argo.ps.partition import DensePlacement

    return DensePlacement.of({v.name: v.nbytes for v in variables}, num_ps).bytes_per_ps()


def by_name(variables: Sequence[Variable], num_ps: int) -> list[int]:
    """Bytes per PS as the PS placed dense variables before placement by size (commit 37a83bc and
    earlier): by ``zlib.crc32`` of the name, modulo the number of PS."""
    loads = [0] * num_ps
    for v in variables:
        loads[zlib.crc32(v.name.encode("utf-8")) % num_ps] += v.nbytes
    return loads


def imbalance(loads: Sequence[int]) -> float:
    """The largest load over the mean."""
    return max(loads) / (sum(loads) / len(loads))


def table(name: str, variables: Sequence[Variable]) -> str:
    total = sum(v.nbytes for v in variables)
    largest = max(v.nbytes for v in variables)
    lines = [
        f"**{name}**: {len(variables)} dense variables, {total / 2**20:.1f} MiB; the largest "
        f"{largest / 2**20:.1f} MiB ({100 * largest / total:.1f}%).",
        "",
        "| parameter servers | max/mean bytes per PS: in pieces (Adam, ...) | variables cut (pieces) | "
        "whole, by size | floor of whole: largest variable / mean | before: by a CRC-32 of the name |",
        "|---|---|---|---|---|---|",
    ]
    for num_ps in PS_COUNTS:
        loads, cut, pieces = in_pieces(variables, num_ps)
        sized, named = imbalance(by_size(variables, num_ps)), imbalance(by_name(variables, num_ps))
        floor = max(1.0, largest / (total / num_ps))
        lines.append(
            f"| {num_ps} | {imbalance(loads):.2f} | {cut} ({pieces}) | {sized:.2f} | {floor:.2f} "
            f"| {named:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--output", help="write the markdown here too")
    args = parser.parse_args(argv)
    report = "\n\n".join(
        (
            table("ResNet50", resnet50()),
            table("Transformer encoder (6 × 512)", transformer_encoder()),
            table("25 M-parameter MLP (the benchmarks' big_mlp)", big_mlp()),
        )
    )
    print(report)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            file.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
