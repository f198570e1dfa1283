"""A step called through the concrete function tf.function picks, remembered by the arguments' signature
(edl_argo.model.train_step.StepCall): the same results as tf.function's own call for every kind of
argument, one trace per signature, and a bounded memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from edl_argo.model import train_step
from edl_argo.model.train_step import StepCall


def make_step() -> tuple[StepCall, list[int]]:
    traces: list[int] = []

    def step(features: Any, scale: Any, extra: Any = None) -> tf.Tensor:
        traces.append(1)
        total = tf.reduce_sum(features["x"]) * tf.cast(features["n"], tf.float32)
        if scale:  # a Python value: part of the signature, as for tf.function
            total = total * 10.0
        for tensor in extra or []:
            total += tf.reduce_sum(tf.cast(tensor, tf.float32))
        return total

    return StepCall(step), traces


def test_results_match_tf_function_for_every_kind_of_argument_and_python_values_pick_their_trace() -> None:
    call, _ = make_step()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    cases = [
        ({"x": tf.constant(x), "n": tf.constant(2)}, True, None),
        ({"x": tf.constant(x), "n": tf.constant(2)}, False, None),
        ({"x": x, "n": np.int32(3)}, False, [tf.constant([1, 2])]),
        ({"x": tf.constant(x[:1]), "n": tf.constant(1)}, 0, (tf.constant([5.0]),)),
        ({"x": tf.constant(x), "n": tf.constant(2)}, False, [tf.ragged.constant([[1], [2, 3]])]),
    ]
    for features, scale, extra in cases * 2:
        want = call.function(features, scale, extra).numpy()
        assert call(features, scale, extra).numpy() == pytest.approx(want)
    assert len(call._concrete) == 4  # the ragged argument goes through tf.function's own pick
    assert call(cases[1][0], False).numpy() == pytest.approx(30.0)  # extra left to its default: likewise
    assert len(call._concrete) == 4
    assert call(cases[0][0], True, None).numpy() == pytest.approx(300.0)
    assert call(cases[1][0], False, None).numpy() == pytest.approx(30.0)


def test_each_signature_is_traced_once_and_a_new_shape_still_runs() -> None:
    call, traces = make_step()
    for rows in (4, 4, 4, 3, 4, 3, 5):
        features = {"x": tf.ones((rows, 2)), "n": tf.constant(1)}
        assert call(features, False).numpy() == pytest.approx(2.0 * rows)
    # tf.function's reduce_retracing: one trace for 4 rows, one generalised for the others.
    assert len(traces) == call.function.experimental_get_tracing_count() <= 2


def test_the_signatures_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_step, "REMEMBERED_SIGNATURES", 4)
    call, _ = make_step()
    for rows in range(1, 12):
        features = {"x": tf.ones((rows, 1)), "n": tf.constant(1)}
        assert call(features, False).numpy() == pytest.approx(rows)
        assert len(call._concrete) <= 4


def test_a_flat_call_runs_the_concrete_function_with_its_captures() -> None:
    variable = tf.Variable([1.0, 2.0])

    def add(x: tf.Tensor) -> tf.Tensor:
        variable.assign_add(x)
        return variable.read_value() * 2.0

    concrete = train_step.step_function(add).get_concrete_function(tf.TensorSpec([2], tf.float32))
    call = train_step.flat_call(concrete)
    assert call is not concrete
    assert call(tf.constant([1.0, 1.0])).numpy().tolist() == [4.0, 6.0]
    assert call(tf.constant([0.5, 0.5])).numpy().tolist() == [5.0, 7.0]
    assert variable.numpy().tolist() == [2.5, 3.5]


def test_without_tensorflows_flat_call_the_concrete_function_is_called_as_it_is() -> None:
    class Concrete:
        def __call__(self, *tensors: Any) -> Any:
            return tensors

    concrete = Concrete()
    assert train_step.flat_call(concrete) is concrete
