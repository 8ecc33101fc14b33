"""The hindsight ring (sampler/window/hindsight.py) as properties: any
sequence of windows, series appearing and leaving, wrap-around. A span read
back is exactly the samples that fell in it (whole), each absence one
unmeasured sample, and a window's span averages to its summary's mean."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.backend import BackendChoice
from sampler.shards.proc_shards import ProcShardSampler
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.hindsight import GAP_S, HindsightRing
from sampler.window.sampler import WindowSampler
from sampler.window.series import RateSeries
from tests.fakeproc import FakeClock, FakeProc
from tests.test_window import ScriptedProc

BASE_US = 1_764_000_000_000_000  # a wall time of 2025, in microseconds: where float64 still holds a microsecond


def read_back(ring: HindsightRing, key: str, from_us: int, to_us: int) -> list[tuple[int, int, float]]:
    """A span as (begin µs, end µs, value) for each sample."""
    span = ring.span(key, from_us / 1e6, to_us / 1e6)
    assert span is not None
    if not len(span.us):
        return []
    begins = round(span.start * 1e6) + np.concatenate([[0], np.cumsum(span.us.astype(np.int64))[:-1]])
    return [(int(b), int(b + u), float(v)) for b, u, v in zip(begins, span.us, span.values, strict=True)]


# A window of one series: how long after the series' last it starts (0: it
# follows on), its samples' lengths (µs) and values (None: not measured).
windows = st.lists(st.tuples(
    st.sampled_from(["machine", "shard:a", "shard:b", "gpu:0"]),
    st.sampled_from([0, 0, 0, 500, 2_000, 3_000_000]),
    st.lists(st.tuples(st.integers(1, 200_000), st.one_of(st.none(), st.floats(0, 64, width=32))), min_size=1,
             max_size=40),
), max_size=25)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(windows, st.integers(1, 60), st.data())
def test_a_span_read_back_is_exactly_the_samples_that_fell_in_it(
    fed: list[tuple[str, int, list[tuple[int, float | None]]]], capacity: int, data: st.DataObject
) -> None:
    ring = HindsightRing(minutes=capacity / 60, mib=64, hz=1.0, rows=4)
    assert ring.capacity == capacity
    truth: dict[str, list[tuple[int, int, float]]] = {}
    end_of: dict[str, int] = {}
    for key, after, samples in fed:
        start = end_of.get(key, BASE_US) + after
        had = truth.setdefault(key, [])
        if key in end_of and after > GAP_S * 1e6:  # an absence: one sample, not measured
            had.append((end_of[key], start, math.nan))
        lengths = np.array([u for u, _ in samples])
        values = np.array([math.nan if v is None else v for _, v in samples])
        ends = start + np.cumsum(lengths)
        had += [(int(e - u), int(e), float(v)) for e, u, v in zip(ends, lengths, values, strict=True)]
        end_of[key] = int(ends[-1])
        assert ring.keep(key, end_of[key] / 1e6, lengths / 1e6, values)
        if after and after <= GAP_S * 1e6:  # within rounding, not an absence: the row's end dates all before
            truth[key] = [(b + after, e + after, v) if i < len(had) - len(samples) else (b, e, v)
                          for i, (b, e, v) in enumerate(had)]  # fmt: skip
    for key, had in truth.items():
        held = had[-capacity:]
        lo, hi = held[0][0] - 10, held[-1][1] + 10
        a = data.draw(st.integers(lo, hi))
        b = data.draw(st.integers(a, hi + 1))
        want = [(bg, e, v) for bg, e, v in held if e > a and bg < b]
        got = read_back(ring, key, a, b)
        assert [(bg, e) for bg, e, _ in got] == [(bg, e) for bg, e, _ in want]
        assert np.array_equal(np.array([v for *_, v in got], dtype=np.float32),
                              np.array([v for *_, v in want], dtype=np.float32), equal_nan=True)  # fmt: skip


def test_a_sample_beginning_exactly_at_a_span_s_end_is_not_in_it() -> None:
    """Bounds are whole microseconds, as the samples' lengths are: a span
    [210, 220) us holds the sample [0, 220) and not [220, 264), though in
    float seconds at 1.8e9 s the second's begin (its end less 44 us) can
    round below 220 (hypothesis' counterexample)."""
    ring = HindsightRing(minutes=2 / 60, mib=64, hz=1.0, rows=4)
    assert ring.keep("machine", (BASE_US + 264) / 1e6, np.array([220, 44]) / 1e6, np.array([1.0, 2.0]))
    assert read_back(ring, "machine", BASE_US + 210, BASE_US + 220) == [(BASE_US, BASE_US + 220, 1.0)]
    assert read_back(ring, "machine", BASE_US + 220, BASE_US + 221) == [(BASE_US + 220, BASE_US + 264, 2.0)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0005, 0.3), st.one_of(st.none(), st.floats(0, 8))), min_size=1, max_size=200))
