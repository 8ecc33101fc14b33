from pathlib import Path

import pytest

from sampler.agent.config import ConfigError, parse_config
from sampler.shards.proc_shards import PAGE_SIZE, USER_HZ, ProcShardSampler, ShardReading, cpus_allowed
from sampler.shards.selectors import CMDLINE_PREFIX_BYTES, ProcessTable, Selector, ShardSpec, busiest_groups
from tests.fakeproc import FakeClock, FakeProc


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def spec(text: str, wid: str = "s0") -> ShardSpec:
    return ShardSpec(wid, Selector.parse(text))


def sampler_for(proc: FakeProc, *specs: ShardSpec) -> tuple[ProcShardSampler, FakeClock]:
    clock = FakeClock()
    s = ProcShardSampler(proc.root, clock)
    s.discover(list(specs), ProcessTable.walk(proc.root))
    return s, clock


def step(s: ProcShardSampler, clock: FakeClock, seconds: float = 1.0, wid: str = "s0") -> ShardReading:
    clock.advance(seconds)
    return s.sample()[wid]


def test_first_sample_reports_no_cores(proc: FakeProc) -> None:
    proc.add(100, utime=50, rss=10)
    s, clock = sampler_for(proc, spec("pgid:100"))
    r = step(s, clock)
    assert r.cores is None
    assert r.memory_bytes == 10 * PAGE_SIZE  # a gauge needs no previous reading


