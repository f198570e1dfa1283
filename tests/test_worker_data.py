"""The worker's streaming input pipeline (:func:`edl_argo.worker.data.stream_batches`) ends promptly, and its
elements reach the training thread as Python values (:class:`~edl_argo.worker.data.StreamElements`).

With tf.data's autotuning on, destroying the iterator of a pipeline that streamed many tasks waits for the
autotuner's optimization thread: 1.2-1.6 s in a loop of 120 tasks here, and up to 7.6 s at the end of a
digits job, where every worker's process (and so the master, which waits for its pods) sat idle that long.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from edl_argo.model import Mode
from edl_argo.readers import SERIALIZED
from edl_argo.worker.data import StreamElements, TaskBatches, make_batches, stream_batches

#: Tasks streamed before the iterator is dropped, and their records (minibatches of 8: 4 per task).
TASKS = 150
RECORDS_PER_TASK = 32
TASK_SECONDS = 0.02
#: Dropping the iterator of a pipeline with nothing left to do: microseconds; the autotuner took seconds.
DROP_BOUND_SECONDS = 0.25


def _parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    values = tf.strings.to_number(tf.strings.split(record, ","))
    return values[:4], values[4:]


def test_dropping_the_stream_after_many_tasks_does_not_wait_on_the_autotuner() -> None:
    spec = types.SimpleNamespace(feed=lambda dataset, mode, metadata: dataset.map(_parse))

    def tasks():
        for seq in range(TASKS):
            records = np.empty(RECORDS_PER_TASK, dtype=object)
            records[:] = [f"{seq},{i},1,2,{i % 2}".encode() for i in range(RECORDS_PER_TASK)]
            yield np.int64(seq), records
            time.sleep(TASK_SECONDS)  # a task's training, during which the autotuner runs

    iterator = iter(stream_batches(spec, tasks, 8))
    minibatches = sum(1 for seq, item in iterator if bool(item.has_value()))
    assert minibatches == TASKS * RECORDS_PER_TASK // 8

    started = time.monotonic()
    del iterator
    assert time.monotonic() - started < DROP_BOUND_SECONDS


def test_stream_elements_are_python_values_and_go_on_after_an_element_that_fails() -> None:
    spec = types.SimpleNamespace(feed=lambda dataset, mode, metadata: dataset.map(_parse))
    bad = b"1,2,not-a-number,4,0"

    def tasks():
        for seq, records in enumerate([[b"0,1,2,3,0"] * 4, [b"0,1,2,3,1", bad, *[b"0,1,2,3,1"] * 2]]):
            array = np.empty(len(records), dtype=object)
            array[:] = records
            yield np.int64(seq), array

    elements = StreamElements(iter(stream_batches(spec, tasks, 2)))
    got: list[tuple[int, int | None] | str] = []
    while True:
        try:
            seq, minibatch = next(elements)
        except StopIteration:
            break
        except tf.errors.InvalidArgumentError:
            got.append("error")
            continue
        assert isinstance(seq, int)
        got.append((seq, None if minibatch is None else int(minibatch[0].shape[0])))
    assert got == [(0, 2), (0, 2), (0, None), "error", (1, 2), (1, None)]


def _rows(values: list[bytes]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _counting_spec() -> tuple[types.SimpleNamespace, list[str]]:
    """A spec whose ``feed`` parses rows as ``_parse`` does (features only, to predict) and records the mode
    of each call."""
    calls: list[str] = []

    def feed(dataset: tf.data.Dataset, mode: str, metadata: object) -> tf.data.Dataset:
        calls.append(mode)
        return dataset.map(_parse if mode != Mode.PREDICTION else lambda record: _parse(record)[0])

    return types.SimpleNamespace(feed=feed), calls


def _values(batches: Iterable[Any]) -> list[Any]:
    return [tf.nest.map_structure(lambda tensor: tensor.numpy().tolist(), batch) for batch in batches]


@pytest.mark.parametrize("mode", [Mode.EVALUATION, Mode.PREDICTION])
def test_task_batches_trace_feed_once_and_give_each_task_what_its_own_pipeline_gives(mode: str) -> None:
    """A worker's evaluation and prediction tasks go through one pipeline per mode (``feed`` traced once),
    and each task gets exactly the minibatches that a pipeline of its own (``make_batches``) gives."""
    spec, calls = _counting_spec()
    tasks = [
        _rows([f"{task},{i},1,2,{i % 3}".encode() for i in range(size)])
        for task, size in enumerate([5, 8, 0, 3])
    ]
    expected = [_values(make_batches(spec, (records,), SERIALIZED, mode, 2)) for records in tasks]
    assert calls == [mode] * len(tasks)

    calls.clear()
    pipeline = TaskBatches(spec, mode, SERIALIZED, 2)
    assert [_values(pipeline.batches((records,))) for records in tasks] == expected
    assert calls == [mode]  # traced once, for every task


def test_a_task_that_fails_or_is_left_early_leaves_nothing_for_the_next() -> None:
    spec, _ = _counting_spec()
    pipeline = TaskBatches(spec, Mode.EVALUATION, SERIALIZED, 2)
    good = _rows([f"1,{i},1,2,0".encode() for i in range(6)])
    bad = _rows([b"0,1,2,3,0", b"0,1,not-a-number,3,0", *[b"0,1,2,3,1"] * 4])

    with pytest.raises(tf.errors.InvalidArgumentError):
        _values(pipeline.batches((bad,)))
    assert _values(pipeline.batches((good,))) == _values(
        make_batches(spec, (good,), SERIALIZED, Mode.EVALUATION, 2)
    )

    first = next(iter(pipeline.batches((bad[2:],))))  # one minibatch of 4 taken, then the task is dropped
    assert first[1].shape[0] == 2
    assert _values(pipeline.batches((good,))) == _values(
        make_batches(spec, (good,), SERIALIZED, Mode.EVALUATION, 2)
    )


def test_a_task_left_unread_is_skipped_when_the_next_one_starts() -> None:
    spec, _ = _counting_spec()
    pipeline = TaskBatches(spec, Mode.EVALUATION, SERIALIZED, 2)
    good = _rows([f"1,{i},1,2,0".encode() for i in range(6)])
    expected = _values(make_batches(spec, (good,), SERIALIZED, Mode.EVALUATION, 2))
    left = pipeline.batches((_rows([b"0,1,2,3,0"] * 6),))
    assert next(left)[1].shape[0] == 2  # not closed: its generator is still alive
    following = pipeline.batches((good,))
    got = _values([next(following)])
    left.close()  # late, in the middle of the next task: it takes nothing of it
    assert got + _values(following) == expected
    assert _values(pipeline.batches((good,))) == expected
