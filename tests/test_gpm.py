"""What a card's SMs do (GPM) and what holds its clocks back, at GPM's own
rate, through the fake NVML (tests/fakenvml.py: its GPM follows NVML's
reference, cited there): each window's figures against the truth the test
sets, the 100 ms minimum kept whatever the tick, and a card without GPM
absent beside one with it, never 0."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.gpu.gpm import CLOCK_EVENTS, METRICS, CardMonitor, clock_event_field, fields
from sampler.gpu.nvml import GpuReader
from sampler.off_thread import Said
from tests.fakenvml import FakeCard, FakeInstance, FakeNvml
from tests.fakeproc import FakeClock

SM = pynvml.NVML_GPM_METRIC_SM_UTIL
TENSOR = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
PCIE_TX = pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC
POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown


def monitor_of(nvml: FakeNvml, clock: FakeClock) -> CardMonitor:
    nvml.nvmlInit()
    monitor = CardMonitor(nvml, clock, Said().first)
    monitor.follow([(c.index, nvml.nvmlDeviceGetHandleByIndex(c.index)) for c in nvml.cards])
    return monitor


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0.1, 0.6), st.floats(0, 100), st.floats(0, 0.09)), min_size=2,
                      max_size=30))  # fmt: skip
def test_a_window_s_mean_is_the_time_weighted_mean_of_its_intervals(steps: list[tuple[float, float, float]]) -> None:
    """Ticks at uneven gaps (each at least 100 ms), the SM activity changing
    between ticks: the window's mean is the activity's mean over the time
    its intervals cover, its max and p95 those of the intervals' own means,
    each weighed by its length (as every p95 of the project's is)."""
    clock = FakeClock()
    nvml = FakeNvml([FakeCard(0)], clock=clock)
    monitor = monitor_of(nvml, clock)
    card = nvml.cards[0]
    card.set_gpm_rates(clock.t, {SM: 0.0})
    monitor.tick()  # the first sample: no interval yet
    began = clock.t
    area, means = 0.0, []
    for gap, level, change_at in steps:
        # The activity changes `change_at` into the interval: the interval's mean is the two levels weighed.
        before = card.gpm_rates[SM]
        clock.advance(change_at)
        card.set_gpm_rates(clock.t, {SM: level})
        clock.advance(gap - change_at)
        monitor.tick()
        interval = (before * change_at + level * (gap - change_at)) / gap
        area += interval * gap
        means.append(interval)
    got = monitor.take(0)
    mean, p95, top = fields("sm_activity")
    assert got[mean] == pytest.approx(area / (clock.t - began), abs=0.01)
    assert got[top] == pytest.approx(max(means), abs=0.01)
    # p95: the least interval mean that the intervals at or below it cover 95% of the time with.
    lengths = [gap for gap, _, _ in steps]
    covering = next(m for m in sorted(means)
                    if sum(g for g, x in zip(lengths, means, strict=True) if x <= m) >= 0.95 * sum(lengths) - 1e-9)
    assert got[p95] == pytest.approx(covering, abs=0.01)
    assert got["gpm_interval_seconds"] == pytest.approx((clock.t - began) / len(steps), abs=1e-3)
    assert nvml.gpm_pairs_too_close == 0
    assert monitor.take(0) == {}  # each interval in one window only


def test_ticks_faster_than_10_hz_never_pair_samples_closer_than_100_ms() -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeCard(0)], clock=clock)
    monitor = monitor_of(nvml, clock)
    nvml.cards[0].set_gpm_rates(clock.t, {SM: 40.0, TENSOR: 25.0, PCIE_TX: 512.0})
    for _ in range(100):  # 1000 Hz for a tenth of a second, ten times
        monitor.tick()
        clock.advance(0.01)
    got = monitor.take(0)
    assert nvml.gpm_pairs_too_close == 0
    assert got["gpm_interval_seconds"] >= 0.1
    assert got["sm_activity_percent"] == pytest.approx(40.0) and got["tensor_activity_max_percent"] == 25.0
    assert got["pcie_tx_bytes_per_second"] == pytest.approx(512 * 2**20)  # NVML's MiB a second, in bytes


