"""The kernel backend, loaded into this kernel, on real workloads.

Needs root (CI is root). With NODESAMPLER_REQUIRE_BPF=1 a test that cannot
load the programs fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from sampler.backend import BackendChoice, open_backend
from sampler.backend_unavailable import BackendUnavailable
from sampler.kernel import build, sched
from sampler.kernel.headers import kernel_version_code
from sampler.kernel.program_stats import program_stats
from sampler.shards.proc_shards import ProcShardSampler
from sampler.shards.selectors import ProcessTable, Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from tests.conftest import REQUIRE_BPF, AccuracyLog
from tests.heartbeats import cores_of
from tests.workloads import (
    BURN_ONE_CORE,
    FORKER,
    PROC,
    QUARTER_WORKERS,
    GroupTruth,
    after_each_reading,
    group_cpu_at,
    group_members,
    start_group,
)
from wire.schema import ProgramCost

pytestmark = pytest.mark.kernel

# The agent's default window. A sample reads the scheduler's runtime, which
# lags a running task by up to a tick (and the cpu-clock tick by up to 10 ms):
# tens of milliseconds at a window's edge, ~1% of a 0.75-core group over 5 s.
WINDOW_S = 5.0
HZ = 10


def spec(pgid: int, wid: str = "w") -> ShardSpec:
    return ShardSpec(wid, Selector.parse(f"pgid:{pgid}"))


def windows_against_truth(groups: sched.KernelShardSampler, pgid: int, n: int) -> list[tuple[float, float]]:
    """(window mean, truth) for n consecutive windows. The truth is read right
    after the sampler's own reading at each window's edge (the priming sample,
    then every window's last), so both cover the same interval: read after the
    window returned, a bursty group's phase and a slow machine (emulation) move
    the truth by percents. A window's last sample is the one at or after its
    final slot (a sampler that fell behind skips slots, so samples are not
    counted)."""
    edges: list[tuple[float, float]] = []  # (time, the group's CPU seconds) at each window's edge
    at_edge: tuple[float, float] | None = None
    final_slot = 0.0
    members = group_members(pgid)  # walked here: under emulation a walk takes 140-280 ms

    def truth() -> None:
        nonlocal at_edge
        if time.monotonic() >= final_slot:
            at_edge = group_cpu_at(pgid, members)

    ws = WindowSampler(PROC, BackendChoice("bpf", None), groups, [spec(pgid)], hz=HZ)
    out: list[tuple[float, float]] = []
    with after_each_reading(groups, truth):
        ws.prime(0)
        assert at_edge is not None
        edges.append(at_edge)
        for _ in range(n):
            final_slot, at_edge = time.monotonic() + WINDOW_S, None
            [shard] = ws.run_window(WINDOW_S).shards
            assert at_edge is not None
            (t0, s0), (t1, s1) = edges[-1], at_edge
            edges.append(at_edge)
            out.append((cores_of(shard).mean, (s1 - s0) / (t1 - t0)))
    return out


@pytest.mark.parametrize("code", [BURN_ONE_CORE, QUARTER_WORKERS], ids=["one-core", "three-quarter-workers"])
def test_steady_workloads_every_window_after_the_first_within_3_percent(
    bpf_groups: sched.KernelShardSampler,
    group: list[subprocess.Popen[str]],
    code: str,
    monkeypatch: pytest.MonkeyPatch,
    accuracy: AccuracyLog,
    request: pytest.FixtureRequest,
) -> None:
    p = start_group(code)
    group.append(p)
    results = windows_against_truth(bpf_groups, p.pid, 3)
    for measured, truth in results[1:]:
        accuracy.record(f"window mean, {request.node.callspec.id}", measured, truth, 0.03)
    for measured, truth in results[1:]:
        assert truth > 0.2  # it ran: a loaded machine may give it less than it asks for
        assert measured == pytest.approx(truth, rel=0.03), results


def test_forked_children_are_counted_from_their_first_slice(
    bpf_groups: sched.KernelShardSampler,
    group: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    accuracy: AccuracyLog,
) -> None:
    """A leader forks a 15 ms child every 20 ms: no walk ever sees most of
    them, the kernel counts each from its first slice."""
    p = start_group(FORKER)
    group.append(p)
    [(measured, truth)] = windows_against_truth(bpf_groups, p.pid, 1)
    accuracy.record("window mean, forker", measured, truth, 0.05)
    assert truth > 0.6
    assert measured == pytest.approx(truth, rel=0.05)


@pytest.mark.parametrize("code", [BURN_ONE_CORE, QUARTER_WORKERS], ids=["one-core", "three-quarter-workers"])
def test_backends_agree_on_steady_workloads(
    bpf_groups: sched.KernelShardSampler,
    group: list[subprocess.Popen[str]],
    code: str,
    accuracy: AccuracyLog,
    request: pytest.FixtureRequest,
) -> None:
    p = start_group(code)
    group.append(p)
    proc_shards = ProcShardSampler(PROC)
    table = ProcessTable.walk(PROC)
    for g in (bpf_groups, proc_shards):
        g.discover([spec(p.pid)], table)
        g.sample()
    totals = {"bpf": 0.0, "proc": 0.0}
    start = time.monotonic()
    for k in range(1, 31):  # 3 s at 10 Hz, both backends at the same instants
        time.sleep(max(0.0, start + k / 10 - time.monotonic()))
        for name, g in (("bpf", bpf_groups), ("proc", proc_shards)):
            cores = g.sample()["w"].cores
            assert cores is not None
            totals[name] += cores
    accuracy.record(f"bpf vs /proc, {request.node.callspec.id}", totals["bpf"] / 30, totals["proc"] / 30, 0.05)
    assert totals["bpf"] / 30 > 0.5
    assert totals["bpf"] == pytest.approx(totals["proc"], rel=0.05)


def test_a_task_that_never_switches_out_is_credited_at_every_sample(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], accuracy: AccuracyLog
) -> None:
    p = start_group(BURN_ONE_CORE)
    group.append(p)
    bpf_groups.discover([spec(p.pid)], ProcessTable.walk(PROC))
    bpf_groups.sample()
    truth, each = GroupTruth(p.pid), GroupTruth(p.pid)
    start = last = truth.at
    readings, truths, seconds = [], [], 0.0
    for k in range(1, 21):
        time.sleep(max(0.0, start + k / 10 - time.monotonic()))
        cores = bpf_groups.sample()["w"].cores
        truths.append(each.cores())
        now = time.monotonic()
        assert cores is not None
        readings.append(cores)
        seconds, last = seconds + cores * (now - last), now
    real = truth.cores()
    # Without the cpu-clock tick a lone busy loop is credited only when it is
    # switched out: samples of 0 and then one of many cores. Each 100 ms
    # reading's own size follows how much CPU the loop got, which on a loaded
    # or emulated machine is not a whole core (0.23 with a core kept busy
    # beside the suite): each is held to at least half of what the kernel
    # counted for its interval, less a tick's lag of the truth's counters
    # (schedstat: 10 ms at HZ=100), and the sum to the truth.
    measured = seconds / (last - start)
    accuracy.record("never switches out, 2 s", measured, real, 0.05)
    assert all(r > t / 2 - 0.1 for r, t in zip(readings, truths, strict=True)), (readings, truths)
    assert max(truths) > 0.3  # it ran enough for the readings to show it
    assert measured == pytest.approx(real, rel=0.05), readings


def test_bpf_statistics_stay_off_unless_asked_for(bpf_groups: sched.KernelShardSampler) -> None:
    """BPF_ENABLE_STATS times every BPF program on the host: not ours to turn on by default."""
    # The run's shared backend (a load of its own costs 12-25 s in a guest);
    # before this module's tests that ask for statistics (bpf_groups_with_stats
    # holds them on to its end), and counted over this test's window alone.
    ws = WindowSampler(PROC, BackendChoice("bpf", None), bpf_groups, None, hz=10)
    ws.prime(0)
    before = program_stats(bpf_groups.programs.programs["on_tick"])
    summary = ws.run_window(0.3)
    after = program_stats(bpf_groups.programs.programs["on_tick"])
    assert summary.bpf == ProgramCost(dropped_forks=0)
    enabled = Path("/proc/sys/kernel/bpf_stats_enabled")
    if enabled.exists() and enabled.read_text().strip() == "0":  # nobody else holds them on either
        # The kernel counted no run of ours: statistics were off all along.
        assert after == before


# Forks enough that a child left in the map would show (each is added at
# fork and removed at exit); 2,000 rather than 5,000: the churn took 47 s of
# the arm64 guest's run.
FORK_CHURN = """
import os, sys
print("ready", flush=True)
sys.stdin.readline()
for _ in range(2000):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print("done", flush=True)
sys.stdin.readline()
"""


def test_pid_churn_leaves_the_task_map_bounded(bpf_groups_with_stats: sched.KernelShardSampler) -> None:
    bpf_groups = bpf_groups_with_stats  # the fork program's run count proves the churn happened
    p = subprocess.Popen([sys.executable, "-c", FORK_CHURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, process_group=0)  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline() == "ready\n"
        bpf_groups.discover([spec(p.pid)], ProcessTable.walk(PROC))
        assert bpf_groups.members.size() == 1
        forks_before = bpf_groups.program_stats()["raw_tracepoint__sched_process_fork"][1]
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline() == "done\n"
        # Every child was added at fork and removed at exit: only the leader is left.
        assert bpf_groups.members.size() == 1
        assert bpf_groups.dropped_forks() == 0
        forks = bpf_groups.program_stats()["raw_tracepoint__sched_process_fork"][1] - forks_before
        assert forks >= 2000
    finally:
        p.kill()
        p.wait()


CHILD_ON_DEMAND = """
import os, sys, time
print("ready", flush=True)
sys.stdin.readline()
pid = os.fork()
if pid == 0:
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    os._exit(0)
os.waitpid(pid, 0)
print(pid, flush=True)
sys.stdin.readline()
"""


def start_with_pid(pid: int, code: str) -> subprocess.Popen[str] | None:
    """Start a process given that pid, by setting the kernel's last pid (root)."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    p = start_group(code)
    if p.pid == pid:
        return p
    p.kill()
    p.wait()
    return None  # another process took it first


def test_reused_pid_is_not_credited_to_its_previous_group(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]]
) -> None:
    leader = subprocess.Popen([sys.executable, "-c", CHILD_ON_DEMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, process_group=0)  # fmt: skip
    assert leader.stdin is not None and leader.stdout is not None
    try:
        assert leader.stdout.readline() == "ready\n"
        bpf_groups.discover([spec(leader.pid)], ProcessTable.walk(PROC))
        bpf_groups.sample()
        leader.stdin.write("fork\n")
        leader.stdin.flush()
        child = int(leader.stdout.readline())
        # The child was counted (the kernel knew it from its fork) and is gone.
        assert bpf_groups.sample()["w"].cores is not None
        keys = bpf_groups.members.pids()
        assert child not in keys and leader.pid in keys
        reuser = None
        for _ in range(5):
            reuser = start_with_pid(child, BURN_ONE_CORE)
            if reuser is not None:
                break
        if reuser is None:
            pytest.fail(f"could not get pid {child} back through ns_last_pid")
        group.append(reuser)
        bpf_groups.sample()
        time.sleep(1.0)  # the new process burns a core meanwhile
        cores = bpf_groups.sample()["w"].cores
        assert cores is not None and cores < 0.05
        assert child not in bpf_groups.members.pids()
    finally:
        leader.kill()
        leader.wait()


def test_overlapping_watches_each_get_the_whole_group(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]]
) -> None:
    p = start_group(BURN_ONE_CORE)
    group.append(p)
    specs = [spec(p.pid, "by-pgid"), ShardSpec("by-pid", Selector.parse(f"pid:{p.pid}"))]
    bpf_groups.discover(specs, ProcessTable.walk(PROC))
    bpf_groups.sample()
    time.sleep(0.5)
    r = bpf_groups.sample()
    assert r["by-pgid"].cores == pytest.approx(r["by-pid"].cores)
    assert r["by-pgid"].cores is not None and r["by-pgid"].cores > 0.5