def test_a_windows_span_averages_to_its_summarys_mean(samples: list[tuple[float, float | None]]) -> None:
    series = RateSeries(len(samples), min_seconds=0.001)
    for length, value in samples:
        series.add(value, length)
    values, lengths = series.samples()
    ring = HindsightRing(minutes=1, mib=1, hz=10_000, rows=1)
    end = BASE_US / 1e6 + float(lengths[lengths > 0].sum())
    ring.keep("machine", end, lengths, values)
    span = ring.span("machine", BASE_US / 1e6 - 1, end + 1)
    assert span is not None
    summary = series.summary()
    measured = ~np.isnan(span.values)
    if summary is None:
        assert not measured.any()
        return
    weights = span.us[measured].astype(np.float64)
    assert float(np.average(span.values[measured], weights=weights)) == pytest.approx(summary["mean"], abs=1e-4)
    assert float(span.values[measured].max()) == pytest.approx(summary["max"], abs=1e-4)


def test_a_series_gone_longer_than_the_ring_gives_its_row_to_a_new_one() -> None:
    ring = HindsightRing(minutes=10 / 60, mib=1, hz=1.0, rows=2)  # 10 samples a row: 10 s at 1 Hz
    t = BASE_US / 1e6
    ones = np.ones(5)
    assert ring.keep("machine", t + 5, ones, ones) and ring.keep("shard:a", t + 5, ones, ones)
    assert not ring.keep("shard:b", t + 10, ones, ones)  # shard:a was here 5 s ago: its row is its own
    assert ring.not_kept == {"shard:b"}
    assert ring.keep("machine", t + 16, np.ones(11), ones[:1].repeat(11))
    assert ring.keep("shard:b", t + 16, ones, 2 * ones)  # shard:a gone 11 s, longer than its row holds
    assert ring.series_kept() == ["machine", "shard:b"] and ring.span("shard:a", t, t + 20) is None
    span = ring.span("shard:b", t, t + 20)
    assert span is not None and span.start == pytest.approx(t + 11) and span.values.tolist() == [2.0] * 5


def test_a_gpus_points_each_cover_the_time_since_the_one_before() -> None:
    ring = HindsightRing(minutes=1, mib=1, hz=10, rows=2)
    t = BASE_US / 1e6
    assert ring.keep_points("gpu:0", t + np.array([0.0, 0.5, 1.0]), np.array([10.0, 20.0, 30.0]))
    # The next window's reading repeats a point it had and adds two.
    assert ring.keep_points("gpu:0", t + np.array([1.0, 1.5, 2.5]), np.array([30.0, 40.0, 50.0]))
    span = ring.span("gpu:0", t - 1, t + 3)
    assert span is not None
    assert span.start == pytest.approx(t) and span.us.tolist() == [500_000, 500_000, 500_000, 1_000_000]
    assert span.values.tolist() == [20.0, 30.0, 40.0, 50.0]  # the first point only dates the next


def test_the_budget_bounds_the_minutes_kept() -> None:
    ring = HindsightRing(minutes=15, mib=16, hz=100)
    assert ring.us.nbytes + ring.values.nbytes <= 16 * 2**20
    assert ring.minutes_held == pytest.approx(10.9, abs=0.05)
    assert HindsightRing(minutes=15, mib=16, hz=10).minutes_held == 15
    with pytest.raises(ValueError, match="positive"):
        HindsightRing(minutes=0, mib=16, hz=10)


def test_the_agents_windows_are_kept_as_their_raw_blocks_carry_them(tmp_path: Path) -> None:
    """A sampler's windows (fake /proc, a stall in the second) and the ring:
    the span of each window's time, for the machine and each shard, is the
    window's raw block, sample for sample; the shard's row has every window
    back to back."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=256)
    clock = FakeClock(BASE_US / 1e6)
    script = ScriptedProc(proc, clock)
    sleeps = 0

    def stalling_sleep(seconds: float) -> None:
        nonlocal sleeps
        sleeps += 1
        script.sleep(seconds + (0.3 if sleeps == 15 else 0.0))

    w = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root, clock),
                      [ShardSpec("s0", Selector.parse("pgid:100"))], hz=10, node="n1", clock=clock,
                      wall_clock=clock, sleep=stalling_sleep)  # fmt: skip
    w.hindsight = HindsightRing(minutes=1, mib=1, hz=10, rows=4)
    w.raw_wanted = True
    w.prime(0)
    for _ in range(3):
        summary = w.run_window(1.0)
        assert summary.raw is not None
        raw = msgspec.json.decode(summary.raw)
        start, end = summary.window.start, summary.window.end
        for key, series in [("machine", raw["machine"]["cpu_percent"]), ("shard:s0", raw["shards"][0]["cpu_cores"])]:
            span = w.hindsight.span(key, start, end)
            assert span is not None
            assert span.start == pytest.approx(start + series["start"], abs=1e-6)
            assert span.us.tolist() == series["us"]
            assert span.values.tolist() == pytest.approx([math.nan if v is None else v for v in series["v"]],
                                                         nan_ok=True, abs=1e-4)  # fmt: skip
    whole = w.hindsight.span("shard:s0", BASE_US / 1e6, clock() + 1)
    assert whole is not None and sum(whole.us.tolist()) == pytest.approx(3e6 + 0.0, abs=30)
    assert np.nanmean(whole.values) == pytest.approx(1.0)
