"""One step's ``edl-argo`` command as a local process, as a container of the step would run it.

The process runs this installation of edl-argo (``python -m edl_argo.cli``, whatever ``PATH`` holds) in a
session of its own, so a signal reaches everything it started (a training job's workers and parameter
servers). Its output, stdout and stderr merged, is copied line by line with the step's name as prefix
(``[train] ...``). While it runs, the ``N/M`` it writes to its ``ARGO_PROGRESS_FILE`` drives a progress
bar. A deadline (the template's ``activeDeadlineSeconds``) or an interrupted runner stops it with SIGTERM,
as the kubelet stops a container (a training job then removes its worker and parameter-server processes),
then SIGKILLs what is left after :data:`GRACE_SECONDS`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from edl_argo.progress import ProgressReporter

#: Lines of output kept to say why a step failed.
TAIL_LINES = 20
#: Seconds between SIGTERM and SIGKILL when a step passes its deadline or the runner is interrupted.
GRACE_SECONDS = 10.0
_POLL_SECONDS = 0.5
_PROGRESS = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class ProcessResult:
    """How a step's process ended: its exit code (128 + N when killed by signal N) and last lines."""

    exit_code: int
    timed_out: bool
    last_lines: tuple[str, ...]


def run_process(
    argv: Sequence[str],
    env: Mapping[str, str],
    name: str,
    progress_file: Path,
    deadline_seconds: float | None,
    sink: Callable[[str], None],
    stop: threading.Event | None = None,
) -> ProcessResult:
    """Run ``edl-argo`` ``argv[1:]`` to its end, copying its output to ``sink`` as ``[name] line``.

    ``stop`` set (the runner was interrupted while this ran in another thread) stops it as a deadline
    does, and raises KeyboardInterrupt."""
    process = subprocess.Popen(
        [sys.executable, "-m", "edl_argo.cli", *argv[1:]],
        env={**env, "ARGO_PROGRESS_FILE": str(progress_file), "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    copier = threading.Thread(target=_copy_lines, args=(process, f"[{name}] ", tail, sink), daemon=True)
    copier.start()
    progress = ProgressReporter(name, unit="it", log_interval=float("inf"))
    deadline = time.monotonic() + deadline_seconds if deadline_seconds else float("inf")
    timed_out = False
    try:
        while process.poll() is None:
            _report(progress_file, progress)
            if not timed_out and time.monotonic() > deadline:
                timed_out = True
                _terminate(process)
            if stop is not None and stop.wait(_POLL_SECONDS):
                raise KeyboardInterrupt
            if stop is None:
                time.sleep(_POLL_SECONDS)
        _report(progress_file, progress)
        _signal(process, signal.SIGKILL)  # what the command left behind, as a container runtime does
    except BaseException:  # Ctrl-C: the step's processes go with the runner
        _terminate(process)
        raise
    finally:
        progress.close()
        copier.join(timeout=5.0)
    code = process.returncode
    return ProcessResult(code if code >= 0 else 128 - code, timed_out, tuple(tail))


def _copy_lines(
    process: subprocess.Popen[bytes], prefix: str, tail: deque[str], sink: Callable[[str], None]
) -> None:
    assert process.stdout is not None
    with process.stdout:
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            tail.append(line)
            sink(prefix + line)


def _report(progress_file: Path, progress: ProgressReporter) -> None:
    with contextlib.suppress(OSError):
        match = _PROGRESS.match(progress_file.read_text())
        if match:
            progress.update(int(match.group(1)), int(match.group(2)))


def _terminate(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process's session, SIGKILL what is left after :data:`GRACE_SECONDS`."""
    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, 5.0)):
        _signal(process, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait)
            return


def _signal(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
