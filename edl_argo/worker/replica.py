"""The worker's replica of the model: dense variables mirrored from the PS, embedding rows pulled per batch.

One training step (:meth:`ModelReplica.train_minibatch`): compute the loss and gradients (a
``tf.function``; embedding rows are pulled before it), push dense gradients, per-row embedding gradients
and how the forward pass changed the non-trainable variables. The push's reply carries the dense parameters
that changed on the PS (the step it completed, if it did), so the next step starts without a pull; a pull
happens only when a reply could not carry them (several synchronous PS not yet of one step), before the
first step and for evaluation. With synchronous SGD a push may be rejected as stale; its reply carries the
current parameters and the replica recomputes the same minibatch. What the worker does of the optimizer's
step (loss scaling, global clipping) is in :mod:`edl_argo.model.train_step`; which state lives where, in
:mod:`edl_argo.model.inventory`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from edl_argo.errors import JobFailedError
from edl_argo.log import get_logger
from edl_argo.model import ModelSpec
from edl_argo.model.inventory import ModelInventory
from edl_argo.model.optimizer import updates_elementwise
from edl_argo.model.outputs import num_records
from edl_argo.model.train_step import StepCall, WorkerSteps, fit_loss, ps_optimizer_factory
from edl_argo.worker.embedding import EmbeddingLookups, bind_embeddings
from edl_argo.worker.gradient_check import check_finite_gradients
from edl_argo.worker.ps_client import ParameterServerClient, PushResult

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


class StepSkipped(Exception):
    """The minibatch's scaled gradients overflowed under ``LossScaleOptimizer``'s dynamic loss scale: as
    ``fit`` does, nothing of it was applied (nothing pushed) and the scale was halved. ``loss`` is the
    minibatch's loss. The caller counts the minibatch as skipped, not trained."""

    def __init__(self, loss: float, loss_scale: float) -> None:
        self.loss = loss
        self.loss_scale = loss_scale
        super().__init__(f"gradients overflowed at loss scale {loss_scale:g}; step skipped, scale halved")


def build_model(spec: ModelSpec, sample_features: Any | None = None) -> keras.Model:
    """A fresh model from the model file, built, with the same variable names in every process."""
    # Keras's names restart; no full garbage collection (``free_memory``): in a process that holds many
    # objects (a master, an in-process command, a test process) it took up to 0.6 s a call.
    keras.utils.clear_session(free_memory=False)
    model = spec.custom_model()
    if not model.built and sample_features is not None:
        model(sample_features, training=False)
    return model


