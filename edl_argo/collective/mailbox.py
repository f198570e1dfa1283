"""The receiving side of collective operations: each worker's Collective gRPC service.

A delivered piece is only stored, keyed by ``(round, operation, step)``; the member's own collective
operation takes it when it gets there (:meth:`Mailbox.take`), so a sender never waits for the receiver's
computation and no ordering between neighbours can deadlock. Pieces of rounds older than the member's
current one are dropped; a piece of a *newer* round tells the member that the group has moved on.

The same service answers ``GetState`` from the state the member published for a round (see
:class:`~edl_argo.collective.group.CollectiveGroup`), which is how new and diverged members receive the
model and optimizer state (a broadcast by pull: each receiver fetches from the round's source).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from edl_argo.log import get_logger
from edl_argo.proto import collective_pb2, collective_pb2_grpc, tensor_pb2
from edl_argo.rpc.channel import make_server
from edl_argo.rpc.tensors import TensorDecodeError, from_tensor

log = get_logger(__name__)

_Key = tuple[int, int, int]

#: ``state_provider(round_id)``: the :class:`ModelState` published for that round (``round_id < 0``: the
#: current state), or None if there is none (yet).
StateProvider = Callable[[int], "collective_pb2.ModelState | None"]


class RoundChanged(Exception):
    """A piece of a newer round arrived while waiting: the group has moved on."""

    def __init__(self, newer_round: int) -> None:
        super().__init__(f"round {newer_round} started")
        self.newer_round = newer_round


class Mailbox:
    """Pieces delivered to this member, waiting to be taken. Thread-safe."""

    def __init__(self) -> None:
        self._pieces: dict[_Key, np.ndarray] = {}
        self._cond = threading.Condition()
        self._round = 0
        self._newest_seen = 0

    def enter_round(self, round_id: int) -> None:
        """From now on, pieces of rounds before ``round_id`` are dropped."""
        with self._cond:
            self._round = round_id
            self._pieces = {k: v for k, v in self._pieces.items() if k[0] >= round_id}

    def put(self, key: _Key, piece: np.ndarray) -> None:
        with self._cond:
            if key[0] < self._round:
                return
            self._pieces[key] = piece
            self._newest_seen = max(self._newest_seen, key[0])
            self._cond.notify_all()

    def take(self, key: _Key, timeout: float, on_slow_wait: Callable[[], None]) -> np.ndarray | None:
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


class CollectiveService(collective_pb2_grpc.CollectiveServicer):
    def __init__(self, mailbox: Mailbox, state_provider: StateProvider) -> None:
        self._mailbox = mailbox
        self._state_provider = state_provider

    def Deliver(
        self, request: collective_pb2.CollectiveChunk, context: grpc.ServicerContext
    ) -> tensor_pb2.Empty:
        try:
            piece = from_tensor(request.data)
        except TensorDecodeError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self._mailbox.put((request.round_id, request.operation, request.step), piece)
        return tensor_pb2.Empty()

    def GetState(
        self, request: collective_pb2.GetStateRequest, context: grpc.ServicerContext
    ) -> collective_pb2.ModelState:
        state = self._state_provider(request.round_id)
        if state is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no state published for round {request.round_id}")
        return state


class CollectiveServer:
    """A worker's Collective service on ``host:port`` (port 0: any free port); see :attr:`address`."""

    def __init__(self, host: str, port: int, state_provider: StateProvider) -> None:
        self.mailbox = Mailbox()
        self._server = make_server(max_workers=4)
        collective_pb2_grpc.add_CollectiveServicer_to_server(
            CollectiveService(self.mailbox, state_provider), self._server
        )
        bound = _bind(self._server, host, port)
        if bound == 0 and port != 0:
            # Only where pods share a network namespace (hostNetwork, or the test suite's stand-in cluster):
            # the address the master hands out is the one actually bound, so any port works.
            log.warning("collective_port_taken", port=port, fallback="any free port")
            bound = _bind(self._server, host, 0)
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} for the collective service")
        self._server.start()
        self.address = f"{host}:{bound}"

    def stop(self) -> None:
        self._server.stop(grace=0.5)


def _bind(server: grpc.Server, host: str, port: int) -> int:
    """The port bound on ``host`` (0 if ``port`` is taken)."""
    try:
        return server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # newer gRPC raises instead of returning 0
        return 0
