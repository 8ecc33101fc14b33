"""Readings taken off the sampling thread, and problems said once.

A reading that may hang (an NVML call, an engine's metrics endpoint) runs on
a thread of its own while the window samples. `InFlight` holds one such call:
the next is not started while it still runs (a hung call costs its own
figures, not the window, and never piles up threads), its result is taken
once done and never waited for, but by a one-shot `sample` that can afford to.

`Said` keeps what the log has said, so that a problem seen at every window is
said when it comes and when it changes, not at each look.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """`fn` run on a daemon thread of its own (one stuck in a hung call must
    not hold the process at exit), as a future."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # the taker sees it, as a pool's future would show it
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class InFlight(Generic[T]):
    """One call off the sampling thread at a time."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future[T] | None = None
        self.since = 0.0  # when the call in flight started

    def running(self) -> bool:
        return self._future is not None and not self._future.done()

    def start(self, future: concurrent.futures.Future[T], now: float) -> None:
        """The call just started (never while the last still runs: ask `running` first)."""
        assert not self.running(), "a call is still in flight"
        self._future, self.since = future, now

    def wait(self, timeout: float) -> bool:
        """Let the call in flight finish, up to `timeout`; False if it has not."""
        if self._future is None:
            return True
        done, _ = concurrent.futures.wait([self._future], timeout=timeout)
        return bool(done)

    def take(self) -> concurrent.futures.Future[T] | None:
        """The call, once done (its result or its exception); None while it
        runs or when none was started. Never waits."""
        future = self._future
        if future is None or not future.done():
            return None
        self._future = None
        return future


class Said:
    """What the log has said of each thing, bounded: beyond `most` things,
    new ones are not said (a flood of distinct names must not become a flood
    of lines)."""

    def __init__(self, most: int = 1000) -> None:
        self.most = most
        self._last: dict[Hashable, object] = {}

    def first(self, key: Hashable) -> bool:
        """True the first time `key` comes: say it."""
        return self.changed(key, True)

    def changed(self, key: Hashable, problem: object) -> bool:
        """True when `key`'s problem is not the one last said (None: it has
        none; a problem that ends is a change too): say it."""
        if self._last.get(key) == problem:
            return False
        if problem is None:
            del self._last[key]
            return True
        if key not in self._last and len(self._last) >= self.most:
            return False
        self._last[key] = problem
        return True

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key` has a problem said and not yet ended."""
        return key in self._last
