"""The rules that keep each sample physically possible, on synthetic counters:
a sample shorter than its counter's resolution merges into the next, and a
slice counted ahead of the kernel's account is paid back by the samples
after it. Neither loses or invents time."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.backend import BackendChoice
from sampler.kernel.slices import SWITCH_SLACK_S, credit_sample, held_through, into_room_before, place_late, settle
from sampler.shards.proc_shards import ProcShardSampler, ShardReading, within_capacity
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from sampler.window.series import RateSeries
from tests.fakeproc import FakeClock, FakeProc
from tests.heartbeats import cores_of

TICK = 0.01

samples = st.lists(st.tuples(st.floats(0.0, 4.0), st.floats(0.0005, 0.05)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(samples)
def test_short_samples_merge_without_losing_time(drawn: list[tuple[float, float]]) -> None:
    series = RateSeries(len(drawn), TICK)
    for cores, seconds in drawn:
        series.add(cores, seconds)
    summary = series.summary()
    assert summary is not None
    total = sum(c * s for c, s in drawn) / sum(s for _, s in drawn)
    assert math.isclose(summary["mean"], total, abs_tol=1e-3)  # the mean is every sample's time, rounded to 4 places
    # A merged sample is a time-weighted mean of the ones it holds: never above the highest.
    assert summary["max"] <= max(c for c, _ in drawn) + 1e-4
    kept = series.seconds[: series.n]
    if series.n > 1:
        assert (kept[:-1] >= TICK - 1e-12).all()  # only the window's last may stay short, merged backwards


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0.0, 4.0)), st.floats(0.0005, 0.05)), min_size=1,
                max_size=60))  # fmt: skip
def test_merging_never_loses_time_even_next_to_unmeasured_samples(drawn: list[tuple[float | None, float]]) -> None:
    series = RateSeries(len(drawn), TICK)
    for cores, seconds in drawn:
        series.add(cores, seconds)
    values, lengths = series.samples()
    # The live view draws the samples end to end: every added second is in one of them.
    assert math.isclose(float(lengths.sum()), sum(s for _, s in drawn), abs_tol=1e-12)
    measured = values[~np.isnan(values)]
    assert (measured <= max((c for c, _ in drawn if c is not None), default=0.0) + 1e-9).all()
    # No measured sample shorter than a tick was made a rate, but for the window's last.
    assert (lengths[:-1][~np.isnan(values[:-1])] >= TICK - 1e-12).all()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(-0.05, 0.05), min_size=1, max_size=100))
def test_time_counted_ahead_is_paid_back_never_below_zero(used: list[float]) -> None:
    debt, reported = 0.0, []
    for u in used:
        r, debt = settle(u, debt)
        assert r >= 0 and debt >= 0
        reported.append(r)
    # Nothing lost or invented: what was reported plus what is still owed is what was measured.
    assert math.isclose(sum(reported) - debt, sum(used), abs_tol=1e-9)


class _Impossible(ProcShardSampler):
    """A backend with a bug: every sample reads 1,000 cores."""

    def sample(self) -> dict[str, ShardReading]:
        return {wid: ShardReading(1000.0, None, 0.1) for wid in self._states}


def test_a_sample_above_the_machine_is_a_bug_said_once_and_kept(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=1)
    clock = FakeClock()
    w = WindowSampler(proc.root, BackendChoice("proc", None), _Impossible(proc.root, clock),
                      [ShardSpec("s0", Selector.parse("pgid:100"))], hz=10, node="n1", clock=clock,
                      wall_clock=clock, sleep=clock.advance)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="sampler.window.sampler"):
        w.run_window(1.0)
        summary = w.run_window(1.0)
    said = [r.getMessage() for r in caplog.records if "more than the machine" in r.getMessage()]
    assert len(said) == 1 and "engine s0: 1000.000 cores in a 100 ms sample" in said[0], said
    assert cores_of(summary.shards[0]).max == 1000.0  # not clipped: the bug stays visible


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.01), st.floats(0.0, 0.01)), min_size=1, max_size=100),
       st.sampled_from([math.inf, 0.0002]))  # fmt: skip
def test_time_beyond_the_threads_is_carried_never_dropped(drawn: list[tuple[float, float]], slack: float) -> None:
    carried, credited = 0.0, 0.0
    for used, capacity in drawn:
        credit, carried = within_capacity(used + carried, capacity, slack)
        # Within the slack, never above the capacity; beyond it, as measured.
        assert credit >= 0 and carried >= 0 and (credit <= capacity or credit == used + carried or carried == 0)
        assert carried <= slack
        credited += credit
    assert math.isclose(credited + carried, sum(u for u, _ in drawn), abs_tol=1e-9)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.01), st.floats(0.0, 0.01), st.floats(0.0, 0.01)), min_size=1, max_size=100))
def test_time_seen_late_fills_room_never_more(drawn: list[tuple[float, float, float]]) -> None:
    """A slice whose switch in the kernel did not see is credited at its end:
    its time goes where the threads had room, never over them, never lost."""
    pending, credited = 0.0, 0.0
    for on_time, late, capacity in drawn:
        on_time = min(on_time, capacity)  # what within_capacity leaves
        credit, pending = place_late(on_time, pending + late, capacity)
        assert on_time <= credit <= capacity + 1e-12 and pending >= 0
        assert math.isclose(credit, capacity, abs_tol=1e-12) or pending == 0  # room left only when nothing waits
        credited += credit
    on_time = sum(min(o, c) for o, _, c in drawn)
    assert math.isclose(credited + pending, on_time + sum(la for _, la, _ in drawn), abs_tol=1e-9)


def _credited_through_short_reads(truth: list[float], missed: list[float], threads_time: float,
                                  cpus_time: float, elapsed: float) -> tuple[list[float], float]:
    """credit_sample over samples whose readings missed `missed[k]` seconds of
    the time so far (a short reading: a CPU's slice left out, which the next
    readings miss too until one holds it): each sample's credit, and what is
    carried at the end."""
    carried, room, credits = 0.0, 0.0, []
    for k, seconds in enumerate(truth):
        before = missed[k - 1] if k else 0.0
        credit, carried, room = credit_sample(seconds - missed[k] + before, carried, room, threads_time, cpus_time,
                                              elapsed, before > 0, missed[k] > 0)  # fmt: skip
        credits.append(credit)
    return credits, carried + missed[-1]


def test_a_forking_engine_read_short_keeps_its_time() -> None:
    """One thread at the walk, children forked since: 1.1 cores in 10 ms
    samples, every third reading short of 4 ms. The sample after holds that
    and the children's excess: the first is carried, and the children's
    samples take it back (not only samples within the walk's one thread,
    which this engine never has: 1.00 cores read of 1.10)."""
    truth, missed = [0.011] * 300, [0.004 if k % 3 == 1 else 0.0 for k in range(300)]
    credits, carried = _credited_through_short_reads(truth, missed, 0.01, 0.04, 0.01)
    assert math.isclose(sum(credits) + carried, sum(truth), abs_tol=1e-9)
    assert sum(credits) / len(credits) == pytest.approx(0.011, rel=0.01)
    assert max(credits) <= 0.02 + 1e-12  # at most the two threads its time shows ran at once


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.02), st.floats(0.0, 1.0)), min_size=1, max_size=100),
       st.sampled_from([1, 2, 4]))  # fmt: skip
def test_short_reads_lose_no_time_nor_read_past_the_cpus(drawn: list[tuple[float, float]], cpus: int) -> None:
    """Up to two threads running, one seen by the walk; readings miss any part
    of the time so far, some several in a row. Nothing is lost, no sample is over the CPUs'
    time nor over the threads its own time shows ran."""
    elapsed = 0.01
    truth = [min(t, cpus * elapsed) for t, _ in drawn]
    missed: list[float] = []
    for seconds, (_, fraction) in zip(truth, drawn, strict=True):
        missed.append(fraction * ((missed[-1] if missed else 0.0) + seconds) if fraction < 0.5 else 0.0)
    credits, carried = _credited_through_short_reads(truth, missed, elapsed, cpus * elapsed, elapsed)
    assert math.isclose(sum(credits) + carried, sum(truth), abs_tol=1e-9)
    assert all(0 <= c <= cpus * elapsed + 1e-12 for c in credits)
    for k, c in enumerate(credits):
        used = truth[k] - missed[k] + (missed[k - 1] if k else 0.0)
        assert c <= max(elapsed, math.ceil(used / elapsed - 1e-9) * elapsed) + 1e-12


def test_a_slice_left_out_of_one_sample_goes_back_into_it() -> None:
    """One thread busy, 1 ms samples; the kernel read a CPU mid-switch at the
    third, which holds none of the 40 ms slice so far: the fourth holds it,
    and the two come back to one thread each, not 0 and 2."""
    capacity = np.full(6, 0.001)
    used = np.array([0.001, 0.001, -0.039, 0.041, 0.001, 0.001])
    np.testing.assert_allclose(into_room_before(used, capacity), np.full(6, 0.001))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(-0.05, 0.05), st.floats(0.0, 0.01)), min_size=1, max_size=100))
def test_moving_time_into_the_sample_before_loses_none_nor_overfills(drawn: list[tuple[float, float]]) -> None:
    used = np.array([u for u, _ in drawn])
    capacity = np.array([c for _, c in drawn])
    moved = into_room_before(used, capacity)
    assert math.isclose(float(moved.sum()), float(used.sum()), abs_tol=1e-9)
    grew = moved > used + 1e-15
    assert (moved[grew] <= capacity[grew] + 1e-12).all()  # filled up to its room, never over
    shrank = moved < used - 1e-15
    assert (moved[shrank] >= capacity[shrank] - 1e-12).all()  # gave only what was beyond its threads
    assert not shrank[0] and not grew[-1] if len(used) > 1 else True
    # An excess beyond the slack stays only where the sample before had no room.
    for i in np.flatnonzero(moved[1:] - capacity[1:] > SWITCH_SLACK_S) + 1:
        assert moved[i - 1] >= capacity[i - 1] - 1e-12


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0005, 0.002), st.booleans(), st.booleans()), min_size=1,
                max_size=120))  # fmt: skip
def test_samples_that_do_not_hold_a_slot_share_the_time_of_the_run(
        drawn: list[tuple[float, float, bool, bool]]) -> None:  # fmt: skip
    """One thread's totals (a rate of at most one core in each sample), some
    samples not holding its slot, read in batches as the agent reads the
    ring: every sample's step is within its own period's one core, never
    negative; a sample not held is measured once a held one follows it, or
    counts nothing; and where the reads meet a held sample the totals are
    the kernel's."""
    rates, periods = np.array([r for r, _, _, _ in drawn]), np.array([p for _, p, _, _ in drawn])
    held_mask = np.array([h for _, _, h, _ in drawn])
    ends = [i + 1 for i, (_, _, _, end) in enumerate(drawn) if end][:-1] if len(drawn) > 1 else []
    at = 100.0 + np.cumsum(periods)
    truth = np.cumsum(rates * periods) * 1e9  # ns from 0 at t = 100.0
    prev_ns, since, previous_at = 0.0, np.array([100.0]), 100.0
    for batch in np.split(np.arange(len(drawn)), ends):
        if not len(batch):
            continue
        grown = np.zeros((len(batch), 1, 2))
        grown[:, 0, 0] = truth[batch] - prev_ns
        held = held_mask[batch][:, None]
        filled, measured, base = held_through(at[batch], grown, held, since.copy(), previous_at)
        steps = np.diff(np.concatenate([base[None], filled]), axis=0)[:, 0, 0]
        elapsed = np.diff(at[batch], prepend=previous_at)
        assert (steps >= -1e-3).all()
        assert (steps <= elapsed * 1e9 + 1e-3).all()  # never over the one thread
        assert (steps[~measured[:, 0]] == 0).all()
        np.testing.assert_allclose(filled[held[:, 0], 0, 0], grown[held[:, 0], 0, 0])
        if held.any():
            last = int(np.flatnonzero(held[:, 0])[-1])
            prev_ns, since = float(truth[batch][last]), np.array([at[batch][last]])
        previous_at = float(at[batch][-1])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.one_of(st.none(), st.floats(0.0, 4.0)), st.floats(0.0, 0.03)), max_size=40),
                max_size=5), st.sampled_from([0.0, 0.01]))  # fmt: skip
def test_a_batch_of_samples_is_kept_as_one_at_a_time(batches: list[list[tuple[float | None, float]]],
                                                     tick: float) -> None:  # fmt: skip
    """`extend` (the kernel's samples, a second's at once) keeps what `add`
    would, short samples merged alike, across batches."""
    one, batch = RateSeries(4, tick), RateSeries(4, tick)
    for drawn in batches:
        for value, seconds in drawn:
            one.add(value, seconds)
        batch.extend(np.array([np.nan if v is None else v for v, _ in drawn], dtype=np.float64),
                     np.array([s for _, s in drawn], dtype=np.float64))  # fmt: skip
    for a, b in zip(one.samples(), batch.samples(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=0.0)