@dataclass(frozen=True)
class _Push:
    """What one minibatch sends to the PS (see :meth:`ParameterServerClient.push_gradients`)."""

    dense: dict[str, np.ndarray]
    sparse: dict[str, tuple[np.ndarray, np.ndarray]]
    #: How the forward pass changed each non-trainable variable (the PS adds it).
    state_changes: dict[str, np.ndarray]
    examples: int


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
        self._inventory = ModelInventory((), (), ())
        self._dense: list[keras.Variable] = []
        self._steps = WorkerSteps(spec.optimizer())
        # Whether the PS may hold big variables in pieces (edl_argo.ps.pieces): the PS's optimizer updates
        # elementwise.
        self._elementwise = updates_elementwise(ps_optimizer_factory(spec.optimizer)())
        self._lookups = EmbeddingLookups()
        self._tables: dict[str, Any] = {}
        # Versions of the parameters this replica holds (as pulled), and the newest version a push saw.
        self.versions = [-1] * ps.num_ps
        self.version = -1
        # The versions whose finalized values (EMA averages) the local model holds for predict(), if any.
        self._finalized_versions: list[int] | None = None
        # The parameters of the last pull or push reply are installed: the next step needs no pull.
        self._current = False
        #: The synchronous step PS 0 assigned to the last minibatch's accepted push (-1: none: asynchronous,
        #: or a step skipped under dynamic loss scaling); for :mod:`edl_argo.worker.step_trace`.
        self.last_update = -1

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
        self._inventory = inventory = ModelInventory.of(model)
        self._dense = list(inventory.trainable)
        self._tables = {spec.name: spec for spec in inventory.tables}
        bind_embeddings(model, self._lookups)
        self._model = model
        self._collect = StepCall(self._collect_ids)
        self._compute = StepCall(self._compute_gradients)
        self._forward = StepCall(self._forward_pass)
        if self._offer_model():
            log.info(
                "model_initialized_on_ps", variables=len(self._dense), state=len(inventory.non_trainable)
            )
        self.sync()

    def _offer_model(self) -> bool:
        """Offer this replica's parameters to every PS; True if any took them."""
        inventory = self._inventory
        return self._ps.push_model(
            inventory.values(inventory.trainable),
            inventory.tables,
            inventory.values(inventory.non_trainable),
            inventory.constraints(),
            elementwise=self._elementwise,
        )

    def sync(self) -> None:
        """Pull the dense parameters that changed since the last pull (or push reply)."""
        self._current = False
        self.flush()
        if self._finalized_versions is not None:  # predict() installed the EMA averages: pull every value
            self._finalized_versions = None
            self.versions = [-1] * self._ps.num_ps
        self._install(*self._fetch(self.versions))
        self._current = True

    def _fetch(self, versions: list[int]) -> tuple[dict[str, np.ndarray], list[int]]:
        """The dense parameters newer than ``versions`` (network only: safe on a background thread)."""
        values, new_versions, initialized = self._ps.pull_dense(versions)
        if not initialized:
            # A PS came back without a checkpoint: offer it this replica's parameters, then pull again.
            log.warning("ps_uninitialized_reoffering_model")
            self._offer_model()
            values, new_versions, initialized = self._ps.pull_dense([-1] * self._ps.num_ps)
            if not initialized:
                raise JobFailedError("a parameter server refuses the model; see its log")
        return values, new_versions

    def _install(self, values: dict[str, np.ndarray], versions: list[int]) -> None:
        """Load pulled parameters into the local model (on the thread that computes); the arrays are the
        pull's or push reply's own, given away."""
        self._inventory.assign(values, given=True)
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

    def _compute_gradients(
        self, features: Any, labels: Any, sample_weight: Any, rows: list[tf.Tensor]
    ) -> tuple[Any, ...]:
        """Loss, gradients (dense, None for a variable the loss does not reach; per pulled embedding row),
        whether they are finite, and how the forward pass changed each non-trainable variable. The local
        non-trainable variables are left as they were: their values come from the PS."""
        model, steps = self.model, self._steps
        state = self._inventory.non_trainable
        before = [tf.identity(v.value) for v in state]
        with tf.GradientTape() as tape:
            self._lookups.start("feed", rows, tape)
            outputs = model(features, training=True)
            loss = fit_loss(self._spec.loss, labels, outputs, sample_weight, model.losses)
            scaled = steps.scale_loss(loss)
        used = list(self._lookups.rows_used)
        positions = list(self._lookups.positions_used) if steps.needs_lookup_gradients else []
        self._lookups.tape = None
        grads = tape.gradient(scaled, [*self._dense, *used, *positions])
        n, m = len(self._dense), len(self._dense) + len(used)
        dense_grads, row_grads, finite = steps.finish(
            list(grads[:n]),
            [tf.convert_to_tensor(g) for g in grads[n:m]],
            [tf.convert_to_tensor(g) for g in grads[m:]],
        )
        changes = [v.value - value for v, value in zip(state, before, strict=True)]
        for variable, value in zip(state, before, strict=True):
            variable.assign(value)
        return loss, dense_grads, row_grads, finite, changes

    def _forward_pass(self, features: Any, rows: list[tf.Tensor]) -> Any:
        self._lookups.start("feed", rows)
        return self.model(features, training=False)

    def _gradients(self, features: Any, labels: Any, sample_weight: Any = None) -> tuple[float, _Push]:
        """The loss of one minibatch at the local parameters and what to push for it.

        Raises :class:`StepSkipped` when the step's gradients are not finite under dynamic loss scaling:
        the step is skipped and the scale halved, as Keras does."""
        tables, ids, rows = self._pull_rows(features)
        loss, dense_grads, row_grads, finite, changes = self._compute(features, labels, sample_weight, rows)
        loss_value = float(loss)
        if not np.isfinite(loss_value):
            raise NonFiniteLossError(loss_value, self.version)
        if not bool(finite) and self._steps.dynamic:
            scale = self._steps.dynamic_scale
            self._steps.step_done(finite=False)
            log.info("step_skipped_non_finite_gradients", loss_scale=scale)
            raise StepSkipped(loss_value, scale)
        # np.asarray: read-only views of the tensors' buffers (numpy() copies); the push copies them once.
        dense = {
            v.path: np.asarray(g) for v, g in zip(self._dense, dense_grads, strict=True) if g is not None
        }
        sparse = _merge_rows(tables, ids, [g.numpy() for g in row_grads])
        if not bool(finite):  # the step's graph checked them all: name the first variable at fault
            check_finite_gradients(dense, sparse, self.version)
        return loss_value, _Push(
            dense=dense,
            sparse=sparse,
            state_changes={
                v.path: np.asarray(c) for v, c in zip(self._inventory.non_trainable, changes, strict=True)
            },
            examples=num_records(features),
        )

    def train_minibatch(self, features: Any, labels: Any, sample_weight: Any = None) -> float:
        """One SGD step on one minibatch (weighted by ``sample_weight`` when given); returns its loss, or
        raises :class:`StepSkipped` (dynamic loss scaling overflowed: nothing pushed).

        Synchronous SGD: compute, push, install the parameters the push's reply carries (pull if it carries
        none), and recompute when the push is rejected as stale. Pipelined (asynchronous SGD only): the
        push of this step (whose reply carries the new parameters) runs in the background while the next
        minibatch is computed, so communication hides behind computation at the price of one more step of
        staleness. :meth:`flush` waits for them.
        """
        self.ensure_built(features)
        self.last_update = -1
        if self._pipeline is not None:
            if self._in_flight is None:
                self.sync()
            computed_at = list(self.versions)  # flush() installs newer parameters: not these gradients'
            loss_value, push = self._gradients(features, labels, sample_weight)
            self.flush()
            self._in_flight = self._pipeline.submit(
                self._push_and_pull, push, computed_at, list(self.versions)
            )
            return loss_value
        for _ in range(MAX_STALE_RETRIES):
            if not self._current:
                self.sync()
            self._current = False
            loss_value, push = self._gradients(features, labels, sample_weight)
            result = self._push(push, self.versions)
            if result.parameters is not None:
                self._install(*result.parameters)
                self._current = True
            if result.accepted:
                self.version = max(self.version, result.version)
                self.last_update = result.step if result.step > 0 else -1
                self._steps.step_done(finite=True)
                return loss_value
        raise JobFailedError(f"gradients rejected as stale {MAX_STALE_RETRIES} times in a row")

    def _push(self, push: _Push, versions: list[int]) -> PushResult:
        return self._ps.push_gradients(
            push.dense,
            push.sparse,
            versions,
            self._lr_scale,
            state_changes=push.state_changes,
            examples=push.examples,
            return_parameters=True,
        )

    def _push_and_pull(
        self, push: _Push, computed_at: list[int], held: list[int]
    ) -> tuple[dict[str, np.ndarray], list[int]]:
        """Push gradients computed from parameters of versions ``computed_at`` (their staleness is
        measured from there) and take the parameters the reply carries: every one, unless no PS moved past
        ``computed_at`` (then the versions ``held`` are current too); pull what changed since ``held`` if
        the reply carries none."""
        result = self._push(push, computed_at)
        if not result.accepted:
            raise JobFailedError("an asynchronous PS rejected gradients; is the PS in synchronous mode?")
        self._steps.step_done(finite=True)
        return result.parameters if result.parameters is not None else self._fetch(held)

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
        """The model's outputs with the latest parameters (no gradients). With an optimizer that keeps EMA
        averages, with the averages: the values ``fit`` ends with and the job exports."""
        self.ensure_built(features)
        if self._steps.keeps_averages and self._finalized_versions != self.versions:
            values, versions, _ = self._ps.pull_dense([-1] * self._ps.num_ps, finalized=True)
            self._current = False  # the next step pulls the trainable values back
            self._inventory.assign(values)
            self.versions = self._finalized_versions = versions
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
