"""The kernel backend for engines: on-CPU time per watched process group,
counted in the kernel by `bpf/sched_groups.bpf.c` (bcc).

A sample reads one per-CPU counter per shard: its cost does not depend
on how many processes the machine runs. Userspace's part is membership: once
per window the walk of /proc says which processes belong to which shard, and
`discover` writes them into the kernel's `task_slot` map; processes forked
inside a group join it in the kernel, at fork.

`load` either returns a working sampler or raises `BackendUnavailable` with
the reason, checking in the order an operator would fix things: bcc,
capabilities, the kernel's BTF, a configured kernel tree, then compiling and
attaching.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sampler.backend_unavailable import BackendUnavailable
from sampler.kernel import btf, handoff, tp_btf
from sampler.shards.proc_shards import PAGE_SIZE, ShardReading, within_capacity
from sampler.shards.selectors import ProcessTable, ShardSpec
from sampler.sources import procfs
from sampler.sources.cpu_lists import format_cpu_list, parse_cpu_list

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "bpf" / "sched_groups.bpf.c"
# A kernel tree of the few headers bcc's helpers include (bpf/include/).
BUNDLED_HEADERS = SOURCE.parent
MAX_SLOTS = 256  # slot 0 is "not watched"; the kernel keeps a slot in one byte
# The program's struct cpu_run, one per CPU: the slice a CPU is running for a slot.
CPU_RUN = np.dtype([("start", "<u8"), ("since", "<u8"), ("task", "<u8"), ("slot", "<u4"), ("seq", "<u4"),
                    ("learnt", "<u4"), ("pad", "<u4"), ("spare", "<u8", 3)])  # fmt: skip
SNAPSHOT_TRIES = 3
TICK_NS = 10_000_000
WAIT_BUCKETS = 32  # log2 buckets of a wait in ns, as in the program


def log2_quantile(counts: np.ndarray, q: float) -> float:
    """The q-quantile of a log2 histogram (bucket b holds [2^b, 2^(b+1)) ns,
    bucket 0 also 0..1), interpolated linearly by rank within its bucket."""
    cumulative = np.cumsum(counts)
    rank = q * cumulative[-1]
    b = int(np.searchsorted(cumulative, rank))
    before = cumulative[b - 1] if b > 0 else 0.0
    lo, hi = (0.0 if b == 0 else 2.0**b), 2.0 ** (b + 1)
    within = (rank - before) / counts[b] if counts[b] else 0.0
    return lo + (hi - lo) * within

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39
# The programs as the kernel names them; sched_switch's is on_switch (tp_btf)
# or, where that cannot load, on_switch_raw (a raw tracepoint).
PROGRAMS = ("on_switch", "on_tick", "raw_tracepoint__sched_process_fork", "raw_tracepoint__sched_process_exit")
SWITCH_PROGRAMS = ("on_switch", "on_switch_raw")


@dataclass
class _KernelShard:
    spec: ShardSpec
    pids: list[int]
    pgids: list[int]
    command: str | None
    fresh: bool = True  # no reading to take a delta from yet
    threads: int = 1  # its processes' threads at the walk
    starts: dict[int, int] = field(default_factory=dict)  # pid -> its start time at the walk: the same process
    carried: float = 0.0  # seconds credited by the kernel that its threads could not have used yet
    late: float = 0.0  # seconds spent in slices the kernel saw late, not yet placed in a sample


def effective_capabilities(proc: Path) -> int:
    for line in procfs.read_bytes(proc / "self" / "status").split(b"\n"):
        if line.startswith(b"CapEff:"):
            return int(line.split()[1], 16)
    raise procfs.ProcParseError("no CapEff in /proc/self/status")


def kernel_version_code(release: str) -> int:
    """LINUX_VERSION_CODE of a kernel release (`6.1.0-18-amd64`, `5.10.209`):
    what a real tree's generated version.h would say, sublevel capped at 255."""
    numbers = []
    for part in release.split("-", 1)[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits) if digits else 0)
    major, minor, sub = (numbers + [0, 0, 0])[:3]
    return (major << 16) + (min(minor, 255) << 8) + min(sub, 255)


@dataclass(frozen=True)
class HeaderTree:
    """What bcc compiles against: its environment, extra flags, and a name for the log."""

    env: dict[str, str | None]  # None: unset while compiling
    cflags: list[str]
    name: str


