"""ParameterServerStrategy gives the model ``model.fit`` gives (issue 21).

Each case is a small model file under ``tests/parity_models/``, written as a user would, trained twice on
the same rows in the same order: once with ``model.fit`` in this process, once as an edl-argo job (1
worker, no shuffling; 2 PS where a feature spans PS). Every variable of the exported ``model.keras`` must
equal ``fit``'s, and the SavedModel's outputs the exported model's, within float32 tolerance: ``RTOL``
relative, plus ``ATOL`` absolute for values near zero (the PS applies Keras's update math in its own
XLA-compiled graph, so results differ from ``fit``'s only by float32 rounding, which a few dozen steps
amplify to ~1e-6).

One job serves several features at once (a job costs seconds of process start-up):

* ``dense_state`` (2 PS, each holding one of the BatchNormalization statistics): BatchNormalization, a
  NonNeg constraint, an L2 regularizer, a weight without gradient, AdamW with a schedule, weight decay,
  EMA and ``loss_scale_factor``, a partial last minibatch; evaluation during training sees the exported
  values;
* ``embedding_clip`` (2 PS): ``global_clipnorm`` over dense and embedding gradients of both PS, with
  ``LossScaleOptimizer``, and a per-row constraint on the embedding table;
* ``weighted``: a ``feed`` yielding sample weights, with ``--grads-to-wait 2`` and minibatches of unequal
  sizes (``fit`` with twice the batch size is the same model).

With 2 and 3 workers (``--grads-to-wait`` = workers), the job is compared with a plain-Keras replay of the
steps the PS applied, as the step trace recorded them (:mod:`parity_replay`).
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from engine_helpers import model_dir, read_metrics
from parity_replay import (
    ATOL,
    MODELS,
    ROWS,
    RTOL,
    assert_equals_replay,
    mixes_workers,
    run_traced_job,
    run_until_mixed,
)
from parity_replay import EPOCHS as TRACED_EPOCHS

from edl_argo.data.commands import write_dataset
from edl_argo.master.config import TrainConfig
from edl_argo.master.export import KERAS_FILE, SAVED_MODEL_DIR
from edl_argo.master.job import TrainingJob
from edl_argo.model import Mode, ModelSpec, load_model_spec
from edl_argo.model.train_step import ps_optimizer_factory
from edl_argo.recordio import Compressor
from edl_argo.storage import LocalStorage

#: Outputs computed in float16 (its machine epsilon is 9.8e-4): a few ulps.
FLOAT16_RTOL = 1e-2
FLOAT16_ATOL = 5e-3
#: float32 variables trained on float16 gradients: the worker's graph and fit's may round a float16
#: intermediate differently, by CPU (measured: 7.5e-7 on an Intel Xeon with AVX-512, 3.2e-4 on an AMD EPYC).
#: A step skipped at another time than fit's, or a gradient left scaled, is 10 times more.
FLOAT16_GRADIENT_RTOL = 2e-3
FLOAT16_GRADIENT_ATOL = 1e-3
EPOCHS = 3


@dataclass(frozen=True)
class Case:
    """One job and the ``fit`` it must equal."""

    model: str
    rows: int
    minibatch_size: int = 8
    #: ``fit``'s batch size (the job's minibatch times ``grads_to_wait`` when pushes are averaged).
    fit_batch_size: int = 8
    #: The module under ``parity_models`` whose ``records(count)`` makes the rows.
    data: str = "parity_data"
    job: dict[str, Any] = field(default_factory=dict)


CASES = {
    # 100 rows in minibatches of 8: the last of each epoch has 4.
    "dense_state": Case("dense_state.py", rows=100, job={"num_ps": 2}),
    "embedding_clip": Case("embedding_clip.py", rows=100, job={"num_ps": 2}),
    # 92 rows: 11 minibatches of 8 and one of 4; pushed in pairs: fit's 5 batches of 16 and one of 12.
    "weighted": Case("weighted.py", rows=92, fit_batch_size=16, job={"num_ps": 1, "grads_to_wait": 2}),
    # ElasticDL's MNIST model's shape: convolutions, BatchNormalization, Dropout (the same masks as fit).
    "conv_dropout": Case("conv_dropout.py", rows=100, data="conv_dropout", job={"num_ps": 2}),
    # LossScaleOptimizer's dynamic scale skips, halves and grows (an overflow forced on some minibatches).
    "loss_scale": Case("loss_scale.py", rows=100, job={"num_ps": 1}),
    # float16 compute, float32 variables, a dynamic loss scale; over 2 PS.
    "mixed_precision": Case("mixed_precision.py", rows=100, job={"num_ps": 2}),
}


@dataclass
class Trained:
    """What a case produced: the job's exported model and metrics, and ``fit``'s model."""

    spec: ModelSpec
    records: list[bytes]
    exported: keras.Model
    saved_model: Any
    metrics: dict[str, Any]
    fitted: keras.Model
    initial: dict[str, np.ndarray]


def _dataset(spec: ModelSpec, records: list[bytes], mode: str, batch: int) -> tf.data.Dataset:
    dataset = tf.data.Dataset.from_tensor_slices(tf.constant(records, dtype=tf.string))
    return spec.feed(dataset, mode, None).batch(batch)


def _fit(spec: ModelSpec, records: list[bytes], batch: int) -> tuple[keras.Model, dict[str, np.ndarray]]:
    keras.utils.clear_session(free_memory=False)
    model = spec.custom_model()
    initial = {v.path: np.array(v.numpy()) for v in model.weights}
    model.compile(optimizer=spec.optimizer(), loss=spec.loss)
    model.fit(_dataset(spec, records, Mode.TRAINING, batch), epochs=EPOCHS, shuffle=False, verbose=0)
    return model, initial


@functools.cache
def _trained(name: str, root: Path) -> Trained:
    case = CASES[name]
    spec = load_model_spec(str(MODELS / case.model))
    records = importlib.import_module(f"parity_models.{case.data}").records(case.rows)
    data = root / name / "data"
    write_dataset(LocalStorage(data), "train", records, 1, Compressor.NONE, overwrite=False)
    output = root / name / "out"
    config = TrainConfig(
        model_def=str(MODELS / case.model),
        training_data=str(data / "train"),
        validation_data=str(data / "train"),
        output=str(output),
        job_name=f"parity-{name}",
        num_epochs=EPOCHS,
        minibatch_size=case.minibatch_size,
        num_minibatches_per_task=4,
        num_workers=1,
        shuffle=False,
        **case.job,
    )
    TrainingJob.load(config).run()
    fitted, initial = _fit(spec, records, case.fit_batch_size)
    exported = keras.saving.load_model(model_dir(output) / KERAS_FILE, compile=False)
    saved_model = tf.saved_model.load(str(model_dir(output) / SAVED_MODEL_DIR))
    return Trained(spec, records, exported, saved_model, read_metrics(output), fitted, initial)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("parity")
    return lambda name: _trained(name, root)


def assert_variables_equal_fit(result: Trained, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every variable of the exported model equals fit's (same paths, same values)."""
    exported = {v.path: np.asarray(v.numpy()) for v in result.exported.weights}
    fitted = {v.path: np.asarray(v.numpy()) for v in result.fitted.weights}
    assert sorted(exported) == sorted(fitted)
    differences = {
        path: float(np.max(np.abs(exported[path] - fitted[path]) / (atol + rtol * np.abs(fitted[path]))))
        for path in fitted
    }
    largest = {path: float(np.max(np.abs(exported[path] - fitted[path]))) for path in fitted}
    print(f"parity_difference max_abs={max(largest.values()):.3g} per_variable={largest}")
    worst = {path: largest[path] for path, d in differences.items() if d > 1.0}
    assert not worst, f"variables that differ from fit (largest absolute difference): {worst}"