def test_program_cost_is_in_the_summary_when_asked_for(bpf_groups_with_stats: sched.KernelShardSampler) -> None:
    ws = WindowSampler(PROC, BackendChoice("bpf", None), bpf_groups_with_stats, None, hz=10)
    ws.prime(0)
    summary = ws.run_window(0.5)
    assert summary.backend == "bpf"
    assert summary.bpf is not None and summary.bpf.programs is not None
    programs = summary.bpf.programs
    assert set(programs) == loaded_programs(bpf_groups_with_stats)
    tick = programs["on_tick"]
    assert tick.runs > 0 and tick.run_time_ns > 0 and tick.ns_per_run is not None and tick.ns_per_run > 0
    assert summary.bpf.dropped_forks == 0


# --- how sched_switch is attached ----------------------------------------------------


def test_sched_switch_is_attached_typed_where_the_kernel_names_it(bpf_groups: sched.KernelShardSampler) -> None:
    """Every kernel we run on (5.10 and later, with BTF) names the tracepoint
    in its BTF: the switch program is tp_btf, whose reads of the tasks are
    plain loads, and no fallback was noted."""
    assert "on_switch" in bpf_groups.programs.programs and "on_switch_raw" not in bpf_groups.programs.programs
    assert not any("raw tracepoint" in note for note in bpf_groups.programs.notes)


