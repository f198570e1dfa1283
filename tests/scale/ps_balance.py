"""How evenly dense variables spread over parameter servers (issue 34, part 6): ``python -m
tests.scale.ps_balance [--output FILE]``.

Builds Keras applications' ResNet50, a Transformer encoder and the benchmarks' 25 M-parameter MLP without
weights (nothing downloaded), takes the dense variables the PS hold (trainable and non-trainable, name and
bytes; an ``Embedding`` table's rows are placed by id instead), and places them on 2 to 100 parameter
servers as the PS do (:class:`edl_argo.ps.partition.DensePlacement`, by size) and as they did before
(a CRC-32 of the name). Prints a markdown table per model: the largest PS's bytes over the mean (1.0 is
perfect balance) under each rule, and the largest single variable over the mean (a floor no placement of
whole variables can go below).
"""

from __future__ import annotations

import argparse
import os
import zlib
from collections.abc import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PS_COUNTS = (2, 4, 8, 10, 16, 32, 64, 100)


def variables_of(model: object) -> list[tuple[str, int]]:
    """``(name, bytes)`` of every dense variable of a built Keras model, by its unique path. ``Embedding``
    layers are left out: the PS serve them as tables whose rows are placed by id."""
    import keras

    embedded = {
        id(v)
        for layer in model.layers
        if isinstance(layer, keras.layers.Embedding)
        for v in layer.weights  # type: ignore[attr-defined]
    }
    return [
        (str(v.path), int(v.numpy().nbytes))
        for v in model.weights  # type: ignore[attr-defined]
        if id(v) not in embedded
    ]


def resnet50() -> list[tuple[str, int]]:
    import keras

    return variables_of(keras.applications.ResNet50(weights=None))


def transformer_encoder(
    layers: int = 6, width: int = 512, heads: int = 8, vocabulary: int = 32_000
) -> list[tuple[str, int]]:
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


def big_mlp() -> list[tuple[str, int]]:
    from tests.bench.models.dense_suite import big_mlp as build

    return variables_of(build())


def by_size(variables: Sequence[tuple[str, int]], num_ps: int) -> list[int]:
    """Bytes per PS as the PS place dense variables."""
    from edl_argo.ps.partition import DensePlacement

    return DensePlacement.of(dict(variables), num_ps).bytes_per_ps()


def by_name(variables: Sequence[tuple[str, int]], num_ps: int) -> list[int]:
    """Bytes per PS as the PS placed dense variables before placement by size (commit 37a83bc and
    earlier): by ``zlib.crc32`` of the name, modulo the number of PS."""
    loads = [0] * num_ps
    for name, size in variables:
        loads[zlib.crc32(name.encode("utf-8")) % num_ps] += size
    return loads


def imbalance(loads: Sequence[int]) -> float:
    """The largest load over the mean."""
    return max(loads) / (sum(loads) / len(loads))


def table(name: str, variables: Sequence[tuple[str, int]]) -> str:
    total = sum(size for _, size in variables)
    largest = max(size for _, size in variables)
    lines = [
        f"**{name}**: {len(variables)} dense variables, {total / 2**20:.1f} MiB; the largest "
        f"{largest / 2**20:.1f} MiB ({100 * largest / total:.1f}%).",
        "",
        "| parameter servers | max/mean bytes per PS, by size | before: by a CRC-32 of the name | floor: "
        "largest variable / mean |",
        "|---|---|---|---|",
    ]
    for num_ps in PS_COUNTS:
        sized, named = imbalance(by_size(variables, num_ps)), imbalance(by_name(variables, num_ps))
        floor = max(1.0, largest / (total / num_ps))
        lines.append(f"| {num_ps} | {sized:.2f} | {named:.2f} | {floor:.2f} |")
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