def test_slow_calls_in_a_tick_never_pair_samples_closer_than_100_ms() -> None:
    """Each sample call takes 30 ms (a loaded machine, a slow driver): the
    later cards of a tick are sampled late in it, and early in the next tick
    if that tick's calls were quick. Pairs are judged by when each sample was
    taken, not by when the tick began: none closer than NVML takes."""
    clock = FakeClock()
    nvml = FakeNvml([FakeCard(i) for i in range(4)], clock=clock)
    slow = {"on": True}
    take = nvml._take_gpm

    def slow_take(counted: Any, sample: Any) -> Any:
        if slow["on"]:
            clock.advance(0.03)
        return take(counted, sample)

    nvml._take_gpm = slow_take  # type: ignore[method-assign, assignment]
    monitor = monitor_of(nvml, clock)
    for card in nvml.cards:
        card.set_gpm_rates(clock.t, {SM: 40.0})
    for k in range(40):  # a tick every 100 ms of its start; every other tick's calls are slow
        slow["on"] = k % 2 == 0
        start = clock.t
        monitor.tick()
        clock.advance(max(0.0, 0.1 - (clock.t - start)))
    assert nvml.gpm_pairs_too_close == 0
    for i in range(4):
        assert monitor.take(i)["sm_activity_percent"] == pytest.approx(40.0)


def test_a_card_without_gpm_beside_one_with_it_is_absent_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeCard(0), FakeCard(1, name="NVIDIA A100-SXM4-80GB", gpm=False)], clock=clock)
    monitor = monitor_of(nvml, clock)
    nvml.cards[0].set_gpm_rates(clock.t, {SM: 30.0})
    nvml.cards[1].set_gpm_rates(clock.t, {SM: 30.0})  # it has SMs too: it does not say what they do
    with caplog.at_level(logging.INFO, logger="sampler.gpu.gpm"):
        for _ in range(5):
            monitor.tick()
            clock.advance(0.2)
        hopper, ampere = monitor.take(0), monitor.take(1)
    assert hopper["sm_activity_percent"] == 30.0
    gpm_fields = {f for stem in METRICS for f in fields(stem)} | {"gpm_interval_seconds"}
    assert not gpm_fields & set(ampere)
    said = [r.getMessage() for r in caplog.records if "GPU 1" in r.getMessage()]
    assert said == ["GPU 1: SM activity, occupancy, tensor and bandwidth not measured: the card has no GPM "
                    "(Hopper and later have it)"]  # fmt: skip


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED])
def test_a_driver_without_gpm_is_absent(code: int) -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeCard(0, fails={"nvmlGpmQueryDeviceSupport": code})], clock=clock)
    monitor = monitor_of(nvml, clock)
    for _ in range(3):
        monitor.tick()
        clock.advance(0.2)
    got = monitor.take(0)
    assert not any(k.startswith(tuple(METRICS)) for k in got) and "gpm_interval_seconds" not in got


def test_a_metric_nvml_refuses_costs_that_metric_alone() -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeCard(0, gpm_refused={TENSOR: pynvml.NVML_ERROR_NOT_SUPPORTED})], clock=clock)
    monitor = monitor_of(nvml, clock)
    nvml.cards[0].set_gpm_rates(clock.t, {SM: 10.0, TENSOR: 90.0})
    for _ in range(3):
        monitor.tick()
        clock.advance(0.25)
    got = monitor.take(0)
    assert got["sm_activity_percent"] == 10.0
    assert not {f for f in got if f.startswith("tensor_activity")}  # absent, not 0
    assert "tensor_hmma_activity_percent" in got  # the card's other metrics, at what the fake counts (0 here)


def test_a_failed_sample_costs_its_intervals_alone() -> None:
    clock = FakeClock()
    card = FakeCard(0)
    nvml = FakeNvml([card], clock=clock)
    monitor = monitor_of(nvml, clock)
    card.set_gpm_rates(clock.t, {SM: 50.0})
    monitor.tick()
    clock.advance(0.2)
    card.fails["nvmlGpmSampleGet"] = pynvml.NVML_ERROR_UNKNOWN
    monitor.tick()
    clock.advance(0.2)
    del card.fails["nvmlGpmSampleGet"]
    monitor.tick()  # a new first sample
    clock.advance(0.3)
    monitor.tick()
    got = monitor.take(0)
    assert got["sm_activity_percent"] == 50.0 and got["gpm_interval_seconds"] == pytest.approx(0.3)