INSTALLED = "installed"  # --kernel-headers installed: the distribution's, where bcc looks for them


def find_kernel_headers(configured: Path | str | None, release: str | None = None) -> HeaderTree:
    """The headers bcc compiles against, or BackendUnavailable.

    By default the few headers shipped in bpf/include/: the programs read no
    kernel struct through headers (offsets come from BTF), so no kernel's own
    are needed, and a machine without any loads the backend. Otherwise, as
    configured: a kernel tree (given to bcc as BCC_KERNEL_SOURCE), or
    `installed`: bcc's own search of /lib/modules/<release>/{build,source}
    (Debian splits its headers in two packages: both are needed).
    $BCC_KERNEL_SOURCE, set by the operator, is honoured as bcc would.
    """
    release = release or platform.release()
    if configured == INSTALLED:
        mod = Path("/lib/modules") / release
        if not ((mod / "build" / "include").is_dir() or (mod / "source" / "include").is_dir()):
            raise BackendUnavailable(
                f"no kernel headers installed for {release}: looked in {mod}/build and {mod}/source "
                "(install the distribution's linux-headers package, or leave --kernel-headers out for the bundled ones)"
            )
        return HeaderTree({"BCC_KERNEL_SOURCE": None}, [], f"the installed headers in {mod}")
    if configured is not None:
        tree = Path(configured)
        if not (tree / "include").is_dir():
            raise BackendUnavailable(f"no kernel headers in {tree} (configured): it has no include/ directory")
        return HeaderTree({"BCC_KERNEL_SOURCE": str(tree)}, [], f"the kernel tree {tree}")
    env = os.environ.get("BCC_KERNEL_SOURCE")
    if env:
        if not (Path(env) / "include").is_dir():
            raise BackendUnavailable(f"no kernel headers in BCC_KERNEL_SOURCE={env}: it has no include/ directory")
        return HeaderTree({}, [], f"the kernel tree {env} (BCC_KERNEL_SOURCE)")
    code = kernel_version_code(release)
    return HeaderTree({"BCC_KERNEL_SOURCE": str(BUNDLED_HEADERS)}, [f"-DLINUX_VERSION_CODE={code}"], "bundled headers")


def _enable_bpf_stats() -> int | None:
    """Turn on the kernel's per-program run time and count for as long as the
    returned fd is open (BPF_ENABLE_STATS, Linux 5.8), so that the agent's own
    cost is measured without leaving the kernel.bpf_stats_enabled sysctl on."""
    attr = (ctypes.c_uint32 * 32)()  # union bpf_attr, zeroed; enable_stats.type = BPF_STATS_RUN_TIME (0)
    try:
        return tp_btf.bpf(32, attr)  # BPF_ENABLE_STATS
    except OSError:
        return None


def _program_stats(fd: int) -> tuple[int, int] | None:
    """run_time_ns and run_cnt of a loaded program, from its fd's fdinfo (Linux 5.1)."""
    values = {}
    try:
        for line in procfs.read_bytes(f"/proc/self/fdinfo/{fd}").split(b"\n"):
            key, _, value = line.partition(b":")
            if key in (b"run_time_ns", b"run_cnt"):
                values[key] = int(value)
    except (OSError, ValueError):
        return None
    if len(values) != 2:
        return None
    return values[b"run_time_ns"], values[b"run_cnt"]


def compile_flags(offsets: dict[str, int], pid_max: int, cpus: int) -> list[str]:
    return [
        f"-DPID_MAX={pid_max}",
        f"-DNR_CPUS={cpus}",
        f"-DMAX_SLOTS={MAX_SLOTS}",
        f"-DTASK_PID_OFF={offsets['pid']}",
        f"-DTASK_TGID_OFF={offsets['tgid']}",
        f"-DTASK_RUNTIME_OFF={offsets['runtime']}",
        f"-DTASK_PICKED_RUNTIME_OFF={offsets['picked_runtime']}",
        f"-DTASK_POLICY_OFF={offsets['policy']}",
        f"-DTICK_NS={TICK_NS}",
        f"-DTASK_SIGNAL_OFF={offsets['signal']}",
        f"-DSIGNAL_LIVE_OFF={offsets['live']}",
        *([f"-DTASK_RUN_DELAY_OFF={offsets['run_delay']}"] if "run_delay" in offsets else []),
    ]