def test_the_raw_tracepoint_fallback_counts_the_same(
    bpf_groups_fallbacks: sched.KernelShardSampler,
    group: list[subprocess.Popen[str]],
    accuracy: AccuracyLog,
) -> None:
    """Where tp_btf cannot load, sched_switch is a raw tracepoint (each read of
    a task through a helper): the same counts, on a group that switches often."""
    groups = bpf_groups_fallbacks
    assert "on_switch_raw" in groups.programs.programs and "on_switch" not in groups.programs.programs
    assert any("sched_switch attached as a raw tracepoint (asked for)" in n for n in groups.programs.notes)
    p = start_group(QUARTER_WORKERS)
    group.append(p)
    results = windows_against_truth(groups, p.pid, 2)
    measured, truth = results[1]
    accuracy.record("window mean, raw sched_switch, three-quarter-workers", measured, truth, 0.03)
    assert truth > 0.2  # it ran: a loaded machine may give it less than it asks for
    assert measured == pytest.approx(truth, rel=0.03), results


# r0 = *(u64 *)(r1 + 800): sched_switch has no 101st argument. exit.
REFUSED_INSNS = bytes([0x79, 0x10, 0x20, 0x03, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])


def test_a_tp_btf_program_the_verifier_refuses_says_why() -> None:
    """The loader's own tp_btf loading: a refused program is an OSError that
    carries the verifier's words (the agent then falls back to the raw
    tracepoint, with them in its log); nothing stays loaded. (On 5.10 the
    first try is refused for RLIMIT_MEMLOCK, the maps this process's tests
    hold counting against it: the loader lifts it and tries again.)"""
    need_root()
    from sampler.kernel import tp_btf

    insns = REFUSED_INSNS
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as e:
        tp_btf.load_and_attach(insns, "refused", "sched_switch")
    assert "loading refused as tp_btf/sched_switch" in str(e.value) and e.value.errno == 13
    assert "argument" in str(e.value) or "invalid" in str(e.value), str(e.value)
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    with pytest.raises(OSError, match="the kernel's BTF has no tracepoint no_such_tracepoint"):
        tp_btf.load_and_attach(insns, "nowhere", "no_such_tracepoint")


