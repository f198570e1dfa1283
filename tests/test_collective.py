"""AllreduceStrategy's building blocks: the ring algorithm, the group over its TCP transport with its
timeouts, and the master's rendezvous bookkeeping. (End-to-end jobs: tests/test_training_allreduce.py.)"""

from __future__ import annotations

import itertools
import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edl_argo.collective import CollectiveAborted, CollectiveGroup, CollectiveServer, ring_allreduce
from edl_argo.collective.checkpoint import decode_state
from edl_argo.collective.membership import survey_member_states
from edl_argo.collective.ring import segment_bounds
from edl_argo.collective.state import GroupState, Lineage, StatePoint
from edl_argo.collective.transport import (
    AUTH_MAGIC,
    FRAME_CAP_ENV,
    HEADER,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    FrameKind,
    PeerConnections,
    StateProvider,
    encode_state,
)
from edl_argo.errors import JobFailedError
from edl_argo.log import configure as configure_logging
from edl_argo.master.rendezvous import SILENT_AFTER_TRAINING_SECONDS, Member, RendezvousManager
from edl_argo.proto import master_pb2
from edl_argo.rpc.auth import TOKEN_BYTES


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


def _ring_in_memory(vectors: list[np.ndarray]) -> list[Any]:
    """:func:`ring_allreduce` of ``vectors`` (one per member) with the pieces passed through queues."""
    size = len(vectors)
    inboxes: list[queue.Queue] = [queue.Queue() for _ in range(size)]

    def member(rank: int) -> np.ndarray:
        def exchange(step: int, outgoing: np.ndarray) -> np.ndarray:
            inboxes[(rank + 1) % size].put((step, outgoing.copy()))
            received_step, piece = inboxes[rank].get(timeout=10)
            assert received_step == step
            return piece

        return ring_allreduce(vectors[rank], rank, size, exchange)

    return _in_threads(size, member)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 7, 1000])
def test_ring_allreduce_sums_and_every_member_gets_identical_bits(size: int, length: int) -> None:
    rng = np.random.default_rng(size * 1000 + length)
    vectors = [rng.standard_normal(length).astype(np.float32) for _ in range(size)]
    results = _ring_in_memory(vectors)
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


def _no_state(_round_id: int) -> GroupState | None:
    return None


class _Members:
    """``count`` collective servers on loopback and the groups of one round over them; member ``i`` serves the
    states of ``state_providers[i]`` (default: none)."""

    def __init__(self, count: int, state_providers: dict[int, StateProvider] | None = None) -> None:
        providers = state_providers or {}
        self.servers = [CollectiveServer("127.0.0.1", 0, providers.get(i, _no_state)) for i in range(count)]
        self.peers = [PeerConnections() for _ in range(count)]
        self.current = [True]

    def group(self, rank: int, timeout: float, round_id: int = 1) -> CollectiveGroup:
        members = [(100 + i, s.address) for i, s in enumerate(self.servers)]
        return CollectiveGroup(
            round_id,
            rank,
            members,
            self.servers[rank].mailbox,
            self.peers[rank],
            lambda: self.current[0],
            timeout,
        )

    def close(self) -> None:
        for server, peers in zip(self.servers, self.peers, strict=True):
            peers.close()
            server.stop()


@pytest.fixture
def three_members() -> Any:
    members = _Members(3)
    yield members
    members.close()


def test_group_allreduces_over_tcp(three_members: _Members) -> None:
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
    """Rank 0 is still in round 1 when its left neighbour (rank 2) already sends round 2's pieces: the master
    has started round 2, and rank 0 asks it as soon as the piece arrives (a round the master did not start
    ends nothing: tests/test_collective_bounds.py)."""
    old = three_members.group(0, timeout=30, round_id=1)
    newer = three_members.group(2, timeout=2, round_id=2)
    three_members.current[0] = False  # the master's answer to rank 0: round 1 is not current any more

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