def test_all_processes_of_the_group_count_together(proc: FakeProc) -> None:
    proc.add(100, utime=0, rss=10)
    proc.add(101, pgrp=100, ppid=100, utime=0, rss=20)
    proc.add(102, pgrp=100, ppid=100, stime=0, rss=30)
    proc.add(200, utime=0)  # another group
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.set(101, pgrp=100, ppid=100, utime=USER_HZ, rss=20)
    proc.set(102, pgrp=100, ppid=100, stime=USER_HZ // 2, rss=30)
    proc.set(200, utime=10 * USER_HZ)
    r = step(s, clock, 2.0)
    assert r.cores == pytest.approx(0.75)
    assert r.memory_bytes == 60 * PAGE_SIZE


def test_vanished_process_is_skipped(proc: FakeProc) -> None:
    proc.add(100)
    proc.add(101, pgrp=100, ppid=1)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.remove(101)
    proc.set(100, utime=USER_HZ)
    assert step(s, clock).cores == pytest.approx(1.0)


def test_reused_pid_is_a_new_process_not_a_member(proc: FakeProc) -> None:
    proc.add(100)
    proc.add(101, pgrp=100, ppid=1, utime=10, start=1000)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    # 101 exited; a new process got pid 101, in the same group, with more CPU time.
    proc.set(101, pgrp=100, ppid=1, utime=5000, start=2000)
    r = step(s, clock)
    assert r.cores == pytest.approx(0.0)
    # The next walk makes it a member, from its reading at that walk on.
    s.discover([spec("pgid:100")], ProcessTable.walk(proc.root))
    proc.set(101, pgrp=100, ppid=1, utime=5000 + USER_HZ, start=2000)
    assert step(s, clock).cores == pytest.approx(1.0)


def test_counter_going_backwards_reports_nothing_for_that_sample(proc: FakeProc) -> None:
    proc.add(100, utime=1000)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.set(100, utime=500)
    assert step(s, clock).cores is None
    proc.set(100, utime=500 + USER_HZ)
    assert step(s, clock).cores == pytest.approx(1.0)


def test_half_written_member_stat_reports_nothing_for_that_sample(proc: FakeProc) -> None:
    proc.add(100)
    proc.add(101, pgrp=100)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.write_raw(101, b"101 (pyth")
    proc.set(100, utime=USER_HZ)
    assert step(s, clock).cores is None  # a member unread: the sum would be short


def test_reaped_children_count(proc: FakeProc) -> None:
    """Children forked and reaped between two samples are never seen; their
    time reaches the group through the reaper's cutime and cstime."""
    proc.add(100)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.set(100, utime=USER_HZ // 10, cutime=USER_HZ // 2, cstime=USER_HZ // 4)
    assert step(s, clock).cores == pytest.approx(0.85)


def test_reaping_a_watched_child_does_not_count_its_life_twice(proc: FakeProc) -> None:
    proc.add(100)
    proc.add(101, pgrp=100, ppid=100, utime=3600 * USER_HZ)  # a worker that ran for an hour
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.set(101, pgrp=100, ppid=100, utime=3600 * USER_HZ + USER_HZ)
    assert step(s, clock).cores == pytest.approx(1.0)
    # It used half a second more, exited, and its parent reaped it.
    proc.remove(101)
    proc.set(100, cutime=3601 * USER_HZ + USER_HZ // 2)
    assert step(s, clock).cores == pytest.approx(0.5)


def test_reap_seen_after_the_exit(proc: FakeProc) -> None:
    """The child is gone at one sample and its parent's cutime grows only at the
    next (the reap raced the reading): counted once, when it shows."""
    proc.add(100)
    proc.add(101, pgrp=100, ppid=100, utime=1000)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.remove(101)
    assert step(s, clock).cores == pytest.approx(0.0)
    proc.set(100, cutime=1000 + USER_HZ)
    assert step(s, clock).cores == pytest.approx(1.0)


def test_process_that_left_the_group_is_not_counted(proc: FakeProc) -> None:
    proc.add(100)
    proc.add(101, pgrp=100)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.set(101, pgrp=101, utime=10 * USER_HZ)  # setsid()
    assert step(s, clock).cores == pytest.approx(0.0)


def test_group_that_is_gone_reports_nothing(proc: FakeProc) -> None:
    proc.add(100)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.remove(100)
    assert step(s, clock) == ShardReading(None, None)


def test_missing_proc_reports_nothing(tmp_path: Path) -> None:
    s = ProcShardSampler(tmp_path / "absent")
    s.discover([spec("pgid:1")], ProcessTable.walk(tmp_path / "absent"))
    assert s.sample()["s0"] == ShardReading(None, None)


def test_members_keep_their_baseline_across_walks(proc: FakeProc) -> None:
    proc.add(100)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.set(100, utime=USER_HZ)
    s.discover([spec("pgid:100")], ProcessTable.walk(proc.root))  # a walk between two samples
    assert step(s, clock).cores == pytest.approx(1.0)


def test_selectors_resolve(proc: FakeProc) -> None:
    proc.add(100, comm="vllm", cmdline="vllm serve meta/llama-70b --tp 2", cgroup="/kubepods/pod-a/c1")
    proc.add(101, pgrp=100, cmdline="vllm worker", cgroup="/kubepods/pod-a/c1")
    proc.add(200, comm="sshd", cmdline="sshd -D", cgroup="/system.slice/ssh.service")
    proc.add(300, pgrp=299, cmdline="orphan group, leader gone", cgroup="/kubepods/pod-ab")
    t = ProcessTable.walk(proc.root)

    def pids(text: str) -> list[int]:
        return sorted(t.resolve(Selector.parse(text)))

    assert pids("pgid:100") == [100, 101]
    assert pids("pid:101") == [100, 101]
    assert pids("pid:999") == []
    assert pids("cmdline:llama-70b") == [100, 101]
    assert pids("cmdline:orphan") == []  # no live leader to match
    assert pids("cgroup:/kubepods/pod-a") == [100, 101]  # not pod-ab
    assert pids("cgroup:/kubepods") == [100, 101, 300]
    assert pids("cgroup:/") == [100, 101, 200, 300]


@pytest.mark.parametrize(
    "text", ["pgid:", "pgid:-1", "pgid:0", "pid:abc", "cmdline:(", "cgroup:relative", "name:x", "pgid"]
)
def test_bad_selectors(text: str) -> None:
    with pytest.raises(ValueError, match="selector"):
        Selector.parse(text)


def test_a_command_line_is_judged_on_its_first_32_kib(proc: FakeProc) -> None:
    """A tenant's 2 MB command line costs what 32 KiB does: the part past
    the prefix is never read, so a name written only there does not match."""
    padding = "x" * (CMDLINE_PREFIX_BYTES - len("vllm serve "))
    proc.add(100, cmdline=f"vllm serve {padding[:-20]} llama-70b")  # ends inside the prefix
    proc.add(200, cmdline=f"vllm serve {padding} llama-70b " + "y" * 2_000_000)  # starts past it
    t = ProcessTable.walk(proc.root)
    assert sorted(t.resolve(Selector.parse("cmdline:vllm serve .*llama-70b"))) == [100]
    line = t.cmdline(200)
    assert line is not None and len(line) == CMDLINE_PREFIX_BYTES


def test_a_leader_is_matched_once_while_its_command_line_stays(proc: FakeProc) -> None:
    """The walk before lends its verdicts: an unchanged leader is not searched
    again; a new command line, or a new process on the same pid, is."""
    searched: list[str] = []
    real = Selector.parse("cmdline:llama")
    assert real.pattern is not None
    pattern = real.pattern

    class Counting:
        def search(self, text: str) -> object | None:
            searched.append(text)
            return pattern.search(text)

    sel = Selector("cmdline", "llama", Counting())
    proc.add(100, cmdline="vllm serve llama")
    proc.add(200, cmdline="sshd -D")
    first = ProcessTable.walk(proc.root)
    assert first.resolve(sel) == [100]
    assert sorted(searched) == ["sshd -D", "vllm serve llama"]
    second = ProcessTable.walk(proc.root, first)
    assert second.resolve(sel) == [100] and len(searched) == 2  # nothing searched again
    proc.add(200, cmdline="llama too")  # the same process, a new command line
    proc.add(100, cmdline="vllm serve llama", start=999)  # the pid reused by a new process
    third = ProcessTable.walk(proc.root, second)
    assert sorted(third.resolve(sel)) == [100, 200]
    assert sorted(searched[2:]) == ["llama too", "vllm serve llama"]


@pytest.mark.parametrize("pattern", [r"(vllm)\\1", r"vllm(?=serve)", r"(?<!x)vllm"])
def test_a_pattern_re2_cannot_run_is_refused_at_config_load(pattern: str) -> None:
    config = f'[[shard]]\nid = "s0"\nselect = "cmdline:{pattern}"\n'.encode()
    with pytest.raises(ConfigError) as e:
        parse_config(config, "agent.toml")
    message = str(e.value)
    assert message.startswith("agent.toml: shard 1: selector") and "RE2" in message
    assert "\n" not in message  # one line


def test_busiest_groups() -> None:
    before = {1: 100, 2: 100, 3: 100}
    after = {1: 150, 2: 400, 3: 100, 4: 20}
    assert busiest_groups(before, after, 2, set()) == [2, 1]
    assert busiest_groups(before, after, 5, {2}) == [1, 4]


def test_ticks_a_sample_could_not_hold_are_carried_to_the_next(proc: FakeProc) -> None:
    """Counters move in ticks: three ticks seen in a 10 ms sample of a
    one-thread process are time of the samples around it. No sample reads
    more than its threads can use; nothing is dropped."""
    proc.add(100, utime=0, threads=1)
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock, 0.01)  # the first reading
    proc.set(100, utime=3, threads=1)  # 30 ms of CPU shows up at once
    readings = [step(s, clock, 0.01).cores for _ in range(4)]
    assert readings == pytest.approx([1.0, 1.0, 1.0, 0.0])
    # Two threads may use two cores: the same lump fits in fewer samples.
    proc.set(100, utime=7, threads=2)
    assert [step(s, clock, 0.01).cores for _ in range(3)] == pytest.approx([2.0, 2.0, 0.0])


def test_the_cpus_a_group_may_use_are_its_processes_affinity(proc: FakeProc) -> None:
    """Four threads pinned to one CPU (`taskset`: Cpus_allowed_list) can use
    one core however many the machine has: counters that jump by two
    seconds in a one-second sample (a tick's step) carry the rest into the
    next, never read as two cores. A process whose status cannot be read
    leaves the machine's CPUs as the bound."""
    proc.add(100, utime=0, threads=4)
    (proc.root / "100" / "status").write_text("Name:\tengine\nThreads:\t4\nCpus_allowed_list:\t3\n")
    s, clock = sampler_for(proc, spec("pgid:100"))
    step(s, clock)
    proc.set(100, utime=2 * USER_HZ, threads=4)
    assert step(s, clock).cores == pytest.approx(1.0)
    assert step(s, clock).cores == pytest.approx(1.0)  # the second carried into the next
    assert cpus_allowed(proc.root, [100], 64) == 1
    (proc.root / "100" / "status").write_text("Name:\tengine\nThreads:\t4\nCpus_allowed_list:\t0-3,8\n")
    proc.add(200)
    (proc.root / "200" / "status").write_text("Name:\tengine\nThreads:\t1\nCpus_allowed_list:\t8-9\n")
    assert cpus_allowed(proc.root, [100, 200], 64) == 6
    assert cpus_allowed(proc.root, [100, 200], 4) == 4  # never over the machine's
    assert cpus_allowed(proc.root, [300], 4) == 4  # gone: the machine's
