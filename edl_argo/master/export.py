"""The trained model, from the parameter servers to a SavedModel and a Keras file.

Layout of the published model tree (one atomic :meth:`Storage.put_tree`)::

    <output>/model/saved_model/   TensorFlow SavedModel (servable by TF Serving)
    <output>/model/model.keras    the Keras model (weights + architecture)
    <output>/model/metrics.json   final and per-evaluation metrics, accounting, relaunches, wall time
    <output>/model/flags.json     the job's configuration
    <output>/model/_COMPLETE      written last
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import keras
import numpy as np

from edl_argo.errors import JobFailedError
from edl_argo.log import get_logger
from edl_argo.model import ModelSpec
from edl_argo.model.inventory import ModelInventory
from edl_argo.storage import Storage
from edl_argo.worker.embedding import embedding_layers
from edl_argo.worker.ps_client import ParameterServerClient
from edl_argo.worker.replica import build_model

log = get_logger(__name__)

MODEL_KEY = "model"
SAVED_MODEL_DIR = "saved_model"
KERAS_FILE = "model.keras"
METRICS_FILE = "metrics.json"
FLAGS_FILE = "flags.json"


def model_from_parameter_servers(
    spec: ModelSpec, ps: ParameterServerClient, sample_features: Any
) -> keras.Model:
    """A Keras model holding the PS's parameters as ``fit`` ends with them: dense variables (EMA averages
    when the optimizer keeps them), non-trainable variables and every embedding row."""
    model = build_model(spec, sample_features)
    values, _, _ = ps.pull_dense([-1] * ps.num_ps, finalized=True)
    ModelInventory.of(model).assign(values, complete=True)
    for layer in embedding_layers(model):
        rows, ids = ps.pull_embedding_table(layer.embeddings.path)
        if ids.size == 0:
            continue
        table = np.array(layer.embeddings.numpy())
        in_range = (ids >= 0) & (ids < table.shape[0])
        if not in_range.all():
            log.warning(
                "embedding_ids_out_of_range", table=layer.embeddings.path, count=int((~in_range).sum())
            )
        table[ids[in_range]] = rows[in_range]
        layer.embeddings.assign(table)
    return model


def model_from_state(spec: ModelSpec, values: list[np.ndarray], sample_features: Any) -> keras.Model:
    """A Keras model holding an AllreduceStrategy member's state (model variables come first in it)."""
    model = build_model(spec, sample_features)
    if len(values) < len(model.variables):
        raise JobFailedError(
            f"the workers' state has {len(values)} variables, fewer than the model's {len(model.variables)}"
        )
    for variable, value in zip(model.variables, values, strict=False):
        variable.assign(value)
    return model


def publish_model(
    storage: Storage, model: keras.Model, metrics: dict[str, Any], flags: dict[str, Any]
) -> str:
    """Save ``model`` in both formats with its metrics and flags, and publish them all or nothing."""
    with tempfile.TemporaryDirectory(prefix="edl-export-") as tmp:
        root = Path(tmp)
        model.export(str(root / SAVED_MODEL_DIR), format="tf_saved_model", verbose=False)
        model.save(root / KERAS_FILE)
        (root / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True, default=_json_default))
        (root / FLAGS_FILE).write_text(json.dumps(flags, indent=2, sort_keys=True))
        storage.put_tree(root, MODEL_KEY)
    url = storage.describe(MODEL_KEY)
    log.info("model_published", url=url)
    return url


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