def test_clock_events_share_of_the_window() -> None:
    """A power cap for 0.6 s of 1.0 s, a thermal slowdown for the last 0.2 s:
    each tick's mask stands for the interval it ends."""
    clock = FakeClock()
    card = FakeCard(0)
    nvml = FakeNvml([card, FakeCard(1, fails={"nvmlDeviceGetCurrentClocksEventReasons":
                                              pynvml.NVML_ERROR_NOT_SUPPORTED})], clock=clock)  # fmt: skip
    monitor = monitor_of(nvml, clock)
    masks = [0, 0, POWER_CAP, POWER_CAP, POWER_CAP | THERMAL]  # at the ticks ending each 0.2 s from the first
    monitor.tick()
    for mask in masks:
        clock.advance(0.1)
        card.clock_events = mask  # set mid-interval: the tick that ends it reads it
        clock.advance(0.1)
        monitor.tick()
    got = monitor.take(0)
    assert got[clock_event_field("sw_power_cap")] == pytest.approx(0.6)
    assert got[clock_event_field("hw_thermal_slowdown")] == pytest.approx(0.2)
    assert got[clock_event_field("sync_boost")] == 0.0  # measured: never set
    assert set(got) >= {clock_event_field(r) for r in CLOCK_EVENTS}
    assert not any(k.startswith("clock_event") for k in monitor.take(1))  # unsupported: absent


def read_once_ticked(reader: GpuReader) -> list[dict[str, Any]]:
    """The reader's cards, asked for again until card 0 carries its SM
    activity (its first GPM interval closed: 0.2 s after the ticks start)."""
    deadline = time.monotonic() + 30
    while True:
        reader.request({})
        assert reader.wait(10)
        reading = reader.take()
        assert reading is not None and reading.gpus is not None
        if "sm_activity_percent" in reading.gpus[0] or time.monotonic() > deadline:
            return reading.gpus
        reader.wait(0.05)  # nothing in flight: a pause between asks, not a synchronisation


def test_the_reader_ticks_on_its_own_clock() -> None:
    """The agent's reader with GPM on: a Hopper card's readings carry its SM
    activity once ticks have come; an older card beside it carries none."""
    nvml = FakeNvml([FakeCard(0), FakeCard(1, gpm=False)])
    nvml.cards[0].set_gpm_rates(time.monotonic(), {SM: 12.5})
    reader = GpuReader(nvml, gpm_every_s=0.1)
    try:
        assert reader.wait_ready(10)
        got = read_once_ticked(reader)
        assert got[0]["sm_activity_percent"] == pytest.approx(12.5)
        assert "sm_activity_percent" not in got[1] and "clock_event_sw_power_cap_ratio" in got[1]
        assert nvml.gpm_pairs_too_close == 0
    finally:
        reader.close()


def test_the_export_names_every_clock_event_reason() -> None:
    from controlplane.export.series import CLOCK_EVENT_REASONS

    assert set(CLOCK_EVENT_REASONS) == set(CLOCK_EVENTS)


def test_an_engine_carries_its_cards_and_what_their_sms_did() -> None:
    """The cards an engine holds a context on (a compute process of its on
    each), and those cards' SM and tensor activity, the mean over those that
    have GPM, beside its own share of them."""
    from sampler.gpu.nvml import GpuReading
    from sampler.window.sampler import WindowSampler

    nvml = FakeNvml([FakeCard(0), FakeCard(1), FakeCard(2, gpm=False)])
    nvml.cards[0].processes = [(100, 2**30)]
    nvml.cards[2].processes = [(101, 2**30), (200, 2**30)]
    reader = GpuReader(nvml)
    try:
        assert reader.wait_ready(10)
        reader.request({"llama": {100, 101}, "idle": {300}})
        assert reader.wait(10)
        reading = reader.take()
    finally:
        reader.close()
    assert reading is not None and reading.gpus is not None
    assert reading.shard_cards == {"llama": [0, 2]}
    # As the window's summary merges them: card 0 with GPM, card 2 without (absent from the mean, not 0).
    gpus = [dict(g) for g in reading.gpus]
    gpus[0].update(sm_activity_percent=40.0, tensor_activity_percent=10.0)
    figures: dict[str, dict[str, Any]] = {"llama": {}, "idle": {}}
    WindowSampler._add_gpus(figures, GpuReading(gpus, reading.shard_memory, 0.0, shard_cards=reading.shard_cards))
    assert figures["llama"]["gpu_indices"] == [0, 2]
    assert figures["llama"]["gpu_sm_activity_percent"] == 40.0
    assert figures["llama"]["gpu_tensor_activity_percent"] == 10.0
    assert "gpu_indices" not in figures["idle"] and "gpu_sm_activity_percent" not in figures["idle"]


