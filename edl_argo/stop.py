"""SIGTERM as a request to stop, like Ctrl-C: :func:`stop_on_sigterm` turns it into :class:`Terminated`.

A process that installs it unwinds on SIGTERM as on SIGINT (its ``finally`` blocks run: a local master
stops its pods within their grace period) and ``edl-argo`` then exits 143 (128 + SIGTERM), the status a
process killed by SIGTERM has. Further SIGTERMs while it unwinds are logged and ignored, so the clean-up
itself is not interrupted (SIGKILL still ends it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import NoReturn

from edl_argo.log import get_logger

log = get_logger(__name__)

#: Exit status of a command stopped by SIGTERM.
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM once :func:`stop_on_sigterm` is installed. A BaseException,
    like KeyboardInterrupt, so that no ``except Exception`` swallows it."""


def stop_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (a no-op outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def unwinding(signum: int, _frame: object) -> None:
        log.warning("stop_already_requested", signal=signal.Signals(signum).name)

    def terminate(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, unwinding)
        log.warning("stop_requested", signal=signal.Signals(signum).name)
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` at once, once its log lines and standard output are flushed: no
    interpreter teardown (``atexit`` handlers, joining threads, unloading modules), whatever its other
    threads are doing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
