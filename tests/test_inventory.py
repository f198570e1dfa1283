"""Installing a PS's values into a worker's model (``edl_argo.model.inventory.ModelInventory.assign``)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from edl_argo.errors import JobFailedError
from edl_argo.model.inventory import BATCHED_INSTALL_AFTER, BATCHED_INSTALL_SETS, ModelInventory
from edl_argo.rpc.packed import SMALL_ARRAY_BYTES


def model() -> tf.keras.Model:
    """Small variables of two dtypes, a large one, and BatchNormalization statistics."""
    inputs = tf.keras.Input((80,))
    wide = tf.keras.layers.Dense(SMALL_ARRAY_BYTES // (4 * 80) + 10, name="wide")(inputs)  # > the bound
    normed = tf.keras.layers.BatchNormalization(name="norm")(wide)
    small = tf.keras.layers.Dense(3, name="small")(normed)
    doubled = tf.keras.layers.Dense(2, dtype="float64", name="doubled")(small)
    return tf.keras.Model(inputs, doubled)


def random_values(inventory: ModelInventory, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        v.path: rng.standard_normal(tuple(v.shape)).astype(np.dtype(v.dtype)) for v in inventory.held_by_ps
    }


def current(inventory: ModelInventory) -> dict[str, np.ndarray]:
    return {v.path: np.array(v.numpy()) for v in inventory.held_by_ps}


def assert_same(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


def test_every_install_sets_every_value_exactly_the_first_one_by_one_then_batched() -> None:
    inventory = ModelInventory.of(model())
    sizes = {v.path: np.dtype(v.dtype).itemsize * int(np.prod(v.shape)) for v in inventory.held_by_ps}
    assert max(sizes.values()) >= SMALL_ARRAY_BYTES and min(sizes.values()) < SMALL_ARRAY_BYTES
    assert len(inventory.non_trainable) == 2  # the statistics travel with the rest

    for step in range(BATCHED_INSTALL_AFTER + 3):
        values = random_values(inventory, step)
        inventory.assign({k: v.copy() for k, v in values.items()}, complete=True, given=True)
        assert_same(current(inventory), values)
        # One by one until the set has been installed often enough to repay tracing, then in one call.
        assert len(inventory._batched._calls) == (0 if step < BATCHED_INSTALL_AFTER else 1)


def test_a_subset_and_many_sets_install_right_with_a_bounded_number_of_batched_calls() -> None:
    inventory = ModelInventory.of(model())
    names = [v.path for v in inventory.held_by_ps]
    expected = current(inventory)
    for round_ in range(BATCHED_INSTALL_AFTER + 1):
        for drop in range(len(names)):
            subset = {
                k: v for k, v in random_values(inventory, 100 * round_ + drop).items() if k != names[drop]
            }
            inventory.assign(subset, given=True)
            expected.update(subset)
            assert_same(current(inventory), expected)
    assert 0 < len(inventory._batched._calls) <= BATCHED_INSTALL_SETS


def test_values_not_given_are_copied_on_either_path() -> None:
    inventory = ModelInventory.of(model())
    for step in range(BATCHED_INSTALL_AFTER + 2):  # one by one, then packed
        values = random_values(inventory, step)
        kept = {k: v.copy() for k, v in values.items()}
        inventory.assign(values, given=False)
        for value in values.values():
            value += 1.0  # the caller's arrays stay the caller's
        assert_same(current(inventory), kept)
    assert inventory._batched._calls  # the packed path was taken too


def test_a_name_the_model_lacks_is_refused_before_anything_changes() -> None:
    inventory = ModelInventory.of(model())
    before = current(inventory)
    values = random_values(inventory, 7)
    values["elsewhere/kernel"] = np.zeros(3, np.float32)
    with pytest.raises(JobFailedError, match="elsewhere/kernel"):
        inventory.assign(values)
    assert_same(current(inventory), before)
