"""SQLFlow's premade models as model files of the model-zoo contract.

``TO TRAIN DNNClassifier ...`` becomes a small generated Python file (:func:`model_file_text`) whose
functions come from a :class:`PremadeModel` made from the JSON it carries: the model's name, its feature
columns (vocabularies and statistics included), the label and the ``model.*`` attributes. Why a generated
file rather than one fixed module configured by ``--model-params``: ``feed`` needs the feature columns too,
and ``--model-params`` reaches only ``custom_model``; and a file that carries its whole configuration is
what gets published beside the trained weights, so ``TO PREDICT ... USING name`` needs nothing but the
model's URL. The file holds no logic: this module (tested with the package) does the work.

Models (``model.*`` attributes; defaults in brackets):

- ``DNNClassifier``: ``hidden_units`` [[64, 32]], ``n_classes`` [2]: the dense columns concatenated, ReLU
  layers, softmax over the classes.
- ``DNNRegressor``: ``hidden_units``: the same layers, one linear output.
- ``LinearClassifier``: ``n_classes``: the logits are a sum of one weight vector per numeric input and one
  per id of each categorical column (an embedding of width ``n_classes``), softmax.
- ``WideAndDeepClassifier``: ``hidden_units``, ``n_classes``: the linear logits of the ``linear`` group plus
  the DNN's of the ``dnn`` group (``COLUMN ... FOR linear`` / ``FOR dnn``; without groups, the categorical
  columns are the linear part and all columns the deep one).

All take ``learning_rate`` [0.01] and ``optimizer`` [Adam] (Adam, Adagrad, SGD, RMSprop, Ftrl). SQLFlow's
estimators default to Adagrad (DNN) and Ftrl (linear); Adam is used here because it trains these small
models reliably in a couple of epochs. A classifier's label is an integer class in ``[0, n_classes)``.
In a DNN, a categorical column without EMBEDDING is one-hot encoded (SQLFlow's indicator column).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.sqlflow.columns import (
    Embedding,
    FeatureColumns,
    Numeric,
    columns_from_json,
    columns_to_json,
    prepare,
)

#: Premade model name -> whether it is a classifier.
MODELS = {
    "DNNClassifier": True,
    "DNNRegressor": False,
    "LinearClassifier": True,
    "WideAndDeepClassifier": True,
}
#: The ``model.*`` attributes each model takes.
MODEL_ATTRS = {
    "DNNClassifier": ("hidden_units", "n_classes", "learning_rate", "optimizer"),
    "DNNRegressor": ("hidden_units", "learning_rate", "optimizer"),
    "LinearClassifier": ("n_classes", "learning_rate", "optimizer"),
    "WideAndDeepClassifier": ("hidden_units", "n_classes", "learning_rate", "optimizer"),
}
OPTIMIZERS = ("Adam", "Adagrad", "SGD", "RMSprop", "Ftrl")


@dataclass(frozen=True)
class PremadeModel:
    """One premade model's configuration and its model-zoo functions."""

    model: str
    columns: FeatureColumns
    label: str
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"TO TRAIN {self.model}: not a premade model ({', '.join(MODELS)})")
        unknown = sorted(set(self.params) - set(MODEL_ATTRS[self.model]))
        if unknown:
            raise ConfigError(
                f"TO TRAIN {self.model}: unknown attribute model.{unknown[0]} (it takes "
                f"{', '.join('model.' + a for a in MODEL_ATTRS[self.model])})"
            )
        units = self.hidden_units
        if not units or not all(isinstance(u, int) and not isinstance(u, bool) and u > 0 for u in units):
            raise ConfigError(
                f"TO TRAIN {self.model}: model.hidden_units must be a list of positive integers"
            )
        if self.classifier and not (isinstance(self.n_classes, int) and self.n_classes >= 2):
            raise ConfigError(f"TO TRAIN {self.model}: model.n_classes must be an integer >= 2")
        if self.optimizer_name not in OPTIMIZERS:
            raise ConfigError(
                f"TO TRAIN {self.model}: model.optimizer {self.optimizer_name!r} is not one of "
                f"{', '.join(OPTIMIZERS)}"
            )
        rate = self.learning_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ConfigError(f"TO TRAIN {self.model}: model.learning_rate must be a positive number")

    @property
    def classifier(self) -> bool:
        return MODELS[self.model]

    @property
    def hidden_units(self) -> list[int]:
        return list(self.params.get("hidden_units", [64, 32]))

    @property
    def n_classes(self) -> int:
        return self.params.get("n_classes", 2)

    @property
    def learning_rate(self) -> float:
        return self.params.get("learning_rate", 0.01)

    @property
    def optimizer_name(self) -> str:
        return str(self.params.get("optimizer", "Adam"))

    # --- JSON ---------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        document = {
            "model": self.model,
            "columns": columns_to_json(self.columns),
            "label": self.label,
            "params": self.params,
        }
        return json.dumps(document, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PremadeModel:
        document = json.loads(text)
        return cls(
            document["model"], columns_from_json(document["columns"]), document["label"], document["params"]
        )

    # --- the model-zoo functions ----------------------------------------------------------------------------

    def _groups(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(linear columns, deep columns)."""
        groups = self.columns.groups
        if self.model == "WideAndDeepClassifier":
            if "linear" in groups or "dnn" in groups:
                return groups.get("linear", ()), groups.get("dnn", ())
            every = self.columns.all
            return tuple(c for c in every if not isinstance(c, Numeric)), every
        every = self.columns.all
        return (every, ()) if self.model == "LinearClassifier" else ((), every)

    def custom_model(self) -> Any:
        """The Keras functional model: one input per feature column (named as :func:`prepare` names them),
        outputs class probabilities ``[batch, n_classes]`` or a value ``[batch, 1]``."""
        import tensorflow as tf

        keras = tf.keras
        inputs: dict[str, Any] = {}
        for column in self.columns.all:
            name = self.columns.input_name(column)
            if isinstance(column, Numeric):
                inputs[name] = keras.Input(shape=(column.shape,), dtype="float32", name=name)
            else:
                inputs[name] = keras.Input(shape=(), dtype="int64", name=name)
        width = self.n_classes if self.classifier else 1
        linear, deep = self._groups()
        logits = []
        if linear:
            logits.append(self._linear(linear, inputs, width))
        if deep:
            hidden = self._dense_features(deep, inputs)
            for i, units in enumerate(self.hidden_units):
                hidden = keras.layers.Dense(units, activation="relu", name=f"hidden_{i}")(hidden)
            logits.append(keras.layers.Dense(width, name="dnn_logits")(hidden))
        output = logits[0] if len(logits) == 1 else keras.layers.Add(name="logits")(logits)
        if self.classifier:
            output = keras.layers.Softmax(name="probabilities")(output)
        return keras.Model(inputs=inputs, outputs=output, name=self.model)

    def _dense_features(self, columns: Any, inputs: Mapping[str, Any]) -> Any:
        import tensorflow as tf

        keras = tf.keras
        parts = []
        for column in columns:
            name = self.columns.input_name(column)
            if isinstance(column, Numeric):
                parts.append(inputs[name])
            elif isinstance(column, Embedding):
                table = keras.layers.Embedding(
                    column.category.num_buckets, column.dim, name=f"embedding_{name}"
                )
                parts.append(table(inputs[name]))
            else:
                one_hot = keras.layers.CategoryEncoding(
                    num_tokens=column.num_buckets, output_mode="one_hot", name=f"one_hot_{name}"
                )
                parts.append(one_hot(inputs[name]))
        return parts[0] if len(parts) == 1 else keras.layers.Concatenate(name="dense_features")(parts)

    def _linear(self, columns: Any, inputs: Mapping[str, Any], width: int) -> Any:
        import tensorflow as tf

        keras = tf.keras
        numeric = [inputs[self.columns.input_name(c)] for c in columns if isinstance(c, Numeric)]
        terms = []
        if numeric:
            joined = numeric[0] if len(numeric) == 1 else keras.layers.Concatenate()(numeric)
            terms.append(keras.layers.Dense(width, name="linear_numeric")(joined))
        for column in columns:
            if isinstance(column, Numeric):
                continue
            name = self.columns.input_name(column)
            category = column.category if isinstance(column, Embedding) else column
            weights = keras.layers.Embedding(category.num_buckets, width, name=f"linear_{name}")
            terms.append(weights(inputs[name]))
        return terms[0] if len(terms) == 1 else keras.layers.Add(name="linear_logits")(terms)

    def feed(self, dataset: Any, mode: str, _metadata: Any = None) -> Any:
        """Records (dicts of column tensors) → ``(inputs, label)``, or inputs alone to predict."""
        from edl_argo.model import Mode

        columns, label = self.columns, self.label

        def training(record: Mapping[str, Any]) -> Any:
            import tensorflow as tf

            target = record[label]
            target = tf.cast(target, tf.int64 if self.classifier else tf.float32)
            return prepare(columns, record), target

        if mode == Mode.PREDICTION:
            return dataset.map(lambda record: prepare(columns, record))
        if not label:
            raise ConfigError(f"TO TRAIN {self.model}: a LABEL is needed to train or evaluate")
        return dataset.map(training)

    def loss(self, labels: Any, predictions: Any) -> Any:
        import tensorflow as tf

        if self.classifier:
            labels = tf.reshape(labels, [-1])
            return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, predictions))
        labels = tf.reshape(tf.cast(labels, tf.float32), [-1, 1])
        return tf.reduce_mean(tf.square(labels - predictions))

    def optimizer(self) -> Any:
        import tensorflow as tf

        return getattr(tf.keras.optimizers, self.optimizer_name)(learning_rate=self.learning_rate)

    def eval_metrics_fn(self) -> dict[str, Any]:
        import tensorflow as tf

        if self.classifier:

            def accuracy(labels: Any, predictions: Any) -> Any:
                predicted = tf.argmax(predictions, axis=-1)
                return tf.cast(tf.equal(predicted, tf.cast(tf.reshape(labels, [-1]), tf.int64)), tf.float32)

            return {"accuracy": accuracy}

        def mse(labels: Any, predictions: Any) -> Any:
            return tf.square(tf.reshape(tf.cast(labels, tf.float32), [-1]) - tf.reshape(predictions, [-1]))

        return {"mse": mse}

    def predicted(self, outputs: Any) -> Any:
        """The value written to the result table per row: a classifier's class id (int64), a regressor's
        value (float64)."""
        import numpy as np

        outputs = np.asarray(outputs)
        if self.classifier:
            return outputs.argmax(axis=-1).astype(np.int64)
        return outputs.reshape(-1).astype(np.float64)


_TEMPLATE = '''"""{model} of a SQLFlow statement, generated by `edl-argo sql`: its configuration is
CONFIG (JSON); the functions are edl_argo.sqlflow.premade.PremadeModel's."""

from edl_argo.sqlflow.premade import PremadeModel

CONFIG = {config!r}

_MODEL = PremadeModel.from_json(CONFIG)
custom_model = _MODEL.custom_model
feed = _MODEL.feed
loss = _MODEL.loss
optimizer = _MODEL.optimizer
eval_metrics_fn = _MODEL.eval_metrics_fn
predicted = _MODEL.predicted
'''


def model_file_text(model: PremadeModel) -> str:
    """The text of the model file of ``model`` (see the module's docstring)."""
    return _TEMPLATE.format(model=model.model, config=model.to_json())
