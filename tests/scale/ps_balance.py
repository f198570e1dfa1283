"""How evenly dense variables spread over parameter servers (issue 34, part 6): ``python -m
tests.scale.ps_balance [--output FILE]``.

Builds Keras applications' ResNet50 and a Transformer encoder without weights (nothing downloaded), takes
their dense trainable variables (name and bytes; an ``Embedding`` table's rows are placed by id instead),
and places
each as the PS do today (:func:`edl_argo.ps.partition.dense_owner`, a CRC-32 of the name) for 2 to 100
parameter servers. Prints a markdown table: bytes per PS, max/mean (1.0 is perfect balance), and the
share of the largest single variable (a floor no placement of whole variables can go below).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PS_COUNTS = (2, 4, 8, 10, 16, 32, 64, 100)


def variables_of(model: object) -> list[tuple[str, int]]:
    """``(name, bytes)`` of every dense trainable variable of a built Keras model, by its unique path.
    ``Embedding`` layers are left out: the PS serve them as tables whose rows are placed by id."""
    import keras

    embedded = {
        id(v)
        for layer in model.layers
        if isinstance(layer, keras.layers.Embedding)
        for v in layer.weights  # type: ignore[attr-defined]
    }
    return [
        (str(v.path), int(v.numpy().nbytes))
        for v in model.trainable_variables  # type: ignore[attr-defined]
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


def imbalance(variables: Sequence[tuple[str, int]], num_ps: int) -> tuple[float, list[int]]:
    """max/mean of the bytes per PS under today's placement, and the bytes per PS."""
    from edl_argo.ps.partition import dense_owner

    loads = [0] * num_ps
    for name, size in variables:
        loads[dense_owner(name, num_ps)] += size
    mean = sum(loads) / num_ps
    return max(loads) / mean, loads


def table(name: str, variables: Sequence[tuple[str, int]]) -> str:
    total = sum(size for _, size in variables)
    largest = max(size for _, size in variables)
    lines = [
        f"**{name}**: {len(variables)} dense trainable variables, {total / 2**20:.1f} MiB; the largest "
        f"{largest / 2**20:.1f} MiB ({100 * largest / total:.1f}%).",
        "",
        "| parameter servers | max/mean bytes per PS (CRC-32 of the name) | floor: largest variable / mean |",
        "|---|---|---|",
    ]
    for num_ps in PS_COUNTS:
        ratio, _ = imbalance(variables, num_ps)
        lines.append(f"| {num_ps} | {ratio:.2f} | {max(1.0, largest / (total / num_ps)):.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--output", help="write the markdown here too")
    args = parser.parse_args(argv)
    report = "\n\n".join(
        (table("ResNet50", resnet50()), table("Transformer encoder (6 × 512)", transformer_encoder()))
    )
    print(report)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            file.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
