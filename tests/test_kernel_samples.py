"""The samples the kernel takes (on_sample in bpf/sched_groups.bpf.c, read
by sampler/kernel/sample_ring.py), on this kernel: at the rate asked, at the
kernel's own time, none lost to an agent that stalls, the machine's CPU as
/proc/stat counts it, and the agent's own loop where a sample cannot hold
every set of shards.

Needs root (CI is root). With NODESAMPLER_REQUIRE_BPF=1 a test that cannot
load the programs fails instead of skipping.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from sampler.backend import BackendChoice
from sampler.kernel import sched
from sampler.kernel.headers import kernel_version_code
from sampler.kernel.sample_ring import RingSamples
from sampler.shards.selectors import ProcessTable, Selector, ShardSpec
from sampler.sources import procfs
from sampler.window.sampler import WindowSampler
from tests.conftest import REQUIRE_BPF, AccuracyLog
from tests.heartbeats import cores_of, cpu_of
from tests.workloads import BURN_ONE_CORE, PROC, after_each_reading, busy_threads, process_cpu_seconds, start_group

pytestmark = [pytest.mark.kernel, pytest.mark.timing]


def busy_group(group: list[subprocess.Popen[str]]) -> int:
    p = start_group(BURN_ONE_CORE)
    group.append(p)
    return p.pid


def sampler_of(groups: sched.KernelShardSampler, pgid: int, hz: float) -> WindowSampler:
    return WindowSampler(PROC, BackendChoice("bpf", None), groups, [ShardSpec("w", Selector.parse(f"pgid:{pgid}"))],
                         hz=hz, node="ring")  # fmt: skip


@contextmanager
def stalled_once(groups: sched.KernelShardSampler, when: Callable[[], bool], seconds: float,
                 until: Callable[[], bool] | None = None) -> Iterator[list[sched.KernelSamples]]:  # fmt: skip
    """The agent's read of the kernel's samples stalls once for `seconds`, for
    real (the first read after `when` holds), before it reads; or, given
    `until`, till that holds (for at most `seconds`: then the test fails);
    yields every read's samples, as they come."""
    take, stalled, reads = groups.take_kernel_samples, [False], []

    def stalling() -> Any:
        if not stalled[0] and when():
            stalled[0] = True
            if until is None:
                time.sleep(seconds)
            else:
                deadline = time.monotonic() + seconds
                while not until():
                    assert time.monotonic() < deadline, f"still stalled after {seconds} s"
                    time.sleep(0.01)
        reads.append(got := take())
        return got

    hooked = vars(groups).get("take_kernel_samples")  # another hook's, inside which this one runs
    groups.take_kernel_samples = stalling  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        assert stalled[0], "the read never stalled"
        if hooked is None:
            del groups.take_kernel_samples
        else:
            groups.take_kernel_samples = hooked  # type: ignore[method-assign]


def test_the_kernel_takes_the_samples_from_5_15_on(bpf_groups: sched.KernelShardSampler) -> None:
    """bpf_timer's kernels and later take the samples in the kernel (on_sample
    loads with bounded loops and probe reads alone: 5.10 too, where it loads)."""
    why = bpf_groups.agent_samples_why
    if kernel_version_code(os.uname().release) >= (5 << 16) + (15 << 8):
        assert bpf_groups.ring is not None, bpf_groups.programs.notes
    elif bpf_groups.ring is None:  # said in the harness's output, for the next one to read
        pytest.skip(f"the agent's loop samples on this kernel: {why}")


def sampling(groups: sched.KernelShardSampler) -> sched.KernelShardSampler:
    """A backend where the kernel takes the samples: its first samples read,
    to know it can (a kernel whose samples read no CPU's time has the agent's
    loop sample instead), else skipped with the reason."""
    if groups.ring is None:
        pytest.skip(f"the kernel takes no samples here: {groups.programs.notes}")
    if groups.samples_in_kernel(100):
        written, since = groups.ring.written(), time.monotonic()
        while groups.ring.written() < written + 2 and time.monotonic() - since < 2.0:
            pass  # the kernel's next samples: written into shared memory, nothing to wait on
        groups.take_kernel_samples()
    if groups.agent_samples_why is not None:
        pytest.skip(f"the agent's loop samples here: {groups.agent_samples_why}")
    return groups


