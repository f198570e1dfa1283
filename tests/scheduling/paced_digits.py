"""TEST-ONLY model file: the digits CNN of ``examples/model_zoo/digits.py`` whose training input is paced at
:data:`SECONDS_PER_RECORD` by sleeping, not by computing.

On a simulated cluster each worker pod stands for a CPU of its own, but every pod here shares the machine's
two cores. Pacing makes a worker's throughput what its simulated CPU gives (about 1 / SECONDS_PER_RECORD
records/s) whatever the other pods do: the sleep holds no core, so throughput grows with the number of
workers as on a real cluster, and the scenarios measure scheduling, not this machine.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import tensorflow as tf

from edl_argo.model import Mode

#: Seconds of simulated work per training record.
SECONDS_PER_RECORD = 0.004


def _load_digits() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "examples" / "model_zoo" / "digits.py"
    spec = importlib.util.spec_from_file_location("paced_digits_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # AutoGraph reads the source of feed's functions through the module
    spec.loader.exec_module(module)
    return module


_DIGITS = _load_digits()
custom_model = _DIGITS.custom_model
loss = _DIGITS.loss
optimizer = _DIGITS.optimizer
eval_metrics_fn = _DIGITS.eval_metrics_fn


def _paced(record: tf.Tensor) -> tf.Tensor:
    slept = tf.py_function(lambda: time.sleep(SECONDS_PER_RECORD) or 0, [], tf.int32)
    with tf.control_dependencies([slept]):
        return tf.identity(record)


def feed(dataset: tf.data.Dataset, mode: str, metadata: object) -> tf.data.Dataset:
    if mode == Mode.TRAINING:
        dataset = dataset.map(_paced)
    return _DIGITS.feed(dataset, mode, metadata)
