"""AllreduceStrategy gives the model ``model.fit`` gives: a small model written as a user would, trained with
``fit`` in this process and by a job with one worker on the same rows in the same order (no shuffling), and
every variable of the exported ``model.keras`` compared with ``fit``'s, and the SavedModel's outputs with the
exported model's.

The tolerance is float32's (1e-5 relative): the job's step averages ``gradient × examples`` over the
group's examples, which is exact for the power-of-two batch sizes used here, so what remains is the order
of float32 operations in two differently traced steps.

With 2 and 3 workers, the job is compared with a plain-Keras replay of the group steps, as the step trace
recorded them (:mod:`parity_replay`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from parity_replay import ATOL, RTOL, assert_equals_replay, run_traced_job

from edl_argo.data.commands import write_dataset
from edl_argo.data.examples import encode_example
from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.model import load_model_spec
from edl_argo.recordio import Compressor
from edl_argo.storage import LocalStorage
from tests.engine_helpers import model_dir

ROWS = 100  # 12 minibatches of 8 and a partial one of 4 per epoch
MINIBATCH = 8
EPOCHS = 3

#: What a user writes; ``OPTIMIZER``, ``LAYERS`` and ``LOSS`` (:data:`MEAN_LOSS` unless a case says) vary by
#: case.
MODEL_FILE = """
import keras
import tensorflow as tf

from edl_argo.model import Mode


def _init(seed):
    return keras.initializers.GlorotUniform(seed=seed)


@keras.saving.register_keras_serializable(package="parity")
class WithUnusedWeight(keras.layers.Layer):
    # tanh(x @ kernel), with one more trainable weight that no loss reaches.

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        shape = (input_shape[-1], self.units)
        self.kernel = self.add_weight(shape=shape, initializer=_init(1), name="kernel")
        self.unused = self.add_weight(shape=(3,), initializer="ones", name="unused")

    def call(self, inputs):
        return keras.ops.tanh(keras.ops.matmul(inputs, self.kernel))

    def get_config(self):
        return {{**super().get_config(), "units": self.units}}


def custom_model():
    inputs = keras.Input(shape=(4,), name="x")
    hidden = inputs
{LAYERS}
    outputs = keras.layers.Dense(1, kernel_initializer=_init(9), name="out")(hidden)
    return keras.Model(inputs, outputs)


def feed(dataset, mode, metadata):
    spec = {{"x": tf.io.FixedLenFeature([4], tf.float32), "y": tf.io.FixedLenFeature([1], tf.float32)}}
    parsed = dataset.map(lambda record: tf.io.parse_single_example(record, spec))
    if mode == Mode.PREDICTION:
        return parsed.map(lambda r: r["x"])
    return parsed.map(lambda r: (r["x"], r["y"]))


def loss(labels, predictions):
    {LOSS}


def optimizer():
    return {OPTIMIZER}


def eval_metrics_fn():
    return {{"mse": lambda labels, predictions: tf.square(labels - predictions)}}