def test_a_hung_driver_piles_no_ticks_up() -> None:
    """A reading hung in the driver holds the NVML thread: the ticks after
    it are skipped, not queued behind it (each would be another call into a
    wedged driver the moment it answers)."""
    hang = threading.Event()
    nvml = FakeNvml([FakeCard(0, hang=hang)])
    reader = GpuReader(nvml, gpm_every_s=0.1)
    try:
        assert reader.wait_ready(10)
        reader.request({})  # blocks in nvmlDeviceGetTemperature until `hang` is set
        deadline = time.monotonic() + 30
        while reader.ticks_skipped < 5 and time.monotonic() < deadline:
            reader.wait(0.1)  # the reading does not finish: this only paces the check
        assert reader.ticks_skipped >= 5
        assert reader._pool._calls.qsize() <= 1  # at most the one tick submitted before the hang
    finally:
        hang.set()
        reader.close()


def test_a_lost_card_s_reinitialisation_frees_its_gpm_buffers_and_measures_again() -> None:
    """A card that fell off the bus: NVML is initialised again, the old GPM
    buffers are freed first (while NVML still runs), new ones taken, and
    the card's SMs measured again once it is back."""
    nvml = FakeNvml([FakeCard(0)])
    nvml.cards[0].set_gpm_rates(time.monotonic(), {SM: 20.0})
    reader = GpuReader(nvml, gpm_every_s=0.1)

    try:
        assert reader.wait_ready(10)
        assert read_once_ticked(reader)[0]["sm_activity_percent"] == pytest.approx(20.0)
        nvml.cards[0].lost = True
        reader.request({})
        assert reader.wait(10)
        lost = reader.take()
        assert lost is not None and lost.gpus == [{"index": 0, "uuid": nvml.cards[0].uuid, "lost": True}]
        assert read_once_ticked(reader)[0]["sm_activity_percent"] == pytest.approx(20.0)  # back after re-initialising
        assert nvml.gpm_unfreed_at_shutdown == 0  # the first pair freed before NVML shut down
        assert len(nvml._gpm_buffers) == 2  # the second pair, in use
    finally:
        reader.close()


@pytest.mark.parametrize("library", [False, True])
def test_a_node_without_cards_wakes_nothing_ten_times_a_second(library: bool) -> None:
    """No NVML, or NVML and no card: the ticker waits for cards instead of
    waking the NVML thread for nothing (measured: 0.15% of a core when it did)."""
    reader = GpuReader(FakeNvml([], library=library), gpm_every_s=0.1)
    try:
        reader.wait_ready(10)
        reader._closed.wait(0.5)  # five ticks' time, in which none must come
        assert reader.ticks == 0
    finally:
        reader.close()


