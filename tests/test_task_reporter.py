"""The worker's task reporter: reports leave the main thread, in order, and a failure ends the worker."""

from __future__ import annotations

import threading
import time

import pytest

from edl_argo.worker.task_reporter import TaskReporter


def test_reports_are_sent_in_order_off_the_calling_thread_and_sent_runs_after_each() -> None:
    order: list[str] = []
    threads: set[int] = set()
    release = threading.Event()

    def report(name: str) -> None:
        release.wait(10)
        threads.add(threading.get_ident())
        order.append(f"report {name}")

    reporter = TaskReporter()
    started = time.monotonic()
    for name in "abc":
        reporter.send(lambda name=name: report(name), lambda name=name: order.append(f"sent {name}"))
    assert time.monotonic() - started < 1.0 and order == []  # the caller did not wait for the master
    release.set()
    reporter.flush()
    assert order == ["report a", "sent a", "report b", "sent b", "report c", "sent c"]
    assert threads and threading.get_ident() not in threads
    reporter.close()


def test_a_report_that_fails_stops_the_rest_calls_on_failure_once_and_is_raised_by_close() -> None:
    failures: list[int] = []
    sent: list[str] = []

    def broken() -> None:
        raise ConnectionError("master 10.0.0.1:50001 unreachable for 300 s")

    reporter = TaskReporter(on_failure=lambda: failures.append(1))
    reporter.send(lambda: None, lambda: sent.append("first"))
    reporter.send(broken, lambda: sent.append("broken"))
    reporter.send(lambda: sent.append("ran"), lambda: sent.append("after"))
    with pytest.raises(ConnectionError, match="unreachable"):
        reporter.flush()
    assert sent == ["first"] and failures == [1]
    with pytest.raises(ConnectionError):
        reporter.send(lambda: None)
    with pytest.raises(ConnectionError):
        reporter.close()
    reporter.close(raise_failure=False)  # idempotent, and quiet when asked


def test_close_sends_what_is_queued_first() -> None:
    sent: list[int] = []
    reporter = TaskReporter()
    for number in range(20):
        reporter.send(lambda number=number: (time.sleep(0.005), sent.append(number)))
    reporter.close()
    assert sent == list(range(20))


def test_a_flush_that_waits_too_long_is_an_error_not_a_hang() -> None:
    hold = threading.Event()
    reporter = TaskReporter(close_seconds=0.3)
    reporter.send(lambda: hold.wait(10))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not sent within"):
        reporter.flush()
    assert time.monotonic() - started < 2.0
    hold.set()
    reporter.close()
