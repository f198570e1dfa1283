"""`make bench` still runs: its quick (smoke) mode on one training benchmark, end to end.

The benchmarks drive the engine through its internals (a tap on the job's ledger, the worker's step timers),
so an interface change can break them while every other test passes. Slow (a minute): `make test-slow`.
The stability benchmark's statistics are checked in `make test` (no training).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_quick_training_benchmark_measures_our_job_against_fit(tmp_path: Path) -> None:
    report = tmp_path / "bench.md"
    command = [
        sys.executable,
        "-m",
        "tests.bench.run",
        "--quick",
        "--only",
        "training_cnn",
        "--output",
        str(report),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=540, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = report.read_text()
    # Examples/s as the report writes them: with thousands separators once a run passes 999.
    ours = re.search(r"\| ours: local job, 1 worker \+ 1 PS, sync \| ([\d,]+) \|", text)
    assert ours and int(ours.group(1).replace(",", "")) > 0, text[:3000]
    pipelined = re.search(r"\| ours: local job, 1 worker \+ 1 PS, async, `--pipelined` \| ([\d,]+) \|", text)
    assert pipelined and int(pipelined.group(1).replace(",", "")) > 0, text[:3000]
    assert re.search(r"worker main thread per step .*compute [\d.]+ ms", text), text[:3000]


def test_the_stability_benchmarks_fisher_test_matches_the_hypergeometric_tail() -> None:
    """The one-sided Fisher exact test of the stability benchmark (scipy's ``fisher_exact(...,
    alternative="greater")`` gives the same figures): 6 collapses in 67 runs against 4 in 110 is 0.126;
    1 in 52 against 4 in 110 is 0.860; no collapse anywhere is 1; 3 in 10 against none in 30 is small."""
    from tests.bench.stability import more_collapses_p_value

    def runs(low: int, count: int) -> list[float]:
        return [0.5] * low + [0.95] * (count - low)

    assert round(more_collapses_p_value(runs(6, 67), runs(4, 110)), 4) == 0.1258
    assert round(more_collapses_p_value(runs(1, 52), runs(4, 110)), 4) == 0.8599
    assert more_collapses_p_value(runs(0, 10), runs(0, 30)) == 1.0
    assert more_collapses_p_value(runs(3, 10), runs(0, 30)) < 0.02


def test_a_baseline_measurement_with_a_stalled_step_is_taken_again_and_noted() -> None:
    """A baseline whose timed window held a step longer than ``STALL_SECONDS`` (the shared machine stalled;
    seen once: the LSTM's ``fit`` at 280 examples/s against 8,000-9,000) is measured again; the second
    figure is kept and the stall is listed. A window without a stall is taken as it is."""
    from tests.bench.training import STALL_SECONDS, BaselineChild

    answers = [
        {"examples_per_s": 8_000.0, "longest_step_s": 0.02},
        {"examples_per_s": 280.0, "longest_step_s": STALL_SECONDS + 4.6},
        {"examples_per_s": 8_900.0, "longest_step_s": 0.03},
    ]
    child = object.__new__(BaselineChild)
    child.kind, child.stalls = "fit", []
    child.measure = lambda seconds, timeout=600.0: answers.pop(0)  # type: ignore[method-assign]
    logged: list[str] = []
    assert child.measure_rate(6.0, logged.append) == 8_000.0
    assert child.stalls == [] and logged == []
    assert child.measure_rate(6.0, logged.append) == 8_900.0
    assert child.stalls == [(280.0, STALL_SECONDS + 4.6)] and len(logged) == 1 and not answers


def test_fits_steps_across_an_epoch_boundary_are_timed_apart_from_its_steady_state() -> None:
    """Keras starts an epoch's data iteration between the epoch's start and its first step (0.8-1.3 s at
    about two in five boundaries here): the steady-state figure leaves the step after a boundary out, the
    figure with epochs counts it in, and the longest step (the stall rule) is a steady one."""
    from tests.bench.train_baselines import BATCH, _StepTimer

    clock = iter([0.0, 0.01, 0.02, 1.02, 1.03, 1.04, 1.05, 1.06])

    class Model:
        stop_training = False

    timer = _StepTimer(warmup=1, seconds=100.0, clock=lambda: next(clock))
    timer.set_model(Model())  # type: ignore[arg-type]
    timer.on_epoch_begin(0)
    timer.on_train_batch_end(0)  # the warm-up step: timing starts at 0.0
    timer.on_train_batch_end(1)  # 0.01
    timer.on_train_batch_end(2)  # 0.01
    timer.on_epoch_begin(1)
    timer.on_train_batch_end(0)  # 1.00: the boundary
    for batch in range(1, 5):
        timer.on_train_batch_end(batch)  # 0.01 each
    result = timer.result()
    assert result["steps"] == 6 and result["epoch_boundaries"] == 1
    assert result["epoch_boundary_s"] == pytest.approx(1.0)
    assert result["examples_per_s"] == pytest.approx(6 * BATCH / 0.06)
    assert result["examples_per_s_with_epochs"] == pytest.approx(7 * BATCH / 1.06)
    assert result["longest_step_s"] == pytest.approx(0.01)


def test_the_report_says_what_fits_epoch_boundaries_cost_and_ours_against_fit_with_them() -> None:
    from tests.bench.training import epoch_boundaries_note

    assert epoch_boundaries_note("`model.fit`", [(0, 0.0, 9_000.0), (0, 0.0, 9_100.0)], [7_000, 7_100]) == ""
    note = epoch_boundaries_note("`model.fit`", [(2, 1.2, 8_000.0), (1, 0.04, 10_000.0)], [7_200.0, 7_000.0])
    assert "3 in its timed windows" in note and "0.413 s each on average" in note, note
    assert "the slowest window's 0.600 s" in note, note
    assert "9,000 [8,000–10,000] examples/s" in note and "0.80 [0.70–0.90]" in note, note
