"""The worker's input prefetcher (:mod:`edl_argo.worker.input_prefetch`): what it gives is what the pipeline
gives, in order, and it prepares elements only while the training thread waits."""

from __future__ import annotations

import threading
import time

import pytest

from edl_argo.worker.input_prefetch import WaitTimePrefetcher
from edl_argo.worker.step_timers import StepTimers

#: Long enough for a prefetch thread that works when it should not to take an element.
SETTLE_SECONDS = 0.3


class Elements:
    """An iterator over 0..count-1 whose elements in ``failing`` raise instead, and which goes on after
    that (as a tf.data iterator does after an error in a map); it records the training thread's section at
    each element taken."""

    def __init__(self, timers: StepTimers, count: int = 1000, failing: frozenset[int] = frozenset()) -> None:
        self._timers = timers
        self._count = count
        self._failing = failing
        self._next = 0
        self.sections: list[str] = []

    def __iter__(self) -> Elements:
        return self

    def __next__(self) -> int:
        if self._next >= self._count:
            raise StopIteration
        index, self._next = self._next, self._next + 1
        self.sections.append(self._timers.current)
        if index in self._failing:
            raise ValueError(f"element {index}")
        return index


@pytest.fixture
def timers() -> StepTimers:
    bound = StepTimers()
    bound.bind()
    return bound


def taken_after_a_while(elements: Elements) -> int:
    """How many elements the prefetcher had taken once it had time to take more."""
    time.sleep(SETTLE_SECONDS)
    return len(elements.sections)


def test_elements_are_prepared_while_steps_wait_and_beside_the_compute_of_steps_that_do_not(
    timers: StepTimers,
) -> None:
    elements = Elements(timers)
    prefetcher = WaitTimePrefetcher(elements, 2, timers)

    def step(waits: bool) -> tuple[int, int]:
        """One training step: what the prefetcher had taken during its compute, and during its wait."""
        with timers.section("input"):
            next(prefetcher)
        with timers.section("compute"):
            computing = taken_after_a_while(elements)
            if not waits:
                return computing, computing
            with timers.section("ps"):
                return computing, taken_after_a_while(elements)

    try:
        assert taken_after_a_while(elements) == 2  # before the first step
        assert step(waits=True) == (3, 3)  # no step waited before it: beside its compute
        assert step(waits=True) == (3, 4)  # the step before waited: during the wait only
        assert step(waits=False) == (4, 4)
        assert step(waits=True) == (6, 6)  # the step before did not wait: beside the compute
    finally:
        prefetcher.close()
    assert elements.sections == ["other", "other", "compute", "ps", "compute", "compute"]


def test_a_consumer_waiting_for_an_element_gets_it_whatever_the_section(timers: StepTimers) -> None:
    elements = Elements(timers, count=3)
    with timers.section("compute"):  # as a caller that takes its input without an input section
        prefetcher = WaitTimePrefetcher(elements, 2, timers)
        try:
            assert list(prefetcher) == [0, 1, 2]
        finally:
            prefetcher.close()


def test_at_most_depth_elements_are_prepared_ahead(timers: StepTimers) -> None:
    elements = Elements(timers)
    prefetcher = WaitTimePrefetcher(elements, 3, timers)
    try:
        with timers.section("peers"):
            assert taken_after_a_while(elements) == 3
        assert next(prefetcher) == 0
        with timers.section("master"):
            assert taken_after_a_while(elements) == 4
    finally:
        prefetcher.close()


def test_errors_come_in_their_place_and_the_elements_after_them_follow(timers: StepTimers) -> None:
    elements = Elements(timers, count=5, failing=frozenset({1, 3}))
    prefetcher = WaitTimePrefetcher(elements, 2, timers)
    received: list[object] = []
    try:
        while True:
            try:
                received.append(next(prefetcher))
            except StopIteration:
                break
            except ValueError as error:
                received.append(str(error))
        assert next(prefetcher, "end") == "end"  # the end stays the end
    finally:
        prefetcher.close()
    assert received == [0, "element 1", 2, "element 3", 4]


def test_close_ends_the_prefetch_thread(timers: StepTimers) -> None:
    before = {thread.ident for thread in threading.enumerate()}
    prefetcher = WaitTimePrefetcher(Elements(timers), 2, timers, name="prefetch-under-test")
    assert next(prefetcher) == 0
    prefetcher.close()
    left = [t for t in threading.enumerate() if t.ident not in before and t.name == "prefetch-under-test"]
    assert not left
