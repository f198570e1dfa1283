"""AllreduceStrategy's building blocks: the ring algorithm, the gRPC group with its timeouts, and the
master's rendezvous bookkeeping. (End-to-end jobs: tests/test_training_allreduce.py.)"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edl_argo.collective import CollectiveAborted, CollectiveGroup, CollectiveServer, ring_allreduce
from edl_argo.collective.group import PeerChannels
from edl_argo.collective.ring import segment_bounds
from edl_argo.master.rendezvous import RendezvousManager


def _in_threads(count: int, body: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
    """Run ``body(rank)`` for every rank in its own thread; results (or raised exceptions) by rank."""
    results: list[Any] = [None] * count

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as error:  # returned to the test
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a member hung"
    return results


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 7, 1000])
def test_ring_allreduce_sums_and_every_member_gets_identical_bits(size: int, length: int) -> None:
    rng = np.random.default_rng(size * 1000 + length)
    vectors = [rng.standard_normal(length).astype(np.float32) for _ in range(size)]
    inboxes: list[queue.Queue] = [queue.Queue() for _ in range(size)]

    def member(rank: int) -> np.ndarray:
        def exchange(step: int, outgoing: np.ndarray) -> np.ndarray:
            inboxes[(rank + 1) % size].put((step, outgoing.copy()))
            received_step, piece = inboxes[rank].get(timeout=10)
            assert received_step == step
            return piece

        return ring_allreduce(vectors[rank], rank, size, exchange)

    results = _in_threads(size, member)
    np.testing.assert_allclose(results[0], np.sum(vectors, axis=0), rtol=1e-5, atol=1e-6)
    for result in results[1:]:
        assert result.tobytes() == results[0].tobytes()


def test_segments_cover_the_vector_once() -> None:
    for length in range(0, 12):
        for parts in range(1, 5):
            bounds = segment_bounds(length, parts)
            assert bounds[0][0] == 0 and bounds[-1][1] == length
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


class _Members:
    """``count`` Collective servers on loopback and the groups of one round over them."""

    def __init__(self, count: int) -> None:
        self.servers = [CollectiveServer("127.0.0.1", 0, lambda _round: None) for _ in range(count)]
        self.channels = [PeerChannels() for _ in range(count)]
        self.current = [True]

    def group(self, rank: int, timeout: float, round_id: int = 1) -> CollectiveGroup:
        members = [(100 + i, s.address) for i, s in enumerate(self.servers)]
        return CollectiveGroup(
            round_id,
            rank,
            members,
            self.servers[rank].mailbox,
            self.channels[rank],
            lambda: self.current[0],
            timeout,
        )

    def close(self) -> None:
        for server, channels in zip(self.servers, self.channels, strict=True):
            channels.close()
            server.stop()


@pytest.fixture
def three_members() -> Any:
    members = _Members(3)
    yield members
    members.close()


def test_group_allreduces_over_grpc_with_raw_bytes(three_members: _Members) -> None:
    vectors = [np.full(100_003, rank + 1, dtype=np.float32) for rank in range(3)]

    def member(rank: int) -> list[np.ndarray]:
        group = three_members.group(rank, timeout=20)
        return [group.allreduce(vectors[rank]), group.allreduce(vectors[rank] * 2)]

    results = _in_threads(3, member)
    for first, second in results:
        assert np.all(first == 6.0) and np.all(second == 12.0)


def test_a_silent_member_is_blamed_and_nobody_hangs(three_members: _Members) -> None:
    """Worker 102 (rank 2) never takes part: rank 0, which waits on it, blames it within the timeout."""

    def member(rank: int) -> Any:
        started = time.monotonic()
        try:
            three_members.group(rank, timeout=1.5).allreduce(np.ones(10, dtype=np.float32))
        except CollectiveAborted as error:
            return error, time.monotonic() - started
        return None, time.monotonic() - started

    results = _in_threads(2, member)
    for error, seconds in results:
        assert isinstance(error, CollectiveAborted) and error.round_id == 1
        assert seconds < 5.0
    assert results[0][0].suspect == 102


def test_a_dead_member_is_blamed_at_once(three_members: _Members) -> None:
    """Rank 2's process is gone (its port refuses): rank 1, which sends to it, blames it without waiting out
    the timeout, and rank 0 learns that its round ended as soon as the master says so."""
    three_members.servers[2].stop()

    def member(rank: int) -> Any:
        started = time.monotonic()
        try:
            three_members.group(rank, timeout=60).allreduce(np.ones(10, dtype=np.float32))
        except CollectiveAborted as error:
            three_members.current[0] = False  # what the master does on the report
            return error, time.monotonic() - started
        return None, 0.0

    results = _in_threads(2, member)
    assert results[1][0].suspect == 102
    for error, seconds in results:
        assert isinstance(error, CollectiveAborted)
        assert seconds < 10.0


def test_a_piece_of_a_newer_round_ends_the_wait(three_members: _Members) -> None:
    """Rank 0 is still in round 1 when its left neighbour (rank 2) already sends round 2's pieces."""
    old = three_members.group(0, timeout=30, round_id=1)
    newer = three_members.group(2, timeout=2, round_id=2)

    def member(index: int) -> Any:
        started = time.monotonic()
        try:
            (old if index == 0 else newer).allreduce(np.ones(4, np.float32))
        except CollectiveAborted as error:
            return error, time.monotonic() - started
        return None, 0.0

    (error, seconds), _ = _in_threads(2, member)
    assert isinstance(error, CollectiveAborted) and "round 2" in str(error)
    assert seconds < 5.0


def test_rendezvous_rounds_follow_membership() -> None:
    rendezvous = RendezvousManager()
    first = rendezvous.rendezvous(0, "a:1")
    assert (first.round_id, first.rank_of(0)) == (1, 0)
    assert rendezvous.rendezvous(0, "a:1") == first  # asking again changes nothing
    second = rendezvous.rendezvous(1, "b:1")
    assert second.round_id == 2 and [m.worker_id for m in second.members] == [0, 1]
    assert second.rank_of(1) == 1 and second.rank_of(7) == -1

    rendezvous.report_failure(reporter=0, round_id=1, suspect=1, message="stale")  # an old round: ignored
    assert rendezvous.current.round_id == 2
    rendezvous.report_failure(reporter=0, round_id=2, suspect=1, message="timeout")
    assert rendezvous.current.round_id == 3 and rendezvous.current.rank_of(1) == -1
    assert rendezvous.rendezvous(1, "b:1").round_id == 4  # alive after all: it joins again

    rendezvous.remove(1, "Killed")
    assert rendezvous.current.round_id == 5 and rendezvous.current.rank_of(1) == -1
    assert rendezvous.rendezvous(1, "b:1").rank_of(1) == -1  # a stopped pod's late call is not a join