"""

#: The ``loss`` of a case that does not give its own: a scalar, the minibatch's mean squared error.
MEAN_LOSS = "return tf.reduce_mean(tf.square(labels - predictions))"

CASES = {
    "batchnorm-schedule-constraint-regularization": {
        "LAYERS": """
    hidden = keras.layers.Dense(
        16,
        activation="relu",
        kernel_initializer=_init(1),
        kernel_regularizer=keras.regularizers.L2(1e-3),
        kernel_constraint=keras.constraints.NonNeg(),
        name="hidden",
    )(hidden)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)""",
        "OPTIMIZER": "keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9))",
    },
    "ema-loss-scaling-global-clipnorm-weight-decay-untouched-variable": {
        "LAYERS": """
    hidden = WithUnusedWeight(16, name="hidden")(hidden)""",
        "OPTIMIZER": (
            "keras.optimizers.AdamW(0.01, weight_decay=0.05, use_ema=True, ema_momentum=0.9, "
            "loss_scale_factor=64.0, global_clipnorm=1.0)"
        ),
    },
    # float16 compute over float32 variables, with LossScaleOptimizer's dynamic scale.
    "mixed-precision-dynamic-loss-scale": {
        "LAYERS": """
    hidden = keras.layers.Dense(
        16, activation="tanh", kernel_initializer=_init(1), dtype="mixed_float16", name="hidden"
    )(hidden)""",
        "OPTIMIZER": "keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))",
        # The SavedModel's traced float16 graph may round differently from the model called eagerly.
        "SERVED_TOLERANCE": (1e-2, 5e-3),
    },
    # One loss value per example, which fit averages over the minibatch, plus a regularization loss.
    "loss-per-example": {
        "LAYERS": """
    hidden = keras.layers.Dense(
        16, activation="tanh", kernel_initializer=_init(1), activity_regularizer="l2", name="hidden"
    )(hidden)""",
        "OPTIMIZER": "keras.optimizers.SGD(0.05, momentum=0.9)",
        "LOSS": "return tf.square(labels - predictions)[:, 0]",
    },
}


def _rows() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(21)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def _fit(model_def: Path) -> keras.Model:
    spec = load_model_spec(str(model_def))
    model = spec.custom_model()
    model.compile(optimizer=spec.optimizer(), loss=spec.loss)
    x, y = _rows()
    model.fit(x, y, batch_size=MINIBATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def _job(model_def: Path, tmp_path: Path) -> Path:
    x, y = _rows()
    records = [encode_example({"x": x[i], "y": y[i]}) for i in range(ROWS)]
    write_dataset(LocalStorage(tmp_path / "data"), "train", records, 1, Compressor.NONE, overwrite=False)
    config = TrainConfig(
        model_def=str(model_def),
        training_data=str(tmp_path / "data" / "train"),
        output=str(tmp_path / "job"),
        job_name=f"parity-{tmp_path.name}"[:40],
        distribution_strategy="AllreduceStrategy",
        num_ps=0,
        num_workers=1,
        minibatch_size=MINIBATCH,
        num_minibatches_per_task=4,
        num_epochs=EPOCHS,
        shuffle=False,
    )
    TrainingJob.load(config).run()
    return model_dir(tmp_path / "job")


@pytest.mark.parametrize("case", list(CASES))
def test_allreduce_gives_the_model_fit_gives(case: str, tmp_path: Path) -> None:
    model_def = tmp_path / "model.py"
    model_def.write_text(MODEL_FILE.format(**{"LOSS": MEAN_LOSS, **CASES[case]}))
    fitted = _fit(model_def)
    exported = _job(model_def, tmp_path)

    trained = keras.saving.load_model(exported / "model.keras", compile=False)
    assert [v.path for v in trained.variables] == [v.path for v in fitted.variables]
    for mine, theirs in zip(trained.variables, fitted.variables, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=RTOL, atol=ATOL, err_msg=mine.path)
    x, _ = _rows()
    saved_model = tf.saved_model.load(str(exported / "saved_model"))
    served = saved_model.serve(tf.constant(x))
    rtol, atol = CASES[case].get("SERVED_TOLERANCE", (RTOL, ATOL))
    # The SavedModel serves the exported model (whose variables are fit's, checked above); compared with
    # fit's model, its outputs would carry the variables' float32 differences through every layer.
    np.testing.assert_allclose(np.asarray(served), trained.predict(x, verbose=0), rtol=rtol, atol=atol)
    metrics: dict[str, Any] = json.loads((exported / "metrics.json").read_text())
    assert metrics["model_version"] == EPOCHS * -(-ROWS // MINIBATCH)


@pytest.mark.parametrize("workers", [2, 3])
def test_several_workers_equal_a_replay_of_the_group_steps(
    workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group step applies the example-weighted mean of its members' gradients, so it equals one step
    over the concatenation of the minibatches its members trained in it (a member without one contributes
    nothing); see :mod:`parity_replay`."""
    job = run_traced_job(tmp_path, monkeypatch, workers, distribution_strategy="AllreduceStrategy", num_ps=0)
    for step in job.updates():
        members = [m.worker for m in step]
        assert len(members) == len(set(members)) <= workers, members
    assert max(len(step) for step in job.updates()) > 1, "no step had two members"
    assert_equals_replay(job)
