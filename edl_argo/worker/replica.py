"""The worker's replica of the model: dense variables mirrored from the PS, embedding rows pulled per batch.

One training step (:meth:`ModelReplica.train_minibatch`): pull the dense parameters that changed on the
PS, compute the loss and gradients (a ``tf.function``; embedding rows are pulled inside it), push dense
gradients and per-row embedding gradients. With synchronous SGD a push may be rejected as stale; the
replica then pulls again and recomputes the same minibatch.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from edl_argo.errors import JobFailedError
from edl_argo.log import get_logger
from edl_argo.model import ModelSpec
from edl_argo.worker.embedding import (
    EmbeddingLookups,
    bind_embeddings,
    embedding_variable_paths,
    table_specs,
)
from edl_argo.worker.ps_client import ParameterServerClient

log = get_logger(__name__)

#: How often a stale (rejected) minibatch is recomputed before the worker gives up on the task.
MAX_STALE_RETRIES = 100


class NonFiniteLossError(JobFailedError):
    """The loss of a minibatch is NaN or infinite; raised before anything of that minibatch is pushed.

    Retrying the task elsewhere cannot help: the worker skips the minibatch (``--nan-loss skip``) or
    reports the task as fatally failed, and the master fails the job (``--nan-loss fail``).
    """

    def __init__(self, loss: float, model_version: int) -> None:
        self.loss = loss
        self.model_version = model_version
        super().__init__(f"training loss became {self.loss_text} at model version {model_version}")

    @property
    def loss_text(self) -> str:
        """``NaN``, ``inf`` or ``-inf``."""
        return "NaN" if np.isnan(self.loss) else str(self.loss)


def build_model(spec: ModelSpec, sample_features: Any | None = None) -> keras.Model:
    """A fresh model from the model file, built, with the same variable names in every process."""
    keras.utils.clear_session()
    model = spec.custom_model()
    if not model.built and sample_features is not None:
        model(sample_features, training=False)
    return model


def dense_variables(model: keras.Model) -> list[keras.Variable]:
    """The trainable variables the PS keeps dense (everything but embedding tables), in a stable order."""
    tables = embedding_variable_paths(model)
    return [v for v in model.trainable_variables if v.path not in tables]


class ModelReplica:
    """The model as one worker sees it; parameters come from and gradients go to the parameter servers."""

    def __init__(
        self,
        spec: ModelSpec,
        ps: ParameterServerClient,
        learning_rate_scale: float = 1.0,
        pipelined: bool = False,
    ) -> None:
        self._spec = spec
        self._pipeline = ThreadPoolExecutor(max_workers=1) if pipelined else None
        self._in_flight: Future[tuple[dict[str, np.ndarray], list[int]]] | None = None
        self._ps = ps
        self._lr_scale = learning_rate_scale
        self._model: keras.Model | None = None
        self._dense: list[keras.Variable] = []
        self._by_name: dict[str, keras.Variable] = {}
        self._lookups = EmbeddingLookups()
        self._tables: dict[str, Any] = {}
        # Versions of the parameters this replica holds (as pulled), and the newest version a push saw.
        self.versions = [-1] * ps.num_ps
        self.version = -1

    @property
    def model(self) -> keras.Model:
        if self._model is None:
            raise RuntimeError("the replica is built on its first batch")
        return self._model

    def ensure_built(self, features: Any) -> None:
        """Build the model on the first batch, offer it to the PS (the first offer wins), then sync."""
        if self._model is not None:
            return
        model = build_model(self._spec, features)
        self._dense = dense_variables(model)
        self._by_name = {v.path: v for v in self._dense}
        initial = {v.path: np.asarray(v.numpy()) for v in self._dense}
        self._tables = {spec.name: spec for spec in table_specs(model)}
        bind_embeddings(model, self._lookups)
        self._model = model
        self._collect = tf.function(self._collect_ids, reduce_retracing=True)
        self._compute = tf.function(self._compute_gradients, reduce_retracing=True)
        self._forward = tf.function(self._forward_pass, reduce_retracing=True)
        if self._ps.push_model(initial, list(self._tables.values())):
            log.info("model_initialized_on_ps", variables=len(initial))
        self.sync()

    def sync(self) -> None:
        """Pull the dense parameters that changed since the last pull."""
        self.flush()
        self._install(*self._fetch(self.versions))

    def _fetch(self, versions: list[int]) -> tuple[dict[str, np.ndarray], list[int]]:
        """The dense parameters newer than ``versions`` (network only: safe on a background thread)."""
        values, new_versions, initialized = self._ps.pull_dense(versions)
        if not initialized:
            # A PS came back without a checkpoint: offer it this replica's parameters, then pull again.
            log.warning("ps_uninitialized_reoffering_model")
            current = {v.path: np.asarray(v.numpy()) for v in self._dense}
            self._ps.push_model(current, list(self._tables.values()))
            values, new_versions, initialized = self._ps.pull_dense([-1] * self._ps.num_ps)
            if not initialized:
                raise JobFailedError("a parameter server refuses the model; see its log")
        return values, new_versions

    def _install(self, values: dict[str, np.ndarray], versions: list[int]) -> None:
        """Load pulled parameters into the local model (on the thread that computes)."""
        unknown = set(values) - set(self._by_name)
        if unknown:
            raise JobFailedError(f"the PS holds variables this model lacks: {sorted(unknown)[:3]}")
        for name, value in values.items():
            self._by_name[name].assign(value)
        self.versions = versions
        self.version = max(self.version, *versions)

    def _collect_ids(self, features: Any) -> list[tf.Tensor]:
        """The unique ids of every embedding lookup of a forward pass (traced once per input shape)."""
        self._lookups.start("collect")
        self.model(features, training=False)
        return list(self._lookups.unique_ids)

    def _pull_rows(self, features: Any) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
        """The tables, unique ids and rows of every embedding lookup ``features`` makes."""
        if not self._tables:
            return [], [], []
        ids = [t.numpy() for t in self._collect(features)]
        tables = list(self._lookups.tables)
        return tables, ids, self._ps.pull_embeddings(list(zip(tables, ids, strict=True)), self._tables)

    def _compute_gradients(self, features: Any, labels: Any, rows: list[tf.Tensor]) -> tuple[Any, ...]:
        model = self.model
        with tf.GradientTape() as tape:
            self._lookups.start("feed", rows, tape)
            outputs = model(features, training=True)
            loss = self._spec.loss(labels, outputs)
            if model.losses:
                loss = loss + tf.add_n(model.losses)
        used = list(self._lookups.rows_used)
        self._lookups.tape = None
        grads = tape.gradient(loss, [*self._dense, *used])
        n = len(self._dense)
        dense_grads = [
            tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
            for v, g in zip(self._dense, grads[:n], strict=True)
        ]
        row_grads = [tf.convert_to_tensor(g) for g in grads[n:]]
        return loss, dense_grads, row_grads

    def _forward_pass(self, features: Any, rows: list[tf.Tensor]) -> Any:
        self._lookups.start("feed", rows)
        return self.model(features, training=False)

    def _gradients(self, features: Any, labels: Any) -> tuple[float, dict[str, np.ndarray], dict[str, Any]]:
        """Loss, dense gradients and per-table row gradients of one minibatch at the local parameters."""
        tables, ids, rows = self._pull_rows(features)
        loss, dense_grads, row_grads = self._compute(features, labels, rows)
        loss_value = float(loss)
        if not np.isfinite(loss_value):
            raise NonFiniteLossError(loss_value, self.version)
        dense = {v.path: g.numpy() for v, g in zip(self._dense, dense_grads, strict=True)}
        return loss_value, dense, _merge_rows(tables, ids, [g.numpy() for g in row_grads])

    def train_minibatch(self, features: Any, labels: Any) -> float:
        """One SGD step on one minibatch; returns its loss.

        Synchronous SGD: pull, compute, push, and recompute when the push is rejected as stale.
        Pipelined (asynchronous SGD only): the push of this step and the pull after it run in the
        background while the next minibatch is computed, so communication hides behind computation
        at the price of one more step of staleness. :meth:`flush` waits for them.
        """
        self.ensure_built(features)
        if self._pipeline is not None:
            if self._in_flight is None:
                self.sync()
            computed_at = list(self.versions)  # flush() installs newer parameters: not these gradients'
            loss_value, dense, sparse = self._gradients(features, labels)
            self.flush()
            self._in_flight = self._pipeline.submit(
                self._push_and_pull, dense, sparse, computed_at, list(self.versions)
            )
            return loss_value
        for _ in range(MAX_STALE_RETRIES):
            self.sync()
            loss_value, dense, sparse = self._gradients(features, labels)
            result = self._ps.push_gradients(dense, sparse, self.versions, self._lr_scale)
            if result.accepted:
                # The local parameters are still those pulled: the next sync() fetches this update.
                self.version = max(self.version, result.version)
                return loss_value
        raise JobFailedError(f"gradients rejected as stale {MAX_STALE_RETRIES} times in a row")

    def _push_and_pull(
        self,
        dense: dict[str, np.ndarray],
        sparse: dict[str, Any],
        computed_at: list[int],
        held: list[int],
    ) -> tuple[dict[str, np.ndarray], list[int]]:
        """Push gradients computed from parameters of versions ``computed_at`` (their staleness is
        measured from there), then pull what changed since the versions ``held`` now."""
        result = self._ps.push_gradients(dense, sparse, computed_at, self._lr_scale)
        if not result.accepted:
            raise JobFailedError("an asynchronous PS rejected gradients; is the PS in synchronous mode?")
        return self._fetch(held)

    def flush(self) -> None:
        """Wait until the gradients pushed in the background are applied, and load the new parameters."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self._install(*in_flight.result())

    def idle_step(self) -> bool:
        """Workers of a PS job do nothing without a task: the caller backs off."""
        return False

    def close(self) -> None:
        """Release this replica's threads and the PS client's (call :meth:`flush` first to wait for a push
        in flight)."""
        if self._pipeline is not None:
            self._pipeline.shutdown(wait=False)
        self._ps.close()

    def predict(self, features: Any) -> Any:
        """The model's outputs with the latest parameters (no gradients)."""
        self.ensure_built(features)
        return self._forward(features, self._pull_rows(features)[2])


def _merge_rows(
    tables: list[str], ids: list[np.ndarray], row_grads: list[np.ndarray]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per table, one ``(row_gradients, ids)``; lookups of one table in several places are concatenated."""
    merged: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for table, table_ids, grads in zip(tables, ids, row_grads, strict=True):
        values, id_lists = merged.setdefault(table, ([], []))
        values.append(grads)
        id_lists.append(table_ids)
    return {t: (np.concatenate(v), np.concatenate(i)) for t, (v, i) in merged.items()}