def assert_saved_model_serves_the_exported_model(
    result: Trained, rtol: float = RTOL, atol: float = ATOL
) -> None:
    """The SavedModel's outputs equal the exported Keras model's on every record. With
    :func:`assert_variables_equal_fit`, the model served is fit's. (Compared with fit's model instead, the
    outputs would carry the variables' float32 differences through every layer: on an AMD EPYC, 3.6e-7 in
    the conv/BatchNormalization model's variables became 1.7e-6 in its logits, beyond ``ATOL``.)"""
    features = next(iter(_dataset(result.spec, result.records, Mode.PREDICTION, len(result.records))))
    served = np.asarray(result.saved_model.serve(features))
    expected = np.asarray(result.exported(features, training=False))
    np.testing.assert_allclose(served, expected, rtol=rtol, atol=atol)


def assert_trained(result: Trained, path: str) -> None:
    """The variable moved in training (so that equality with fit means something)."""
    value = next(v for v in result.fitted.weights if v.path == path).numpy()
    assert np.max(np.abs(value - result.initial[path])) > 1e-3, f"{path} did not change in fit"


def test_dense_model_with_state_constraint_ema_and_loss_scale_equals_fit(trained) -> None:
    result = trained("dense_state")
    assert_trained(result, "batch_normalization/moving_mean")
    assert_trained(result, "batch_normalization/moving_variance")
    assert_variables_equal_fit(result)
    assert_saved_model_serves_the_exported_model(result)
    # (The exported kernel holds EMA averages, which Keras updates before it applies the constraint: they
    # may be negative, in fit too.)
    spare = next(v for v in result.exported.weights if v.path == "spare/spare").numpy()
    assert np.array_equal(spare, np.ones(3)), "a weight without gradient moved"