def read_pid_max(proc: Path) -> int:
    """The largest pid plus one: the size of the kernel's tgid-indexed map.
    Raising pid_max after the programs load leaves the new pids uncounted."""
    try:
        return int(procfs.read_bytes(proc / "sys" / "kernel" / "pid_max"))
    except (OSError, ValueError) as e:
        raise BackendUnavailable(f"cannot read pid_max: {e}") from None


def _compile(bpf_class: Any, source: Path, cflags: list[str], env: dict[str, str | None]) -> Any:
    """BPF(src_file=...) with clang's diagnostics captured from fd 2, so a
    failure's reason carries them instead of spilling onto the terminal."""
    saved_env = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    saved_fd = os.dup(2)
    with handoff.scratch_file("clang-stderr") as err:
        os.dup2(err.fileno(), 2)
        try:
            return bpf_class(src_file=str(source).encode(), cflags=cflags)
        except Exception as e:
            os.dup2(saved_fd, 2)
            err.seek(0)
            lines = [ln for ln in err.read().decode(errors="replace").splitlines() if "error" in ln]
            detail = "; ".join(lines[:3]) or str(e).strip()
            raise BackendUnavailable(f"compiling or attaching {source.name} failed: {detail}") from None
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def load(
    proc: Path,
    kernel_headers: Path | str | None = None,
    source: Path = SOURCE,
    btf_path: Path = btf.VMLINUX,
    clock: Callable[[], float] = time.monotonic,
    bpf_stats: bool = False,
    sysfs: Path = Path("/sys"),
    raw_switch: bool = False,
) -> KernelShardSampler:
    """The programs compiled, loaded and attached (by a child process, so that
    this one never holds the compiler: sampler/kernel/handoff.py). With
    `bpf_stats`, the kernel's BPF statistics are turned on while the sampler
    lives (they time every BPF program on the host, not ours alone) and each
    window reports the programs' runs and run time. `raw_switch`: sched_switch
    as a raw tracepoint even where tp_btf would load (the fallback, as tests
    and benchmarks run it)."""
    headers = ["tree", str(kernel_headers)] if isinstance(kernel_headers, Path) else kernel_headers
    options = {"proc": str(proc), "kernel_headers": headers, "source": str(source), "btf_path": str(btf_path),
               "sysfs": str(sysfs), "raw_switch": raw_switch}  # fmt: skip
    programs = handoff.load_programs(options)
    for note in programs.notes:
        log.info("%s", note)
    return KernelShardSampler(programs, proc, clock, bpf_stats)


@dataclass
class Attached:
    """What the loader child attached: bcc's BPF object (its maps, and the
    programs bcc loaded and attached), the programs loaded outside bcc with
    their attachments, and what was learnt on the way."""

    bpf: Any
    own_programs: dict[str, int]
    own_attachments: list[int]
    pid_max: int
    cpus: int  # rows of the per-CPU arrays
    tickless_cpus: list[int]
    notes: list[str]


def attach_switch(bpf: Any, raw: bool) -> tuple[dict[str, int], list[int], str | None]:
    """sched_switch's program attached: on_switch as tp_btf where it loads
    (its own program and attachment descriptors returned), else on_switch_raw
    as a raw tracepoint, through bcc, with a note saying why."""
    why = "asked for"
    if not raw:
        try:
            prog, link = tp_btf.load_and_attach(bpf.dump_func(b"on_switch"), "on_switch", "sched_switch")
            return {"on_switch": prog}, [link], None
        except OSError as e:
            why = e.strerror or str(e)
    bpf.attach_raw_tracepoint(tp=b"sched_switch", fn_name=b"on_switch_raw")
    return {}, [], f"sched_switch attached as a raw tracepoint ({why}): a task switching in is read through a helper"


