"""Datasets the training benchmarks generate, and reading them back as the arrays ``model.fit`` takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edl_argo.data.commands import ctr_records, digits_records, write_dataset
from edl_argo.data.examples import encode_example
from edl_argo.recordio import Compressor, ShardReader, open_dataset
from edl_argo.storage import LocalStorage

MNIST_SIDE = 28


def mnist_like_records(count: int, seed: int = 0) -> list[bytes]:
    """``count`` generated 28×28 MNIST-style examples (``image``: 784 floats in [0, 1], ``label``).

    Each class has a fixed random stroke pattern; an example is its class pattern, shifted by up to two
    pixels, plus noise, so the task is learnable without shipping MNIST.
    """
    rng = np.random.default_rng(seed)
    patterns = (np.random.default_rng(4321).random((10, MNIST_SIDE, MNIST_SIDE)) > 0.75).astype(np.float32)
    labels = rng.integers(0, 10, size=count)
    shifts = rng.integers(-2, 3, size=(count, 2))
    records = []
    for label, (dy, dx) in zip(labels, shifts, strict=True):
        image = np.roll(patterns[label], (dy, dx), axis=(0, 1)) * 0.8
        image += rng.random((MNIST_SIDE, MNIST_SIDE), dtype=np.float32) * 0.3
        records.append(encode_example({"image": np.clip(image, 0.0, 1.0).ravel(), "label": int(label)}))
    return records


def digits_train_records() -> list[bytes]:
    """scikit-learn's digits, the training split ``edl-argo data digits`` writes (1,437 records)."""
    train, _test = digits_records(test_fraction=0.2, seed=0)
    return train


def digits_28x28_records() -> tuple[list[bytes], list[bytes]]:
    """scikit-learn's digits as ElasticDL's MNIST model reads them: ``image`` 28×28 floats in [0, 255]
    (each 8×8 pixel repeated, nearest neighbour), ``label``; the (train, test) split of ``edl-argo data
    digits`` (1,437 and 360 records)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    rows = (np.arange(MNIST_SIDE) * 8) // MNIST_SIDE
    records = [
        encode_example(
            {
                "image": (digits.images[i][np.ix_(rows, rows)] * (255.0 / 16.0)).astype(np.float32).ravel(),
                "label": int(digits.target[i]),
            }
        )
        for i in order
    ]
    test = len(records) // 5 + (len(records) % 5 > 0)  # the 20% digits_records keeps for testing
    return records[test:], records[:test]


def ctr_train_records(count: int) -> list[bytes]:
    """``count`` synthetic click records as ``edl-argo data ctr`` writes them (vocabulary 100,000)."""
    return ctr_records(count, vocabulary=100_000, seed=0)


def write_records(folder: Path, records: list[bytes], shards: int = 1) -> str:
    """Write ``records`` as a dataset of ``shards`` snappy shards (and its manifest) in ``folder``."""
    write_dataset(LocalStorage(folder), "", records, shards, Compressor.SNAPPY, overwrite=False)
    return str(folder)


def read_records(folder: str) -> list[bytes]:
    """Every record of the dataset in ``folder``, in shard order."""
    dataset = open_dataset(LocalStorage(folder))
    return [record for key in dataset.records for record in ShardReader(dataset.storage, key).iter_records()]


def feed_to_arrays(spec: Any, records: list[bytes]) -> tuple[Any, Any]:
    """Run the model file's own ``feed`` (evaluation mode: no shuffling) over ``records`` and return
    ``(features, labels)`` as numpy arrays, so ``model.fit`` sees exactly what our workers see."""
    import tensorflow as tf

    from edl_argo.model import Mode

    dataset = spec.feed(tf.data.Dataset.from_tensor_slices(tf.constant(records)), Mode.EVALUATION, None)
    features, labels = next(iter(dataset.batch(len(records))))
    return tf.nest.map_structure(np.asarray, features), np.asarray(labels)
