"""A sample's share of the slices the kernel counted: what it may be
credited, and what is carried to the samples after (never over what its
threads could use, never lost)."""

from __future__ import annotations

import math

import numpy as np

# The most a sample's slice ends can read beyond its threads' time through the
# scheduler's clock and the tracepoint's disagreeing (tens of us a switch).
SWITCH_SLACK_S = 0.0002


def credit_sample(used: float, carried: float, room_before: float, threads_time: float, cpus_time: float,
                  elapsed: float, after_short: bool, short: bool = False) -> tuple[float, float, float]:
    """One sample of one group: of `used` seconds counted for it (debts
    settled), what it credits, what is carried into the next samples, and the
    room it leaves (its threads' time it did not read) for the sample after.

    `threads_time` is what the threads the walk saw could use in `elapsed`,
    `cpus_time` what the CPUs the group may use could; `after_short`: the
    reading before was short (a CPU left out mid-switch, or counted ahead and
    settled here), `short`: this one is (its room then adds to the room
    before: the readings after a CPU's slice was left out all miss it). A
    short reading misses at most the threads' time it had room for: that
    much of this sample's excess is the samples' before, carried. Beyond
    it, more than SWITCH_SLACK_S over the threads' time is threads the walk
    did not see (children forked since): they ran, so the sample is credited
    as measured, and with carried time up to the whole threads its time shows
    ran at once, never past the CPUs. Carried time
    that only a sample within the walk's threads could take stayed carried
    while a forking engine ran at its threads' time: 1.00 cores read of its
    1.10 in a guest whose vCPUs were preempted mid-switch."""
    before = min(max(0.0, used - threads_time), room_before) if after_short else 0.0
    own = used - before
    room = max(0.0, threads_time - own) + (room_before - before if short and after_short else 0.0)
    if own - threads_time > SWITCH_SLACK_S:
        ran = min(cpus_time, math.ceil(own / elapsed - 1e-9) * elapsed)
        credit = min(own + carried, ran)
        return credit, own + carried - credit + before, room
    total = used + carried
    credit = min(total, threads_time)
    return credit, total - credit, room


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


def held_through(at: np.ndarray, grown: np.ndarray, held: np.ndarray, since: np.ndarray,
                 previous_at: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The kernel's samples' totals for each slot, where some do not hold it
    (taken while the agent wrote the list of slots, or before the slot was
    listed): `grown` [sample, slot, (ns, late)] is each total less the last
    read one, which was read at `since` [slot] (NaN: not known); `at` the
    samples' times; `previous_at` the time of the sample before them.

    The samples between two that hold the slot are given the totals' growth
    in proportion to their time (a straight line between the two): the held
    sample after such a run holds the run's time, and counted in its own
    period alone it read the run's length over it (51 cores of one thread
    when the list stayed mid-write 50 ms at 1000 Hz). Those after the last
    held one, and before `since`, keep the totals before them and stay not
    measured. Returns the totals (float ns, relative to the last read), which
    samples measured the slot, and the totals' value at `previous_at` (where
    a run began before these samples: the steps start from there)."""
    filled = grown.astype(np.float64)
    measured = held.copy()
    base = np.zeros(grown.shape[1:])
    # The slots some sample does not hold, and those whose run of samples not
    # held ended the last read (read before the sample before these).
    with np.errstate(invalid="ignore"):
        runs = ~held.all(axis=0) | (since < previous_at)
    for j in np.flatnonzero(runs).tolist():
        rows = np.flatnonzero(held[:, j])
        known_at, known = at[rows], filled[rows, j]
        if math.isfinite(since[j]) and (not len(rows) or since[j] < at[rows[0]]):
            known_at, known = np.concatenate([[since[j]], known_at]), np.concatenate([np.zeros((1, 2)), known])
        if not len(known_at):
            filled[:, j] = 0.0
            continue
        inside = ~held[:, j] & (at > known_at[0]) & (at < known_at[-1])
        outside = ~held[:, j] & ~inside
        before = np.searchsorted(known_at, at[outside], side="right") - 1  # the last known at or before each
        filled[outside, j] = np.where(before[:, None] >= 0, known[np.maximum(before, 0)], 0.0)
        for column in range(filled.shape[2]):
            filled[inside, j, column] = np.interp(at[inside], known_at, known[:, column])
            if known_at[0] < previous_at < known_at[-1]:
                base[j, column] = np.interp(previous_at, known_at, known[:, column])
        measured[inside, j] = True
    return filled, measured, base