def compile_and_attach(
    proc: str, kernel_headers: list[str] | str | None, source: str, btf_path: str, sysfs: str,
    raw_switch: bool = False,
) -> Attached:  # fmt: skip
    """What the loader child does (everything bcc is needed for): the
    programs compiled, loaded and attached, with pid_max, the per-CPU arrays'
    rows, the CPUs left without the cpu-clock tick, and notes for the agent's
    log; or BackendUnavailable, checked in the order an operator would fix
    things."""
    try:
        from bcc import BPF, PerfSWConfig, PerfType
    except ImportError as e:
        raise BackendUnavailable(f"bcc is not installed ({e}); install python3-bpfcc") from None
    try:
        caps = effective_capabilities(Path(proc))
    except (OSError, procfs.ProcParseError) as e:
        raise BackendUnavailable(f"cannot read this process's capabilities: {e}") from None
    if not (caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1)):
        raise BackendUnavailable("missing capabilities: needs CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN (run as root)")
    try:
        offsets = btf.task_offsets(Path(btf_path))
    except btf.BtfError as e:
        raise BackendUnavailable(str(e)) from None
    headers = find_kernel_headers(Path(kernel_headers[1]) if isinstance(kernel_headers, list) else kernel_headers)
    pid_max = read_pid_max(Path(proc))
    try:
        cpus = possible_cpus(Path(sysfs))
    except (OSError, ValueError) as e:
        raise BackendUnavailable(f"cannot tell which CPUs are possible: {e}") from None
    cflags = compile_flags(offsets, pid_max, cpus) + headers.cflags
    bpf = _compile(BPF, Path(source), cflags, headers.env)
    notes = [f"kernel backend compiled against {headers.name}"]
    try:
        ticked, tickless = tick_cpus(Path(sysfs))
    except (OSError, ValueError) as e:
        bpf.cleanup()
        raise BackendUnavailable(f"cannot tell which CPUs are online: {e}") from None
    try:
        own_programs, own_attachments, note = attach_switch(bpf, raw_switch)
    except Exception as e:
        bpf.cleanup()
        raise BackendUnavailable(f"attaching to sched_switch failed: {e}") from None
    if note:
        notes.append(note)
    try:
        # The tick only learns the slot of a task that was already running when
        # it was given one (samples count running slices themselves): 100 a
        # second, on every CPU but those kept free of ticks (nohz_full,
        # isolated), where such a task is learnt at its next switch.
        event = (PerfType.SOFTWARE, PerfSWConfig.CPU_CLOCK)
        if not tickless:
            bpf.attach_perf_event(ev_type=event[0], ev_config=event[1], fn_name=b"on_tick", sample_period=TICK_NS)
        else:
            # bcc keeps one CPU's events per attach: gathered, so all are handed over.
            events = {}
            for cpu in ticked:
                bpf.attach_perf_event(ev_type=event[0], ev_config=event[1], fn_name=b"on_tick",
                                      sample_period=TICK_NS, cpu=cpu)  # fmt: skip
                events.update(bpf.open_perf_events[event])
            bpf.open_perf_events[event] = events
    except Exception as e:
        for fd in [*own_attachments, *own_programs.values()]:
            os.close(fd)
        bpf.cleanup()
        raise BackendUnavailable(f"attaching the cpu-clock perf event failed: {e}") from None
    if tickless:
        notes.append(f"no cpu-clock tick on CPUs {format_cpu_list(tickless)} (nohz_full or isolated)")
    return Attached(bpf, own_programs, own_attachments, pid_max, cpus, tickless, notes)


def possible_cpus(sysfs: Path = Path("/sys")) -> int:
    """The highest possible CPU id + 1: the rows of the per-CPU arrays (a CPU
    brought online later has its row already)."""
    return max(parse_cpu_list((sysfs / "devices" / "system" / "cpu" / "possible").read_text())) + 1


def tick_cpus(sysfs: Path = Path("/sys")) -> tuple[list[int], list[int]]:
    """The online CPUs that get the cpu-clock tick, and those left without
    it: a CPU the operator keeps free of the kernel's own ticks (nohz_full)
    or of the scheduler (isolcpus) is not woken 100 times a second by us."""
    cpu_dir = sysfs / "devices" / "system" / "cpu"
    online = parse_cpu_list((cpu_dir / "online").read_text())
    quiet: set[int] = set()
    for name in ("nohz_full", "isolated"):
        try:
            text = (cpu_dir / name).read_text()
        except OSError:  # a kernel without the file: no such CPUs
            continue
        if text.strip() != "(null)":  # nohz_full says so when the feature is built but unused
            quiet.update(parse_cpu_list(text))
    return [c for c in online if c not in quiet], [c for c in online if c in quiet]


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


