"""From a task's record range to the batches a model consumes."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from edl_argo.model import Mode, ModelSpec
from edl_argo.model.feed_maps import maps_on_the_calling_thread
from edl_argo.proto import master_pb2
from edl_argo.readers import (
    SERIALIZED,
    RangeReader,
    ReaderSpec,
    Records,
    RecordSchema,
    range_reader,
    spec_from_json,
)

#: The first component :func:`python_stream` gives after the generator's last element (never yielded).
STREAM_END = np.iinfo(np.int64).min


class RecordSource:
    """Reads the record range of a task, through one reader per dataset (:mod:`edl_argo.readers`), each
    caching what it learns of a shard (an index, an open file's footer, a database engine).

    A shard read with a ``version`` (the one the master pinned, sent with the task) is read only in that
    version: :class:`~edl_argo.recordio.ShardChangedError` names it if it was replaced since.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: dict[tuple[str, str], RangeReader] = {}
        self._specs: dict[tuple[str, str], ReaderSpec] = {}

    def spec(self, task: master_pb2.Task) -> ReaderSpec:
        """The reader spec of ``task``'s dataset."""
        key = (task.data_spec, task.data_url)
        with self._lock:
            if key not in self._specs:
                self._specs[key] = spec_from_json(task.data_spec, task.data_url)
            return self._specs[key]

    def read(self, task: master_pb2.Task) -> Records:
        """The records of ``task``: ``[start, end)`` of its shard."""
        key = (task.data_spec, task.data_url)
        spec = self.spec(task)
        with self._lock:
            if key not in self._readers:
                self._readers[key] = range_reader(spec)
            reader = self._readers[key]
        return reader.read(task.shard, task.start, task.end, version=task.shard_version, hint=task.read_hint)


@tf.autograph.experimental.do_not_convert
def records_dataset(schema: RecordSchema, records: Sequence[Any]) -> tf.data.Dataset:
    """``records`` (arrays or tensors, one per :attr:`RecordSchema.dtypes` entry) as the dataset ``feed``
    receives: one serialized string per element, or a dict of the columns' scalars.

    The input pipeline's own functions are not converted by AutoGraph (:func:`stream_batches`)."""
    tensors = [_tensor(values, dtype) for values, dtype in zip(records, schema.dtypes, strict=True)]
    if not schema.columns:
        return tf.data.Dataset.from_tensor_slices(tensors[0])
    return tf.data.Dataset.from_tensor_slices(dict(zip(schema.names, tensors, strict=True)))


def _tensor(values: Any, dtype: str) -> tf.Tensor:
    if isinstance(values, tf.Tensor):
        return values
    if dtype == "string":
        return tf.constant(list(values), dtype=tf.string, shape=[len(values)])
    return tf.constant(values, dtype=tf.as_dtype(dtype))


def make_batches(
    spec: ModelSpec,
    records: Records,
    schema: RecordSchema,
    mode: str,
    minibatch_size: int,
    metadata: Any = None,
) -> tf.data.Dataset:
    """Records → ``feed(dataset, mode, metadata)`` → batches of ``minibatch_size``."""
    return fed_records(spec, schema, records, mode, metadata).batch(minibatch_size).prefetch(1)


def fed_records(
    spec: ModelSpec, schema: RecordSchema, records: Sequence[Any], mode: str, metadata: Any
) -> tf.data.Dataset:
    """``feed(dataset of records, mode, metadata)``, its per-record maps run on the thread that asks for the
    element (:mod:`edl_argo.model.feed_maps`)."""
    with maps_on_the_calling_thread():
        return spec.feed(records_dataset(schema, records), mode, metadata)


def stream_batches(
    spec: ModelSpec,
    tasks: Callable[[], Iterator[tuple[Any, ...]]],
    minibatch_size: int,
    schema: RecordSchema = SERIALIZED,
    metadata: Any = None,
    mode: str = Mode.TRAINING,
) -> tf.data.Dataset:
    """One input pipeline for a whole job (training), or for a worker's evaluation or prediction tasks
    (:class:`TaskBatches`): ``tasks()`` yields ``(seq, *records)`` per task (the records in ``schema``);
    each task's records go through ``feed(dataset, mode, metadata)`` (traced once, for every task) and are
    batched on their own, so that no minibatch holds records of two tasks.

    AutoGraph converts ``feed`` (called from the one function of the pipeline it converts), and so the
    functions ``feed`` maps, as it converts those of ``fit``'s input; it converts none of the pipeline's other
    functions, which are this module's (each costs a pod tens of milliseconds before its first step).

    Elements are ``(seq, item)``: ``item`` (a :class:`tf.experimental.Optional`) holds a minibatch of task
    ``seq``, or nothing after a task's last minibatch. Maps run in parallel (tf.data's map parallelization).
    Nothing is prefetched: the worker prepares minibatches ahead while its training step waits
    (:mod:`edl_argo.worker.input_prefetch`), not beside its compute. The dataset is meant to be iterated
    once (:func:`python_stream`).
    """
    signature = (
        tf.TensorSpec([], tf.int64),
        *(tf.TensorSpec([None], tf.as_dtype(dtype)) for dtype in schema.dtypes),
    )
    tasks_dataset = python_stream(tasks, signature)

    def task_batches(seq: tf.Tensor, *records: tf.Tensor) -> tf.data.Dataset:
        with maps_on_the_calling_thread():  # as in fed_records (called here, AutoGraph would convert it)
            fed = spec.feed(records_dataset(schema, records), mode, metadata)
        batches = fed.batch(minibatch_size)
        end = tf.experimental.Optional.empty(batches.element_spec)

        @tf.autograph.experimental.do_not_convert
        def of_task(*batch: tf.Tensor) -> tuple[tf.Tensor, tf.experimental.Optional]:
            # tf.data passes a tuple's parts as arguments: the minibatch is rebuilt as ``feed`` made it (a
            # tensor or a dict as well as a tuple).
            minibatch = tf.nest.pack_sequence_as(batches.element_spec, tf.nest.flatten(batch))
            return seq, tf.experimental.Optional.from_value(minibatch)

        return batches.map(of_task).concatenate(tf.data.Dataset.from_tensors((seq, end)))

    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = True
    # Each minibatch's maps run on their own, not fused with its batching: a fused MapAndBatch took 2.6 ms of
    # CPU (1.9 ms wall) per minibatch of 64 digits records against 1.5 ms (1.1 ms), beside the step's compute.
    options.experimental_optimization.map_and_batch_fusion = False
    options.deterministic = True
    # No autotuning: its optimization thread made dropping this iterator (a worker's last act) wait 1-8 s
    # (tests/test_worker_data.py), and it bought no throughput here. Parallel maps then run on every core.
    options.autotune.enabled = False
    return tasks_dataset.flat_map(task_batches).with_options(options)


class TaskBatches:
    """The minibatches of evaluation or prediction tasks (a worker's; the ranges ``edl-argo evaluate`` and
    ``predict`` read), one task after another, through one pipeline (:func:`stream_batches` in ``mode``)
    that traces ``feed`` once for all of them.

    A pipeline of its own per task (:func:`make_batches`) traces ``feed`` and starts an iterator again each
    time: 20-50 ms of CPU a task of digits, against 3-5 ms here. Each task gets the minibatches its own
    pipeline would give. The pipeline is used by one thread at a time. Its source never waits: it gives the
    records of the task that :meth:`batches` just handed it, or, if there are none, an empty task of
    :data:`IDLE_SEQ`, so that no call here can block on a task that was never given.
    """

    #: The seq of "no task was waiting" (the source found nothing to give).
    IDLE_SEQ = -1

    def __init__(
        self, spec: ModelSpec, mode: str, schema: RecordSchema, minibatch_size: int, metadata: Any = None
    ) -> None:
        """Builds the pipeline (and so traces ``feed``: what it raises is raised here)."""
        self._schema = schema
        self._waiting: list[tuple[Any, ...]] = []
        self._seqs = itertools.count()
        self._unfinished: int | None = None  # the seq of a task handed out and not read to its end
        pipeline = stream_batches(spec, self._generate, minibatch_size, schema, metadata, mode)
        self._elements = StreamElements(iter(pipeline))

    def batches(self, records: Records) -> Iterator[Any]:
        """The minibatches of one task's ``records``, in order (the task is handed to the pipeline when the
        first is asked for). What the pipeline raises for one of them is raised here. The task's remaining
        minibatches are read and dropped when the caller stops early (an error, ``close()``) or asks for the
        next task's first: the next task starts with its own."""
        self._skip_unfinished()
        seq = next(self._seqs)
        self._waiting.append((np.int64(seq), *records))
        self._unfinished = seq
        try:
            while True:
                got, minibatch = next(self._elements)
                if got == self.IDLE_SEQ:  # never for a task handed out and read by one caller at a time
                    raise RuntimeError(f"the minibatches of evaluation or prediction task {seq} were lost")
                if got == seq and minibatch is None:
                    self._unfinished = None
                    return
                if got == seq:
                    yield minibatch
        finally:
            if self._unfinished == seq:
                self._skip_unfinished()

    def _skip_unfinished(self) -> None:
        """Read and drop what is left of the task handed out last, if it was not read to its end: up to that
        end, or to an idle task (the pipeline moved past the task without ending it)."""
        seq, self._unfinished = self._unfinished, None
        while seq is not None:
            try:
                got, minibatch = next(self._elements)
            except StopIteration:
                return
            except Exception:  # another minibatch of the task given up: its error was the task's
                continue
            if got == self.IDLE_SEQ or (got == seq and minibatch is None):
                return

    def _generate(self) -> Iterator[tuple[Any, ...]]:
        while True:
            yield self._waiting.pop(0) if self._waiting else (np.int64(self.IDLE_SEQ), *self._schema.empty())


class StreamElements:
    """The elements of a :func:`stream_batches` iterator as Python values: ``(seq, minibatch)``, ``seq`` an
    int and ``minibatch`` None after a task's last one. Unpacked on the thread that iterates (the worker's
    prefetch thread), not on the one that trains: the TensorFlow calls it takes cost the training thread
    0.2-0.4 ms a step. An error the pipeline raises for one element is raised for it; iterating goes on."""

    def __init__(self, elements: Iterator[tuple[tf.Tensor, tf.experimental.Optional]]) -> None:
        self._elements = elements

    def __iter__(self) -> StreamElements:
        return self

    def __next__(self) -> tuple[int, Any | None]:
        seq, item = next(self._elements)
        return int(seq), (item.get_value() if bool(item.has_value()) else None)


def python_stream(
    generate: Callable[[], Iterator[tuple[Any, ...]]], signature: tuple[tf.TensorSpec, ...]
) -> tf.data.Dataset:
    """The elements of ``generate()`` (one call, on the first element asked for), pulled on a tf.data thread,
    each a tuple matching ``signature``; the first component must be a scalar ``int64`` below
    :data:`STREAM_END`.

    Not ``Dataset.from_generator``: on Python 3.11 TensorFlow's generator kernel calls
    ``mallopt(M_MMAP_THRESHOLD, 128 KiB)`` when it is built (``ApplyPython311MemoryPatch``), which turns
    every later allocation of 128 KiB or more in the process (each buffer of a training step) into a fresh
    mapping that the kernel faults in and zeroes: a CNN worker spent a third of its step doing that
    (``docs/profile.md``). ``tf.py_function`` pulls from the same generator without that side effect.
    """
    state: dict[str, Iterator[tuple[Any, ...]]] = {}
    end = (
        np.int64(STREAM_END),
        *(np.zeros([dim or 0 for dim in spec.shape], spec.dtype.as_numpy_dtype) for spec in signature[1:]),
    )

    def pull(_: tf.Tensor) -> tuple[Any, ...]:
        if "elements" not in state:
            state["elements"] = generate()
        return next(state["elements"], end)

    @tf.autograph.experimental.do_not_convert
    def pulled(step: tf.Tensor) -> tuple[tf.Tensor, ...]:
        values = tf.py_function(pull, [step], [spec.dtype for spec in signature])
        for value, spec in zip(values, signature, strict=True):
            value.set_shape(spec.shape)
        return tuple(values)

    @tf.autograph.experimental.do_not_convert
    def before_the_end(first: tf.Tensor, *_: tf.Tensor) -> tf.Tensor:
        return first != STREAM_END

    return tf.data.Dataset.range(1).repeat().map(pulled).take_while(before_the_end)