@pytest.fixture
def ring(bpf_groups: sched.KernelShardSampler) -> sched.KernelShardSampler:
    """The shared backend, the kernel taking the samples."""
    return sampling(bpf_groups)


@pytest.mark.parametrize("hz", [10, 100, 1000])
def test_a_sample_every_period_at_the_kernel_s_time(ring: sched.KernelShardSampler, group: list[subprocess.Popen[str]],
                                                    hz: int) -> None:  # fmt: skip
    ws = sampler_of(ring, busy_group(group), hz)
    ws.prime(0)
    ws.run_window(1.0)
    ring.take_kernel_samples()  # those taken since the window's end
    time.sleep(1.0)  # the kernel samples while this process sleeps
    got = ring.take_kernel_samples()
    gaps = np.diff(got.at)
    # The timer fires every period; a busy machine delays some expiries, and
    # the kernel skips the periods it missed rather than bunching them (CI:
    # 884 in a second at 1000 Hz once), so the count is a floor.
    assert len(got.at) >= hz / 2
    assert float(np.median(gaps)) == pytest.approx(1 / hz, rel=0.01)
    assert np.isfinite(got.shards["w"]).all()  # every one measured the group (tests elsewhere say how well)
    assert (got.shards["w"] <= 1.0 + 1e-9).all()  # and never more than its one thread


def test_an_agent_that_stalls_loses_no_sample(ring: sched.KernelShardSampler, group: list[subprocess.Popen[str]],
                                              accuracy: AccuracyLog) -> None:  # fmt: skip
    """Stalled 2.5 s, more than two reads of the ring, less than it holds at 1000 Hz."""
    pgid = busy_group(group)
    ws = sampler_of(ring, pgid, 1000)
    edges: list[tuple[float, float]] = []
    final = 0.0

    def truth() -> None:
        if (now := time.monotonic()) >= final:
            edges.append((now, process_cpu_seconds(pgid)))

    with after_each_reading(ring, truth):
        ws.prime(0)
        primed_at = ws._last_sample_at  # the first readings: the window holds what the kernel took after them
        assert primed_at is not None
        start = time.monotonic()
        final = start + 4.0
        with stalled_once(ring, lambda: time.monotonic() >= start + 0.5, 2.5) as reads:
            summary = ws.run_window(4.0)
    (t0, s0), (t1, s1) = edges[0], edges[-1]
    cores = cores_of(summary.shards[0])
    accuracy.record("window mean, 1000 Hz, a 2.5 s stall", cores.mean, (s1 - s0) / (t1 - t0), 0.03)
    # Every sample the kernel took from the priming read to the window's last
    # is in the window: none written over (each read takes all written since
    # the one before), none dropped on the way (an emulated guest's timer
    # skips periods it could not fire in time: fewer than 4000 there). A
    # guest's timer also fires late: a sample it took before the priming read
    # may be written after it (7 of them once, in Debian 12's guest), and it
    # is not this window's (its time is before the window's start).
    assert [r.lost for r in reads] == [0] * len(reads)
    assert summary.window.samples == sum(int((r.at > primed_at).sum()) for r in reads)
    assert summary.window.samples > 4000 * 0.8
    assert cores.mean == pytest.approx((s1 - s0) / (t1 - t0), rel=0.03)
    assert cores.max <= 1.01


