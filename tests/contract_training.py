"""Training a model-zoo contract's model in the test process, as ``model.fit`` would, without a job."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def train_in_process(contract: Any, dataset: tf.data.Dataset, epochs: int) -> tf.keras.Model:
    """A new ``contract.custom_model()`` trained ``epochs`` times over ``dataset`` (batches of features and
    labels) with the contract's ``loss`` and ``optimizer()``, one ``tf.function`` step per batch (eager
    steps cost a test seconds)."""
    model = contract.custom_model()
    optimizer = contract.optimizer()

    @tf.function(reduce_retracing=True)
    def step(features: Any, labels: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = contract.loss(labels, model(features, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    for _ in range(epochs):
        for features, labels in dataset:
            step(features, labels)
    return model