class CompiledRefused:
    """bcc's BPF object, as attach_switch uses it, with an on_switch the verifier refuses."""

    def __init__(self) -> None:
        self.raw_attached: list[tuple[bytes, bytes]] = []

    def dump_func(self, name: bytes) -> bytes:
        assert name == b"on_switch"
        return REFUSED_INSNS

    def attach_raw_tracepoint(self, tp: bytes, fn_name: bytes) -> None:
        self.raw_attached.append((tp, fn_name))


def test_a_switch_program_refused_as_tp_btf_is_attached_raw_with_the_reason() -> None:
    """The loader's fallback, against this kernel's verifier: on_switch refused
    as tp_btf, on_switch_raw is attached to the raw tracepoint instead, and the
    note for the agent's log carries the verifier's reason."""
    need_root()
    compiled = CompiledRefused()
    programs, attachments, note = build.attach_switch(compiled, raw=False)
    assert programs == {} and attachments == []
    assert compiled.raw_attached == [(b"sched_switch", b"on_switch_raw")]
    assert note is not None
    assert note.startswith("sched_switch attached as a raw tracepoint (loading on_switch as tp_btf/sched_switch")
    assert "invalid bpf_context access" in note or "argument" in note, note


# --- falling back -----------------------------------------------------------------


def loads_or_says_why(**kwargs: object) -> str:
    with pytest.raises(BackendUnavailable) as e:
        s = sched.load(PROC, **kwargs)  # type: ignore[arg-type]
        s.close()
    return str(e.value)


