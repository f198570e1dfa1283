"""The trained model, from the parameter servers to a SavedModel and a Keras file.

Layout of the published model tree (:meth:`Storage.put_tree`, see :mod:`edl_argo.storage.trees`)::

    <output>/model/_edl-tree.json             the pointer: names the current version, written last
    <output>/model/<version>/saved_model/     TensorFlow SavedModel (servable by TF Serving)
    <output>/model/<version>/model.keras      the Keras model (weights + architecture)
    <output>/model/<version>/metrics.json     final and per-evaluation metrics, accounting, relaunches, time
    <output>/model/<version>/flags.json       the job's configuration

``<version>`` is ``v-<UTC time>-<hex>``. **A published model is never lost:** a new one is uploaded beside
the previous one and the pointer's single atomic write switches to it, so a publish that fails or is killed
at any step leaves the previous model readable; the previous version is kept after the switch, older ones
are deleted. ``edl-argo evaluate`` and ``predict`` follow the pointer (a model of older edl-argo, without
one, is read as it is), build the model from the model file and load ``model.keras``'s weights into it
(:mod:`edl_argo.inference`); the SavedModel is for serving.

**Publishing that fails keeps the trained model.** If the tree cannot be published (the store stays
unreachable beyond the retry budget), the master puts the same tree under ``master/trained-model/`` of its
state storage (``--master-state``, by default ``--output``), keeps its state, and fails with exit code 1.
The next run of the same job (same name and settings) finds it and publishes it, without training again.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np

from edl_argo.errors import JobFailedError, StorageError
from edl_argo.json_values import dumps
from edl_argo.log import get_logger
from edl_argo.model import ModelSpec
from edl_argo.model.embedding_tables import embedding_layers
from edl_argo.model.inventory import ModelInventory
from edl_argo.storage import Storage
from edl_argo.worker.ps_client import ParameterServerClient
from edl_argo.worker.replica import build_model

log = get_logger(__name__)

MODEL_KEY = "model"
SAVED_MODEL_DIR = "saved_model"
KERAS_FILE = "model.keras"
METRICS_FILE = "metrics.json"
FLAGS_FILE = "flags.json"
#: Where a trained model that could not be published waits, in the master's state storage.
KEPT_MODEL_KEY = "master/trained-model"


class ModelNotPublishedError(JobFailedError):
    """Training finished but the model could not be published (exit code 1)."""


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
    """A Keras model holding an AllreduceStrategy member's state (model variables, then the optimizer's).

    With an optimizer that keeps moving averages (``use_ema``), the model holds the averages, as at the end
    of ``model.fit`` (``finalize_variable_values``).
    """
    model = build_model(spec, sample_features)
    if len(values) < len(model.variables):
        raise JobFailedError(
            f"the workers' state has {len(values)} variables, fewer than the model's {len(model.variables)}"
        )
    for variable, value in zip(model.variables, values, strict=False):
        variable.assign(value)
    optimizer = spec.optimizer()
    if getattr(optimizer, "use_ema", False):
        optimizer.build(model.trainable_variables)
        slots = values[len(model.variables) :]
        if len(slots) != len(optimizer.variables):
            raise JobFailedError(
                f"the workers' state has {len(slots)} optimizer variables, the model file's optimizer "
                f"{len(optimizer.variables)}"
            )
        for variable, value in zip(optimizer.variables, slots, strict=True):
            variable.assign(value)
        optimizer.finalize_variable_values(model.trainable_variables)
    return model


def write_model_tree(
    root: Path, model: keras.Model, metrics: Mapping[str, Any], flags: Mapping[str, Any]
) -> None:
    """The model tree's files (all but the marker) in the local folder ``root``."""
    model.export(str(root / SAVED_MODEL_DIR), format="tf_saved_model", verbose=False)
    model.save(root / KERAS_FILE)
    (root / METRICS_FILE).write_text(dumps(metrics, indent=2, sort_keys=True))
    (root / FLAGS_FILE).write_text(json.dumps(flags, indent=2, sort_keys=True))


def publish_model(
    storage: Storage,
    model: keras.Model,
    metrics: Mapping[str, Any],
    flags: Mapping[str, Any],
    keep_in: Storage | None = None,
) -> str:
    """Save ``model`` in both formats with its metrics and flags, and publish them all or nothing.

    If that fails and ``keep_in`` is given, the tree is kept there (:data:`KEPT_MODEL_KEY`) and
    :class:`ModelNotPublishedError` raised; without ``keep_in`` the StorageError propagates.
    """
    with tempfile.TemporaryDirectory(prefix="edl-export-") as tmp:
        root = Path(tmp)
        write_model_tree(root, model, metrics, flags)
        return _publish_tree(storage, root, keep_in)


def _publish_tree(storage: Storage, root: Path, keep_in: Storage | None) -> str:
    url = storage.describe(MODEL_KEY)
    try:
        storage.put_tree(root, MODEL_KEY)
    except StorageError as failure:
        if keep_in is None:
            raise
        kept = keep_in.describe(KEPT_MODEL_KEY)
        try:
            keep_in.put_tree(root, KEPT_MODEL_KEY)
        except StorageError as error:
            raise ModelNotPublishedError(
                f"training finished but publishing the model to {url} failed ({failure}), and keeping it at "
                f"{kept} failed too ({error})"
            ) from None
        log.error("model_kept", url=url, kept=kept, error=str(failure))
        raise ModelNotPublishedError(
            f"training finished but publishing the model to {url} failed ({failure}); the trained model is "
            f"kept at {kept}: run the job again to publish it without training"
        ) from None
    log.info("model_published", url=url)
    return url


def publish_kept_model(storage: Storage, keep_in: Storage) -> dict[str, Any] | None:
    """Publish the model an earlier run of the job kept in ``keep_in`` and remove it there; its metrics,
    or None if no model is kept. A failure to publish raises StorageError and keeps it; a run killed part-way
    leaves the kept model or the published one (or both: the next run publishes it again)."""
    if not keep_in.tree_complete(KEPT_MODEL_KEY):
        return None
    with tempfile.TemporaryDirectory(prefix="edl-kept-model-") as tmp:
        root = Path(tmp)
        keep_in.get_tree(KEPT_MODEL_KEY, root)
        metrics = json.loads((root / METRICS_FILE).read_text())
        _publish_tree(storage, root, keep_in=None)
    keep_in.remove_tree(KEPT_MODEL_KEY)
    log.info("kept_model_published", url=storage.describe(MODEL_KEY), kept=keep_in.describe(KEPT_MODEL_KEY))
    return metrics