def test_samples_taken_while_the_slot_list_is_written_hold_no_more_than_their_time(
        ring: sched.KernelShardSampler, group: list[subprocess.Popen[str]], accuracy: AccuracyLog) -> None:  # fmt: skip
    """A sample the kernel takes while the agent writes its list of slots
    (generation odd) holds no slot. The agent's thread can be held off
    mid-write for many periods on a loaded machine, and the first sample
    after such a run held all of their time over its own (a one-core burner
    read 5.22 cores in a 1 ms sample on the arm64 guest, 2.04 on a loaded
    2-CPU host). Forced here: after each of the first reads the list stays
    mid-write for 50 ms. Every sample is within the burner's one thread, the
    run's samples share its time (they are measured), and the window's mean
    is the process's."""
    pgid = busy_group(group)
    ws = sampler_of(ring, pgid, 1000)
    assert ring.ring is not None
    gens = ring.ring._gen
    held_off: list[int] = []
    edges: list[tuple[float, float]] = []

    def mid_write() -> None:
        edges.append((time.monotonic(), process_cpu_seconds(pgid)))
        if len(held_off) < 3:
            gen = int(gens[0])
            gens[0] = gen + 1  # as sample_slots begins a write
            before = ring.ring.written()  # type: ignore[union-attr]
            time.sleep(0.05)
            held_off.append(ring.ring.written() - before)  # type: ignore[union-attr]
            gens[0] = gen  # the same list: its generation again

    with after_each_reading(ring, mid_write):
        ws.prime(0)
        summary = ws.run_window(3.0)
    assert sum(held_off) > 20  # the kernel sampled while the list was mid-write
    cores = cores_of(summary.shards[0])
    (t0, s0), (t1, s1) = edges[0], edges[-1]
    accuracy.record("window mean, 1000 Hz, the slot list held mid-write", cores.mean, (s1 - s0) / (t1 - t0), 0.03)
    assert cores.max <= 1.01
    assert summary.window.samples > 3000 * 0.8  # those taken mid-write included
    assert cores.mean == pytest.approx((s1 - s0) / (t1 - t0), rel=0.03)


@pytest.mark.parametrize("sampled_by", ["kernel", "agent"])
def test_a_group_with_more_threads_than_cpus_never_reads_more_than_the_machine(
        bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], sampled_by: str) -> None:  # fmt: skip
    """Twice as many threads as CPUs, contending for the interpreter's lock
    (a switch every few hundred microseconds), sampled 1000 times a second
    by the kernel's samples and by the agent's own loop: the group's threads
    outnumber the CPUs, so no sample may read more than the machine's CPUs,
    however the reads meet the switches (docs/sampling.md)."""
    groups = sampling(bpf_groups) if sampled_by == "kernel" else bpf_groups
    cpus = os.cpu_count() or 1
    p = start_group(busy_threads(2 * cpus))
    group.append(p)
    ws = sampler_of(groups, p.pid, 1000)
    ws.kernel_samples = sampled_by == "kernel"
    ws.prime(0)
    summary = ws.run_window(3.0)
    assert summary.backend_reason is None, summary.backend_reason  # the kernel sampled where asked to
    cores = cores_of(summary.shards[0])
    assert cores.max <= cpus + 1e-3
    assert cores.mean > 0.5  # it ran, and was measured


class MidSwitch:
    """The CPUs' entries of SlotCounters as a reading sees them while `cpu`
    is mid-switch at every try (its sequence number odd)."""

    def __init__(self, entries: np.ndarray, cpu: int) -> None:
        self.entries, self.cpu = entries, cpu

    def __getitem__(self, field: str) -> np.ndarray:
        got = self.entries[field]
        if field == "seq":
            got = got.copy()
            got[self.cpu] |= got.dtype.type(1)  # numpy before 2 widens a Python int past uint64
        return got

    def copy(self) -> np.ndarray:
        return self.entries.copy()