def auto_with_bcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> BackendChoice:
    """open_backend("auto") with a `bcc` of `source` ahead of the system's on
    the loader child's path (bcc is imported there alone): it falls back."""
    (tmp_path / "bcc").mkdir()
    (tmp_path / "bcc" / "__init__.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    choice, groups = open_backend("auto", PROC)
    assert choice.name == "proc" and isinstance(groups, ProcShardSampler) and choice.reason is not None
    return choice


def test_missing_bcc_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bcc that cannot be imported stands for a machine without."""
    choice = auto_with_bcc(tmp_path, monkeypatch, "raise ImportError('No module named bcc')\n")
    assert choice.reason is not None and "bcc is not installed" in choice.reason
    with pytest.raises(BackendUnavailable, match="bcc is not installed"):
        open_backend("bpf", PROC)


def test_a_loader_that_dies_is_a_reason_to_fall_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child that compiles exits without answering (here its bcc kills
    it): the agent falls back with what the child said on its way out."""
    choice = auto_with_bcc(tmp_path, monkeypatch, "import os, sys\nsys.stderr.write('bcc exploded\\n')\nos._exit(7)\n")
    assert choice.reason is not None and "the loader process failed" in choice.reason
    assert "bcc exploded" in choice.reason and "exit status 7" in choice.reason


LLVM_FATAL_ERROR = """
import os
PerfSWConfig = PerfType = None
class BPF:
    def __init__(self, src_file, cflags):
        os.write(2, b"error: /virtual/main.c:380:5: in function on_switch i32 (ptr): "
                    b"Invalid usage of the XADD return value\\n")
        os._exit(1)  # LLVM's report_fatal_error: no exception, the process ends
"""


def test_a_compiler_s_fatal_error_reaches_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLVM ends the compiling process itself on a fatal error (exit(1),
    sid's bcc 0.37 on a fetching add): what it printed while compiling is
    the reason the agent falls back with, not "no output"."""
    need_root()
    choice = auto_with_bcc(tmp_path, monkeypatch, LLVM_FATAL_ERROR)
    assert choice.reason is not None and "exit status 1" in choice.reason, choice.reason
    assert "Invalid usage of the XADD return value" in choice.reason


def loaded_programs(sampler: sched.KernelShardSampler) -> set[str]:
    """Every program, on_sample only where the kernel takes the samples
    (tests/test_kernel_samples.py says on which kernels it must)."""
    return set(build.PROGRAMS) - (set() if sampler.ring is not None else {"on_sample"})


def test_the_agent_never_holds_the_compiler(loads_in_children: ChildLoads) -> None:
    """bcc (and with it LLVM and clang) is loaded by the child that compiles,
    never by the agent, which gets the programs attached all the same."""
    r = loads_in_children.without_headers
    assert r.returncode == 0, r.stderr
    loaded = json.loads(r.stdout)
    assert loaded["modules"] == [] and loaded["libraries"] == [], r.stdout
    expected = set(build.PROGRAMS) - (set() if loaded["ring"] else {"on_sample"})
    assert loaded["programs"] == sorted(expected)


def program_ids(sampler: sched.KernelShardSampler) -> list[int]:
    ids = []
    for fd in sampler.programs.programs.values():
        fdinfo = Path(f"/proc/self/fdinfo/{fd}").read_text()
        ids.append(int(next(line.split()[1] for line in fdinfo.splitlines() if line.startswith("prog_id:"))))
    return ids


def test_closing_the_backend_unloads_its_programs(bpf_groups_with_stats: sched.KernelShardSampler) -> None:
    """The agent holds the only references the child handed over (no pins in
    bpffs): once it closes them, the kernel has none of the programs left."""
    import ctypes
    import errno

    from sampler.kernel.libbpf import libbpf

    # The module's backend with statistics, after the last test that reads
    # them: a load of its own cost an emulated guest 15-29 s.
    bpf_groups = bpf_groups_with_stats
    ids = program_ids(bpf_groups)
    assert len(ids) == len(loaded_programs(bpf_groups))
    lib = libbpf()
    lib.bpf_prog_get_fd_by_id.restype = ctypes.c_int
    fd = lib.bpf_prog_get_fd_by_id(ctypes.c_uint32(ids[0]))
    assert fd >= 0, "the program is loaded while the backend is open"
    os.close(fd)
    bpf_groups.close()
    # The kernel frees a detached program after a grace period, from a work
    # queue: nothing to wait on but the program's absence, asked for until then.
    def loaded(prog_id: int) -> bool:
        fd = lib.bpf_prog_get_fd_by_id(ctypes.c_uint32(prog_id))
        if fd >= 0:
            os.close(fd)  # a reference of our own: it would keep the program
            return True
        assert ctypes.get_errno() == errno.ENOENT
        return False

    deadline = time.monotonic() + 60
    left = ids
    while left and time.monotonic() < deadline:
        left = [i for i in left if loaded(i)]
        time.sleep(0.05)
    assert left == [], f"programs {left} still loaded a minute after close"


def test_empty_headers_directory_falls_back(tmp_path: Path) -> None:
    choice, _ = open_backend("auto", PROC, kernel_headers=tmp_path)
    assert choice.name == "proc"
    assert choice.reason is not None and f"no kernel headers in {tmp_path}" in choice.reason


def test_missing_btf_falls_back(tmp_path: Path) -> None:
    assert "kernel BTF unreadable" in loads_or_says_why(btf_path=tmp_path / "vmlinux")


def need_root() -> None:
    if os.geteuid() != 0:
        if REQUIRE_BPF:
            pytest.fail("NODESAMPLER_REQUIRE_BPF=1 and not root")
        pytest.skip("needs root")


# A mount namespace of the child's own where no kernel headers are: the
# distribution's places hidden under empty mounts.
WITHOUT_HEADERS = (
    "mount -t tmpfs none /lib/modules && { [ ! -d /usr/src ] || mount -t tmpfs none /usr/src; } "
    '&& exec "$0" -c "$1" "$2"'
)
# An agent's load: the reason where it cannot, else what the agent holds
# once loaded (modules and libraries of the compiler: none) and what it got.
LOAD = """
import json, logging, sys
from pathlib import Path
from sampler.kernel import sched
from sampler.backend_unavailable import BackendUnavailable
logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    sampler = sched.load(Path("/proc"), kernel_headers=sys.argv[1] or None)
except BackendUnavailable as e:
    print(e)
    raise SystemExit(0)
maps = open("/proc/self/maps").read()
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m == "bcc" or m.startswith("bcc.")),
    "libraries": sorted({line.split()[-1].rsplit("/", 1)[-1] for line in maps.splitlines()
                         if any(lib in line for lib in ("libbcc", "LLVM", "clang"))}),
    "programs": sorted(sampler.programs.programs), "ring": sampler.ring is not None}))
