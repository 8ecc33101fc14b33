from pathlib import Path

import numpy as np
import pytest

import wire
from sampler.backend import BackendChoice
from sampler.kernel.groups_run import GroupsRun
from sampler.shards.proc_shards import PAGE_SIZE, USER_HZ, ProcShardSampler, ShardReading
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from sampler.window.series import RateSeries
from tests.fakeproc import FakeClock, FakeProc
from tests.heartbeats import cores_of, cpu_of
from wire.schema import CoreStats, PercentStats


def test_mean_is_time_weighted_and_bursts_show_in_max() -> None:
    s = RateSeries(4)
    s.add(1.0, 0.1)
    s.add(1.0, 0.1)
    s.add(3.0, 0.2)  # a late sample covering twice the time
    summary = s.summary()
    assert summary is not None
    assert summary["mean"] == pytest.approx((0.1 + 0.1 + 0.6) / 0.4)
    assert summary["max"] == 3.0
    assert summary["p95"] == 3.0  # the burst covers half the window's time: p95 is in it


def test_unmeasured_samples_are_left_out_not_zero() -> None:
    s = RateSeries(3)
    s.add(None, 0.1)
    s.add(2.0, 0.1)
    s.add(None, 0.1)
    assert s.summary() == {"mean": 2.0, "p95": 2.0, "max": 2.0}


def test_window_with_nothing_measured_has_no_summary() -> None:
    s = RateSeries(2)
    assert s.summary() is None
    s.add(None, 0.1)
    assert s.summary() is None


def test_series_grows_past_its_capacity() -> None:
    s = RateSeries(2)
    for v in range(5):
        s.add(float(v), 1.0)
    assert s.summary() == {"mean": 2.0, "p95": 4.0, "max": 4.0}


def test_p95_is_weighted_by_the_time_each_sample_covers() -> None:
    s = RateSeries(100)
    for _ in range(90):
        s.add(1.0, 0.1)  # 9 s at one core
    for _ in range(10):
        s.add(8.0, 0.01)  # ten short bursts, 0.1 s together: 1% of the time
    summary = s.summary()
    assert summary is not None and summary["p95"] == 1.0 and summary["max"] == 8.0
    assert float(np.percentile(s.values[: s.n], 95)) == 8.0  # counting samples, not time, would say 8


def test_a_sample_shorter_than_a_tick_is_merged_not_made_a_rate() -> None:
    s = RateSeries(10, min_seconds=0.01)
    s.add(0.5, 0.1)
    s.add(200.0, 0.00005)  # one 10 ms tick seen in 50 us
    s.add(0.4, 0.1)
    summary = s.summary()
    assert summary is not None and s.n == 2
    assert summary["max"] == 0.5  # the merged sample reads (0.01 + 0.04) / 0.10005, not 200
    assert summary["mean"] == pytest.approx((0.05 + 0.01 + 0.04) / 0.20005, abs=1e-4)
    s.add(100.0, 0.0001)  # the window's last sample short: into the one before it
    last = s.summary()
    assert last is not None and last["max"] < 1.0 and last["mean"] == pytest.approx(0.11 / 0.20015, abs=1e-4)


class ScriptedProc:
    """Moves a fake /proc forward at each sleep, as a real one moves with time."""

    def __init__(self, proc: FakeProc, clock: FakeClock, comm: str = "python3") -> None:
        self.proc, self.clock, self.ticks, self.comm = proc, clock, 0, comm

    def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.ticks += round(seconds * USER_HZ)
        # The machine: one of two CPUs busy. The engine: one core.
        self.proc.set_cpu(user=self.ticks, idle=self.ticks)
        self.proc.set(100, self.comm, utime=self.ticks, rss=256)


def test_window_summary_shape(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=256)
    clock = FakeClock()
    script = ScriptedProc(proc, clock)
    w = WindowSampler(
        proc.root,
        BackendChoice("proc", "asked for proc"),
        ProcShardSampler(proc.root, clock),
        [ShardSpec("s0", Selector.parse("pgid:100"), model="llama", replica="r1"),
         ShardSpec("gone", Selector.parse("pgid:999"))],
        hz=10,
        node="n1",
        clock=clock,
        wall_clock=clock,
        sleep=script.sleep,
    )
    first = w.run_window(1.0)
    second = w.run_window(1.0)
    assert first.seq == 1 and second.seq == 2
    assert second.bpf is None  # no kernel programs, no cost to report
    assert second.window.samples == 10
    assert second.backend == "proc"
    m = second.machine
    assert m.cpu_percent == PercentStats(mean=50.0, p95=50.0, max=50.0)
    assert m.cpus == 2 and m.memory_bytes == 16000000 * 1024
    s0, gone = second.shards
    assert (s0.id, s0.model, s0.replica, s0.pgid) == ("s0", "llama", "r1", 100)
    assert s0.cpu_cores == CoreStats(mean=1.0, p95=1.0, max=1.0)
    assert s0.memory_bytes == 256 * PAGE_SIZE
    # A group that does not exist is reported as unmeasured, not as idle.
    assert gone.cpu_cores is None and gone.memory_bytes is None and gone.pgids == ()
    # The very first sample had nothing to compare with: 9 measured samples, same figures.
    assert first.shards[0].cpu_cores == CoreStats(mean=1.0, p95=1.0, max=1.0)