def test_a_member_gone_since_the_last_round_is_blamed_at_once() -> None:
    """Two members: round 1 opens the connections, then member 101's process goes away (its server closes
    them). In round 2, member 100 finds its connection closed, cannot open a new one, and blames 101 at once:
    a send into the stale connection would seem to succeed and leave it waiting out the timeout for 101's
    piece."""
    members = _Members(2)
    try:
        first = _in_threads(2, lambda rank: members.group(rank, 20).allreduce(np.ones(10, np.float32)))
        assert all(np.all(total == 2.0) for total in first)
        members.servers[1].stop()
        started = time.monotonic()
        with pytest.raises(CollectiveAborted) as aborted:
            members.group(0, timeout=60, round_id=2).allreduce(np.ones(10, dtype=np.float32))
        assert aborted.value.suspect == 101 and time.monotonic() - started < 10.0
    finally:
        members.close()


def test_connections_to_members_that_left_are_closed_and_the_others_kept() -> None:
    members = _Members(2)
    try:
        peers = members.peers[0]
        kept, dropped = (peers.connection(server.address) for server in members.servers)
        peers.retain({members.servers[0].address})
        assert peers.connection(members.servers[0].address) is kept
        with pytest.raises(ConnectionError, match="closed"):
            dropped.send_piece((1, 1, 0), 0, np.ones(3, np.float32), timeout=5).result(timeout=5)
        kept.send_piece((1, 1, 0), 0, np.ones(3, np.float32), timeout=5).result(timeout=5)
        piece = members.servers[0].mailbox.take((1, 1, 0), 5, lambda: None)
        assert piece is not None and piece.tolist() == [1.0, 1.0, 1.0]
    finally:
        members.close()


def _raw_header(
    magic: bytes = MAGIC, kind: int = FrameKind.PIECE, dtype_code: int = 1, payload_bytes: int = 8
) -> bytes:
    """A frame header as a broken or hostile peer may send it (round 1, operation 1, step 0, sender 2)."""
    return HEADER.pack(magic, PROTOCOL_VERSION, kind, dtype_code, 0, 1, 1, 0, 2, payload_bytes)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closes ``sock`` (a reset when it left bytes unread) rather than answering."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_malformed_frames_are_rejected_and_the_server_keeps_serving(
    three_members: _Members, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging()
    host, port = three_members.servers[0].address.split(":")
    malformed = {
        "bad magic": _raw_header(magic=b"HTTP") + bytes(8),
        "exceeds the cap": _raw_header(payload_bytes=MAX_PAYLOAD_BYTES + 4),
        "unexpected frame kind 9": _raw_header(kind=9, payload_bytes=0),
        "unknown dtype code 77": _raw_header(dtype_code=77) + bytes(8),
    }
    for reason, frame in malformed.items():
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(AUTH_MAGIC + bytes(TOKEN_BYTES) + frame)  # a server of no job: any token passes
            assert _closed_by_peer(raw), f"the server kept a connection that sent a frame with {reason}"
        rejected = [
            line for line in capsys.readouterr().err.splitlines() if "collective_frame_rejected" in line
        ]
        assert len(rejected) == 1 and reason in rejected[0] and "peer=127.0.0.1:" in rejected[0]

    vectors = [np.full(1000, rank + 1, dtype=np.float32) for rank in range(3)]
    totals = _in_threads(3, lambda rank: three_members.group(rank, timeout=20).allreduce(vectors[rank]))
    assert all(np.all(total == 6.0) for total in totals)


def test_a_large_vector_is_bit_identical_to_the_rings_sum(three_members: _Members) -> None:
    """4.8 MB per member (the MNIST CNN's gradient): every byte arrives, in order, on every member."""
    rng = np.random.default_rng(48)
    vectors = [rng.standard_normal(1_199_884).astype(np.float32) for _ in range(3)]
    expected = _ring_in_memory(vectors)[0].tobytes()
    totals = _in_threads(3, lambda rank: three_members.group(rank, timeout=30).allreduce(vectors[rank]))
    for total in totals:
        assert isinstance(total, np.ndarray) and total.tobytes() == expected