sampler.close()
"""


def load_without_headers(kernel_headers: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BCC_KERNEL_SOURCE"}
    argv = ["unshare", "--mount", "sh", "-c", WITHOUT_HEADERS, sys.executable, LOAD, kernel_headers]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).parent.parent)


BROKEN_PROGRAMS = {
    "broken.bpf.c": "int on_tick(struct bpf_perf_event_data *ctx) { return undeclared_thing; }\n",
    "noattach.bpf.c": "RAW_TRACEPOINT_PROBE(no_such_tracepoint_here) { return 0; }\n",
}


class ChildLoads(NamedTuple):
    """The module's loads that each end in a child of their own."""

    without_headers: subprocess.CompletedProcess[str]  # an agent's load, no kernel headers in sight
    installed_without_headers: subprocess.CompletedProcess[str]  # the same, asked for the installed ones
    broken: dict[str, str]  # why each of BROKEN_PROGRAMS does not load


@pytest.fixture(scope="module")
def loads_in_children(tmp_path_factory: pytest.TempPathFactory) -> ChildLoads:
    """The module's loads in children, all at once: each is mostly a compile
    or the compiler's start (10-34 s each in an emulated guest), and one
    after another they took a minute of the arm64 guest's run."""
    need_root()
    folder = tmp_path_factory.mktemp("broken")
    for name, text in BROKEN_PROGRAMS.items():
        (folder / name).write_text(text)
    with ThreadPoolExecutor(2 + len(BROKEN_PROGRAMS)) as pool:
        without = pool.submit(load_without_headers)
        installed = pool.submit(load_without_headers, "installed")
        broken = {name: pool.submit(loads_or_says_why, source=folder / name) for name in BROKEN_PROGRAMS}
        return ChildLoads(without.result(), installed.result(), {name: f.result() for name, f in broken.items()})


def test_loads_on_a_machine_without_kernel_headers(loads_in_children: ChildLoads) -> None:
    """The headers bpf/include/ ships are all the programs need: with none of
    the distribution's in sight the backend compiles and attaches; asked for
    the installed ones there, it says they are missing."""
    r = loads_in_children.without_headers
    assert r.returncode == 0 and r.stdout.startswith("{"), r.stdout + r.stderr
    assert "kernel backend compiled against bundled headers" in r.stderr
    r = loads_in_children.installed_without_headers
    assert r.stdout.startswith(f"no kernel headers installed for {os.uname().release}"), r.stdout + r.stderr


