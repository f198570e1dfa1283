"""A pod's watch on its master: a worker or PS whose master stays unreachable for ``--master-timeout`` ends.

A master that Argo retries comes back at the same address within the timeout (the ``<job>-master``
Service, or the same local port) and adopts its pods; a master that is gone for good (``argo terminate``,
a lost master that is not retried, SIGKILL on one machine) leaves nobody to delete them. :class:`MasterWatch`
bounds that: a thread probes the master's address (a gRPC connection, no request) every few seconds and,
once none succeeded for ``timeout_seconds``, logs ``master_lost`` and calls ``on_lost`` once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from edl_argo.log import get_logger
from edl_argo.rpc.tls import TlsFiles
from edl_argo.rpc.tls import channel as tls_channel
from edl_argo.settings.table import MASTER_TIMEOUT_SECONDS

log = get_logger(__name__)

#: ``--master-timeout`` default: seconds a pod waits for an unreachable master before it ends.
DEFAULT_MASTER_TIMEOUT_SECONDS = MASTER_TIMEOUT_SECONDS
#: Longest wait between two probes, and for one probe's connection.
PROBE_SECONDS = 5.0
#: gRPC's reconnection backoff is capped so a master that is back is seen within a probe or two (the
#: default cap, 120 s, could hide a returning master for longer than a short timeout).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class MasterWatch:
    """Calls ``on_lost`` (once, from its own thread) when ``address`` was unreachable ``timeout_seconds``.

    ``start`` begins probing; ``close`` stops it (``on_lost`` is then never called).
    """

    def __init__(
        self,
        address: str,
        timeout_seconds: float,
        on_lost: Callable[[], None],
        tls: TlsFiles | None = None,
    ) -> None:
        """``tls``: the master serves TLS (:mod:`edl_argo.rpc.tls`); a probe then counts only once the
        handshake succeeded."""
        self.address = address
        self._tls = tls
        self.timeout_seconds = timeout_seconds
        self._on_lost = on_lost
        self._interval = max(0.2, min(PROBE_SECONDS, timeout_seconds / 5))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="master-watch", daemon=True)

    def start(self) -> MasterWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(PROBE_SECONDS + 1)

    def _run(self) -> None:
        if self._tls is None:
            channel = grpc.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
        else:
            channel = tls_channel(self.address, self._tls, _CHANNEL_OPTIONS)
        try:
            last_reached = time.monotonic()
            while not self._stop.wait(self._interval):
                try:
                    grpc.channel_ready_future(channel).result(timeout=self._interval)
                    last_reached = time.monotonic()
                    continue
                except grpc.FutureTimeoutError:
                    pass
                unreachable = time.monotonic() - last_reached
                if unreachable >= self.timeout_seconds and not self._stop.is_set():
                    log.error(
                        "master_lost",
                        master=self.address,
                        unreachable_s=round(unreachable, 1),
                        master_timeout_s=self.timeout_seconds,
                    )
                    self._on_lost()
                    return
        finally:
            channel.close()
