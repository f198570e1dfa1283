"""Training stability: ElasticDL's own MNIST model, many times per strategy, next to ``model.fit``.

ElasticDL's model-zoo MNIST model (``tests/bench/models/mnist_functional_api.py``: convolutions,
BatchNormalization, Dropout, ``SGD(0.1)``) trains on scikit-learn's digits at 28×28 (1,437 records in 4
shards, minibatch 64, 4 minibatches per task, 8 epochs) and is scored on the 360 test records. One run gives
one accuracy; the model is fragile (its convolutions grow fast ahead of BatchNormalization), so accuracy
varies from run to run with the order of the data and the random draws, in ``fit`` too. A strategy is as
stable as ``fit`` when its distribution over runs has no tail that ``fit``'s lacks: each job configuration's
lowest accuracy may fall below ``fit``'s lowest by at most 0.03 (issue 37's goal). Every run is a new
process with new random draws (``fit``: ``keras.utils.set_random_seed(run)``, the model's own ``feed``, which
shuffles with a buffer of 1,024); a run below 0.85 is counted as collapsed.

``fit`` collapses too, rarely (4 runs below 0.85 in 120 measured, the lowest 0.503), so a minimum over 10 runs
says little about its tail: ``fit`` runs 30 times (a run takes seconds), each job configuration 10 times
(1 in ``--quick``, with 1 epoch). Each configuration's row also gives the one-sided p-value of Fisher's exact
test that it collapses more often than ``fit`` (small: a tail ``fit`` lacks; the hypergeometric tail, computed
exactly); a second goal asks that p be at least 0.05. The first goal, the issue's, compares two minima of a
few runs each: it fails for any configuration that draws one of the rare collapses ``fit`` also has.

Usage of the child that runs ``fit``: ``python -m tests.bench.stability DATA RUNS EPOCHS`` (one JSON line
per run).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.bench.common import ROOT, BenchContext, BenchResult, Goal, Stat, child_env
from tests.bench.data import digits_28x28_records, write_records

MODEL = ROOT / "tests" / "bench" / "models" / "mnist_functional_api.py"
MINIBATCH = 64
MINIBATCHES_PER_TASK = 4
EPOCHS = 8
SHARDS = 4
FULL_RUNS = 10
FULL_FIT_RUNS = 30
#: A run whose test accuracy is below this has collapsed (``fit`` reaches 0.90-0.97 here).
COLLAPSED_BELOW = 0.85
#: How far a job configuration's lowest accuracy may fall below ``fit``'s lowest.
MAX_TAIL_GAP = 0.03
#: Below this p-value, a configuration collapses more often than ``fit`` (a tail ``fit`` lacks).
MIN_P_VALUE = 0.05
#: The longest one run may take (a job of 4 workers on a loaded 2-core machine takes about a minute).
RUN_TIMEOUT = 900.0


@dataclass(frozen=True)
class JobConfig:
    """One way to train the model as a job: its label in the report and its ``edl-argo train`` flags."""

    label: str
    flags: tuple[str, ...]


JOBS = (
    JobConfig("ParameterServerStrategy, 1 worker + 2 PS, sync", ("--num-workers", "1", "--num-ps", "2")),
    JobConfig(
        "ParameterServerStrategy, 4 workers + 2 PS, sync, --grads-to-wait 1",
        ("--num-workers", "4", "--num-ps", "2", "--grads-to-wait", "1"),
    ),
    JobConfig(
        "ParameterServerStrategy, 1 worker + 2 PS, --use-async",
        ("--num-workers", "1", "--num-ps", "2", "--use-async"),
    ),
    JobConfig(
        "ParameterServerStrategy, 2 workers + 2 PS, --use-async",
        ("--num-workers", "2", "--num-ps", "2", "--use-async"),
    ),
    JobConfig(
        "AllreduceStrategy, 1 worker", ("--num-workers", "1", "--distribution-strategy", "AllreduceStrategy")
    ),
)
FIT = "plain `model.fit`, batch 64"


def _fit_accuracies(ctx: BenchContext, data: Path, runs: int, epochs: int) -> list[float]:
    """``runs`` accuracies of ``model.fit``, from a child process (:func:`main`)."""
    command = [sys.executable, "-m", "tests.bench.stability", str(data), str(runs), str(epochs)]
    done = subprocess.run(
        command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT * runs
    )
    if done.returncode != 0:
        raise RuntimeError(f"the fit child failed: {done.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line)["accuracy"] for line in done.stdout.splitlines() if line.startswith("{")]


def _job_accuracy(ctx: BenchContext, data: Path, config: JobConfig, run: int, epochs: int) -> float:
    """The final test accuracy of one ``edl-argo train`` job of ``config``."""
    name = f"stability-{JOBS.index(config)}-{run}"
    output = ctx.workdir / "jobs" / name
    metrics = output / "metrics.json"
    command = [
        sys.executable,
        "-m",
        "edl_argo.cli",
        "train",
        f"--model-def={MODEL}",
        f"--training-data={data / 'train'}",
        f"--validation-data={data / 'test'}",
        f"--output={output / 'model'}",
        f"--metrics-output={metrics}",
        f"--job-name={name}",
        f"--num-epochs={epochs}",
        f"--minibatch-size={MINIBATCH}",
        f"--num-minibatches-per-task={MINIBATCHES_PER_TASK}",
        "--log-level=WARNING",
        *config.flags,
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    if done.returncode != 0:
        raise RuntimeError(f"{config.label}, run {run}: {done.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(metrics.read_text())["accuracy"])


def collapsed(accuracies: list[float]) -> int:
    return sum(a < COLLAPSED_BELOW for a in accuracies)


def more_collapses_p_value(runs: list[float], fit: list[float]) -> float:
    """One-sided Fisher exact test: the probability, were collapses equally likely in both, that ``runs``
    would hold at least as many of all the collapses as it does (the hypergeometric tail)."""
    hits = collapsed(runs)
    total = hits + collapsed(fit)
    size, population = len(runs), len(runs) + len(fit)
    return sum(
        math.comb(total, k) * math.comb(population - total, size - k)
        for k in range(hits, min(total, size) + 1)
    ) / math.comb(population, size)


def _row(label: str, accuracies: list[float], p_value: float | None = None) -> dict[str, object]:
    return {
        "how it trained": label,
        "runs": len(accuracies),
        "test accuracy": Stat.of(accuracies).format(3),
        f"collapsed (< {COLLAPSED_BELOW})": collapsed(accuracies),
        "p (collapses more than fit)": "" if p_value is None else f"{p_value:.2f}",
        "accuracies": ", ".join(f"{a:.3f}" for a in sorted(accuracies)),
    }


def training_stability(ctx: BenchContext) -> BenchResult:
    runs, fit_runs, epochs = (1, 1, 1) if ctx.quick else (FULL_RUNS, FULL_FIT_RUNS, EPOCHS)
    data = ctx.folder("stability")
    train, test = digits_28x28_records()
    write_records(data / "train", train, shards=SHARDS)
    write_records(data / "test", test)
    fit = _fit_accuracies(ctx, data, fit_runs, epochs)
    ctx.log(f"[bench] stability: fit {sorted(fit)}")
    result = BenchResult(
        name="training_stability",
        title="Training stability: ElasticDL's MNIST model, run after run, next to fit",
        method=__doc__ or "",
        columns=[
            "how it trained",
            "runs",
            "test accuracy",
            f"collapsed (< {COLLAPSED_BELOW})",
            "p (collapses more than fit)",
            "accuracies",
        ],
        rows=[_row(FIT, fit)],
    )
    for config in JOBS:
        accuracies = []
        for run in range(runs):
            accuracies.append(_job_accuracy(ctx, data, config, run, epochs))
            ctx.log(f"[bench] stability: {config.label} run {run}: {accuracies[-1]:.3f}")
        p_value = more_collapses_p_value(accuracies, fit)
        result.rows.append(_row(config.label, accuracies, p_value))
        result.goals.append(
            Goal(
                f"{config.label}: lowest accuracy − fit's lowest ≥ −{MAX_TAIL_GAP}",
                Stat.of([min(accuracies) - min(fit)]),
                -MAX_TAIL_GAP,
            )
        )
        result.goals.append(
            Goal(
                f"{config.label}: collapses no more often than fit (one-sided Fisher p ≥ {MIN_P_VALUE})",
                Stat.of([p_value]),
                MIN_P_VALUE,
            )
        )
    return result


def main(argv: list[str]) -> int:
    """The ``fit`` child: ``DATA RUNS EPOCHS``; prints ``{"run": i, "accuracy": a}`` per run."""
    import keras
    import numpy as np
    import tensorflow as tf

    from edl_argo.model import Mode, load_model_spec
    from tests.bench.data import read_records

    data, runs, epochs = Path(argv[0]), int(argv[1]), int(argv[2])
    spec = load_model_spec(str(MODEL))
    train = read_records(str(data / "train"))
    test = tf.data.Dataset.from_tensor_slices(read_records(str(data / "test")))
    features, labels = next(iter(spec.feed(test, Mode.EVALUATION, None).batch(100_000)))
    for run in range(runs):
        keras.utils.clear_session()
        keras.utils.set_random_seed(run)
        model = spec.custom_model()
        # compile() hands the loss labels converted to the predictions' dtype; the model's loss wants ints.
        model.compile(optimizer=spec.optimizer(), loss=lambda y, p: spec.loss(tf.cast(y, tf.int32), p))
        batches = spec.feed(tf.data.Dataset.from_tensor_slices(train), Mode.TRAINING, None).batch(MINIBATCH)
        model.fit(batches, epochs=epochs, verbose=0)
        predicted = np.argmax(np.asarray(model(features, training=False)), axis=1)
        accuracy = float(np.mean(predicted == np.reshape(np.asarray(labels), [-1])))
        print(json.dumps({"run": run, "accuracy": accuracy}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
