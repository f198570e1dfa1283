"""The model file's ``feed`` maps run each record's function on the thread that asks for the element
(:mod:`edl_argo.model.feed_maps`), in training and in evaluation, and give the elements TensorFlow's own
maps give.

What is checked is the map's ``use_inter_op_parallelism`` attribute in the dataset's graph (False: the
function's ops run one after the other on the calling thread, as tf.data's own internal maps run). The
speed it buys is measured by ``make bench`` (``docs/benchmarks.md``), never here.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from edl_argo.model import Mode
from edl_argo.model.feed_maps import maps_on_the_calling_thread
from edl_argo.readers import SERIALIZED
from edl_argo.worker.data import make_batches, stream_batches

RECORDS = [f"{i},{i % 3},{i * 0.5}".encode() for i in range(40)]
MAP_OPS = {"MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2"}
#: Seconds a pipeline may take to give its 40 records (a deadlocked map would never give them).
PIPELINE_SECONDS = 60.0


def _parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    values = tf.strings.to_number(tf.strings.split(record, ","))
    return values[:2], values[2:]


def _maps(dataset: tf.data.Dataset) -> list[tuple[str, bool]]:
    """(op, use_inter_op_parallelism) of every map in ``dataset``'s graph, its functions' included."""
    graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())
    nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
    return [(node.op, node.attr["use_inter_op_parallelism"].b) for node in nodes if node.op in MAP_OPS]


def _spec(feed: Callable[[tf.data.Dataset], tf.data.Dataset]) -> Any:
    return types.SimpleNamespace(feed=lambda dataset, mode, metadata: feed(dataset))


def _records() -> np.ndarray:
    records = np.empty(len(RECORDS), dtype=object)
    records[:] = RECORDS
    return records


def _one_task() -> Any:
    yield np.int64(1), _records()


def test_feed_maps_run_on_the_calling_thread_in_training_and_in_evaluation() -> None:
    spec = _spec(lambda dataset: dataset.map(_parse).map(lambda x, y: (x * 2.0, y)))
    training = _maps(stream_batches(spec, _one_task, 8))
    evaluation = _maps(make_batches(spec, [_records()], SERIALIZED, Mode.EVALUATION, 8))
    # stream_batches maps each minibatch once more (its own map, not feed's): only feed's two are inline.
    assert [inter_op for _, inter_op in training].count(False) == 2
    assert evaluation == [("MapDataset", False), ("MapDataset", False)]


def test_a_map_given_num_parallel_calls_and_maps_outside_feed_stay_tensorflow_s() -> None:
    parallel = _spec(lambda dataset: dataset.map(_parse, num_parallel_calls=2))
    assert _maps(make_batches(parallel, [_records()], SERIALIZED, Mode.EVALUATION, 8)) == [
        ("ParallelMapDatasetV2", True)
    ]
    assert _maps(tf.data.Dataset.from_tensor_slices(RECORDS).map(_parse)) == [("MapDataset", True)]


def test_only_the_thread_calling_feed_builds_maps_on_the_calling_thread() -> None:
    inside, built = threading.Event(), threading.Event()
    other: list[tf.data.Dataset] = []

    def build_elsewhere() -> None:
        assert inside.wait(PIPELINE_SECONDS)
        other.append(tf.data.Dataset.from_tensor_slices(RECORDS).map(_parse))
        built.set()

    thread = threading.Thread(target=build_elsewhere)
    thread.start()
    with maps_on_the_calling_thread():
        mine = tf.data.Dataset.from_tensor_slices(RECORDS).map(_parse)
        inside.set()
        assert built.wait(PIPELINE_SECONDS)
    thread.join(PIPELINE_SECONDS)
    assert _maps(mine) == [("MapDataset", False)]
    assert _maps(other[0]) == [("MapDataset", True)]


def _scaled_in_python(values: tf.Tensor) -> tf.Tensor:
    scaled = tf.py_function(lambda v: v.numpy() * 3.0, [values], tf.float32)
    scaled.set_shape(values.shape)
    return scaled


@tf.function
def _nested(values: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(values) + values


def _looped(values: tf.Tensor) -> tf.Tensor:
    return tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 1.5), (0, values))[1]


def _branched(values: tf.Tensor) -> tf.Tensor:
    return tf.cond(values[0] > 10.0, lambda: values - 10.0, lambda: values + 1.0)


def _png_round_trip(values: tf.Tensor) -> tf.Tensor:
    image = tf.cast(tf.reshape(tf.tile(values, [2]), [2, 2, 1]), tf.uint8)
    return tf.cast(tf.reshape(tf.io.decode_png(tf.io.encode_png(image)), [4]), tf.float32)


def _seeded_noise(values: tf.Tensor) -> tf.Tensor:
    return values + tf.random.stateless_uniform([2], seed=tf.cast(values[:2], tf.int32))


def _numpy_function(values: tf.Tensor) -> tf.Tensor:
    doubled = tf.numpy_function(lambda v: (v * 2).astype(np.float32), [values], tf.float32)
    doubled.set_shape(values.shape)
    return doubled


@pytest.mark.parametrize(
    "function",
    [_scaled_in_python, _nested, _looped, _branched, _png_round_trip, _seeded_noise, _numpy_function],
)
def test_a_map_on_the_calling_thread_gives_what_tensorflow_s_map_gives(
    function: Callable[[tf.Tensor], tf.Tensor],
) -> None:
    def feed(dataset: tf.data.Dataset) -> tf.data.Dataset:
        return dataset.map(_parse).map(lambda x, y: (function(x), y))

    expected = list(feed(tf.data.Dataset.from_tensor_slices(RECORDS)).batch(8).as_numpy_iterator())
    dataset = make_batches(_spec(feed), [_records()], SERIALIZED, Mode.EVALUATION, 8)
    assert [inter_op for _, inter_op in _maps(dataset)] == [False, False]
    got = _elements_within(dataset, PIPELINE_SECONDS)
    assert len(got) == len(expected) == len(RECORDS) // 8
    for (x, y), (want_x, want_y) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(x, want_x)
        np.testing.assert_array_equal(y, want_y)


def _elements_within(dataset: tf.data.Dataset, seconds: float) -> list[Any]:
    """Every element of ``dataset``, read on a thread given ``seconds`` (a hung map fails, not hangs)."""
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.extend(dataset.as_numpy_iterator()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the pipeline gave {len(got)} elements in {seconds} s, then hung"
    return got


def test_the_sql_front_end_reads_rows_through_maps_on_the_calling_thread() -> None:
    """``edl-argo sql``'s evaluation and prediction feed a premade model's rows as a job's workers feed a
    model file's records, and get what the premade model's ``feed`` gives outside the context."""
    from edl_argo.sqlflow import columns as feature_columns
    from edl_argo.sqlflow.command import fed_rows
    from edl_argo.sqlflow.parser import parse
    from edl_argo.sqlflow.premade import PremadeModel

    schema = {"age": "int64", "workclass": "string", "income": "int64"}
    sample = {
        "age": [20, 30, 40, 50],
        "workclass": ["Private", "State", "Private", "Self"],
        "income": [0, 1, 0, 1],
    }
    statement = parse("SELECT * FROM t TO TRAIN DNNClassifier LABEL income INTO m")
    columns = feature_columns.build(statement.columns, schema, sample, "income")
    premade = PremadeModel("DNNClassifier", columns, "income")
    rows = {name: tf.constant(values) for name, values in sample.items()}
    for mode in (Mode.EVALUATION, Mode.PREDICTION):
        dataset = fed_rows(premade, rows, mode)
        maps = _maps(dataset)
        assert maps and not any(inter_op for _, inter_op in maps), maps
        expected = premade.feed(tf.data.Dataset.from_tensor_slices(rows), mode).batch(4)
        got, want = next(iter(dataset.batch(4))), next(iter(expected))
        for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