def test_gpm_intervals_reach_the_live_view_and_hindsight_one_by_one(tmp_path: Path) -> None:
    """A window's raw block carries a card's GPM intervals as points (SM
    activity and occupancy, tensor activity, DRAM bandwidth) at their own
    rate, beside NVML's utilisation samples, whose mean is the window's;
    hindsight keeps the SM activity's (a row a card); a card without GPM
    has no such points, not zeros."""
    import msgspec

    from sampler.backend import BackendChoice
    from sampler.shards.proc_shards import ProcShardSampler
    from sampler.shards.selectors import Selector, ShardSpec
    from sampler.window.hindsight import HindsightRing
    from sampler.window.sampler import WindowSampler
    from tests.fakeproc import FakeProc

    nvml = FakeNvml([FakeCard(0), FakeCard(1, gpm=False)])
    nvml.cards[0].set_gpm_rates(time.monotonic(), {SM: 12.5, TENSOR: 3.0})
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=10)
    reader = GpuReader(nvml, gpm_every_s=0.1)
    try:
        assert reader.wait_ready(10)
        ws = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root),
                           [ShardSpec("llama", Selector.parse("pgid:100"))], hz=10, node="n1", gpus=reader)  # fmt: skip
        ws.hindsight = HindsightRing(minutes=1, mib=1, hz=10, rows=8)
        ws.raw_wanted = True
        ws.prime(0)
        first = ws.run_window(1.0)
        summary = ws.run_window(1.0)
    finally:
        reader.close()
    assert summary.raw is not None and summary.gpus is not None
    by_card = {g["index"]: g for g in msgspec.json.decode(summary.raw)["gpus"]}
    sm, tensor = by_card[0]["sm_activity_percent"], by_card[0]["tensor_activity_percent"]
    assert sm["v"] and set(sm["v"]) == {12.5} and set(tensor["v"]) == {3.0}
    assert summary.gpus[0].sm_activity_percent == 12.5 == summary.gpus[0].sm_activity_max_percent
    # Each point at its interval's end: ticks after the first window began, before this one ended, in order.
    at = [summary.window.start + t for t in sm["t"]]
    assert first.window.start <= at[0] and at == sorted(at) and at[-1] <= summary.window.end
    assert not any(field in by_card.get(1, {}) for field in ("sm_activity_percent", "tensor_activity_percent"))
    kept = set(ws.hindsight.series_kept())
    assert "gpu:0:sm_activity_percent" in kept and "gpu:0:tensor_activity_percent" not in kept
    assert not any(key.startswith("gpu:1:") for key in kept)


# --- MIG ------------------------------------------------------------------------------


def mig_card() -> FakeCard:
    """An H100 cut in three: GPU instances 1 and 2 in slots 0 and 2 (slot 1 empty), 5 on the third."""
    return FakeCard(0, name="NVIDIA H100 80GB HBM3", memory_total=80 * 2**30,
                    mig=[FakeInstance(1, memory_total=20 * 2**30, memory_used=6 * 2**30, processes=[(100, 6 * 2**30)]),
                         None,
                         FakeInstance(2, memory_total=20 * 2**30, memory_used=2**30, processes=[(200, 2**30)]),
                         FakeInstance(5, memory_total=10 * 2**30)])  # fmt: skip


def test_a_mig_card_s_instances_are_rows_of_their_own_with_their_memory_processes_and_sms() -> None:
    """Each instance under its card, by its GPU instance id: its memory, and
    its SM activity from its own GPM samples (nvmlGpmMigSampleGet); the
    card's own figures stay the whole card's. An engine's memory comes from
    the instances it runs on (the card's handle refuses an unprivileged
    agent every instance's processes), and its SM activity is its
    instance's, not its neighbours'. A card beside it without MIG has no
    instance rows at all (absent, not an empty list)."""
    card = mig_card()
    now = time.monotonic()
    card.set_gpm_rates(now, {SM: 50.0})
    card.mig[0].set_gpm_rates(now, {SM: 90.0})  # type: ignore[index, union-attr]
    card.mig[2].set_gpm_rates(now, {SM: 10.0})  # type: ignore[index, union-attr]
    nvml = FakeNvml([card, FakeCard(1)])
    reader = GpuReader(nvml, gpm_every_s=0.1)
    try:
        assert reader.wait_ready(10)
        read_once_ticked(reader)
        deadline = time.monotonic() + 30
        while True:  # until an interval of each instance has closed too
            reader.request({"llama": {100}, "mistral": {200}})
            assert reader.wait(10)
            reading = reader.take()
            assert reading is not None and reading.gpus is not None
            rows = reading.gpus[0].get("mig_instances", [])
            if (rows and all("sm_activity_percent" in r for r in rows)) or time.monotonic() > deadline:
                break
            reader.wait(0.05)  # nothing in flight: a pause between asks, not a synchronisation
    finally:
        reader.close()
    whole, plain = reading.gpus
    assert [r["gpu_instance_id"] for r in whole["mig_instances"]] == [1, 2, 5]
    first, second, third = whole["mig_instances"]
    assert (first["memory_used_bytes"], first["memory_total_bytes"]) == (6 * 2**30, 20 * 2**30)
    assert first["uuid"].startswith("MIG-") and first["compute_instance_id"] == 0
    assert first["sm_activity_percent"] == pytest.approx(90.0) and second["sm_activity_percent"] == pytest.approx(10.0)
    assert third["sm_activity_percent"] == 0.0  # idle, and measured so
    assert whole["sm_activity_percent"] == pytest.approx(50.0)  # the card's own: the whole card
    assert "mig_instances" not in plain
    assert reading.shard_memory == {"llama": 6 * 2**30, "mistral": 2**30}
    assert reading.shard_cards == {"llama": [0], "mistral": [0]}
    assert reading.shard_instances == {"llama": [(0, 1)], "mistral": [(0, 2)]}
    assert nvml.gpm_pairs_too_close == 0


