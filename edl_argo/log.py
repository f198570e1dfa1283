"""Structured logging: one line per event, ``key=value`` pairs a person can read in ``argo logs``.

Usage::

    from edl_argo.log import get_logger
    log = get_logger(__name__)
    log.info("task_done", task=12, worker=3, records=512)

prints ``2026-11-21T23:50:01.123Z INFO master task_done task=12 worker=3 records=512``.
Values with spaces are quoted. Secrets never reach a logger: callers pass names, not credentials. An ERROR
event logged with ``exc_info=True`` (an unexpected exception: a bug) gets ``error="Type: message"`` and
``traceback="servicer.py:211 ReportEvaluationOutputs < evaluation.py:58 update"``, outermost frame first, on
the same line.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_ROOT = "edl_argo"
_configured = False


def _format_value(value: Any) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    if text == "" or any(c.isspace() for c in text) or '"' in text or "=" in text:
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def one_line_traceback(error: BaseException | None) -> str:
    """Where ``error`` was raised, on one line: ``file:line function`` of each frame, outermost first,
    joined by `` < ``; ``""`` without a traceback."""
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    return " < ".join(f"{Path(frame.filename).name}:{frame.lineno} {frame.name}" for frame in frames)


class _EventFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        ts += f".{int(record.msecs):03d}Z"
        component = getattr(record, "component", record.name.rsplit(".", 1)[-1])
        fields = getattr(record, "fields", {})
        parts = [ts, record.levelname, component, record.getMessage()]
        parts += [f"{k}={_format_value(v)}" for k, v in fields.items()]
        line = " ".join(parts)
        if record.exc_info and record.levelno >= logging.ERROR:
            exc = record.exc_info[1]
            line += f" error={_format_value(f'{type(exc).__name__}: {exc}')}"
            line += f" traceback={_format_value(one_line_traceback(exc))}"
        return line


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each event (it may be replaced after set-up)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure(level: str | None = None, component: str | None = None) -> None:
    """Send edl-argo's events to stderr, one line each. Idempotent; ``level`` may change it later."""
    global _configured
    root = logging.getLogger(_ROOT)
    if not _configured:
        handler = _StderrHandler()
        handler.setFormatter(_EventFormatter())
        root.addHandler(handler)
        root.propagate = False
        _configured = True
    root.setLevel((level or os.environ.get("EDL_LOG_LEVEL", "INFO")).upper())
    if component:
        _component[0] = component


_component: list[str | None] = [None]


class EventLogger:
    """A thin wrapper that turns keyword arguments into structured fields."""

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")

    def _log(self, level: int, event: str, exc_info: bool = False, **fields: Any) -> None:
        if not self._logger.isEnabledFor(level):
            return
        extra: dict[str, Any] = {"fields": fields}
        if _component[0]:
            extra["component"] = _component[0]
        self._logger.log(level, event, extra=extra, exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, **fields)

    def error(self, event: str, exc_info: bool = False, **fields: Any) -> None:
        self._log(logging.ERROR, event, exc_info=exc_info, **fields)


def get_logger(name: str) -> EventLogger:
    return EventLogger(name)