def test_a_state_is_pulled_once_its_source_publishes_it() -> None:
    """The source answers "not yet" twice, then publishes: the pull asks again until it gets the state. A
    state never published for a round ends the pull within the timeout, blaming the source."""
    state = GroupState(1, 7, [np.arange(5, dtype=np.float32)], Lineage.origin(1, 7))
    requests: list[int] = []

    def source(round_id: int) -> GroupState | None:
        requests.append(round_id)
        return state if round_id == 1 and len(requests) >= 3 else None

    members = _Members(2, {0: source})
    try:
        pulled = members.group(1, timeout=10).pull_state(0)
        assert requests == [1, 1, 1] and _same_state(pulled, state)
        started = time.monotonic()
        with pytest.raises(CollectiveAborted, match="not published") as aborted:
            members.group(1, timeout=1, round_id=2).pull_state(0)
        assert aborted.value.suspect == 100 and time.monotonic() - started < 5.0
    finally:
        members.close()


def _same_state(a: GroupState | None, b: GroupState) -> bool:
    return (
        a is not None
        and (a.round_id, a.version, a.lineage) == (b.round_id, b.version, b.lineage)
        and len(a.values) == len(b.values)
        and all(
            x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
            for x, y in zip(a.values, b.values, strict=True)
        )
    )


def test_the_master_surveys_every_member_that_has_a_state() -> None:
    """The master's export: members answer with their current state (round -1); a member without one, or
    one that is gone, is left out and named when nobody has a state. The newest state is kept, and the
    largest difference of any other from it is reported."""
    current = GroupState(-1, 12, [np.ones(3, dtype=np.float32)], Lineage.origin(4, 12))
    older = GroupState(-1, 11, [np.array([1.0, 1.5, 1.0], np.float32)], Lineage.origin(4, 11))
    members = _Members(3, {0: lambda _round: older, 2: lambda _round: current})
    try:
        addresses = [server.address for server in members.servers]
        survey = survey_member_states(addresses, timeout=10)
        assert _same_state(survey.newest, current)
        assert (survey.members_compared, survey.max_abs_difference, survey.versions) == (2, 0.5, [11, 12])
        members.servers[2].stop()
        assert _same_state(survey_member_states(addresses, timeout=10).newest, older)
        with pytest.raises(JobFailedError, match=f"{addresses[1]}: no state; {addresses[2]}: .*refused"):
            survey_member_states(addresses[1:], timeout=10)
    finally:
        members.close()


def test_a_member_that_joined_after_the_last_step_is_named_behind_not_compared() -> None:
    """A member that joined the final round after the last step still holds an earlier state of the
    newest state's lineage (chaos ``allreduce_master_restart_k8s``: a worker back at version 177 as its
    peer, alone meanwhile, finished at 304). It is named as behind; the replicas compared are those at the
    newest state, which must be identical. A state of another lineage is compared, and differs."""
    lineage = Lineage(((4, 0), (9, 178)))  # versions up to 177 made in round 4, the rest in round 9
    newest = GroupState(-1, 304, [np.ones(3, np.float32)], lineage)
    twin = GroupState(-1, 304, [np.ones(3, np.float32)], lineage)
    behind = GroupState(-1, 177, [np.full(3, 9.0, np.float32)], Lineage.origin(4))
    stranger = GroupState(-1, 200, [np.full(3, 3.0, np.float32)], Lineage.origin(7))
    providers = [behind, newest, behind, twin, stranger]  # the behind ones before and after the newest
    members = _Members(5, {i: (lambda _round, state=state: state) for i, state in enumerate(providers)})
    try:
        addresses = [server.address for server in members.servers]
        survey = survey_member_states(addresses[:4], timeout=10)
        assert _same_state(survey.newest, newest)
        assert (survey.members_compared, survey.max_abs_difference) == (2, 0.0)
        assert survey.behind == [f"{addresses[i]}: version 177 of round 4" for i in (0, 2)]
        assert survey.versions == [177, 304] and survey.left_out == []
        survey = survey_member_states(addresses, timeout=10)
        assert (survey.members_compared, survey.max_abs_difference) == (3, 2.0)
        assert len(survey.behind) == 2
    finally:
        members.close()