def test_a_sample_after_one_read_mid_switch_holds_no_more_than_its_time(
        bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]]) -> None:  # fmt: skip
    """The agent's loop reads a CPU's running slice only between switches;
    one left out (mid-switch at every try) is short of the slice so far, and
    the sample after holds it whole: a one-thread engine alone on its CPU
    read its whole slice (tens of milliseconds) in a 1 ms sample. Forced: the
    engine's CPU is read mid-switch for 20 readings in a row, mid-window (the
    writer held off 20 ms, as a loaded guest's vCPU can be), so that the slice
    left out is more than a sample long whatever else runs on that CPU. That
    time is carried
    into the samples after, as far as they have room: every sample within
    the engine's one thread, the window's mean its own."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    p = start_group(busy_threads(1, cpu=cpu))
    group.append(p)
    counters = bpf_groups.counters
    entries = counters._cpu_run
    mid_switch: list[float] = []  # the readings taken mid-switch
    edges: list[tuple[float, float]] = []

    def mid_switch_once() -> None:
        now = time.monotonic()
        edges.append((now, process_cpu_seconds(p.pid)))
        # From a second into the window (an emulated guest's loop reads far
        # fewer than 1000 a second), for 20 readings.
        due = len(edges) > 1 and now - edges[1][0] > 1.0 and len(mid_switch) < 20
        if due:
            mid_switch.append(now)
        counters._cpu_run = MidSwitch(entries, cpu) if due else entries  # type: ignore[assignment]

    ws = sampler_of(bpf_groups, p.pid, 1000)
    ws.kernel_samples = False
    try:
        with after_each_reading(bpf_groups, mid_switch_once):
            ws.prime(0)
            summary = ws.run_window(3.0)
    finally:
        counters._cpu_run = entries
    assert len(mid_switch) == 20 and edges[-1][0] > mid_switch[-1]  # taken, and read whole after
    cores = cores_of(summary.shards[0])
    (t0, s0), (t1, s1) = edges[0], edges[-1]
    assert cores.max <= 1.01
    # What was carried waits for room (the engine's CPU shared with the
    # test's other processes): some of it may be after the window (tens of
    # milliseconds here, over 100 in an emulated guest).
    carried = bpf_groups._specs["w"].carried
    assert cores.mean + carried / (t1 - t0) == pytest.approx((s1 - s0) / (t1 - t0), rel=0.03)


def test_samples_written_over_are_said_and_their_time_kept(ring: sched.KernelShardSampler,
                                                           group: list[subprocess.Popen[str]],
                                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Stalled past the ring (4096 samples, 4.1 s at 1000 Hz): the samples
    written over are lost, their time is not: the next sample read covers it."""
    caplog.set_level(logging.WARNING)
    pgid = busy_group(group)
    ws = sampler_of(ring, pgid, 1000)
    ws.raw_wanted = True
    ws.prime(0)
    assert ring.ring is not None
    kernel_ring, stall_from = ring.ring, [0]

    def past_the_ring() -> bool:
        # Held till the kernel wrote the ring over and 900 samples more, not
        # for a fixed time: an emulated guest's timer skips periods (sid's x86
        # guest wrote under 4096 samples in 5 s, and nothing was written over).
        if not stall_from[0]:
            stall_from[0] = kernel_ring.written()
        return kernel_ring.written() - stall_from[0] >= kernel_ring.ring_len + 900

    before = time.monotonic(), process_cpu_seconds(pgid)
    with stalled_once(ring, lambda: True, 60.0, until=past_the_ring) as reads:
        summary = ws.run_window(6.0)
    after = time.monotonic(), process_cpu_seconds(pgid)
    assert "some were written over" in caplog.text
    assert sum(r.lost for r in reads) > 900
    assert summary.raw is not None
    [series] = msgspec.json.decode(summary.raw)["shards"]
    seconds = np.array(series["cpu_cores"]["us"]) / 1e6
    # All the window's time is in its samples (the 900 periods and more
    # written over included), the gap's in one of them, up to the last sample
    # before its last read of the ring: the window's 6 s or more. What that
    # read and the summary take after it is the next window's first sample's:
    # 0.04 s here, about 0.4 s in the emulated guests (trixie: 6.05 s of
    # samples in a window of 6.55).
    assert 6.0 - 0.1 <= float(seconds.sum()) <= summary.window.end - summary.window.start + 0.01
    assert float(seconds.max()) > 0.8
    assert cores_of(summary.shards[0]).mean == pytest.approx((after[1] - before[1]) / (after[0] - before[0]), rel=0.05)


