"""The receiving side of collective operations: each worker's mailbox, filled by its collective server.

A delivered piece is only stored, keyed by ``(round, operation, step)``; the member's own collective
operation takes it when it gets there (:meth:`Mailbox.take`), so a sender never waits for the receiver's
computation and no ordering between neighbours can deadlock. Pieces of rounds older than the member's
current one are dropped; a piece of a *newer* round tells the member that the group may have moved on: the
member asks the master, and abandons its round only if the master has indeed started a newer one (a piece
of a round the master never started, from a buggy or hostile peer, is kept aside and ends nothing).

What a mailbox holds is bounded: a neighbour runs at most one operation ahead, so pieces of operations
more than :data:`OPERATIONS_AHEAD` before or after the one being waited for are dropped, and pieces
of newer rounds are kept up to :data:`FUTURE_ROUND_BYTES` in all (those of rounds the master said it never
started go first).

The same server answers state requests from the state the member published for a round (see
:class:`~edl_argo.collective.group.CollectiveGroup`), which is how new and diverged members receive the
model and optimizer state (a broadcast by pull: each receiver fetches from the round's source). The bytes
travel as the frames of :mod:`edl_argo.collective.transport`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edl_argo.addresses import join_host_port
from edl_argo.collective.transport import FrameServer, PieceKey, StateProvider
from edl_argo.log import get_logger
from edl_argo.rpc.sockets import open_listener

log = get_logger(__name__)

#: How many operations past the one a member waits for (or last waited for) its pieces may be.
OPERATIONS_AHEAD = 4
#: Bytes of pieces of rounds newer than the member's current one that its mailbox keeps at most.
FUTURE_ROUND_BYTES = 64 << 20
#: Newer rounds the master said it never started, remembered at most (then forgotten, and asked again).
MAX_DISMISSED_ROUNDS = 256


class RoundChanged(Exception):
    """A piece of a newer round arrived while waiting: the group has moved on."""

    def __init__(self, newer_round: int) -> None:
        super().__init__(f"round {newer_round} started")
        self.newer_round = newer_round


@dataclass
class _Dropped:
    """Pieces a mailbox refused to keep (see the module docstring), for its log line."""

    pieces: int = 0
    logged_at: float = 0.0


class Mailbox:
    """Pieces delivered to this member, waiting to be taken. Thread-safe."""

    def __init__(self) -> None:
        self._pieces: dict[PieceKey, np.ndarray] = {}
        self._cond = threading.Condition()
        self._round = 0
        self._operation = 0  # the newest operation of the current round a take waited for
        self._steps: int | None = None  # ring steps of an operation of the current round, if known
        self._newer: set[int] = set()  # newer rounds seen in pieces, not asked about yet
        self._dismissed: set[int] = set()  # newer rounds the master had not started when asked
        self._dropped = _Dropped()

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the pieces held, waiting to be taken."""
        with self._cond:
            return sum(piece.nbytes for piece in self._pieces.values())

    def enter_round(self, round_id: int, size: int | None = None) -> None:
        """From now on, pieces of rounds before ``round_id`` are dropped; ``size``: the round's members (its
        pieces then have steps below ``2 * size``, those of a ring operation)."""
        with self._cond:
            self._round = round_id
            self._steps = None if size is None else 2 * size
            self._operation = 0
            self._pieces = {k: v for k, v in self._pieces.items() if k[0] >= round_id}
            self._newer = {r for r in self._newer if r > round_id}
            self._dismissed = {r for r in self._dismissed if r > round_id}
            # A member enters the round the master just named current: newer rounds seen before are none
            # the master had started then (a member of a round started since is noticed by the next watch).
            self._dismiss_locked(round_id)

    @property
    def newest_round(self) -> int:
        """The newest round of the pieces delivered since this member entered its round, among those the
        master has not said it never started (0: none)."""
        with self._cond:
            return max(self._newer, default=0)

    def put(self, key: PieceKey, piece: np.ndarray) -> None:
        with self._cond:
            round_id, operation, step = key
            now = self._operation if round_id == self._round else 0  # a newer round starts at its first
            if round_id < self._round or not now - OPERATIONS_AHEAD <= operation <= now + OPERATIONS_AHEAD:
                self._drop(key, "not an operation this member can still wait for")
                return
            if step < 0 or (round_id == self._round and self._steps is not None and step >= self._steps):
                self._drop(key, "not a step of a ring operation of this round")
                return
            if round_id > self._round and not self._make_room_locked(key, piece.nbytes):
                self._drop(key, f"more than {FUTURE_ROUND_BYTES} bytes of pieces of newer rounds")
                return
            self._pieces[key] = piece
            if round_id > self._round and round_id not in self._dismissed:
                self._newer.add(round_id)
            self._cond.notify_all()

    def _make_room_locked(self, key: PieceKey, size: int) -> bool:
        """Whether a piece of ``size`` bytes of a newer round fits in :data:`FUTURE_ROUND_BYTES`, after
        dropping pieces of rounds the master never started if need be."""
        future = {k: v.nbytes for k, v in self._pieces.items() if k[0] > self._round and k != key}
        held = sum(future.values())
        for stale in [k for k in future if k[0] in self._dismissed]:
            if held + size <= FUTURE_ROUND_BYTES:
                break
            held -= future[stale]
            del self._pieces[stale]
        return held + size <= FUTURE_ROUND_BYTES

    def _drop(self, key: PieceKey, reason: str) -> None:
        self._dropped.pieces += 1
        now = time.monotonic()
        if now - self._dropped.logged_at >= 10.0:  # at most one line every 10 s
            self._dropped.logged_at = now
            log.warning(
                "collective_piece_dropped",
                round=key[0],
                operation=key[1],
                step=key[2],
                current_round=self._round,
                reason=reason,
                dropped=self._dropped.pieces,
            )

    def take(
        self,
        key: PieceKey,
        timeout: float,
        on_slow_wait: Callable[[], None],
        round_is_current: Callable[[], bool] | None = None,
    ) -> np.ndarray | None:
        """The piece at ``key``; None after ``timeout`` seconds.

        While waiting longer than a moment, ``on_slow_wait()`` is called about every half second (the
        caller checks whether its round is still current and raises to abandon the wait). When a piece of a
        newer round than ``key``'s arrives, ``round_is_current()`` (the master's word) is asked at once:
        :class:`RoundChanged` is raised if it says False (without it: at once); if it says True, that round
        is one the master never started, and its pieces end no wait.
        """
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + 0.5
        with self._cond:
            if key[0] == self._round and key[1] > self._operation:
                self._operation = key[1]
                oldest = key[1] - OPERATIONS_AHEAD  # pieces of operations before it can be waited for no more
                self._pieces = {k: v for k, v in self._pieces.items() if k[0] > key[0] or k[1] >= oldest}
            while True:
                piece = self._pieces.pop(key, None)
                if piece is not None:
                    return piece
                newer = max((r for r in self._newer if r > key[0]), default=None)
                if newer is not None:
                    if round_is_current is None:
                        raise RoundChanged(newer)
                    self._cond.release()
                    try:
                        current = round_is_current()
                    finally:
                        self._cond.acquire()
                    if not current:
                        raise RoundChanged(newer)
                    self._dismiss_locked(key[0])
                    continue
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

    def _dismiss_locked(self, current_round: int) -> None:
        """The master says ``current_round`` is current: the newer rounds seen are none it started."""
        rounds = sorted(r for r in self._newer if r > current_round)
        if not rounds:
            return
        log.warning("collective_round_not_started", current_round=current_round, rounds=rounds[:5])
        if len(self._dismissed) + len(rounds) > MAX_DISMISSED_ROUNDS:
            self._dismissed.clear()
        self._dismissed.update(rounds)
        self._newer.difference_update(rounds)


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