def test_a_survey_none_of_whose_many_members_answers_names_five_and_counts_the_rest() -> None:
    """The export of a big group none of whose members answers: one short line, not one cause per worker."""
    closed = []
    for _ in range(40):  # ports that were just free: nothing listens there
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            closed.append(f"127.0.0.1:{probe.getsockname()[1]}")
    with pytest.raises(JobFailedError) as failure:
        survey_member_states(closed, timeout=5)
    message = str(failure.value)
    assert message.startswith(f"no worker of the group returned the trained model ({closed[0]}: "), message
    assert message.endswith("; and 35 more workers)"), message
    assert message.count("127.0.0.1:") == 5 and len(message) < 1_000


def _state_of_every_kind(rng: np.random.Generator) -> GroupState:
    values = [
        rng.standard_normal((70, 30)).astype(np.float32),  # 8,400 bytes: three frames at a 4 KiB cap
        np.array(5, dtype=np.int64),  # a scalar (the optimizer's iterations)
        np.zeros((0, 4), dtype=np.float32),  # no bytes at all
        rng.integers(0, 2**32, size=2, dtype=np.uint32),  # a seed generator's state
        rng.standard_normal(4096 // 8).astype(np.float64),  # exactly one frame
    ]
    return GroupState(3, 41, values, Lineage(((2, 0), (3, 40))))


def test_a_state_larger_than_the_frame_cap_streams_to_its_puller_and_into_a_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a 4 KiB cap, a state of 12 KiB travels in frames no larger than the cap, every dtype and shape
    intact, and a checkpoint holds the same frames; a piece over the cap is still refused."""
    monkeypatch.setenv(FRAME_CAP_ENV, "4096")
    state = _state_of_every_kind(np.random.default_rng(7))
    assert state.nbytes > 3 * 4096
    members = _Members(2, {0: lambda round_id: state if round_id == 3 else None})
    try:
        assert _same_state(members.group(1, timeout=10, round_id=3).pull_state(0), state)
    finally:
        members.close()
    encoded = encode_state(state)
    assert _same_state(decode_state(encoded), state)
    offset, sizes = 0, []
    while offset < len(encoded):
        length = HEADER.unpack(encoded[offset : offset + HEADER.size])[-1]
        sizes.append(length)
        offset += HEADER.size + length
    assert max(sizes) <= 4096 and len(sizes) >= 6


def test_a_vector_whose_pieces_exceed_the_frame_cap_is_summed_in_blocks(
    three_members: _Members, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 KiB frames, 10,007 float32 per member (13 KiB per ring piece): the sum is the in-memory ring's,
    bit for bit, on every member."""
    monkeypatch.setenv(FRAME_CAP_ENV, "1024")
    rng = np.random.default_rng(3)
    vectors = [rng.standard_normal(10_007).astype(np.float32) for _ in range(3)]
    totals = _in_threads(3, lambda rank: three_members.group(rank, timeout=20).allreduce(vectors[rank]))
    np.testing.assert_allclose(totals[0], np.sum(vectors, axis=0), rtol=1e-5, atol=1e-5)
    for total in totals:
        assert isinstance(total, np.ndarray) and total.tobytes() == totals[0].tobytes()


def test_lineage_names_the_round_that_made_each_version() -> None:
    lineage = Lineage.origin(5).after_step(1, 5).after_step(2, 5).after_step(3, 8).after_step(4, 8)
    assert lineage.spans == ((5, 0), (8, 3))
    assert [lineage.round_of(v) for v in range(5)] == [5, 5, 5, 8, 8]
    assert lineage.descends_from(4, StatePoint(2, 5)) and lineage.descends_from(4, StatePoint(3, 8))
    assert not lineage.descends_from(4, StatePoint(3, 7))  # version 3 of another round: another branch
    assert not lineage.descends_from(2, StatePoint(3, 8))  # behind it
    assert Lineage().round_of(0) is None and not Lineage().descends_from(9, StatePoint(0, 1))


def test_a_taken_port_falls_back_to_a_free_one_and_stop_releases_it() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        fallback = CollectiveServer("127.0.0.1", port, _no_state)
        fallback.stop()
        assert fallback.address != f"127.0.0.1:{port}" and fallback.address.startswith("127.0.0.1:")
    rebound = CollectiveServer("127.0.0.1", int(fallback.address.split(":")[1]), _no_state)
    rebound.stop()
    assert rebound.address == fallback.address


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


def test_the_master_commits_reports_of_its_current_round_only_and_a_restart_keeps_them() -> None:
    rendezvous = RendezvousManager()
    current = rendezvous.rendezvous(0, "a:1")
    formed = master_pb2.RendezvousRequest(formed_round=current.round_id)

    def report(version: int, made_in: int, formed_round: int, checkpoint: int = 0) -> None:
        request = master_pb2.RendezvousRequest(
            formed_round=formed_round,
            state=master_pb2.StatePoint(version=version, round_id=made_in),
            checkpoint=master_pb2.StatePoint(version=checkpoint, round_id=made_in if checkpoint else 0),
        )
        rendezvous.rendezvous(0, "a:1", request)

    report(5, current.round_id, formed_round=0)  # not agreed in this round yet: ignored
    assert rendezvous.committed is None
    report(5, current.round_id, formed.formed_round, checkpoint=4)
    assert rendezvous.committed == StatePoint(5, current.round_id)
    assert rendezvous.checkpoint == StatePoint(4, current.round_id)
    report(3, current.round_id, formed.formed_round)  # behind: the committed state stays
    assert rendezvous.committed == StatePoint(5, current.round_id)

    restarted = RendezvousManager(first_round=100)
    restarted.restore(json.loads(json.dumps(rendezvous.snapshot())))
    assert (restarted.committed, restarted.checkpoint) == (rendezvous.committed, rendezvous.checkpoint)
    answer = restarted.response(restarted.rendezvous(0, "a:1"), 0)
    assert (answer.committed.version, answer.checkpoint.version) == (5, 4)


def test_a_round_formed_after_training_ended_is_no_restore() -> None:
    """Once the master has read the trained state, a member left alone as its peers finish forms a round on
    the older state it holds (it joined after the last step): no steps are lost, nothing is logged or
    counted as the model moving backwards, and the committed state stays."""
    rendezvous = RendezvousManager()
    first = rendezvous.rendezvous(0, "a:1")
    made = master_pb2.StatePoint(version=304, round_id=first.round_id)
    rendezvous.rendezvous(0, "a:1", master_pb2.RendezvousRequest(formed_round=first.round_id, state=made))
    rendezvous.rendezvous(1, "b:1")
    rendezvous.end_training()
    rendezvous.remove(0, "Completed")
    alone = rendezvous.rendezvous(1, "b:1", _formed(rendezvous.current.round_id, 177, made_in=1, watch=True))
    assert alone.members == (Member(1, "b:1"),)
    assert rendezvous.restores == [] and rendezvous.steps_lost == 0
    assert rendezvous.committed == StatePoint(304, first.round_id)


def _formed(round_id: int, version: int, made_in: int, watch: bool = False) -> master_pb2.RendezvousRequest:
    """A member's report: it formed ``round_id`` on its own state (not a descendant of the committed one),
    ``version`` made in round ``made_in``."""
    state = master_pb2.StatePoint(version=version, round_id=made_in)
    return master_pb2.RendezvousRequest(
        formed_round=round_id, formed_from=master_pb2.MEMBER, formed_state=state, state=state, watch=watch
    )


def test_a_watch_call_reports_without_joining_and_silent_or_twice_reported_suspects_are_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rendezvous = RendezvousManager()
    for worker in (0, 1, 2):
        rendezvous.rendezvous(worker, f"w{worker}:1")
    clock = [1000.0]
    monkeypatch.setattr("edl_argo.master.rendezvous.time.monotonic", lambda: clock[0])

    def watch(worker: int, formed_round: int = 0) -> int:
        request = master_pb2.RendezvousRequest(watch=True, formed_round=formed_round)
        return rendezvous.rendezvous(worker, f"w{worker}:1", request).round_id

    first = rendezvous.current.round_id
    rendezvous.report_failure(reporter=0, round_id=first, suspect=1, message="silent")  # 1 is hung
    rendezvous.report_failure(reporter=0, round_id=first + 1, suspect=2, message="silent")  # 2 is alive
    dropped = rendezvous.current.round_id
    assert watch(2) == dropped and rendezvous.current.rank_of(2) == -1  # a watch call does not join
    clock[0] += 5
    watch(2)
    assert rendezvous.stuck(timeout=8) == []
    clock[0] += 4  # 1 silent for 9 s, 2 called 4 s ago
    assert rendezvous.stuck(timeout=8) == [1]
    assert rendezvous.stuck(timeout=8) == []  # named once

    rejoined = rendezvous.rendezvous(2, "w2:1").round_id  # 2 joins again...
    watch(2, formed_round=rejoined)  # ...and forms the round: no longer a suspect
    rendezvous.report_failure(reporter=0, round_id=rejoined, suspect=2, message="silent")
    assert rendezvous.stuck(timeout=8) == []  # reported once since it formed
    again = rendezvous.rendezvous(2, "w2:1").round_id  # joins, but never forms (its path is broken)
    rendezvous.report_failure(reporter=0, round_id=again, suspect=2, message="silent")
    assert rendezvous.stuck(timeout=8) == [2]


def test_once_training_is_over_a_suspect_silent_since_its_report_is_named_before_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the end of a job the master does not wait out the collective timeout for a member its peer
    reported (a SIGSTOPped pod would hold the job's end for the whole exit grace): a suspect that has made
    no call in two watch intervals since its report is named; one that has called since is alive and exits
    on its own."""
    rendezvous = RendezvousManager()
    for worker in (0, 1, 2):
        rendezvous.rendezvous(worker, f"w{worker}:1")
    clock = [1000.0]
    monkeypatch.setattr("edl_argo.master.rendezvous.time.monotonic", lambda: clock[0])
    first = rendezvous.current.round_id
    rendezvous.report_failure(reporter=0, round_id=first, suspect=1, message="silent")  # 1 is hung
    rendezvous.report_failure(reporter=0, round_id=first + 1, suspect=2, message="silent")  # 2 is alive
    clock[0] += 1
    rendezvous.rendezvous(2, "w2:1", master_pb2.RendezvousRequest(watch=True))  # 2 calls after its report
    assert rendezvous.silent_since_reported() == []  # 1 silent for one watch interval only
    clock[0] += SILENT_AFTER_TRAINING_SECONDS
    assert rendezvous.stuck(timeout=8) == []  # the timeout of training has not run out for 1
    assert rendezvous.silent_since_reported() == [1]
    assert rendezvous.silent_since_reported() == []  # named once
    clock[0] += 9
    assert rendezvous.stuck(timeout=8) == [2]  # 2 then silent for the timeout: named as during training