def test_loads_against_the_installed_headers_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    """The distribution's headers stay usable (`--kernel-headers installed`).
    NODESAMPLER_REQUIRE_HEADERS=1 (CI's host, and each guest once it has
    unpacked its kernel's headers) fails where there are none."""
    need_root()
    release = os.uname().release
    if not Path(f"/lib/modules/{release}/build").exists():
        if os.environ.get("NODESAMPLER_REQUIRE_HEADERS") == "1":
            pytest.fail(f"NODESAMPLER_REQUIRE_HEADERS=1 and no headers in /lib/modules/{release}/build")
        pytest.skip(f"no kernel headers installed for {release}")
    caplog.set_level("INFO", logger="sampler.kernel.sched")
    sched.load(PROC, kernel_headers="installed").close()
    assert f"kernel backend compiled against the installed headers in /lib/modules/{release}" in caplog.text


def test_kernel_version_code_from_a_release() -> None:
    assert kernel_version_code("6.1.0-18-amd64") == (6 << 16) + (1 << 8)
    assert kernel_version_code("5.10.209") == (5 << 16) + (10 << 8) + 209
    assert kernel_version_code("6.18.44-fc-v857") == (6 << 16) + (18 << 8) + 44
    assert kernel_version_code("4.19.300") == (4 << 16) + (19 << 8) + 255  # sublevel capped, as the kernel
    assert kernel_version_code("6.13-rc1") == (6 << 16) + (13 << 8)


def test_program_that_fails_to_compile_does_not_crash_auto(loads_in_children: ChildLoads) -> None:
    reason = loads_in_children.broken["broken.bpf.c"]
    assert "compiling or attaching broken.bpf.c failed" in reason and "undeclared" in reason


def test_program_that_fails_to_attach_falls_back(loads_in_children: ChildLoads) -> None:
    assert "compiling or attaching noattach.bpf.c failed" in loads_in_children.broken["noattach.bpf.c"]


