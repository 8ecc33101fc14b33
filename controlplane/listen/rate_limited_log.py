"""Warnings that whoever sends the control plane requests cannot multiply.

A refused token, a wrong password or a bad heartbeat entry is worth a line
in the log, so that a misconfigured fleet or a scanner is seen; one a
request would let a single client write megabytes of log a second (a flood
of too-long passwords once wrote 9 MB of tracebacks in 3 s). Each line's
reason is keyed by its category (what the sender chose taken out), and a
category is written at most once a minute.
"""

from __future__ import annotations

import logging
import re
import time

_SENDERS_TEXT = re.compile(r"'[^']*'|\"[^\"]*\"|\d+(\.\d+)?")


def category(reason: str) -> str:
    """A reason with what the sender chose taken out (quoted text, numbers):
    what a log line or a label is keyed by, from a set the code's own
    messages bound, however many distinct reasons a client makes up."""
    return _SENDERS_TEXT.sub("_", reason)[:200]


class RateLimitedLog:
    """A warning once a minute per category of its reason: a JWT's key id,
    a user name or a list's lengths, which the sender chooses, make no new
    line."""

    EVERY_S = 60.0
    MAX_CATEGORIES = 1000

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self.what = what
        self.logger = logger
        self._last: dict[str, float] = {}

    def log(self, reason: str, *context: object) -> None:
        key, now = category(reason), time.monotonic()
        if now - self._last.get(key, -self.EVERY_S) < self.EVERY_S:
            return
        if len(self._last) > self.MAX_CATEGORIES:
            self._last.clear()
        self._last[key] = now
        self.logger.warning("%s %s: %s", self.what, " ".join(map(str, context)), reason[:500])
