"""The request deadline of every call is watched by one thread (:class:`DeadlineWatcher`), not a thread per
call: actions run at their deadline in order, cancelled ones never, a failing one stops no other."""

from __future__ import annotations

import threading
import weakref

import grpc
import pytest

from edl_argo.rpc.channel import make_server
from edl_argo.rpc.request_deadline import DeadlineWatcher
from edl_argo.rpc.server_limits import ServerLimits

pytestmark = pytest.mark.timeout(60)


def test_an_earlier_deadline_added_later_runs_first_and_a_cancelled_one_never() -> None:
    watcher = DeadlineWatcher()
    ran: list[str] = []
    done = threading.Event()
    watcher.call_later(3600, lambda: ran.append("late"))
    cancelled = watcher.call_later(0.01, lambda: ran.append("cancelled"))
    cancelled.cancel()
    watcher.call_later(0.02, lambda: (ran.append("soon"), done.set()))
    assert done.wait(10)
    assert ran == ["soon"]
    assert watcher.pending() == 1


def test_an_action_that_raises_stops_no_other() -> None:
    watcher = DeadlineWatcher()
    done = threading.Event()

    def fail() -> None:
        raise RuntimeError("boom")

    watcher.call_later(0, fail)
    watcher.call_later(0, done.set)
    assert done.wait(10)


def test_a_cancelled_deadline_lets_go_of_its_action_at_once() -> None:
    class Action:
        def __call__(self) -> None:
            pass

    action = Action()
    kept = weakref.ref(action)
    watch = DeadlineWatcher().call_later(3600, action)
    del action
    assert kept() is not None
    watch.cancel()
    assert kept() is None


def test_serving_calls_starts_no_thread_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each call started a threading.Timer (a thread) to watch its request's arrival.
    limits = ServerLimits(threads=2, priority_threads=2, priority_methods=("/t.S/Priority",))
    server = make_server(limits=limits)
    echo = grpc.unary_unary_rpc_method_handler(lambda request, _context: request)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("t.S", {"M": echo, "Priority": echo}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    started: list[str] = []
    start = threading.Thread.start

    def counting_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    calls = 100
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in ("/t.S/M", "/t.S/Priority"):
                for _ in range(calls // 2):
                    assert channel.unary_unary(method)(b"x", timeout=10) == b"x"
    finally:
        server.stop(None)
    # The pools' threads (started as calls come, at most their size) and the watcher's, at most.
    assert len(started) <= limits.threads + limits.priority_threads + 1, started[:10]
