"""The receiving side of collective operations: each worker's mailbox, filled by its collective server.

A delivered piece is only stored, keyed by ``(round, operation, step)``; the member's own collective
operation takes it when it gets there (:meth:`Mailbox.take`), so a sender never waits for the receiver's
computation and no ordering between neighbours can deadlock. Pieces of rounds older than the member's
current one are dropped; a piece of a *newer* round tells the member that the group has moved on.

The same server answers state requests from the state the member published for a round (see
:class:`~edl_argo.collective.group.CollectiveGroup`), which is how new and diverged members receive the
model and optimizer state (a broadcast by pull: each receiver fetches from the round's source). The bytes
travel as the frames of :mod:`edl_argo.collective.transport`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from edl_argo.addresses import join_host_port
from edl_argo.collective.transport import FrameServer, PieceKey, StateProvider, open_listener
from edl_argo.log import get_logger

log = get_logger(__name__)


class RoundChanged(Exception):
    """A piece of a newer round arrived while waiting: the group has moved on."""

    def __init__(self, newer_round: int) -> None:
        super().__init__(f"round {newer_round} started")
        self.newer_round = newer_round


class Mailbox:
    """Pieces delivered to this member, waiting to be taken. Thread-safe."""

    def __init__(self) -> None:
        self._pieces: dict[PieceKey, np.ndarray] = {}
        self._cond = threading.Condition()
        self._round = 0
        self._newest_seen = 0

    def enter_round(self, round_id: int) -> None:
        """From now on, pieces of rounds before ``round_id`` are dropped."""
        with self._cond:
            self._round = round_id
            self._pieces = {k: v for k, v in self._pieces.items() if k[0] >= round_id}

    def put(self, key: PieceKey, piece: np.ndarray) -> None:
        with self._cond:
            if key[0] < self._round:
                return
            self._pieces[key] = piece
            self._newest_seen = max(self._newest_seen, key[0])
            self._cond.notify_all()

    def take(self, key: PieceKey, timeout: float, on_slow_wait: Callable[[], None]) -> np.ndarray | None:
        """The piece at ``key``; None after ``timeout`` seconds.

        While waiting longer than a moment, ``on_slow_wait()`` is called about every half second (the
        caller checks whether its round is still current and raises to abandon the wait). Raises
        :class:`RoundChanged` as soon as a piece of a newer round than ``key``'s is seen.
        """
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + 0.5
        with self._cond:
            while True:
                piece = self._pieces.pop(key, None)
                if piece is not None:
                    return piece
                if self._newest_seen > key[0]:
                    raise RoundChanged(self._newest_seen)
                now = time.monotonic()
                if now >= deadline:
                    return None
                if now >= next_check:
                    self._cond.release()
                    try:
                        on_slow_wait()
                    finally:
                        self._cond.acquire()
                    next_check = time.monotonic() + 0.5
                    continue
                self._cond.wait(min(deadline, next_check) - now)


class CollectiveServer:
    """A worker's collective server on ``host:port`` (port 0: any free port), delivering into
    :attr:`mailbox`; see :attr:`address`."""

    def __init__(
        self, host: str, port: int, state_provider: StateProvider, token: bytes | None = None
    ) -> None:
        """``token``: the collective token callers must present (default: this process's, see
        :class:`~edl_argo.collective.transport.FrameServer`)."""
        self.mailbox = Mailbox()
        listener = open_listener(host, port)
        if listener is None:
            # Only where pods share a network namespace (hostNetwork, or the test suite's stand-in cluster):
            # the address the master hands out is the one actually bound, so any port works.
            log.warning("collective_port_taken", port=port, fallback="any free port")
            listener = open_listener(host, 0)
        if listener is None:
            raise OSError(f"cannot listen on {join_host_port(host, port)} for the collective service")
        self._server = FrameServer(listener, self.mailbox.put, state_provider, token)
        self.address = join_host_port(host, self._server.port)

    def stop(self) -> None:
        """Close the port and every connection; pieces in flight are lost."""
        self._server.stop()