def test_busiest_groups_are_found_by_priming(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, comm="engine", rss=1)
    proc.add(200, comm="idle")
    clock = FakeClock()
    script = ScriptedProc(proc, clock, comm="engine")
    groups = ProcShardSampler(proc.root, clock)
    w = WindowSampler(proc.root, BackendChoice("proc", None), groups, None, hz=10, node="n1",
                      clock=clock, wall_clock=clock, sleep=script.sleep)
    w.prime(1.0)
    summary = w.run_window(1.0)
    [shard] = summary.shards
    assert (shard.id, shard.command) == ("comm:engine", "engine")
    assert cores_of(shard).mean == pytest.approx(1.0)


class _TicksSaid(ProcShardSampler):
    """/proc's backend, with the groups that ran said as the kernel's tick says them."""

    def __init__(self, proc: Path, clock: FakeClock, ticks: dict[int, int]) -> None:
        super().__init__(proc, clock)
        self.ticks = ticks

    def groups_run(self) -> GroupsRun:  # type: ignore[override]
        return GroupsRun(dict(self.ticks), True, True, 0.01)


def test_busiest_groups_by_the_kernels_ticks_are_groups_with_a_live_leader(tmp_path: Path) -> None:
    """A group the tick counted that has exited since (the busiest here) is
    not a shard: it would have nothing to measure."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, comm="engine", rss=1)
    proc.add(200, comm="idle")
    clock = FakeClock()
    script = ScriptedProc(proc, clock, comm="engine")
    groups = _TicksSaid(proc.root, clock, {100: 50, 999: 90})
    w = WindowSampler(proc.root, BackendChoice("proc", None), groups, None, hz=10, node="n1",
                      clock=clock, wall_clock=clock, sleep=script.sleep)  # fmt: skip
    w.prime(1.0)
    [shard] = w.run_window(1.0).shards
    assert (shard.id, shard.command) == ("comm:engine", "engine")
    assert cores_of(shard).mean == pytest.approx(1.0)


def test_busiest_groups_are_named_by_command_and_outlive_a_restart(tmp_path: Path) -> None:
    """Without a config the busiest groups are shards named by their leaders'
    command names: two groups of one name are one shard (their cores summed),
    an engine restarted in a new group keeps its shard, and a leader whose
    name is not printable text is named by its group."""
    proc = FakeProc(tmp_path / "proc")
    clock = FakeClock()
    ticks = 0
    running = {100: "vllm", 200: "worker", 201: "worker", 400: "\x1b[31mx"}  # pid: comm, each its own group
    used = dict.fromkeys(running, 0)
    share = {100: 1.0, 200: 0.5, 201: 0.3, 400: 0.5}  # cores each: whole ticks a sample

    def sleep(seconds: float) -> None:
        nonlocal ticks
        clock.advance(seconds)
        ticks += round(seconds * USER_HZ)
        proc.set_cpu(user=ticks, idle=ticks)
        for pid, comm in running.items():
            used[pid] += round(seconds * USER_HZ * share[pid])
            proc.set(pid, comm, utime=used[pid], rss=10)

    for pid, comm in running.items():
        proc.add(pid, comm=comm, rss=10)
    groups = ProcShardSampler(proc.root, clock)
    w = WindowSampler(proc.root, BackendChoice("proc", None), groups, None, hz=10, node="n1",
                      clock=clock, wall_clock=clock, sleep=sleep)  # fmt: skip
    w.prime(1.0)
    w.run_window(1.0)  # the busiest groups are learnt from the window before
    shards = {s.id: s for s in w.run_window(1.0).shards}
    assert shards.keys() == {"comm:vllm", "comm:worker", "pgid:400"}
    assert shards["comm:worker"].pgids == (200, 201)
    assert cores_of(shards["comm:worker"]).mean == pytest.approx(0.8)
    assert cores_of(shards["comm:vllm"]).mean == pytest.approx(1.0)

    # The engine restarts: group 100 is gone, group 300 of the same name at half the load.
    proc.remove(100)
    del running[100]
    running[300], used[300], share[300] = "vllm", 0, 0.5
    proc.add(300, comm="vllm", rss=10)
    w.run_window(1.0)
    shards = {s.id: s for s in w.run_window(1.0).shards}
    assert shards["comm:vllm"].pgids == (300,)
    assert cores_of(shards["comm:vllm"]).mean == pytest.approx(0.5)


def test_a_wall_clock_stepped_back_costs_no_window(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """NTP steps the wall clock back 30 s during a window: the window's end is
    the clock's, its start its end less the window's monotonic length, and
    the control plane takes it (an end before its start is refused)."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=1)
    clock = FakeClock()
    script = ScriptedProc(proc, clock)
    walls = iter([1000.0, 971.0])
    w = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root, clock),
                      [ShardSpec("s0", Selector.parse("pgid:100"))], hz=10, node="n1", clock=clock,
                      wall_clock=lambda: next(walls), sleep=script.sleep)  # fmt: skip
    summary = w.run_window(1.0)
    assert summary.window.end == 971.0 and summary.window.start == pytest.approx(970.0)
    assert wire.decode_heartbeat(wire.encode(summary)).heartbeat.window == summary.window
    assert "wall clock went back" in caplog.text


