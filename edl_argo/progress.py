"""Progress of long work: a bar on a terminal, ``N/M`` in ``ARGO_PROGRESS_FILE`` under Argo, else log lines.

Argo Workflows reads a step's self-reported progress from the file named by ``ARGO_PROGRESS_FILE``
(content ``N/M``) and shows it in the UI.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edl_argo.log import get_logger

log = get_logger(__name__)


class ProgressReporter:
    """Reports ``done/total`` of one piece of work to every channel that applies."""

    def __init__(self, description: str, unit: str = "task", log_interval: float = 10.0) -> None:
        self._description = description
        self._unit = unit
        self._log_interval = log_interval
        self._last_log = 0.0
        self._last: tuple[int, int, dict[str, object]] | None = None
        path = os.environ.get("ARGO_PROGRESS_FILE")
        self._argo_file = Path(path) if path else None
        self._bar: Any = None
        if sys.stderr.isatty() and not os.environ.get("EDL_NO_PROGRESS_BAR"):
            from tqdm import tqdm

            self._bar = tqdm(desc=description, unit=unit, total=0, dynamic_ncols=True)

    def update(self, done: int, total: int, detail: Mapping[str, object] | None = None) -> None:
        """``done`` of ``total``, and ``detail`` (``{"workers": 3, ...}``) shown beside it on the bar and in
        the log line, not in the Argo file (Argo reads ``N/M`` only)."""
        shown = dict(detail or {})
        if self._last == (done, total, shown):
            return
        self._last = (done, total, shown)
        if self._argo_file is not None:
            temporary = self._argo_file.with_name(f".{self._argo_file.name}.tmp")
            temporary.write_text(f"{done}/{total}")
            os.replace(temporary, self._argo_file)
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = done
            if shown:
                self._bar.set_postfix(shown, refresh=False)
            self._bar.refresh()
        now = time.monotonic()
        if now - self._last_log >= self._log_interval or done == total:
            self._last_log = now
            log.info("progress", work=self._description, done=done, total=total, unit=self._unit, **shown)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