def test_missing_capabilities_fall_back() -> None:
    """Root with an empty capability bounding set: no CAP_BPF, no CAP_SYS_ADMIN."""
    need_root()
    base = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-m", "nodesampler", "sample",
            "--duration", "0.1"]  # fmt: skip
    # Both at once: each is mostly the agent's imports (15 s in an emulated arm64 guest).
    asked_bpf = subprocess.Popen([*base, "--backend", "bpf"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    auto = subprocess.Popen([*base, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = asked_bpf.communicate(timeout=60)
    assert asked_bpf.returncode == 3, err
    assert "missing capabilities" in err
    out, err = auto.communicate(timeout=60)
    assert auto.returncode == 0, err
    assert '"backend": "proc"' in out and "missing capabilities" in out


def test_waits_for_a_cpu_from_the_kernel_histogram(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], accuracy: AccuracyLog
) -> None:
    """Two busy groups pinned to one CPU wait about half the window, of the
    order of a slice a wait; one alone next to nothing in all (its few waits,
    behind the tests' own threads, can each be as long as a contended one under
    emulation); the histogram's mean agrees with schedstat's."""
    from sampler.sources.runqueue import RunQueueWaitSampler
    from tests.test_runqueue import pinned_burner

    cpu = max(os.sched_getaffinity(0))
    a = pinned_burner(cpu)
    group.append(a)

    def window(pgids: list[int]) -> tuple[dict[str, dict[str, float] | None], dict[str, Any]]:
        specs = [spec(p, f"g{p}") for p in pgids]
        table = ProcessTable.walk(PROC)
        bpf_groups.discover(specs, table)
        members = {w.id: set(table.resolve(w.selector)) for w in specs}
        schedstat = RunQueueWaitSampler(PROC)
        bpf_groups.runqueue_waits()
        schedstat.read(members)
        time.sleep(2.0)  # the window itself: the groups run meanwhile
        return bpf_groups.runqueue_waits() or {}, schedstat.read(members)

    kernel_alone, fallback_alone = window([a.pid])
    b = pinned_burner(cpu)
    group.append(b)
    kernel, fallback = window([a.pid, b.pid])
    alone, alone_truth = kernel_alone[f"g{a.pid}"], fallback_alone[f"g{a.pid}"]
    assert alone is not None and alone_truth is not None
    # Alone, it waits only behind what else runs on its CPU: nothing much on
    # a quiet machine, half the window beside a hog; what schedstat counts,
    # but for a wait at each edge of the window (the kernel counts a wait
    # when the slice after it ends: tens of milliseconds under emulation).
    assert alone["total"] == pytest.approx(alone_truth["total"], rel=0.2, abs=0.1), (alone, alone_truth)
    for p in (a.pid, b.pid):
        k, f = kernel[f"g{p}"], fallback[f"g{p}"]
        assert k is not None and f is not None
        assert k["total"] > 0.5 and k["mean"] > 0.001, k  # half of 2 s or more, milliseconds a wait
        assert k["p50"] <= k["p99"] and k["p99"] > 0.001
        accuracy.record("wait per slice vs schedstat", k["mean"], f["mean"], 0.2)
        assert k["mean"] == pytest.approx(f["mean"], rel=0.2), (k, f)
        assert k["total"] == pytest.approx(f["total"], rel=0.2), (k, f)


def test_a_300_ms_stall_on_the_real_clock(
    bpf_groups: sched.KernelShardSampler, group: list[subprocess.Popen[str]], accuracy: AccuracyLog
) -> None:
    from tests.test_live_proc import assert_within_what_quarter_workers_can_use, window_with_a_stall

    p = start_group(QUARTER_WORKERS)
    group.append(p)
    stats, truth = window_with_a_stall(bpf_groups, "bpf", p.pid)
    accuracy.record("window mean with a 300 ms stall", stats["mean"], truth, 0.05)
    assert stats["mean"] == pytest.approx(truth, rel=0.05)
    assert_within_what_quarter_workers_can_use(stats)


def translated_instructions(prog_fd: int) -> bytes:
    """A loaded program's instructions as the verifier left them
    (BPF_OBJ_GET_INFO_BY_FD's xlated_prog_insns, through libbpf)."""
    import ctypes

    from sampler.kernel.libbpf import libbpf

    lib = libbpf()
    lib.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    info = (ctypes.c_uint8 * 256)()  # struct bpf_prog_info's first fields, the rest zero
    size = ctypes.c_uint32(len(info))
    assert lib.bpf_obj_get_info_by_fd(prog_fd, info, ctypes.byref(size)) == 0
    xlated_len = int.from_bytes(bytes(info[20:24]), "little")
    insns = ctypes.create_string_buffer(xlated_len)
    info = (ctypes.c_uint8 * 256)()
    info[20:24] = list(xlated_len.to_bytes(4, "little"))
    info[32:40] = list(ctypes.addressof(insns).to_bytes(8, "little"))
    size = ctypes.c_uint32(len(info))
    assert lib.bpf_obj_get_info_by_fd(prog_fd, info, ctypes.byref(size)) == 0
    return insns.raw


def test_counts_are_published_with_fully_ordered_atomics(bpf_groups: sched.KernelShardSampler) -> None:
    """From 5.12, every sequence number and the ring's count move by a
    fetching atomic (BPF_ATOMIC with BPF_FETCH: an exchange, arm64's SWPAL,
    fully ordered; on_sample's fences are exchanges too), never a plain
    one (STADD, which orders nothing on arm64): clang drops the fetch of an
    atomic whose result is unused (sampler/kernel/memory_order.py)."""
    if kernel_version_code(os.uname().release) < (5 << 16) + (12 << 8):
        pytest.skip("no fetching atomics before 5.12: the programs keep x86's order")
    programs = bpf_groups.programs.programs
    for name in ("on_switch", "on_switch_raw", "on_tick", "on_sample"):
        if name not in programs:
            continue
        code = translated_instructions(programs[name])
        atomics = [(code[i + 1], int.from_bytes(code[i + 4 : i + 8], "little", signed=True))
                   for i in range(0, len(code), 8) if code[i] == 0xDB]  # BPF_STX | BPF_ATOMIC | BPF_DW  # fmt: skip
        fetching = [imm for _regs, imm in atomics if imm & 0x01]  # BPF_FETCH
        assert len(fetching) >= 2, (name, atomics)  # a sequence's two moves; on_sample: its fences and its count
        # No fetching add (BPF_ADD | BPF_FETCH): this host's LLVM compiles one,
        # but LLVM 20 and later under bcc 0.32's CPU v1 end the compile on it.
        assert 0x01 not in fetching, (name, atomics)
    assert "on_sample" in programs or bpf_groups.ring is None
