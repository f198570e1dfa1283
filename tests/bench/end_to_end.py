"""A dense-model job end to end against ``model.fit`` end to end, each a program of its own: a measurement,
not a test.

``python -m tests.bench.end_to_end [--model big_mlp] [--epochs 6] [--trials 3]``

The data is the model's benchmark records (:mod:`tests.bench.training`, the dense suite's cases). Each
trial times, from the start of its program to its end:

* ``fit``: a Python process that imports TensorFlow, reads the records through the model file's ``feed``,
  builds the model and runs ``model.fit`` for the epochs (batch 64, no shuffle);
* ours: ``edl-argo train`` with 1 worker and 1 PS (synchronous), the same epochs and minibatch, which also
  exports the trained model at the end.

The two alternate, so both see the same machine. Prints every trial and the median ratio fit ÷ ours.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.data import write_records
from tests.bench.training import BATCH, SUITE

ROOT = Path(__file__).resolve().parents[2]
#: The ``fit`` program: model file and data folder, epochs as arguments.
FIT_PROGRAM = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from edl_argo.model import load_model_spec
from tests.bench.data import feed_to_arrays, read_records
model_def, data, epochs, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
spec = load_model_spec(model_def)
features, labels = feed_to_arrays(spec, read_records(data))
model = spec.custom_model()
model.compile(optimizer=spec.optimizer(), loss=spec.loss)
model.fit(features, labels, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
"""


def timed(command: list[str], env: dict[str, str]) -> float:
    """Seconds ``command`` ran; raises if it failed."""
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{command[:3]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    cases = {case.name.removeprefix("suite_"): case for case in SUITE}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(cases), default="big_mlp")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    case = cases[args.model]
    with tempfile.TemporaryDirectory(prefix="edl-e2e-") as scratch:
        work = Path(scratch)
        data = write_records(work / "data", case.records(False))
        env = {**os.environ, "EDL_RUN_DIR": str(work / "run"), "EDL_NO_PROGRESS_BAR": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        fit = [sys.executable, "-c", FIT_PROGRAM, str(case.model_def), data, str(args.epochs), str(BATCH)]
        ratios = []
        for trial in range(args.trials):
            ours = [
                str(Path(sys.executable).with_name("edl-argo")),
                *("train", "--model-def", str(case.model_def), "--training-data", data),
                *("--output", str(work / f"out-{trial}"), "--num-workers", "1", "--num-ps", "1"),
                *("--minibatch-size", str(BATCH), "--num-epochs", str(args.epochs), "--log-level", "WARNING"),
            ]
            fit_seconds, our_seconds = timed(fit, env), timed(ours, env)
            ratios.append(fit_seconds / our_seconds)
            load = os.getloadavg()[0]
            print(
                f"trial {trial + 1}: fit {fit_seconds:.1f} s, ours {our_seconds:.1f} s, "
                f"fit ÷ ours {ratios[-1]:.2f} (load average {load:.1f})",
                flush=True,
            )
        median = statistics.median(ratios)
        print(f"{args.model}, {args.epochs} epochs: fit ÷ ours end to end, median {median:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
