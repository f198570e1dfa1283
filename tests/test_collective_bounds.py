"""The collective transport bounds what its peers can do (issue 24, items 1, 2 and 10): raw frames from a
test-side peer against real collective servers, and members whose neighbour's address is malformed.

* a member address that is not ``host:port`` fails the sends to it (the sender thread lives on) and its
  member is blamed at once;
* a piece of a round the master never started (round id 2^63-1) ends no wait, now or later;
* a declared payload is not allocated before it arrives and must arrive in time; idle connections are
  closed, and beyond the cap the idlest one makes room; pieces of operations no member can be at, and of
  newer rounds beyond a budget, are not kept.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest

from edl_argo.collective import mailbox as mailbox_module
from edl_argo.collective import transport
from edl_argo.collective.group import CollectiveAborted, CollectiveGroup
from edl_argo.collective.mailbox import CollectiveServer
from edl_argo.collective.transport import HEADER, MAGIC, PROTOCOL_VERSION, FrameKind, PeerConnections
from tests.test_collective import _in_threads, _Members, _no_state

pytestmark = pytest.mark.timeout(120)

INT64_MAX = 2**63 - 1


def piece_frame(
    round_id: int, operation: int, step: int, payload: bytes = b"\0" * 4, declared: int = -1
) -> bytes:
    """A float32 PIECE frame as a hostile peer sends it (``declared``: the length its header announces)."""
    length = len(payload) if declared < 0 else declared
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, FrameKind.PIECE, 1, 0, round_id, operation, step, 0, length)
    return header + payload


def connect(server: CollectiveServer) -> socket.socket:
    """A raw connection past the preamble (these servers belong to no job: any token is taken)."""
    host, port = server.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(transport.AUTH_MAGIC + bytes(transport.TOKEN_BYTES))
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def two_members() -> Iterator[_Members]:
    members = _Members(2)
    yield members
    members.close()


def test_a_member_address_that_is_not_host_port_fails_its_sends_and_is_blamed_at_once() -> None:
    """Item 1: the sender thread died on a ValueError, its future never completed, and the group waited
    out its timeout for the fake member, every step."""
    server = CollectiveServer("127.0.0.1", 0, _no_state)
    peers = PeerConnections()
    try:
        for address in ("bogus-no-port", "x" * (1 << 20) + ":80", "host:99999"):
            sending = peers.connection(address).send_piece((1, 1, 0), 0, np.ones(3, np.float32), timeout=5)
            with pytest.raises(ConnectionError, match="address"):
                sending.result(timeout=5)
        members = [(100, server.address), (666, "bogus-no-port")]
        group = CollectiveGroup(1, 0, members, server.mailbox, peers, lambda: True, timeout=30)
        started = time.monotonic()
        with pytest.raises(CollectiveAborted) as aborted:
            group.allreduce(np.ones(10, np.float32))
        assert aborted.value.suspect == 666 and time.monotonic() - started < 5
        # The connection to a real member still works.
        peers.connection(server.address).send_piece((1, 1, 1), 0, np.ones(3, np.float32), 5).result(timeout=5)
    finally:
        peers.close()
        server.stop()


def test_a_piece_of_a_round_the_master_never_started_ends_no_wait(two_members: _Members) -> None:
    """Item 2: one 44-byte frame with round id 2^63-1 made every later wait raise RoundChanged."""
    asked: list[int] = []

    def master_says_current() -> bool:
        asked.append(1)
        return True

    for server in two_members.servers:
        with connect(server) as raw:
            raw.sendall(piece_frame(INT64_MAX, 1, 0))
    time.sleep(0.2)

    def member(rank: int, round_id: int) -> np.ndarray:
        servers = two_members.servers
        group = CollectiveGroup(
            round_id,
            rank,
            [(100 + i, s.address) for i, s in enumerate(servers)],
            servers[rank].mailbox,
            two_members.peers[rank],
            master_says_current,
            timeout=20,
        )
        return group.allreduce(np.full(8, rank + 1, np.float32))

    for round_id in (1, 2):  # the round it arrived in, and the next one
        totals = _in_threads(2, lambda rank, r=round_id: member(rank, r))
        assert all(isinstance(t, np.ndarray) and np.all(t == 3.0) for t in totals), totals
    # Entering a round the master named dismisses the newer rounds seen before it (no call); a piece that
    # arrives later is asked about once per member, not at every wait.
    assert len(asked) <= 2


def test_a_declared_payload_is_not_allocated_before_it_arrives_and_must_arrive_in_time(
    two_members: _Members, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 10: a declared 48 MiB piece was allocated at once and read with no deadline (8 half-sent
    frames: +380 MB, held for good)."""
    monkeypatch.setattr(transport, "PIECE_READ_SECONDS", 2.0, raising=False)
    server = two_members.servers[0]
    two_members.group(0, timeout=5, round_id=1)  # its mailbox is in round 1
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = [connect(server) for _ in range(8)]
        for raw in held:
            raw.sendall(piece_frame(1, 1, 0, b"\0" * 1024, declared=48 << 20))
        time.sleep(0.5)
        grown = tracemalloc.get_traced_memory()[0] - before
        assert grown < 8 * (2 << 20), f"{grown} bytes held for 8 KiB received"
        assert all(closed_within(raw, 10) for raw in held), (
            "a half-sent piece was waited for past its deadline"
        )
    finally:
        tracemalloc.stop()
        for raw in held:
            raw.close()
    # A real piece of the same size arrives whole.
    vector = np.arange(3 << 20, dtype=np.float32)
    with connect(server) as raw:
        raw.sendall(piece_frame(1, 1, 1, vector.tobytes()))
        piece = server.mailbox.take((1, 1, 1), 10, lambda: None)
    assert piece is not None and np.array_equal(piece, vector)