@pytest.mark.parametrize("way", ["from a task", "by each CPU's tick"])
def test_the_machine_s_cpu_is_what_proc_stat_counts(way: str, group: list[subprocess.Popen[str]],
                                                    accuracy: AccuracyLog,
                                                    request: pytest.FixtureRequest) -> None:  # fmt: skip
    """One core busy: the kernel's samples of the machine, against /proc/stat
    read after the first and last samples; no sample above 100%. Each CPU's
    run queue found both ways: from any task, through its task group (to
    7.1), and by each CPU's own tick (7.2's way, asked for elsewhere)."""
    ring = sampling(request.getfixturevalue("bpf_groups" if way == "from a task" else "bpf_groups_fallbacks"))
    if way != "from a task":
        assert any("run queue by its tick" in note for note in ring.programs.notes), ring.programs.notes
    ws = sampler_of(ring, busy_group(group), 100)
    ws.prime(0)
    if ring.agent_samples_why is not None:  # seen before this test: said in the harness's output
        pytest.skip(ring.agent_samples_why)
    edges: list[tuple[float, procfs.CpuTimes, int]] = []  # when read, the counters, the online CPUs
    final = 0.0

    def truth() -> None:
        if time.monotonic() >= final:
            data = procfs.read_bytes(PROC / "stat")
            edges.append((time.monotonic(), procfs.parse_cpu_times(data), procfs.count_cpus(data)))

    with after_each_reading(ring, truth):
        ws.prime(0)
        final = time.monotonic() + 3.0
        summary = ws.run_window(3.0)
    (t0, first, _), (t1, last, online) = edges[0], edges[-1]
    if summary.machine.cpu_percent is None and ring.agent_samples_why is not None:
        pytest.skip(ring.agent_samples_why)  # this kernel's samples cannot read it: the agent's loop samples
    # The busy counters over the online CPUs' time, as docs/sampling.md defines
    # the kernel's samples of the machine. Not over the counters' own sum: idle
    # is counted exactly there and busy a tick at a time, and beside an emulator
    # the sum ran 3% ahead of the clock: the samples read 97.1% against 93.5%
    # over the sum (a guest's 49.8 against 53.4 while its host was busy), and
    # within 0.2 points of the busy counters over the clock.
    expected = 100 * (last.busy - first.busy) / (os.sysconf("SC_CLK_TCK") * online * (t1 - t0))
    cpu = cpu_of(summary)
    accuracy.record(f"machine CPU mean, 100 Hz, run queues {way}", cpu.mean, expected, 0.03)
    assert cpu.mean == pytest.approx(expected, abs=3.0)
    assert cpu.mean > 100 / len(os.sched_getaffinity(0)) * 0.9
    assert cpu.max <= 100.0


