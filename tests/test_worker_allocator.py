"""The worker's input pipeline leaves glibc's malloc tuning alone.

TensorFlow's ``Dataset.from_generator`` kernel calls ``mallopt(M_MMAP_THRESHOLD, 128 KiB)`` when it is
built on Python 3.11 (``tensorflow::data::ApplyPython311MemoryPatch``, a workaround for TensorFlow issue
65675). That pins the threshold for the rest of the process: every allocation of 128 KiB or more (each
activation, gradient and convolution buffer of a training step, each received gRPC message) is then a fresh
``mmap`` whose pages the kernel faults in and zeroes, and an ``munmap`` when it is freed. A CNN worker spent
more than a third of its step in the kernel that way (``docs/profile.md``). These tests count the page faults
of 1 MiB allocations after a pipeline has run, in a fresh process, where glibc's dynamic threshold serves
them from the heap without faults.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

#: 1 MiB allocations timed after the pipeline ran; each costs 256 page faults when it is a fresh mapping.
ALLOCATIONS = 200
PAGES_PER_ALLOCATION = 256

_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, resource, sys, threading, types
    import numpy as np
    import tensorflow as tf

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def faults_per_allocation():
        # page faults per 1 MiB malloc, written and freed, on a new thread: in an arena of its own, as
        # TensorFlow's compute threads allocate
        result = []

        def allocate():
            def cycle():
                block = libc.malloc(1 << 20)
                ctypes.memset(block, 1, 1 << 20)
                libc.free(block)

            for _ in range(5):  # glibc raises its threshold on the first free of a large mapping
                cycle()
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            for _ in range({allocations}):
                cycle()
            result.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / {allocations})

        thread = threading.Thread(target=allocate)
        thread.start()
        thread.join()
        return result[0]

    which = sys.argv[1]
    if which == "worker":
        from edl_argo.worker.data import stream_batches

        lengths = lambda record: (tf.strings.length(record), tf.strings.length(record))
        spec = types.SimpleNamespace(feed=lambda dataset, mode, metadata: dataset.map(lengths))

        def tasks():
            for seq in range(3):
                yield seq, np.array([b"a" * (seq + 1)] * 5, dtype=object)

        elements = list(stream_batches(spec, tasks, 2))
        assert len(elements) == 3 * (3 + 1), len(elements)  # 3 minibatches and an end per task
    elif which == "from_generator":
        signature = tf.TensorSpec([], tf.int32)
        dataset = tf.data.Dataset.from_generator(lambda: iter([1, 2]), output_signature=signature)
        assert list(dataset.as_numpy_iterator()) == [1, 2]
    print(json.dumps({{"faults": faults_per_allocation()}}))
    """
).format(allocations=ALLOCATIONS)


def _faults_per_allocation(which: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, which], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return float(json.loads(done.stdout.strip().splitlines()[-1])["faults"])


def test_large_allocations_come_from_the_heap_after_the_worker_pipeline_ran() -> None:
    assert _faults_per_allocation("worker") < PAGES_PER_ALLOCATION / 8


def test_the_measure_sees_tensorflows_from_generator_pinning_the_mmap_threshold() -> None:
    """The check above can fail: after ``Dataset.from_generator`` every 1 MiB block is a fresh mapping."""
    assert _faults_per_allocation("from_generator") >= PAGES_PER_ALLOCATION * 0.9
