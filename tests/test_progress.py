"""What long work reports as it goes (:mod:`edl_argo.progress`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edl_argo import log
from edl_argo.progress import ProgressReporter


def test_the_detail_goes_to_the_log_line_and_argo_reads_only_done_of_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARGO_PROGRESS_FILE", str(tmp_path / "progress"))
    log.configure("INFO")
    reporter = ProgressReporter("train job", log_interval=0.0)
    reporter.update(3, 10, {"workers": 2, "pending": 1, "records_per_second": 250})
    reporter.update(3, 10, {"workers": 2, "pending": 1, "records_per_second": 250})  # unchanged: no line
    reporter.update(3, 10, {"workers": 3, "records_per_second": 310})  # the workers changed: a line
    reporter.close()

    assert (tmp_path / "progress").read_text() == "3/10"
    lines = [line for line in capfd.readouterr().err.splitlines() if " progress " in line]
    assert len(lines) == 2
    assert lines[0].endswith("done=3 total=10 unit=task workers=2 pending=1 records_per_second=250")
    assert lines[1].endswith("done=3 total=10 unit=task workers=3 records_per_second=310")
