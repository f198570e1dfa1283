"""The step trace (:mod:`edl_argo.worker.step_trace`): off unless asked, one line per applied minibatch,
appended (a relaunched worker adds to its file), read back in order. Whole jobs read it in parity_replay."""

from __future__ import annotations

from pathlib import Path

from edl_argo.worker.step_trace import STEP_TRACE_ENV, StepTrace, TracedMinibatch, read_trace


def _minibatch(worker: int, index: int, update: int) -> TracedMinibatch:
    return TracedMinibatch(
        worker=worker,
        task=3,
        epoch=1,
        shard="s/data-0",
        start=16,
        end=26,
        minibatch=index,
        examples=4,
        update=update,
    )


def test_no_trace_unless_the_environment_names_a_folder(tmp_path: Path) -> None:
    assert StepTrace.from_env(0, {}) is None
    assert StepTrace.from_env(0, {STEP_TRACE_ENV: ""}) is None
    trace = StepTrace.from_env(7, {STEP_TRACE_ENV: str(tmp_path / "trace")})
    assert trace is not None and trace.path == tmp_path / "trace" / "worker-7.jsonl"
    trace.close()


def test_lines_are_appended_per_worker_and_read_back_by_worker_in_order(tmp_path: Path) -> None:
    lines = {10: [_minibatch(10, 0, 5)], 2: [_minibatch(2, 0, 4), _minibatch(2, 1, 6)]}
    for worker, minibatches in lines.items():
        for minibatch in minibatches:  # a trace per line: as a relaunched worker, appending
            trace = StepTrace(tmp_path, worker)
            trace.record(minibatch)
            assert trace.path.read_text().endswith("\n")  # in the file at once, whole
            trace.close()
    assert read_trace(tmp_path) == [*lines[2], *lines[10]]


def test_a_minibatch_names_its_records_and_the_last_one_ends_with_the_task() -> None:
    assert _minibatch(0, 0, 1).records(4) == range(16, 20)
    assert _minibatch(0, 2, 1).records(4) == range(24, 26)
