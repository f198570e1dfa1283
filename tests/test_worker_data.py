"""The worker's streaming input pipeline (:func:`edl_argo.worker.data.stream_batches`) ends promptly, and its
elements reach the training thread as Python values (:class:`~edl_argo.worker.data.StreamElements`).

With tf.data's autotuning on, destroying the iterator of a pipeline that streamed many tasks waits for the
autotuner's optimization thread: 1.2-1.6 s in a loop of 120 tasks here, and up to 7.6 s at the end of a
digits job, where every worker's process (and so the master, which waits for its pods) sat idle that long.
"""

from __future__ import annotations

import time
import types

import numpy as np
import tensorflow as tf

from edl_argo.worker.data import StreamElements, stream_batches

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