def read_gpus(reader: GpuReader) -> list[dict[str, Any]]:
    reader.request({})
    assert reader.wait(10)
    reading = reader.take()
    assert reading is not None and reading.gpus is not None
    return reading.gpus


def test_an_instance_that_goes_is_found_gone_and_a_card_without_mig_mode_has_no_rows() -> None:
    """An operator re-partitions a drained card: the instance destroyed is
    found gone at the reading its handle fails (its row left out, found again
    at the next), its GPM buffers freed. A driver that cannot say whether the
    card is in MIG mode leaves the card as one card."""
    card = mig_card()
    nvml = FakeNvml([card, FakeCard(1, fails={"nvmlDeviceGetMigMode": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})])
    reader = GpuReader(nvml)
    try:
        assert reader.wait_ready(10)
        gpus = read_gpus(reader)
        assert [r["gpu_instance_id"] for r in gpus[0]["mig_instances"]] == [1, 2, 5]
        assert "mig_instances" not in gpus[1]
        card.mig[2].gone = True  # type: ignore[index, union-attr]
        gone = read_gpus(reader)[0]["mig_instances"]
        assert [r["gpu_instance_id"] for r in gone] == [1, 2, 5] and "memory_used_bytes" not in gone[1]
        assert [r["gpu_instance_id"] for r in read_gpus(reader)[0]["mig_instances"]] == [1, 5]
    finally:
        reader.close()
    assert nvml.gpm_unfreed_at_shutdown == 0


def test_an_engine_on_a_mig_instance_carries_its_instance_s_sms() -> None:
    from sampler.gpu.nvml import GpuReading
    from sampler.window.sampler import WindowSampler

    gpus: list[dict[str, Any]] = [{"index": 0, "sm_activity_percent": 50.0,
                                   "mig_instances": [{"gpu_instance_id": 1, "sm_activity_percent": 90.0,
                                                      "tensor_activity_percent": 7.0},
                                                     {"gpu_instance_id": 2, "sm_activity_percent": 10.0}]},
                                  {"index": 1, "sm_activity_percent": 30.0}]  # fmt: skip
    figures: dict[str, dict[str, Any]] = {"llama": {}, "mistral": {}, "both": {}}
    reading = GpuReading(gpus, {}, 0.0, shard_cards={"llama": [0], "mistral": [0], "both": [0, 1]},
                         shard_instances={"llama": [(0, 1)], "mistral": [(0, 2)], "both": [(0, 2)]})  # fmt: skip
    summary = WindowSampler._add_gpus(figures, reading)
    llama, mistral = figures["llama"], figures["mistral"]
    assert llama["gpu_sm_activity_percent"] == 90.0 and llama["gpu_tensor_activity_percent"] == 7.0
    assert mistral["gpu_sm_activity_percent"] == 10.0 and "gpu_tensor_activity_percent" not in mistral
    assert figures["both"]["gpu_sm_activity_percent"] == 20.0  # its instance of card 0 and the whole of card 1
    assert [i.gpu_instance_id for i in summary["gpus"][0].mig_instances] == [1, 2]
