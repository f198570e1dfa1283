"""The master's watch on its parameter servers: one that stops answering is replaced as if it had died.

A PS whose process is paused (SIGSTOP) or whose network path went silent is still a running pod: no pod
event ever tells the master, and the workers' calls to it only run out of their deadlines, again and
again. So the master pings every PS (:mod:`edl_argo.rpc.health`) every :data:`PING_INTERVAL_SECONDS`,
and a PS that has answered since it (re)started but then leaves its pings unanswered for
``silence_seconds`` (``--rpc-timeout-seconds``) is reported once by :meth:`ParameterServerWatch.silent`;
the master deletes it, and its terminal event starts it again with the same id and address, restoring its
newest checkpoint. A PS that has not answered yet since it started is not judged: it is still starting,
and a crash shows in its pod's events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from edl_argo.log import get_logger
from edl_argo.rpc.auth import ClientCredential
from edl_argo.rpc.channel import make_channel
from edl_argo.rpc.health import ping
from edl_argo.rpc.tls import TlsFiles

log = get_logger(__name__)

#: Seconds between two pings of one PS.
PING_INTERVAL_SECONDS = 2.0


class ParameterServerWatch:
    """Pings PS ``0 .. num_ps - 1`` at ``address_of(ps_id)`` from one thread each, until :meth:`close`.

    Each ping has the deadline ``silence_seconds / 2``. Only a ping that runs out of it counts against a PS
    (a refused one means the process is gone or still starting, which its pod's events cover); a PS is
    silent after two such pings in a row spanning ``silence_seconds``. One unanswered ping alone never
    is: after the master itself was paused, the ping in flight runs out of its deadline on resuming.
    """

    def __init__(
        self,
        address_of: Callable[[int], str],
        num_ps: int,
        silence_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        credential: ClientCredential | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        """Pings present ``credential`` (the master's; default: this process's), over TLS with ``tls``."""
        self._silence = silence_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._answered = dict.fromkeys(range(num_ps), False)
        self._unanswered = dict.fromkeys(range(num_ps), 0)  # pings in a row that ran out of their deadline
        self._unanswered_since: dict[int, float] = {}  # when the first of them was sent
        # When each PS was last reported silent: an answer to a ping sent before that is of the old
        # process (a deleted PS is woken up to exit), not of the one started again.
        self._reported_at: dict[int, float] = dict.fromkeys(range(num_ps), float("-inf"))
        self._stop = threading.Event()
        self._channels = [make_channel(address_of(ps_id), credential, tls) for ps_id in range(num_ps)]
        self._threads = [
            threading.Thread(target=self._watch, args=(ps_id,), name=f"ps-watch-{ps_id}", daemon=True)
            for ps_id in range(num_ps)
        ]
        for thread in self._threads:
            thread.start()

    def answered(self, ps_id: int) -> bool:
        """Whether PS ``ps_id`` answered a ping since it (re)started."""
        with self._lock:
            return self._answered[ps_id]

    def silent(self) -> list[int]:
        """The PSes that answered since they (re)started but then left pings unanswered for
        ``silence_seconds``; each is reported once, and judged again once it answers again."""
        now = self._clock()
        with self._lock:
            silent = [
                ps_id
                for ps_id, answered in self._answered.items()
                if answered
                and self._unanswered[ps_id] >= 2
                and now - self._unanswered_since[ps_id] >= self._silence
            ]
            for ps_id in silent:
                log.warning("ps_silent", ps=ps_id, silent_s=round(now - self._unanswered_since[ps_id], 1))
                self._answered[ps_id] = False
                self._unanswered[ps_id] = 0
                self._reported_at[ps_id] = now
        return silent

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self._silence + PING_INTERVAL_SECONDS)
        for channel in self._channels:
            channel.close()

    def _watch(self, ps_id: int) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                ping(self._channels[ps_id], timeout=self._silence / 2)
            except grpc.RpcError as error:
                self._record(ps_id, started, unanswered=error.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
            except ValueError:  # the channel was closed: the watch is over
                return
            else:
                self._record(ps_id, started, answered=True)
            self._stop.wait(max(0.0, PING_INTERVAL_SECONDS - (self._clock() - started)))

    def _record(self, ps_id: int, sent: float, answered: bool = False, unanswered: bool = False) -> None:
        with self._lock:
            if unanswered:
                if self._unanswered[ps_id] == 0:
                    self._unanswered_since[ps_id] = sent
                self._unanswered[ps_id] += 1
                return
            self._unanswered[ps_id] = 0
            if answered and sent > self._reported_at[ps_id]:
                self._answered[ps_id] = True