def test_idle_connections_are_closed_and_beyond_the_cap_the_idlest_makes_room(
    two_members: _Members, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 10: 300 idle connections made 300 threads, for good."""
    monkeypatch.setattr(transport, "IDLE_SECONDS", 2.0, raising=False)
    server = two_members.servers[0]
    monkeypatch.setattr(server._server._server, "max_connections", 8)  # its FrameServer's SocketServer
    idle = connect(server)
    assert closed_within(idle, 10), "an idle connection was kept past IDLE_SECONDS"
    idle.close()

    monkeypatch.setattr(transport, "IDLE_SECONDS", 600.0, raising=False)
    readers_before = sum(t.name.startswith("collective-read-") for t in threading.enumerate())
    crowd = [connect(server) for _ in range(30)]
    try:
        time.sleep(1.0)
        readers = sum(t.name.startswith("collective-read-") for t in threading.enumerate()) - readers_before
        assert readers <= 8, f"{readers} reader threads for 30 idle connections"
        assert sum(closed_within(raw, 0.2) for raw in crowd) >= 22
        # The members' own connections still carry their operations.
        totals = _in_threads(2, lambda rank: two_members.group(rank, 20, 3).allreduce(np.ones(5, np.float32)))
        assert all(isinstance(t, np.ndarray) and np.all(t == 2.0) for t in totals), totals
    finally:
        for raw in crowd:
            raw.close()


def test_pieces_no_operation_waits_for_and_newer_rounds_beyond_a_budget_are_not_kept(
    two_members: _Members, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 10: pieces of far-future operations were kept until the round changed (+320 MB held 100 s)."""
    monkeypatch.setattr(mailbox_module, "FUTURE_ROUND_BYTES", 4 << 20, raising=False)
    server = two_members.servers[0]
    two_members.group(0, timeout=5, round_id=5)
    megabyte = b"\0" * (1 << 20)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    with connect(server) as raw:
        for operation in range(1000, 1016):  # far ahead of the operation it is at
            raw.sendall(piece_frame(5, operation, 0, megabyte))
        for step in range(4, 20):  # steps no ring of 2 members has
            raw.sendall(piece_frame(5, 1, step, megabyte))
        for round_id in range(6, 22):  # newer rounds: 16 MiB against a budget of 4
            raw.sendall(piece_frame(round_id, 1, 0, megabyte))
        raw.sendall(piece_frame(5, 1, 0, b"\0" * 8))  # a piece it does wait for
        assert server.mailbox.take((5, 1, 0), 10, lambda: None, lambda: True) is not None
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held < 6 << 20, f"{held} bytes held after 48 MiB of pieces no operation waits for"
    assert server.mailbox.buffered_bytes <= 4 << 20