class KernelShardSampler:
    """Same interface as ProcShardSampler: discover, sample, memory, describe.

    The kernel counts per slot; a process has one slot. Shards may overlap
    (two selectors naming one group), so a slot stands for a set of shards:
    every process watched by exactly the same shards shares one. A shard's
    CPU time is the sum over the slots whose set holds it, a matrix product.
    """

    def __init__(self, programs: handoff.LoadedPrograms, proc: Path, clock: Callable[[], float] = time.monotonic,
                 bpf_stats: bool = False) -> None:  # fmt: skip
        self.programs, self.proc, self._clock = programs, proc, clock
        self.finest_hz: float | None = None  # nanoseconds, up to each sample
        self.tickless_cpus = programs.tickless_cpus  # CPUs without the cpu-clock tick (nohz_full, isolated)
        # The kernel's tgid -> slot bytes, shared memory: reading and writing
        # membership costs no system call.
        self._task_slot_map = mmap.mmap(programs.maps["task_slot"].fd, (programs.pid_max + 7) // 8 * 8,
                                        mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        self.task_slot = np.frombuffer(self._task_slot_map, dtype=np.uint8)
        # Each CPU's totals by slot and what it runs: shared memory too, read
        # at every sample without a system call.
        cpus = programs.cpus
        self._slot_ns_map = mmap.mmap(programs.maps["slot_ns"].fd, cpus * MAX_SLOTS * 16, mmap.MAP_SHARED,
                                      mmap.PROT_READ)  # fmt: skip
        self._slot_ns = np.frombuffer(self._slot_ns_map, dtype=np.uint64).reshape(cpus, MAX_SLOTS, 2)
        self._cpu_run_map = mmap.mmap(programs.maps["cpu_run"].fd, cpus * CPU_RUN.itemsize, mmap.MAP_SHARED,
                                      mmap.PROT_READ)  # fmt: skip
        self._cpu_run = np.frombuffer(self._cpu_run_map, dtype=CPU_RUN)
        self._dropped_table = programs.maps["dropped_forks"]
        self._specs: dict[str, _KernelShard] = {}
        self._slot_of: dict[frozenset[str], int] = {}  # a set of shard ids -> its slot
        self._slots = np.zeros(0, dtype=np.int64)  # the slots in use, in a fixed order
        self._prev_ns = np.zeros((0, 2), dtype=np.int64)  # their totals (ns, late ns) at the last reading
        self._index_of_slot = np.full(MAX_SLOTS, -1, dtype=np.int64)  # slot -> its place in _slots
        self._debt: dict[str, float] = {}  # shard id -> seconds counted ahead of the kernel's own account
        self._member_of = np.zeros((0, 0))  # [shard, slot] = 1 where the slot counts for the shard
        self._last_at: float | None = None
        self._cpus = os.cpu_count() or 1
        self._stats_fd = _enable_bpf_stats() if bpf_stats else None
        # The wait histogram, where the kernel keeps run_delay (CONFIG_SCHED_INFO).
        # Compiled out where the kernel has no run_delay (TASK_RUN_DELAY_OFF).
        self._wait_log = programs.maps.get("wait_log")
        self._wait_prev_slots: list[int] = []
        self._wait_prev_hist: list[np.ndarray] = []
        self._wait_prev_total: list[int] = []

    @property
    def specs(self) -> list[ShardSpec]:
        return [w.spec for w in self._specs.values()]

    def describe(self, shard_id: str) -> tuple[list[int], str | None]:
        w = self._specs[shard_id]
        return w.pgids, w.command

    def close(self) -> None:
        """Unmaps, detaches and unloads; a second call does nothing."""
        if not hasattr(self, "task_slot"):
            return
        # The views go before the mappings they look into.
        del self.task_slot, self._slot_ns, self._cpu_run
        for name, mapping in (("task_slot", self._task_slot_map), ("slot_ns", self._slot_ns_map),
                              ("cpu_run", self._cpu_run_map)):  # fmt: skip
            try:
                mapping.close()
            except BufferError:  # a view still held (a traceback's frame): unmapped when it goes
                log.debug("%s still viewed at close: unmapped later", name)
        self.programs.close()
        if self._stats_fd is not None:
            os.close(self._stats_fd)
            self._stats_fd = None

    # --- membership -------------------------------------------------------------

    def discover(self, specs: list[ShardSpec], table: ProcessTable) -> None:
        old = self._specs
        new: dict[str, _KernelShard] = {}
        watches_of: dict[int, set[str]] = {}
        for gw in specs:
            prev = old.get(gw.id)
            pids = table.resolve(gw.selector)
            pgids = sorted({table.stats[p].pgrp for p in pids if table.stats[p].pgrp > 0})
            command = table.stats[pgids[0]].comm if len(pgids) == 1 and pgids[0] in table.stats else None
            same = prev is not None and prev.spec == gw
            fresh, carried, late = (prev.fresh, prev.carried, prev.late) if prev and same else (True, 0.0, 0.0)
            threads = sum(table.stats[p].threads for p in pids if p in table.stats)
            starts = {p: table.stats[p].start_ticks for p in pids if p in table.stats}
            new[gw.id] = _KernelShard(gw, pids, pgids, command, fresh, threads=max(threads, 1), starts=starts,
                                carried=carried, late=late)  # fmt: skip
            for pid in pids:
                watches_of.setdefault(pid, set()).add(gw.id)

        # Slots of sets that remain keep their counters; a new set never takes a
        # slot in use until now: the kernel's map still points processes at it
        # until _sync_map has run.
        classes = {frozenset(ws) for ws in watches_of.values()}
        prev_ns = dict(zip(self._slots.tolist(), self._prev_ns.tolist(), strict=True))
        free = sorted(set(range(1, MAX_SLOTS)) - set(self._slot_of.values()))
        slot_of = {c: s for c, s in self._slot_of.items() if c in classes}
        for c in sorted(classes - slot_of.keys(), key=sorted):
            if not free:
                log.warning("more than %d distinct shard sets: %s not counted", MAX_SLOTS, sorted(c))
                continue
            slot_of[c] = free.pop(0)
        self._specs, self._slot_of = new, slot_of
        want = {pid: slot_of[frozenset(ws)] for pid, ws in watches_of.items() if frozenset(ws) in slot_of}
        if self._sync_map(table, want):
            # A new member already on a CPU is learnt at the next tick: until then
            # its slice is not counted. Wait that long, so that a new shard's
            # first reading (below) starts from what the kernel now counts.
            time.sleep(TICK_NS / 1e9 + 0.001)

        self._slots = np.array(sorted(slot_of.values()), dtype=np.int64)
        index = {wid: i for i, wid in enumerate(new)}
        self._member_of = np.zeros((len(new), len(self._slots)))
        for j, slot in enumerate(self._slots.tolist()):
            for wid in next(c for c, s in slot_of.items() if s == slot):
                self._member_of[index[wid], j] = 1.0
        self._index_of_slot[:] = -1
        self._index_of_slot[self._slots] = np.arange(len(self._slots))
        now_ns, _ = self._read_totals()
        self._prev_ns = np.array([prev_ns.get(s, now_ns[j].tolist()) for j, s in enumerate(self._slots.tolist())],
                                 dtype=np.int64).reshape(-1, 2)  # fmt: skip
        self._debt = {wid: d for wid, d in self._debt.items() if wid in new}

    def _sync_map(self, table: ProcessTable, want: dict[int, int]) -> bool:
        """Make task_slot say what the walk found. Entries the kernel added at
        fork for processes the walk has not seen are kept: they are members
        born since. Processes the walk saw outside every shard are cleared
        (they left their group, or their shard went), as are entries of slots
        no longer in use. True when a process was given a slot it lacked."""
        slots = self.task_slot
        # Computed on a copy: the kernel writes the map at every fork and exit,
        # and numpy's flatnonzero refuses an array that changes under it.
        snapshot = slots.copy()
        live = np.zeros(MAX_SLOTS, dtype=bool)
        live[list(set(want.values()))] = True
        have = np.flatnonzero(snapshot)
        seen = np.fromiter(table.stats.keys(), dtype=np.int64)
        wanted = np.fromiter(want.keys(), dtype=np.int64, count=len(want))
        stale = have[~live[snapshot[have]] | (np.isin(have, seen) & ~np.isin(have, wanted))]
        slots[stale] = 0
        pids = np.fromiter(want.keys(), dtype=np.int64, count=len(want))
        values = np.fromiter(want.values(), dtype=np.uint8, count=len(want))
        in_range = pids < len(slots)
        if not in_range.all():
            log.warning("pids above pid_max at load time not counted: %s", pids[~in_range][:5].tolist())
        pids, values = pids[in_range], values[in_range]
        added = pids[slots[pids] != values]
        slots[pids] = values
        # A process that exited between the walk and this write had its exit
        # seen while it had no slot: clear it ourselves, or a new process given
        # that pid would be credited to this shard.
        for pid in added.tolist():
            try:
                st = procfs.read_pid_stat(self.proc, pid)
                # A zombie has exited: its exit was seen, and its pid may be reused once it is reaped.
                alive = st.start_ticks == table.stats[pid].start_ticks and st.state not in ("Z", "X")
            except (procfs.ProcessGone, procfs.ProcParseError):
                alive = False
            if not alive:
                slots[pid] = 0
        return bool(len(added))

    def task_pids(self) -> set[int]:
        """The processes the kernel now counts for some shard."""
        return set(np.flatnonzero(self.task_slot.copy()).tolist())

    def map_size(self) -> int:
        return int(np.count_nonzero(self.task_slot))

    # --- samples ----------------------------------------------------------------

    def _read_ns(self) -> np.ndarray:
        """Each slot's on-CPU ns credited by the kernel (slices that have ended),
        and of those the ns credited late: [slot, (ns, late)]."""
        totals: np.ndarray = self._slot_ns[:, self._slots, :].sum(axis=0, dtype=np.uint64).astype(np.int64)
        return totals

    def _read_totals(self) -> tuple[np.ndarray, float]:
        """Each slot's on-CPU ns up to now: what the kernel credited, and the
        slices still running on a CPU from when they were counted from; beside
        it, the part of those the kernel credited late. The CPUs' sequence
        numbers are read before their entries and the totals, and again after:
        a CPU whose number moved in between (a switch) or was odd is read
        again, and after a few tries left out: its slice began or ended within
        microseconds of the reading. (The order of the reads is the
        program's: x86 does not reorder loads; arm64 would need barriers.)"""
        for _ in range(SNAPSHOT_TRIES):
            seq = self._cpu_run["seq"].copy()
            running = self._cpu_run.copy()
            now = self._clock()
            credited = self._read_ns()
            steady = (self._cpu_run["seq"] == seq) & (seq % 2 == 0)
            if steady.all():
                break
        busy = steady & (running["slot"] != 0)
        if busy.any():
            where = self._index_of_slot[running["slot"][busy]]
            ahead = np.maximum(0, round(now * 1e9) - running["since"][busy].astype(np.int64))
            known = where >= 0  # a slot given up since: its slice no longer counts
            credited[:, 0] += np.bincount(where[known], weights=ahead[known], minlength=len(credited)).astype(np.int64)
        return credited, now

    def sample(self) -> dict[str, ShardReading]:
        current, now = self._read_totals()
        elapsed = None if self._last_at is None else now - self._last_at
        self._last_at = now
        # A slice is counted by wall time while it runs and credited with its
        # runtime when it ends; where the runtime grew less (time stolen by a
        # hypervisor), the difference is taken from the following samples;
        # where it grew more (the scheduler's clock and the tracepoint's are
        # read microseconds apart at each switch), beyond what the shard's
        # threads could have used in the sample, the rest goes to the next.
        # More than SWITCH_SLACK_S beyond is no clock's doing but threads the
        # walk did not see (forked since): counted as measured. Time the kernel
        # credited late (slices whose switch in it did not see) was spent in
        # samples already taken: it goes into this one and the next as far as
        # the threads had room, never over them, never lost.
        previous, self._prev_ns = self._prev_ns, current
        used_s, late_s = (self._member_of @ ((current - previous).astype(np.float64) / 1e9)).T
        out = {}
        for i, w in enumerate(self._specs.values()):
            wid = w.spec.id
            late = min(max(0.0, float(late_s[i])), max(0.0, float(used_s[i])))
            used, debt = settle(float(used_s[i]) - late, self._debt.pop(wid, 0.0))
            if debt:
                self._debt[wid] = debt
            valid = elapsed is not None and elapsed > 0 and not w.fresh and bool(w.pids)
            w.fresh = False
            if not valid or not elapsed:
                out[wid] = ShardReading(None, None, elapsed)
                continue
            capacity = min(w.threads, self._cpus) * elapsed
            credit, w.carried = within_capacity(used + w.carried, capacity, SWITCH_SLACK_S)
            credit, w.late = place_late(credit, w.late + late, capacity)
            out[wid] = ShardReading(credit / elapsed, None, elapsed)
        return out

    def memory(self) -> dict[str, int | None]:
        """Resident memory of each shard's processes known to userspace, read
        once per window (a gauge: its last value is what a window reports)."""
        out: dict[str, int | None] = {}
        for w in self._specs.values():
            pages, alive = 0, False
            for pid in w.pids:
                try:
                    st = procfs.read_pid_stat(self.proc, pid)
                except (procfs.ProcessGone, procfs.ProcParseError):
                    continue
                if st.start_ticks != w.starts.get(pid, st.start_ticks):
                    continue  # the pid was reused since the walk: another process's memory
                pages += st.rss_pages
                alive = True
            out[w.spec.id] = pages * PAGE_SIZE if alive else None
        return out

    # --- the programs' own cost ---------------------------------------------------------

    def program_stats(self) -> dict[str, tuple[int, int]]:
        """Per program: cumulative (run_time_ns, run_cnt) as the kernel counts
        them; nothing unless asked for (`bpf_stats`)."""
        out: dict[str, tuple[int, int]] = {}
        if self._stats_fd is None:
            return out
        for name, fd in self.programs.programs.items():
            if (st := _program_stats(fd)) is not None:
                out[name] = st
        return out

    # --- waiting for a CPU -------------------------------------------------------------

    def runqueue_waits(self) -> dict[str, dict[str, float] | None] | None:
        """Per shard, the waits for a CPU since the last call: p50 and p99 from the
        kernel's log2 histogram (interpolated within a bucket), total and mean.
        None when this kernel has no run_delay (the caller falls back to schedstat)."""
        if self._wait_log is None:
            return None
        slots = self._slots.tolist()
        hist = np.zeros((len(slots), WAIT_BUCKETS), dtype=np.uint64)
        total = np.zeros(len(slots), dtype=np.uint64)
        for j, slot in enumerate(slots):
            # Every CPU's struct wait_log: ns waited, then the counts by log2(ns).
            log = np.frombuffer(self._wait_log.lookup(slot), dtype=np.uint64).reshape(-1, 1 + WAIT_BUCKETS).sum(axis=0)
            total[j], hist[j] = log[0], log[1:]
        prev = {s: (h, t) for s, h, t in zip(self._wait_prev_slots, self._wait_prev_hist, self._wait_prev_total,
                                                strict=True)}  # fmt: skip
        known = np.array([s in prev for s in slots], dtype=bool)
        d_hist = hist.astype(np.float64) - np.array([prev[s][0] if s in prev else h for s, h in zip(slots, hist,
                                                     strict=True)], dtype=np.float64).reshape(hist.shape)  # fmt: skip
        d_total = total.astype(np.float64) - np.array([prev[s][1] if s in prev else t for s, t in zip(slots, total,
                                                       strict=True)], dtype=np.float64)  # fmt: skip
        self._wait_prev_slots, self._wait_prev_hist, self._wait_prev_total = slots, list(hist), list(total)
        out: dict[str, dict[str, float] | None] = {}
        watch_hist = self._member_of @ d_hist
        watch_total = self._member_of @ d_total
        watch_known = (self._member_of @ (~known).astype(np.float64)) == 0
        for i, wid in enumerate(self._specs):
            if not watch_known[i] or not self._specs[wid].pids:
                out[wid] = None
                continue
            counts = watch_hist[i]
            n = counts.sum()
            result: dict[str, float] = {"total": round(float(watch_total[i]) / 1e9, 6)}
            if n > 0:
                result["mean"] = round(float(watch_total[i] / n) / 1e9, 9)
                result["p50"] = round(float(log2_quantile(counts, 0.5)) / 1e9, 9)
                result["p99"] = round(float(log2_quantile(counts, 0.99)) / 1e9, 9)
            out[wid] = result
        return out

    def dropped_forks(self) -> int | None:
        return int(np.frombuffer(self._dropped_table.lookup(0), dtype=np.uint64).sum())
