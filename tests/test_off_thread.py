"""Readings off the sampling thread, and problems said once (sampler/off_thread.py)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from sampler.off_thread import InFlight, Said, on_own_thread


def test_a_problem_is_said_when_it_comes_changes_and_ends() -> None:
    said = Said()
    assert said.changed("disk", "timeout") and not said.changed("disk", "timeout")  # once, not at every look
    assert said.changed("disk", "EIO")  # another problem: said
    assert "disk" in said
    assert said.changed("disk", None) and "disk" not in said  # it ended: said
    assert not said.changed("disk", None)  # still fine: nothing to say
    assert said.first("x") and not said.first("x")


def test_said_is_bounded() -> None:
    said = Said(most=3)
    assert [said.first(i) for i in range(5)] == [True, True, True, False, False]
    assert said.changed(0, "another")  # a thing already known may still change


def test_a_call_in_flight_is_taken_once_done_and_never_waited_for() -> None:
    reading: InFlight[int] = InFlight()
    assert reading.take() is None and reading.wait(0.0)  # none started
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    reading.start(future, now=5.0)
    assert reading.running() and reading.since == 5.0
    assert reading.take() is None and not reading.wait(0.01)  # still running: nothing, and no wait past the timeout
    with pytest.raises(AssertionError):
        reading.start(concurrent.futures.Future(), now=6.0)  # never two at once
    future.set_result(7)
    done = reading.take()
    assert done is not None and done.result() == 7
    assert reading.take() is None and not reading.running()  # taken once


def test_a_call_on_its_own_thread_gives_its_result_or_its_error() -> None:
    release = threading.Event()
    slow = on_own_thread(lambda: release.wait(60) and 42, "slow")
    failing = on_own_thread(lambda: 1 // 0, "failing")
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=60)
    assert not slow.done()
    release.set()
    assert slow.result(timeout=60) == 42