def test_a_300_ms_stall_keeps_every_figure(tmp_path: Path) -> None:
    """A sample that comes 300 ms late (a GC pause, a slow walk) covers the
    time it came late for; the slots it missed are skipped, not taken back to
    back; mean, p95 and max stay the truth's."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=1)
    clock = FakeClock()
    script = ScriptedProc(proc, clock)
    groups = ProcShardSampler(proc.root, clock)
    sleeps = 0

    def stalling_sleep(seconds: float) -> None:
        nonlocal sleeps
        sleeps += 1
        script.sleep(seconds + (0.3 if sleeps == 15 else 0.0))  # the process runs on while the sampler stalls

    w = WindowSampler(proc.root, BackendChoice("proc", None), groups,
                      [ShardSpec("s0", Selector.parse("pgid:100"))], hz=10, node="n1", clock=clock,
                      wall_clock=clock, sleep=stalling_sleep)  # fmt: skip
    w.run_window(1.0)
    stalled = w.run_window(1.0)
    assert stalled.window.samples == 10 - 3  # three slots skipped, none bunched
    assert stalled.window.end - stalled.window.start == pytest.approx(1.0)
    assert stalled.machine.cpu_percent == PercentStats(mean=50.0, p95=50.0, max=50.0)
    assert stalled.shards[0].cpu_cores == CoreStats(mean=1.0, p95=1.0, max=1.0)


def test_the_first_sample_is_weighted_from_the_machines_first_reading(tmp_path: Path) -> None:
    """Priming reads the machine's counters, then the groups' (slow on a
    crowded machine): the first window's first sample covers both, so its
    weight runs from the machine's reading. Here the machine is all busy for
    the 100 ms those reads take, then half busy: over the window 1.2 of 2.2
    CPU-seconds, 54.5%, not the 52.5% of a weight stamped after them."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=1)
    clock = FakeClock()
    ticks = {"user": 0, "idle": 0}

    def run(seconds: float, busy: float) -> None:  # two CPUs, `busy` of them in use
        clock.advance(seconds)
        ticks["user"] += round(seconds * USER_HZ * busy)
        ticks["idle"] += round(seconds * USER_HZ * (2 - busy))
        proc.set_cpu(**ticks)

    proc.set_cpu(**ticks)
    groups = ProcShardSampler(proc.root, clock)
    read_groups = groups.sample

    def slow_read() -> dict[str, ShardReading]:
        run(0.1, busy=2.0)
        return read_groups()

    groups.sample = slow_read  # type: ignore[method-assign]
    w = WindowSampler(proc.root, BackendChoice("proc", None), groups,
                      [ShardSpec("s0", Selector.parse("pgid:100"))], hz=10, node="n1", clock=clock,
                      wall_clock=clock, sleep=lambda s: run(s, busy=1.0))  # fmt: skip
    w.prime(0)
    groups.sample = read_groups  # type: ignore[method-assign]
    first = w.run_window(1.0)
    assert cpu_of(first).mean == pytest.approx(100 * 1.2 / 2.2, abs=1e-3)
    assert cpu_of(first).max == pytest.approx(75.0)  # 30 busy ticks of 40 in its 200 ms
