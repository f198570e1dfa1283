"""One member's view of one membership round: its rank, its neighbours, and the operations of the round.

Every operation of a :class:`CollectiveGroup` either completes or raises :class:`CollectiveAborted`
within the group's timeout — never hangs:

* a right neighbour that refuses or resets the connection, or does not take a piece in time, is the
  *suspect*;
* a left neighbour that sends nothing within the timeout is the suspect;
* a round that ended meanwhile (the master's rendezvous says so, checked every half second while a wait
  lasts, and at once when a piece of a newer round arrives) aborts with no suspect.

The caller reports the suspect to the master, which starts a new round without it, and starts over in
that round. Operations are numbered within a round; every member of a round runs the same operations in
the same order. Pieces and states travel as the frames of :mod:`edl_argo.collective.transport`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from edl_argo.collective.mailbox import Mailbox, RoundChanged
from edl_argo.collective.ring import ring_allreduce
from edl_argo.collective.state import GroupState
from edl_argo.collective.transport import PeerConnections, max_payload_bytes, request_state

#: Pause between two state requests while the round's source has not published its state yet.
STATE_POLL_SECONDS = 0.02


class CollectiveAborted(Exception):
    """An operation of round ``round_id`` failed; ``suspect`` is the worker id to blame, or None."""

    def __init__(self, message: str, round_id: int, suspect: int | None = None) -> None:
        super().__init__(message)
        self.round_id = round_id
        self.suspect = suspect


class CollectiveGroup:
    """The members of round ``round_id`` as seen by the member at ``rank``.

    Args:
        members: ``(worker_id, address)`` in rank order.
        round_is_current: returns False once the master has started a newer round.
        timeout: seconds any single wait (a send, a receive, a state pull) may take.
    """

    def __init__(
        self,
        round_id: int,
        rank: int,
        members: Sequence[tuple[int, str]],
        mailbox: Mailbox,
        peers: PeerConnections,
        round_is_current: Callable[[], bool],
        timeout: float,
    ) -> None:
        self.round_id = round_id
        self.rank = rank
        self.members = list(members)
        self.size = len(members)
        self._mailbox = mailbox
        self._peers = peers
        self._round_is_current = round_is_current
        self._timeout = timeout
        self._operation = 0
        mailbox.enter_round(round_id, self.size)

    def worker_id_of(self, rank: int) -> int:
        return self.members[rank % self.size][0]

    def allreduce(self, vector: np.ndarray) -> np.ndarray:
        """The sum of every member's ``vector`` (same length and dtype everywhere).

        A vector whose ring pieces would exceed the frame cap is summed in consecutive blocks, each its own
        ring operation, so that no piece does; the result is one array (the only copy made).
        """
        block = self.size * max(1, max_payload_bytes() // vector.dtype.itemsize)
        if len(vector) <= block:
            return self._ring(vector)
        result = np.empty_like(vector)
        for start in range(0, len(vector), block):
            result[start : start + block] = self._ring(vector[start : start + block])
        return result

    def _ring(self, vector: np.ndarray) -> np.ndarray:
        """One ring allreduce of ``vector`` as the round's next operation."""
        self._operation += 1
        operation = self._operation
        right_id, right_address = self.members[(self.rank + 1) % self.size]
        connection = self._peers.connection(right_address) if self.size > 1 else None

        def exchange(step: int, outgoing: np.ndarray) -> np.ndarray:
            assert connection is not None
            key = (self.round_id, operation, step)
            sending = connection.send_piece(key, self.rank, outgoing, self._timeout)

            def send_failed(reason: object) -> CollectiveAborted:
                return CollectiveAborted(
                    f"round {self.round_id}: worker {right_id} at {right_address} did not take step {step}: "
                    f"{reason}",
                    self.round_id,
                    suspect=right_id,
                )

            def check_send() -> None:
                if sending.done() and sending.exception() is not None:
                    raise send_failed(sending.exception())

            received = self._receive(key, check_send)
            try:
                sending.result(timeout=self._timeout)
            except TimeoutError:  # the future's wait, or the socket's (both TimeoutError since Python 3.11)
                raise send_failed(f"not sent within {self._timeout:.0f} s") from None
            except OSError as error:
                raise send_failed(error) from None
            return received

        return ring_allreduce(vector, self.rank, self.size, exchange)

    def _receive(self, key: tuple[int, int, int], check_send: Callable[[], None]) -> np.ndarray:
        def on_slow_wait() -> None:
            check_send()
            self._check_round()

        try:
            piece = self._mailbox.take(key, self._timeout, on_slow_wait, self._round_is_current)
        except RoundChanged as changed:
            raise CollectiveAborted(f"round {self.round_id} ended: {changed}", self.round_id) from None
        if piece is None:
            left = self.worker_id_of(self.rank - 1)
            raise CollectiveAborted(
                f"round {self.round_id}: nothing from worker {left} for {self._timeout:.0f} s",
                self.round_id,
                suspect=left,
            )
        return piece

    def _check_round(self) -> None:
        if not self._round_is_current():
            raise CollectiveAborted(
                f"round {self.round_id} ended (the master started a newer one)", self.round_id
            )

    def pull_state(self, source_rank: int) -> GroupState:
        """The state the member at ``source_rank`` published for this round (it publishes it first).

        Asks again every :data:`STATE_POLL_SECONDS` while the source has not published it yet, for up to the
        group's timeout; a source that cannot be reached or does not answer is the suspect.
        """
        worker_id, address = self.members[source_rank]
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                state = request_state(address, self.round_id, self._timeout)
            except OSError as error:
                reason: object = error
            else:
                if state is not None:
                    return state
                if time.monotonic() <= deadline:
                    self._check_round()
                    time.sleep(STATE_POLL_SECONDS)
                    continue
                reason = f"not published within {self._timeout:.0f} s"
            raise CollectiveAborted(
                f"round {self.round_id}: no state from worker {worker_id} at {address}: {reason}",
                self.round_id,
                suspect=worker_id,
            )
