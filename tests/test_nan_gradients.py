"""Non-finite gradients with a finite loss (issue 24, item 5): never applied; ``--nan-gradients`` decides
whether the job fails or skips and counts the minibatches per worker in metrics.json. The parameter
server's own refusal of such pushes is in tests/test_ps_bounds.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.engine_helpers import read_metrics
from tests.test_cli import run_cli
from tests.test_hostile_input import QUICK_JOB, local_data, model_file, one_error_line, train

pytestmark = pytest.mark.timeout(240)
__all__ = ["local_data"]  # the module-scoped fixture, shared with tests/test_hostile_input.py

#: A loss that stays finite while its gradient is NaN on every minibatch whose labels add up to an odd
#: number (about half of them): the gradient of sqrt at 0 (as a norm of zero would give), times 0.
NAN_GRADIENTS_ON_ODD_LABEL_SUMS = """
def loss(labels, predictions):
    labels = tf.reshape(labels, [-1])
    mean = tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )
    odd = tf.equal(tf.math.floormod(tf.reduce_sum(tf.cast(labels, tf.int64)), 2), 1)
    zero = tf.reduce_sum(predictions) * 0.0
    return mean + tf.cond(odd, lambda: tf.sqrt(zero), lambda: zero)
"""


def test_nan_gradients_fail_the_job_at_once_naming_the_variable_task_and_shard(
    capsys: pytest.CaptureFixture[str], local_data: Path, tmp_path: Path
) -> None:
    model = model_file(tmp_path, "nan_gradients.py", NAN_GRADIENTS_ON_ODD_LABEL_SUMS)
    output = tmp_path / "out"
    code, _, err = run_cli(capsys, *train(local_data / "train", output, *QUICK_JOB, model=model))
    assert code == 1
    line = one_error_line(err)
    assert line.startswith("edl-argo train: error: the gradient of '"), line
    assert "is not finite at model version" in line and line.endswith("use --nan-gradients skip"), line
    assert "(task " in line and re.search(r", shard v-\S+/data-0000", line), line
    assert "worker_lost" not in err and "worker_relaunched" not in err
    assert not (output / "model").exists()


def test_nan_gradients_skip_skips_and_counts_them_per_worker(
    capsys: pytest.CaptureFixture[str], local_data: Path, tmp_path: Path
) -> None:
    model = model_file(tmp_path, "nan_gradients.py", NAN_GRADIENTS_ON_ODD_LABEL_SUMS)
    output = tmp_path / "out"
    argv = train(local_data / "train", output, *QUICK_JOB, "--nan-gradients", "skip", model=model)
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    metrics = read_metrics(output)
    skipped = metrics["nan_gradients_skipped"]
    # 2 epochs x 2 shards of 96 records x 6 minibatches of 16; each is NaN with probability 1/2; 1 worker.
    assert set(skipped) == {"0"} and 0 < skipped["0"] < 24, skipped
    assert metrics["nan_batches_skipped"] == 0
    assert all(np.isfinite(loss) for loss in metrics["training_loss_per_epoch"].values())
    assert metrics["relaunches"]["worker"] == 0
    assert "nan_gradients_skipped" in err
