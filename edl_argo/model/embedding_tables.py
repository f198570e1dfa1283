"""The embedding tables of a model: its Keras ``Embedding`` layers, whose rows live on the parameter servers.

The worker routes their lookups through the PS (:mod:`edl_argo.worker.embedding`), the model's inventory
(:mod:`edl_argo.model.inventory`) sets them apart from the dense variables, and the export writes the
trained rows back into them (:mod:`edl_argo.master.export`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import keras


@dataclass(frozen=True)
class EmbeddingTableSpec:
    """What a PS needs to create the rows of one table lazily."""

    name: str
    dim: int
    dtype: str
    initializer: str  # JSON of keras.initializers.serialize(...)
    constraint: str = ""  # JSON of keras.constraints.serialize(...), empty for none


def embedding_layers(model: keras.Model) -> list[keras.layers.Embedding]:
    """Every ``Embedding`` layer of the model, nested ones included, in a stable order."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.Embedding)]


def table_specs(model: keras.Model) -> list[EmbeddingTableSpec]:
    return [
        EmbeddingTableSpec(
            name=layer.embeddings.path,
            dim=int(layer.output_dim),
            dtype=str(layer.embeddings.dtype),
            initializer=json.dumps(keras.initializers.serialize(layer.embeddings_initializer)),
            constraint=(
                json.dumps(keras.constraints.serialize(layer.embeddings.constraint))
                if layer.embeddings.constraint is not None
                else ""
            ),
        )
        for layer in embedding_layers(model)
    ]


def embedding_variable_paths(model: keras.Model) -> set[str]:
    return {layer.embeddings.path for layer in embedding_layers(model)}
