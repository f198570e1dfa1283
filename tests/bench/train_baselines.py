"""Training baselines in a child process: plain ``model.fit`` (on numpy arrays, and on a ``tf.data``
pipeline) and TF's ``ParameterServerStrategy``.

Started by :mod:`tests.bench.training` as ``python -m tests.bench.train_baselines --kind fit|fit_tfdata|tf_ps
--model-def PATH --data DIR``, one process per kind (once TF connects to a cluster, the process's local
``fit`` functions stop working). It loads the data, builds and warms up its baseline, prints
``{"ready": ...}``, then answers each ``measure SECONDS`` line on stdin with one JSON line (examples per
second over about SECONDS of timed steps) until ``quit`` or end of input. Between requests it is idle, so
the parent can run our job in the meantime and pair measurements taken one after the other.

Both baselines train the model file's ``custom_model()`` with its ``loss`` and ``optimizer()`` on the
records of ``--data`` passed through the model file's own ``feed`` (so they see what our workers see), held
in memory as numpy arrays, batch 64:

* ``fit``: ``model.compile(optimizer, loss)`` with Keras's defaults, then ``model.fit``; a callback times
  the steps after a short warm-up and stops training once the window is over. The steps that cross an epoch
  boundary are timed apart (:class:`_StepTimer`): the figure is ``fit``'s steady state, and the answer
  says what the boundaries cost. With
  ``--size-thread-pools`` it first sizes TensorFlow's thread pools to its cgroup's CPU quota, as every pod
  does (:func:`~edl_argo.cpu_limit.size_tensorflow_threads`; :mod:`tests.bench.cpu_limit` runs it so), and
  its ``ready`` line says which pools it has.
* ``fit_tfdata``: the same ``model.fit``, on what a careful user writes instead of numpy in memory: a
  ``tf.data`` pipeline that reads the RecordIO shards of ``--data`` again every epoch (a generator over
  :func:`~tests.bench.data.read_records`) and decodes them every epoch with the model file's ``feed``, with
  tf.data's map parallelization on, batched and prefetched (autotuned). Its generator is
  ``Dataset.from_generator``, which on Python 3.11 pins glibc's mmap threshold for the process
  (``docs/profile.md``, *Found*): that slows this baseline's every step, not only its input; our
  workers avoid it, so compare against ``fit`` on numpy first.
* ``tf_ps``: an in-process cluster of ``tf.distribute.Server``\\ s, one worker and one PS on loopback;
  ``ParameterServerStrategy`` with a ``ClusterCoordinator`` that schedules a ``tf.function`` train step
  (GradientTape + ``optimizer.apply_gradients`` inside ``strategy.run``) over a
  ``create_per_worker_dataset`` iterator (Keras 3 has no ``model.fit`` path for this strategy). Steps are
  scheduled in chunks of about one second and joined; the warm-up steps are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from edl_argo.cpu_limit import cgroup_cpu_limit, size_tensorflow_threads
from edl_argo.model import Mode, ModelSpec, load_model_spec
from edl_argo.pods import find_free_port
from tests.bench.data import feed_to_arrays, read_records

BATCH = 64
#: ``fit`` gets at least this many examples per epoch (the data repeated), so that a small dataset (1,437
#: digits) does not make it start a new epoch every few steps.
FIT_MIN_EXAMPLES = 16_384
#: Steps run untimed at the start of every measurement (after the first one's longer warm-up).
REWARM_STEPS = 3


class _StepTimer(keras.callbacks.Callback):
    """Times the steps after ``warmup`` steps; stops ``fit`` once ``seconds`` are timed.

    The step that follows an epoch boundary is timed apart from the others: Keras starts the epoch's data
    iteration between the epoch's start and its first step, which took 30-45 ms at most boundaries and
    0.8-1.3 s at about two in five of them on an idle machine, up to 2.5 s beside another job
    (``docs/benchmarks.md``), so that a window of a few seconds read a third slower or not as it caught
    them or none. ``examples_per_s`` is the steady state (steps within an epoch);
    ``examples_per_s_with_epochs`` counts the boundaries in."""

    def __init__(self, warmup: int, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.warmup = warmup
        self.seconds = seconds
        self.clock = clock
        self.steps = 0
        self.timed_steps = 0
        self.boundary_steps = 0
        self.boundary_seconds = 0.0
        self.started = 0.0
        self.last = 0.0
        self.longest = 0.0  # the longest timed step within an epoch (a stall of the machine shows here)
        self._after_boundary = False

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._after_boundary = True

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.steps += 1
        now = self.clock()
        if self.steps == self.warmup:
            self.started = self.last = now
        elif self.steps > self.warmup:
            took = now - self.last
            if self._after_boundary:
                self.boundary_steps += 1
                self.boundary_seconds += took
            else:
                self.timed_steps += 1
                self.longest = max(self.longest, took)
            self.last = now
        self._after_boundary = False
        if self.steps >= self.warmup and now - self.started >= self.seconds:
            self.model.stop_training = True

    def result(self) -> dict[str, float]:
        elapsed = self.last - self.started
        steady = elapsed - self.boundary_seconds  # the steps within an epoch
        return {
            "examples_per_s": self.timed_steps * BATCH / steady if steady > 0 else 0.0,
            "examples_per_s_with_epochs": (
                (self.timed_steps + self.boundary_steps) * BATCH / elapsed if elapsed > 0 else 0.0
            ),
            "steps": self.timed_steps,
            "s": elapsed,
            "longest_step_s": self.longest,
            "epoch_boundaries": self.boundary_steps,
            "epoch_boundary_s": self.boundary_seconds,
        }


class FitBaseline:
    """Plain ``model.fit`` with Keras's defaults."""

    def __init__(self, spec: ModelSpec, features: Any, labels: np.ndarray) -> None:
        copies = max(1, -(-FIT_MIN_EXAMPLES // len(labels)))
        self.features = tf.nest.map_structure(lambda a: np.concatenate([a] * copies), features)
        self.labels = np.concatenate([labels] * copies)
        self.model = spec.custom_model()
        self.model.compile(optimizer=spec.optimizer(), loss=spec.loss)

    def run(self, warmup: int, seconds: float) -> dict[str, float]:
        """One ``fit`` call: ``warmup`` untimed steps, then about ``seconds`` of timed steps."""
        timer = _StepTimer(warmup, seconds)
        self.model.fit(
            self.features, self.labels, batch_size=BATCH, epochs=1_000_000, verbose=0, callbacks=[timer]
        )
        return timer.result()


class FitTfDataBaseline:
    """``model.fit`` on a ``tf.data`` pipeline that reads and decodes the records every epoch."""

    def __init__(self, spec: ModelSpec, data: str) -> None:
        self.model = spec.custom_model()
        self.model.compile(optimizer=spec.optimizer(), loss=spec.loss)
        records = tf.data.Dataset.from_generator(
            lambda: iter(read_records(data)), output_signature=tf.TensorSpec([], tf.string)
        )
        options = tf.data.Options()
        options.experimental_optimization.map_parallelization = True
        dataset = spec.feed(records, Mode.TRAINING, None).batch(BATCH).repeat()
        self.dataset = dataset.with_options(options).prefetch(tf.data.AUTOTUNE)

    def run(self, warmup: int, seconds: float) -> dict[str, float]:
        timer = _StepTimer(warmup, seconds)
        self.model.fit(
            self.dataset,
            epochs=1_000_000,
            steps_per_epoch=FIT_MIN_EXAMPLES // BATCH,
            verbose=0,
            callbacks=[timer],
        )
        return timer.result()


class TfPsBaseline:
    """``ParameterServerStrategy`` with 1 worker + 1 PS as ``tf.distribute.Server``\\ s in this process."""

    def __init__(self, spec: ModelSpec, features: Any, labels: np.ndarray) -> None:
        cluster = tf.train.ClusterSpec(
            {"worker": [f"localhost:{find_free_port()}"], "ps": [f"localhost:{find_free_port()}"]}
        )
        worker_config = tf.compat.v1.ConfigProto()
        worker_config.inter_op_parallelism_threads = 2  # TF's in-process cluster recipe, for 1 worker
        self._servers = [
            tf.distribute.Server(
                cluster, job_name="worker", task_index=0, config=worker_config, protocol="grpc"
            ),
            tf.distribute.Server(cluster, job_name="ps", task_index=0, protocol="grpc"),
        ]
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
        strategy = tf.distribute.ParameterServerStrategy(resolver)
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = spec.custom_model()
            optimizer = spec.optimizer()
            optimizer.build(model.trainable_variables)

        def dataset_fn(_context: Any = None) -> tf.data.Dataset:
            dataset = tf.data.Dataset.from_tensor_slices((features, labels)).shuffle(4096).repeat()
            return dataset.batch(BATCH, drop_remainder=True).prefetch(2)

        self.iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))

        @tf.function
        def train_step(iterator: Any) -> tf.Tensor:
            def replica_step(batch_features: Any, batch_labels: Any) -> tf.Tensor:
                with tf.GradientTape() as tape:
                    loss = spec.loss(batch_labels, model(batch_features, training=True))
                variables = model.trainable_variables
                optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
                return loss

            batch_features, batch_labels = next(iterator)
            return strategy.run(replica_step, args=(batch_features, batch_labels))

        self.train_step = train_step

    def _steps(self, count: int) -> float:
        started = time.perf_counter()
        for _ in range(count):
            self.coordinator.schedule(self.train_step, args=(self.iterator,))
        self.coordinator.join()
        return time.perf_counter() - started

    def run(self, warmup: int, seconds: float) -> dict[str, float]:
        """``warmup`` untimed steps (joined one by one), then chunks of ~1 s of steps for ``seconds``."""
        for _ in range(warmup):
            self._steps(1)
        chunk, steps, elapsed = 5, 0, 0.0
        while elapsed < seconds:
            took = self._steps(chunk)
            steps += chunk
            elapsed += took
            chunk = max(5, min(500, int(chunk / took)))
        return {"examples_per_s": steps * BATCH / elapsed if elapsed else 0.0, "steps": steps, "s": elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="training baselines for tests.bench.training")
    parser.add_argument("--kind", choices=["fit", "fit_tfdata", "tf_ps"], required=True)
    parser.add_argument("--model-def", required=True)
    parser.add_argument("--data", required=True, help="folder of RecordIO shards")
    parser.add_argument("--warmup-steps", type=int, default=20, help="untimed steps before the first request")
    parser.add_argument(
        "--size-thread-pools", action="store_true", help="size TensorFlow's pools to the CPU quota first"
    )
    args = parser.parse_args(argv)
    sized = size_tensorflow_threads() if args.size_thread_pools else None
    spec = load_model_spec(args.model_def)
    features, labels = feed_to_arrays(spec, read_records(args.data))
    baseline: FitBaseline | FitTfDataBaseline | TfPsBaseline
    if args.kind == "fit_tfdata":
        baseline = FitTfDataBaseline(spec, args.data)
    else:
        baseline = (FitBaseline if args.kind == "fit" else TfPsBaseline)(spec, features, labels)
    baseline.run(args.warmup_steps, 0.0)
    pools = {
        "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        "source": sized.source if sized else "default",
        "cpu_limit": cgroup_cpu_limit(),
    }
    print(json.dumps({"ready": True, "records": len(labels), **pools}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        seconds = float(words[1])
        print(json.dumps(baseline.run(REWARM_STEPS, seconds)), flush=True)
    sys.stderr.flush()
    os._exit(0)  # the in-process TF servers cannot be shut down; do not wait for their threads


if __name__ == "__main__":
    sys.exit(main())
