"""One member's view of one membership round: its rank, its neighbours, and the operations of the round.

Every operation of a :class:`CollectiveGroup` either completes or raises :class:`CollectiveAborted`
within the group's timeout — never hangs:

* a neighbour that refuses the connection or does not take a piece in time is the *suspect*;
* a left neighbour that sends nothing within the timeout is the suspect;
* a round that ended meanwhile (the master's rendezvous says so, checked every half second while a wait
  lasts, or a piece of a newer round arrives) aborts with no suspect.

The caller reports the suspect to the master, which starts a new round without it, and starts over in
that round. Operations are numbered within a round; every member of a round runs the same operations in
the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import numpy as np

from edl_argo.collective.mailbox import Mailbox, RoundChanged
from edl_argo.collective.ring import ring_allreduce
from edl_argo.proto import collective_pb2, collective_pb2_grpc
from edl_argo.rpc.channel import make_channel
from edl_argo.rpc.tensors import fill_tensor


class CollectiveAborted(Exception):
    """An operation of round ``round_id`` failed; ``suspect`` is the worker id to blame, or None."""

    def __init__(self, message: str, round_id: int, suspect: int | None = None) -> None:
        super().__init__(message)
        self.round_id = round_id
        self.suspect = suspect


@dataclass
class PeerChannels:
    """Collective stubs by address, kept across rounds (members usually stay)."""

    _stubs: dict[str, collective_pb2_grpc.CollectiveStub] = field(default_factory=dict)
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def stub(self, address: str) -> collective_pb2_grpc.CollectiveStub:
        if address not in self._stubs:
            self._channels[address] = make_channel(address)
            self._stubs[address] = collective_pb2_grpc.CollectiveStub(self._channels[address])
        return self._stubs[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._stubs.clear()
        self._channels.clear()


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
        channels: PeerChannels,
        round_is_current: Callable[[], bool],
        timeout: float,
    ) -> None:
        self.round_id = round_id
        self.rank = rank
        self.members = list(members)
        self.size = len(members)
        self._mailbox = mailbox
        self._channels = channels
        self._round_is_current = round_is_current
        self._timeout = timeout
        self._operation = 0
        mailbox.enter_round(round_id)

    def worker_id_of(self, rank: int) -> int:
        return self.members[rank % self.size][0]

    def allreduce(self, vector: np.ndarray) -> np.ndarray:
        """The sum of every member's ``vector`` (same length and dtype everywhere)."""
        self._operation += 1
        operation = self._operation
        right = self.members[(self.rank + 1) % self.size]
        stub = self._channels.stub(right[1]) if self.size > 1 else None

        def exchange(step: int, outgoing: np.ndarray) -> np.ndarray:
            assert stub is not None
            chunk = collective_pb2.CollectiveChunk(
                round_id=self.round_id, operation=operation, step=step, sender_rank=self.rank
            )
            fill_tensor(chunk.data, outgoing)
            sending: Future = stub.Deliver.future(chunk, timeout=self._timeout)

            def check_send() -> None:
                if sending.done() and sending.exception() is not None:
                    raise CollectiveAborted(
                        f"round {self.round_id}: worker {right[0]} at {right[1]} did not take step {step}: "
                        f"{sending.exception().code().name}",  # type: ignore[union-attr]
                        self.round_id,
                        suspect=right[0],
                    )

            received = self._receive((self.round_id, operation, step), check_send)
            try:
                sending.result()
            except grpc.RpcError:
                check_send()
            return received

        return ring_allreduce(vector, self.rank, self.size, exchange)

    def _receive(self, key: tuple[int, int, int], check_send: Callable[[], None]) -> np.ndarray:
        def on_slow_wait() -> None:
            check_send()
            self._check_round()

        try:
            piece = self._mailbox.take(key, self._timeout, on_slow_wait)
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

    def pull_state(self, source_rank: int) -> collective_pb2.ModelState:
        """The state the member at ``source_rank`` published for this round (it publishes it first)."""
        worker_id, address = self.members[source_rank]
        stub = self._channels.stub(address)
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return stub.GetState(collective_pb2.GetStateRequest(round_id=self.round_id), timeout=10.0)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise CollectiveAborted(
                        f"round {self.round_id}: no state from worker {worker_id} at {address}: "
                        f"{error.code().name}",
                        self.round_id,
                        suspect=worker_id,
                    ) from None
            self._check_round()
            time.sleep(0.02)
