"""A sample's share of the slices the kernel counted: what it may be
credited, and what is carried to the samples after (never over what its
threads could use, never lost)."""

from __future__ import annotations

# The most a sample's slice ends can read beyond its threads' time through the
# scheduler's clock and the tracepoint's disagreeing (tens of us a switch).
SWITCH_SLACK_S = 0.0002


def place_late(credit: float, pending: float, capacity: float) -> tuple[float, float]:
    """A sample's credit with time spent in earlier samples (`pending`, seen
    late by the kernel) added as far as its threads had room, and what is
    left for the samples after: never over the capacity, nothing lost."""
    placed = min(pending, max(0.0, capacity - credit))
    return credit + placed, pending - placed


def settle(used: float, debt: float) -> tuple[float, float]:
    """A sample's seconds on CPU after what earlier samples counted ahead of
    the kernel (`debt`), and the debt left: never negative, nothing lost."""
    return max(0.0, used - debt), max(0.0, debt - used)
