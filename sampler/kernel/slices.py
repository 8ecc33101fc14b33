"""A sample's share of the slices the kernel counted: what it may be
credited, and what is carried to the samples after (never over what its
threads could use, never lost)."""

from __future__ import annotations

import numpy as np

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


def into_room_before(used: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Samples' seconds (a run the kernel took, in order), with what one
    holds beyond its threads' time (more than SWITCH_SLACK_S) moved into the
    sample before, as far as that one had room. A CPU mid-switch as the
    kernel read it has its running slice in neither its credited time nor
    its running slices: that sample is short of the slice so far, the next
    one holds it whole (twice the threads' time in an emulated guest, where
    a switch takes long), and the slack would take the excess for threads
    the walk did not see. Nothing is lost; capacity NaN (the first sample
    ever) has no room."""
    out = used.copy()
    with np.errstate(invalid="ignore"):
        over = np.flatnonzero(out[1:] - capacity[1:] > SWITCH_SLACK_S) + 1
        if over.size:
            room = np.maximum(0.0, capacity[over - 1] - out[over - 1])
            shift = np.nan_to_num(np.minimum(out[over] - capacity[over], room))
            out[over - 1] += shift
            out[over] -= shift
    return out