def test_more_sets_of_shards_than_a_sample_holds_are_sampled_by_the_agent(
    ring: sched.KernelShardSampler, group: list[subprocess.Popen[str]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    assert ring.ring is not None
    sleepers = [subprocess.Popen(["sleep", "60"], process_group=0) for _ in range(ring.ring.ring_slots + 1)]
    try:
        specs = [ShardSpec(f"s{p.pid}", Selector.parse(f"pgid:{p.pid}")) for p in sleepers]
        ws = WindowSampler(PROC, BackendChoice("bpf", None), ring, specs, hz=20, node="ring")
        ws.prime(0)
        summary = ws.run_window(1.0)
        # The agent's loop takes at most a sample a slot, and skips the slots
        # it was late for (docs/sampling.md): 17 of 20 in a guest beside another.
        assert 1 <= summary.window.samples <= 20
        assert summary.backend_reason is not None and "by the agent" in summary.backend_reason
        assert "more than a kernel sample holds" in caplog.text
        ring.discover([], ProcessTable.walk(PROC))
        ws.specs = [ShardSpec("w", Selector.parse(f"pgid:{busy_group(group)}"))]
        summary = ws.run_window(1.0)
        assert summary.backend_reason is None  # the kernel samples again
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


@contextmanager
def every_read(groups: sched.KernelShardSampler) -> Iterator[list[sched.KernelSamples]]:
    """Each read of the kernel's samples, as it comes."""
    take, reads = groups.take_kernel_samples, list[sched.KernelSamples]()

    def recorded() -> sched.KernelSamples:
        reads.append(got := take())
        return got

    groups.take_kernel_samples = recorded  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        del groups.take_kernel_samples


@pytest.mark.parametrize("backend", ["bpf", "proc"])
@pytest.mark.parametrize("selected", [False, True], ids=["busiest-groups", "a-group"])
def test_the_first_window_holds_its_own_samples_alone(ring: sched.KernelShardSampler,
                                                      group: list[subprocess.Popen[str]], backend: str,
                                                      selected: bool) -> None:  # fmt: skip
    """`nodesampler sample --hz 10 --duration 1` is one window of 10 samples
    and 1 s, whatever finds its groups: the second spent ranking the busiest
    (no --group) once leaked into the kernel backend's window (30 samples in
    a 2 s window)."""
    from sampler.shards.proc_shards import ProcShardSampler

    specs = [ShardSpec("w", Selector.parse(f"pgid:{busy_group(group)}"))] if selected else None
    shards = ring if backend == "bpf" else ProcShardSampler(PROC)
    ws = WindowSampler(PROC, BackendChoice(backend, None), shards, specs, hz=10, node="first")
    with every_read(ring) as reads:
        ws.prime(0.5)  # as the command primes: a wait between two walks where no group is named
        primed_at = ws._last_sample_at
        assert primed_at is not None
        del reads[:]  # the priming read's: taken before the sampler's first readings
        first = ws.run_window(1.0)
        in_first = len(reads)
        second = ws.run_window(1.0)  # and the next follows it, with its own
    windows = (first.window, second.window)
    if backend == "proc":  # the agent's loop takes each sample at its time
        assert [w.samples for w in windows] == [10, 10]
        # A window ends at its last sample, which a slow loop takes late (74 ms on CI's
        # emulated arm64 guest): by less than a period, or its slot would have been skipped.
        assert all(1.0 - 0.05 <= w.end - w.start < 1.0 + 0.1 for w in windows), windows
    else:
        # Each window holds what the kernel wrote after the one before, and
        # nothing of the wait before it: 10 samples in 1 s, or 9 where the
        # kernel's timer skipped a period (the next sample covers its time; CI
        # once, and this host one run in ten). Where the skipped one was a
        # window's last, that window ends at its ninth sample (0.9 s) and the
        # next one's first sample covers the period it left (1.1 s: CI saw
        # exactly that pair), so a window is a period short or long at most.
        taken = [sum(int((r.at > primed_at).sum()) for r in part) for part in (reads[:in_first], reads[in_first:])]
        assert [w.samples for w in windows] == taken
        assert all(9 <= w.samples <= 10 for w in windows), windows
        assert all(0.9 - 0.01 <= w.end - w.start <= 1.1 + 0.05 for w in windows), windows
        assert second.window.end - second.window.start <= 1.0 + 0.05 or first.window.end - first.window.start < 0.95
    # The second begins where the first ends, to the letter: overlapping windows are drawn one in two by the
    # hindsight view, and the two clocks read anew each window drifted 0.2 ms apart in an emulated guest.
    assert second.window.start == first.window.end


@contextmanager
def written_late(groups: sched.KernelShardSampler, seconds: float) -> Iterator[list[sched.KernelSamples]]:
    """The kernel's timer writes each sample `seconds` after its time, as an
    emulated guest's may: a read sees only those taken that long before it,
    the rest at a later read. Yields every sample as the kernel wrote it."""
    take, held, written = groups.take_kernel_samples, list[sched.KernelSamples | None]([None]), []

    def late() -> sched.KernelSamples:
        written.append(got := take())
        if held[0] is not None:
            got = joined(held[0], got)
        visible = got.at <= time.monotonic() - seconds
        held[0] = part(got, ~visible)
        return part(got, visible)

    groups.take_kernel_samples = late  # type: ignore[method-assign]
    try:
        yield written
    finally:
        del groups.take_kernel_samples


def part(samples: sched.KernelSamples, keep: np.ndarray) -> sched.KernelSamples:
    return sched.KernelSamples(samples.at[keep], samples.seconds[keep], samples.machine[keep], samples.steal[keep],
                               {wid: cores[keep] for wid, cores in samples.shards.items()}, samples.lost)  # fmt: skip


def joined(a: sched.KernelSamples, b: sched.KernelSamples) -> sched.KernelSamples:
    return sched.KernelSamples(np.concatenate([a.at, b.at]), np.concatenate([a.seconds, b.seconds]),
                               np.concatenate([a.machine, b.machine]), np.concatenate([a.steal, b.steal]),
                               {wid: np.concatenate([a.shards[wid], b.shards[wid]]) for wid in b.shards},
                               a.lost + b.lost)  # fmt: skip


def test_a_sample_due_at_the_window_s_end_and_written_late_is_the_window_s(
    ring: sched.KernelShardSampler, group: list[subprocess.Popen[str]]
) -> None:
    """A window whose last sample is due just before its end waits for the
    late write of it. The window here begins just after a sample, so that its
    tenth at 10 Hz is due as it ends, and is written 20 ms late: without the
    wait, the window held 9 and the next one the tenth."""
    ws = sampler_of(ring, busy_group(group), 10)
    assert ring.ring is not None
    before = ring.ring.written()
    while ring.ring.written() == before:
        pass  # the kernel's next sample: written into shared memory, nothing to wait on
    with written_late(ring, 0.02) as written:
        ws.prime(0)
        primed_at, window_from = ws._last_sample_at, time.monotonic()
        assert primed_at is not None
        first = ws.run_window(1.0)
        second = ws.run_window(1.0)
    at = np.concatenate([w.at for w in written])
    taken_by_its_end = int(((at > primed_at) & (at <= window_from + 1.0)).sum())
    assert first.window.samples >= taken_by_its_end >= 9  # 9: a period the timer skipped
    assert second.window.start == first.window.end


def out_of_order(at: np.ndarray, busy: np.ndarray, cpus: np.ndarray) -> int:
    """Samples that cannot follow the one before in a ring read in order: a
    time not after its predecessor's, or less busy time over the same CPUs (an
    entry read from the ring's lap before the count said, or torn by a write)."""
    same_cpus = cpus[1:] == cpus[:-1]
    return int(np.count_nonzero(np.diff(at) <= 0) + np.count_nonzero((np.diff(busy) < 0) & same_cpus))


def _compiled(gcc: str, source: Path, binary: Path) -> str | None:
    """None when gcc built `binary`, else what it said."""
    try:
        subprocess.run([gcc, "-O2", "-Wall", "-Werror", "-o", str(binary), str(source)], check=True,
                       capture_output=True, text=True, cwd=binary.parent)  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        return f"{e} {(getattr(e, 'stderr', '') or '')[-500:]}"
    return None


def ring_reader(tmp_path: Path) -> tuple[Path | None, str]:
    """tests/ring_reader.c compiled here (the guests' images carry gcc for
    it), or None and why when the machine's C toolchain cannot build even an
    empty program (Debian sid's gcc 16 and binutils snapshot, December 2026:
    "collect2: cannot find 'ld'"): the test then checks the agent's reader
    alone, and says so. ring_reader.c itself not compiling fails the test."""
    # By its real path, in a writable folder: gcc finds its cc1 relative to
    # where it runs from (a bare "gcc" with no PATH, a guest's init, or
    # /bin/gcc on a merged /usr, points it elsewhere).
    found = shutil.which("gcc")
    gcc = os.path.realpath(found) if found else "gcc"
    empty = tmp_path / "empty.c"
    empty.write_text("int main(void) { return 0; }\n")
    if (broken := _compiled(gcc, empty, tmp_path / "empty")) is not None:
        return None, f"this machine's C toolchain builds nothing: {broken}"
    binary = tmp_path / "ring_reader"
    if (said := _compiled(gcc, Path(__file__).parent / "ring_reader.c", binary)) is not None:
        if REQUIRE_BPF:
            pytest.fail(f"NODESAMPLER_REQUIRE_BPF=1 and tests/ring_reader.c does not compile: {said}")
        pytest.skip(f"tests/ring_reader.c does not compile: {said}")
    return binary, ""


def test_the_ring_s_publication_holds_at_its_highest_rate(
    ring: sched.KernelShardSampler, group: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    """The kernel writes a sample every 10 us (the cpu-clock's floor, the most
    the ring takes) for 3 s, and until each reader has read new samples often
    enough (a loaded machine gives them fewer reads a second: 145 of the 300
    asked in an arm64 guest beside another), while two readers read the ring
    as fast as they can: the agent's own (Python: microseconds between its loads) and the same
    steps in C (tests/ring_reader.c: nanoseconds, the window a publication out
    of order would show in). Every sample either reads follows the one before
    (none read before the kernel finished it, none torn by its next lap), and
    every sample written is read or counted lost (bpf/sched_groups.bpf.c's
    ordered_add, sampler/kernel/memory_order.py)."""
    reader, why_not = ring_reader(tmp_path)
    sampler_of(ring, busy_group(group), 1000).prime(0)  # a watched slot: its column read too
    samples, maps = ring.ring, ring.programs.maps
    assert samples is not None
    samples.stop()
    written_from = samples.written()
    fds = (maps["sample_head"].fd, maps["sample_time"].fd)
    agent_reads, c_reads = 300, 1_000  # each reader's races with the writer, at least
    fast = None if reader is None else subprocess.Popen(
        [str(reader), *map(str, fds), str(samples.ring_len), "3", str(c_reads + 1)], pass_fds=fds,
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    samples.start(100_000)
    reads: list[RingSamples] = []
    try:
        until, limit = time.monotonic() + 3.0, time.monotonic() + 63.0
        # The kernel writes on till both readers are done: the C reader counts a read only where it found new samples.
        while time.monotonic() < until or len(reads) <= agent_reads or (fast is not None and fast.poll() is None):
            assert time.monotonic() < limit, f"{len(reads)} reads in a minute"
            reads.append(samples.take(ring._slots))
    finally:
        samples.stop()
    reads.append(samples.take(ring._slots))
    written = samples.written() - written_from
    fast_out = fast.communicate(timeout=60)[0] if fast is not None else f"not run: {why_not}"
    assert fast is None or fast.returncode == 0, fast_out
    at, busy, cpus = (np.concatenate([getattr(r, name) for r in reads]) for name in ("at", "busy", "cpus"))
    read, lost = len(at), sum(r.lost for r in reads)
    print(f"publication: {written} samples written; the agent's reader: {len(reads)} reads, {read} read, "
          f"{lost} lost; C: {fast_out.strip()}")  # fmt: skip
    assert out_of_order(at[::-1], busy[::-1], cpus[::-1]) > 0  # the count sees disorder where there is some
    assert out_of_order(at, busy, cpus) == 0
    assert read + lost == written
    # The writer and the readers raced, many times (the emulated arm64 guest: 32,608 samples, 1,235 and 7,179 reads).
    assert read > 10_000 and len(reads) > agent_reads
    if fast is None:
        return  # the C reader said why it did not run, above
    fast_read, fast_lost, disorder, fast_reads = map(int, fast_out.split()[1::2])
    assert disorder == 0
    assert fast_read > 10_000 and fast_reads > c_reads