def test_evaluation_during_training_uses_the_exported_state(trained) -> None:
    """The job's final evaluation (validation = training rows) is the exported model's, i.e. fit's."""
    result = trained("dense_state")
    features, labels = next(iter(_dataset(result.spec, result.records, Mode.EVALUATION, len(result.records))))
    predictions = result.exported(features, training=False)
    expected = float(np.mean(np.square(np.asarray(labels) - np.asarray(predictions))))
    assert result.metrics["final_metrics"]["squared_error"] == pytest.approx(expected, rel=1e-5)


def test_global_clipnorm_spans_embedding_and_dense_gradients_of_two_ps(trained) -> None:
    result = trained("embedding_clip")
    assert_trained(result, "embedding/embeddings")
    assert_variables_equal_fit(result)
    assert_saved_model_serves_the_exported_model(result)
    table = next(v for v in result.exported.weights if v.path == "embedding/embeddings").numpy()
    assert (table == 0.0).any() and table.min() == 0.0, "the NonNeg constraint did not bind"


def test_convolutions_batch_normalization_and_dropout_equal_fit(trained) -> None:
    """ElasticDL's MNIST model's shape: Dropout's masks are drawn on the worker from the generator the
    model built (its state is not the PS's), so one worker draws fit's masks step for step."""
    result = trained("conv_dropout")
    for path in ("conv2d/kernel", "conv2d_1/kernel", "batch_normalization/moving_variance", "dense/kernel"):
        assert_trained(result, path)
    assert_variables_equal_fit(result)
    assert_saved_model_serves_the_exported_model(result)
    features, labels = next(iter(_dataset(result.spec, result.records, Mode.EVALUATION, len(result.records))))
    predicted = np.argmax(np.asarray(result.exported(features, training=False)), axis=1)
    accuracy = float(np.mean(predicted == np.reshape(labels, [-1])))
    assert result.metrics["final_metrics"]["accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_the_dynamic_loss_scale_skips_halves_and_grows_as_in_fit(trained) -> None:
    """Steps whose scaled gradients overflow are skipped by the worker, as ``fit``'s LossScaleOptimizer skips
    them, and counted: the job's accounting knows that they pushed nothing."""
    result = trained("loss_scale")
    assert_trained(result, "dense/kernel")
    assert_variables_equal_fit(result)
    assert_saved_model_serves_the_exported_model(result)
    skipped = result.metrics["steps_skipped_by_loss_scale"]
    minibatches = result.metrics["accounting"]["minibatches_trained"]
    # fit's own count: its LossScaleOptimizer's iterations count only the steps it applied.
    applied = int(result.fitted.optimizer.iterations.numpy())
    assert skipped > 3 and minibatches == applied and minibatches + skipped == EPOCHS * 13


def test_mixed_precision_equals_fit(trained) -> None:
    """Layers computing in float16 over float32 variables: the worker computes what fit computes, in the
    same precision, and the PS applies float32 updates."""
    result = trained("mixed_precision")
    assert_trained(result, "dense/kernel")
    assert {v.dtype for v in result.exported.trainable_variables} == {"float32"}
    assert result.exported.layers[1].compute_dtype == "float16"
    assert_variables_equal_fit(result, rtol=FLOAT16_GRADIENT_RTOL, atol=FLOAT16_GRADIENT_ATOL)
    # The SavedModel's traced float16 graph rounds differently from the model called eagerly: a few
    # float16 ulps (measured against fit's model: 7e-3 relative, 3e-3 absolute).
    assert_saved_model_serves_the_exported_model(result, rtol=FLOAT16_RTOL, atol=FLOAT16_ATOL)


def test_sample_weights_and_pushes_weighted_by_examples_equal_fit(trained) -> None:
    result = trained("weighted")
    assert_variables_equal_fit(result)
    assert_saved_model_serves_the_exported_model(result)


@pytest.mark.parametrize("workers", [2, 3])
def test_several_workers_equal_a_replay_of_the_steps_the_ps_applied(
    workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Synchronous SGD with ``--grads-to-wait`` = workers: each PS step is the example-weighted mean of the
    pushes PS 0 took for it, all computed at the step's parameters, so it equals one step over their
    concatenation; the pushes left when training ends form one last, partial step (:mod:`parity_replay`)."""
    job = run_until_mixed(tmp_path, monkeypatch, workers, num_ps=1, grads_to_wait=workers)
    pushes = [len(step) for step in job.updates()]
    assert all(count == workers for count in pushes[:-1]), pushes
    assert 0 < pushes[-1] < workers, f"no partial last step: {pushes}"
    assert mixes_workers(job), "no step mixed workers' pushes"
    assert_equals_replay(job)


def test_several_workers_one_push_per_step_equal_a_replay_of_every_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Synchronous SGD with ``--grads-to-wait 1`` and several workers (issue 37's configuration): a push is
    accepted only if it was computed at the current version, so every step is one minibatch at the
    parameters and BatchNormalization statistics of the step before. The job is sequential SGD in the order
    PS 0 accepted the pushes: every variable, the BatchNormalization tower's included, equals the replay."""
    job = run_traced_job(tmp_path, monkeypatch, 3, num_ps=2, grads_to_wait=1)
    assert [len(step) for step in job.updates()] == [1] * len(job.trace)
    assert len({m.worker for m in job.trace}) > 1, "one worker trained every minibatch"
    assert_equals_replay(job, state_mixed=False)


@pytest.mark.parametrize(
    "workers, job",
    [(1, {"use_async": True, "pipelined": True}), (3, {"use_async": True})],
    ids=["pipelined", "async-3-workers"],
)
def test_every_push_changes_the_non_trainable_state_however_stale_it_is(
    workers: int, job: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asynchronous pushes are computed at parameters other pushes have moved since (pipelined: every push
    after the first; several workers: whenever they overlap). A non-trainable variable that counts the
    examples of each forward pass must end at the examples trained: each push's change is added, none is
    lost to a push computed from an older value."""
    model = MODELS / "seen_examples.py"
    result = run_traced_job(tmp_path, monkeypatch, workers, model=model, num_ps=1, **job)
    trained = sum(m.examples for m in result.trace)
    assert trained == ROWS * TRACED_EPOCHS
    seen = {v.path: np.asarray(v.numpy()) for v in result.exported.weights}["counter/seen"]
    assert seen == trained, f"the PS counted {seen:g} of {trained} examples"


# -- the parameter server's share of the state, without a job ------------------------------------------


def _model_message() -> Any:
    from edl_argo.proto import ps_pb2
    from edl_argo.rpc.tensors import to_tensor

    non_negative = json.dumps(keras.constraints.serialize(keras.constraints.NonNeg()))
    return ps_pb2.Model(
        dense_parameters=[to_tensor(np.array([0.5, -0.2, 0.1], np.float32), "w")],
        non_trainable_parameters=[to_tensor(np.zeros(2, np.float32), "moving_mean")],
        constraints={"w": non_negative},
        embedding_table_infos=[
            ps_pb2.EmbeddingTableInfo(name="t", dim=2, initializer="zeros", constraint=non_negative)
        ],
    )


def _adam_with_ema() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.1, use_ema=True)


def _push(parameters: Any, step: int) -> None:
    from edl_argo.ps.parameters import Gradients

    gradient = np.array([1.0, -1.0, 0.5], np.float32) * (step + 1)
    state = {"moving_mean": np.array([step, -step], np.float32)}
    rows = (np.array([0, 3]), np.array([[1.0, -1.0], [2.0, 0.5]], np.float32) * (step + 1))
    parameters.apply_gradients(Gradients(dense={"w": gradient}, embeddings={"t": rows}, state_changes=state))


def test_ps_checkpoint_restores_non_trainable_state_constraints_and_ema_exactly() -> None:
    """A PS restored from its checkpoint continues exactly as the original: EMA averages, non-trainable
    values and constraints (of dense variables and tables) survive (the checkpoint-restore case)."""
    from edl_argo.ps.checkpoint import decode_state, encode_state
    from edl_argo.ps.parameters import Parameters

    original = Parameters(ps_optimizer_factory(_adam_with_ema), jit_compile=False)
    assert original.init_from_model(_model_message())
    for step in range(3):
        _push(original, step)
    assert original.dense_values()["w"].min() >= 0.0  # NonNeg applied after the updates
    assert original.export_table("t")[1].min() == 0.0  # and to the rows of the table an update changed
    restored = Parameters(ps_optimizer_factory(_adam_with_ema), jit_compile=False)
    restored.restore(decode_state(encode_state(original.snapshot())))
    for parameters in (original, restored):
        _push(parameters, 3)
    finalized = dict(original.pull_dense(-1, finalized=True) or [])
    assert dict(restored.pull_dense(-1, finalized=True) or []).keys() == finalized.keys()
    for name, value in restored.pull_dense(-1, finalized=True) or []:
        np.testing.assert_array_equal(value, finalized[name])
    # Each push added its change of the non-trainable value: 0 + 1 + 2 + 3, in both.
    np.testing.assert_array_equal(finalized["moving_mean"], [6.0, -6.0])
    np.testing.assert_array_equal(restored.export_table("t")[1], original.export_table("t")[1])
    live = dict(original.pull_dense(-1) or [])
    assert not np.array_equal(live["w"], finalized["w"]), "finalized values are not the EMA averages"


def test_a_synchronous_step_weights_pushes_by_examples() -> None:
    from edl_argo.ps.parameters import Gradients
    from edl_argo.ps.servicer import _Accumulator

    accumulator = _Accumulator()
    for w, m, examples in ((1.0, 2.0, 8), (4.0, 5.0, 4)):
        gradients = Gradients(dense={"w": np.array([w], np.float32)}, state_changes={"m": np.array([m])})
        accumulator.add(gradients, 1.0, examples)
    mean, _ = accumulator.mean()
    np.testing.assert_allclose(mean.dense["w"], [(8 * 1.0 + 4 * 4.0) / 12])
    np.testing.assert_allclose(mean.state_changes["m"], [(8 * 2.0 + 4 * 5.0) / 12])


def test_the_ps_refuses_malformed_state_and_constraints_naming_the_variable() -> None:
    from edl_argo.proto import ps_pb2
    from edl_argo.ps.parameters import InvalidRequestError, Parameters
    from edl_argo.ps.pushed import PushedModel
    from edl_argo.rpc.tensors import to_tensor

    bad_constraint = _model_message()
    bad_constraint.constraints["w"] = json.dumps({"class_name": "NoSuchConstraint", "config": {}})
    with pytest.raises(InvalidRequestError, match=r"'w'.*NoSuchConstraint"):
        Parameters(_adam_with_ema).init_from_model(bad_constraint)
    parameters = Parameters(_adam_with_ema, jit_compile=False)
    assert parameters.init_from_model(_model_message())
    for tensor, reason in [
        (to_tensor(np.zeros(2, np.float32), "nope"), "unknown non-trainable variable 'nope'"),
        (to_tensor(np.zeros(3, np.float32), "moving_mean"), r"'moving_mean' is float32\[3\], the .*\[2\]"),
    ]:
        with pytest.raises(InvalidRequestError, match=reason):
            parameters.decode_gradients(
                PushedModel.of_message(ps_pb2.Model(non_trainable_parameters=[tensor]))
            )


def test_allreduce_refuses_a_feed_with_sample_weights_before_any_pod_starts(tmp_path: Path) -> None:
    from parity_models.parity_data import records

    from edl_argo.errors import ConfigError

    write_dataset(LocalStorage(tmp_path / "data"), "train", records(16), 1, Compressor.NONE, overwrite=False)
    config = TrainConfig(
        model_def=str(MODELS / "weighted.py"),
        training_data=str(tmp_path / "data" / "train"),
        output=str(tmp_path / "out"),
        distribution_strategy="AllreduceStrategy",
    )
    with pytest.raises(ConfigError, match=r"weighted\.py yields \(features, labels, sample_weights\)"):
        TrainingJob.load(config)
    assert not (tmp_path / "out").exists()
