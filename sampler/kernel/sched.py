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

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sampler.kernel import btf, handoff, memory_order
from sampler.kernel.build import MAX_SLOTS, SOURCE, TICK_NS
from sampler.kernel.counters import SlotCounters
from sampler.kernel.groups_run import GroupsRun, GroupTicks
from sampler.kernel.membership import CGROUP_SLOTS_MAX, TaskSlots
from sampler.kernel.program_stats import enable_bpf_stats, program_stats
from sampler.kernel.sample_ring import RingSamples, SampleRing
from sampler.kernel.slices import credit_sample, held_through, into_room_before, place_late, settle
from sampler.kernel.waits import WaitHistograms
from sampler.off_thread import Said
from sampler.shards.container_ids import container_dir
from sampler.shards.proc_shards import PAGE_SIZE, ShardReading, cpus_allowed
from sampler.shards.selectors import CGROUP_KINDS, GROUP_KINDS, ProcessTable, ShardSpec
from sampler.sources import procfs
from sampler.sources.cgroup_view import unified_ids_below

log = logging.getLogger(__name__)


@dataclass
class KernelSamples:
    """Samples the kernel took, oldest first."""

    at: np.ndarray  # each one's time (monotonic seconds)
    seconds: np.ndarray  # the time each covers (NaN for the first the sampler ever read)
    machine: np.ndarray  # the machine's busy share of its online CPUs, percent (NaN: not measured)
    steal: np.ndarray  # the share stolen by the hypervisor, percent
    shards: dict[str, np.ndarray]  # each shard's cores in each (NaN: not measured)
    lost: int  # samples written over before they were read

    def after(self, t: float) -> KernelSamples:
        """Those taken after monotonic time `t`."""
        keep = self.at > t
        return KernelSamples(self.at[keep], self.seconds[keep], self.machine[keep], self.steal[keep],
                             {wid: cores[keep] for wid, cores in self.shards.items()}, self.lost)  # fmt: skip


@dataclass
class _KernelShard:
    spec: ShardSpec
    pids: list[int]
    pgids: list[int]
    command: str | None
    fresh: bool = True  # no reading to take a delta from yet
    threads: int = 1  # its processes' threads at the walk
    cpus: int = 1  # the CPUs its processes may run on, at the walk (cpus_allowed)
    starts: dict[int, int] = field(default_factory=dict)  # pid -> its start time at the walk: the same process
    carried: float = 0.0  # seconds credited by the kernel that its threads could not have used yet
    late: float = 0.0  # seconds spent in slices the kernel saw late, not yet placed in a sample
    room: float = 0.0  # its threads' time the last sample did not read (what a short reading can have missed)


def load(
    proc: Path,
    kernel_headers: Path | str | None = None,
    source: Path = SOURCE,
    btf_path: Path = btf.VMLINUX,
    clock: Callable[[], float] = time.monotonic,
    bpf_stats: bool = False,
    sysfs: Path = Path("/sys"),
    raw_switch: bool = False,
    rq_from_tick: bool = False,
) -> KernelShardSampler:
    """The programs compiled, loaded and attached (by a child process, so that
    this one never holds the compiler: sampler/kernel/handoff.py). With
    `bpf_stats`, the kernel's BPF statistics are turned on while the sampler
    lives (they time every BPF program on the host, not ours alone) and each
    window reports the programs' runs and run time. `raw_switch`: sched_switch
    as a raw tracepoint even where tp_btf would load (the fallback, as tests
    and benchmarks run it). `rq_from_tick`: the kernel's samples find each
    CPU's run queue by its tick even where the way from a task holds (7.2's
    way, as tests run it)."""
    fence = memory_order.reader_fence()  # before anything is compiled: its absence refuses the backend
    headers = ["tree", str(kernel_headers)] if isinstance(kernel_headers, Path) else kernel_headers
    options = {"proc": str(proc), "kernel_headers": headers, "source": str(source), "btf_path": str(btf_path),
               "sysfs": str(sysfs), "raw_switch": raw_switch, "rq_from_tick": rq_from_tick}  # fmt: skip
    programs = handoff.load_programs(options)
    for note in programs.notes:
        log.info("%s", note)
    return KernelShardSampler(programs, proc, clock, bpf_stats, fence=fence)


class KernelShardSampler:
    """Same interface as ProcShardSampler: discover, sample, memory, describe.

    The kernel counts per slot; a process has one slot. Shards may overlap
    (two selectors naming one group), so a slot stands for a set of shards:
    every process watched by exactly the same shards shares one. A shard's
    CPU time is the sum over the slots whose set holds it, a matrix product.
    """

    def __init__(self, programs: handoff.LoadedPrograms, proc: Path, clock: Callable[[], float] = time.monotonic,
                 bpf_stats: bool = False, *, fence: Callable[[], None]) -> None:  # fmt: skip
        """`fence`: called between the reads of what the kernel writes meanwhile (memory_order.py)."""
        self.programs, self.proc, self._clock = programs, proc, clock
        self.finest_hz: float | None = None  # nanoseconds, up to each sample
        self.tickless_cpus = programs.tickless_cpus  # CPUs without the cpu-clock tick (nohz_full, isolated)
        self.members = TaskSlots(programs.maps["task_slot"], programs.pid_max, proc, programs.maps.get("group_slot"),
                                 programs.maps.get("group_keyed"), programs.maps.get("cgroup_slot"),
                                 programs.maps.get("cgroup_keyed"))  # fmt: skip
        # Compiled out where the kernel's BTF does not say where a task's group is.
        self._group_ticks = (GroupTicks(programs.maps["group_ticks"], programs.maps["group_ticks_full"])
                             if "group_ticks" in programs.maps else None)  # fmt: skip
        self._following = False  # the tick follows the watched groups (the last discover said so)
        self._said_cgroups = Said()
        self.counters = SlotCounters(programs.maps["slot_ns"], programs.maps["cpu_run"], programs.cpus, clock, fence)
        self._closed = False
        self._dropped_table = programs.maps["dropped_forks"]
        self._specs: dict[str, _KernelShard] = {}
        self._slot_of: dict[frozenset[str], int] = {}  # a set of shard ids -> its slot
        self._slots = np.zeros(0, dtype=np.int64)  # the slots in use, in a fixed order
        self._prev_ns = np.zeros((0, 2), dtype=np.int64)  # their totals (ns, late ns) at the last reading
        self._prev_at = np.zeros(0)  # when each slot's were read (monotonic seconds; NaN: not known)
        self._debt: dict[str, float] = {}  # shard id -> seconds counted ahead of the kernel's own account
        self._member_of = np.zeros((0, 0))  # [shard, slot] = 1 where the slot counts for the shard
        self._last_at: float | None = None
        self._read_short = False  # the last reading left a CPU mid-switch out (SlotCounters.left_out)
        self._cpus = os.cpu_count() or 1
        self._stats_fd = enable_bpf_stats() if bpf_stats else None
        # The wait histogram, where the kernel keeps run_delay (CONFIG_SCHED_INFO).
        # Compiled out where the kernel has no run_delay (TASK_RUN_DELAY_OFF).
        wait_log = programs.maps.get("wait_log")
        self._waits = WaitHistograms(wait_log) if wait_log is not None else None
        # The samples the kernel takes, where on_sample loaded; None: the caller's loop samples.
        self.ring: SampleRing | None = None
        # Why the caller's loop samples, while it does (None: the kernel does).
        self.agent_samples_why: str | None = (programs.sample or {}).get("error") or "no sample program was loaded"
        self._no_machine: str | None = None  # why the kernel's samples cannot read the machine's time, once seen
        if programs.sample_event is not None and programs.sample is not None:
            self.ring = SampleRing(programs.maps, programs.sample_event, programs.sample["ring_len"],
                                   programs.sample["ring_slots"], fence)  # fmt: skip
            self.agent_samples_why = None
        self._machine_at: tuple[float, float, float, int] | None = None  # the last kernel sample: at, busy, steal, cpus
        self._machine_carry = (0.0, 0.0)  # busy and stolen ns beyond the samples' capacity, for the next

    @property
    def specs(self) -> list[ShardSpec]:
        return [w.spec for w in self._specs.values()]

    def describe(self, shard_id: str) -> tuple[list[int], str | None]:
        w = self._specs[shard_id]
        return w.pgids, w.command

    def close(self) -> None:
        """Unmaps, detaches and unloads; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.ring is not None:
            self.ring.close()
        self.members.close()
        self.counters.close()
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
            new[gw.id] = _KernelShard(gw, pids, pgids, command, fresh, threads=max(threads, 1),
                                      cpus=cpus_allowed(self.proc, pids, self._cpus), starts=starts, carried=carried,
                                      late=late)  # fmt: skip
            for pid in pids:
                watches_of.setdefault(pid, set()).add(gw.id)

        # Slots of sets that remain keep their counters; a new set never takes a
        # slot in use until now: the kernel's map still points processes at it
        # until the map is synced.
        classes = {frozenset(ws) for ws in watches_of.values()}
        prev_ns = dict(zip(self._slots.tolist(), self._prev_ns.tolist(), strict=True))
        prev_at = dict(zip(self._slots.tolist(), self._prev_at.tolist(), strict=True))
        free = sorted(set(range(1, MAX_SLOTS)) - set(self._slot_of.values()))
        slot_of = {c: s for c, s in self._slot_of.items() if c in classes}
        for c in sorted(classes - slot_of.keys(), key=sorted):
            if not free:
                log.warning("more than %d distinct shard sets: %s not counted", MAX_SLOTS, sorted(c))
                continue
            slot_of[c] = free.pop(0)
        self._specs, self._slot_of = new, slot_of
        want = {pid: slot_of[frozenset(ws)] for pid, ws in watches_of.items() if frozenset(ws) in slot_of}
        groups = {table.stats[pid].pgrp: slot for pid, slot in want.items()
                  if pid in table.stats and table.stats[pid].pgrp > 0}  # fmt: skip
        # The tick follows processes into and out of watched groups between walks.
        rule = groups if all(w.selector.kind in GROUP_KINDS for w in specs) else None
        self._following = self.members.follow_groups(rule) and rule is not None
        # And into and out of watched cgroups (cgroup.procs), between walks.
        by_cgroup = bool(specs) and all(w.selector.kind in CGROUP_KINDS for w in specs)
        self.members.follow_cgroups(self._cgroup_rule(new, table, slot_of) if by_cgroup else None)
        if self.members.sync(table, want):
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
        self.counters.read_slots(self._slots)
        if self.ring is not None:
            self.agent_samples_why = self._no_machine
            if not self.ring.sample_slots(self._slots.tolist()):
                self.agent_samples_why = (f"{len(self._slots)} sets of shards, more than a kernel sample holds "
                                          f"({self.ring.ring_slots})")  # fmt: skip
                log.warning("%s: sampled by the agent", self.agent_samples_why)
        now_ns, now = self.counters.totals()
        self._prev_ns = np.array([prev_ns.get(s, now_ns[j].tolist()) for j, s in enumerate(self._slots.tolist())],
                                 dtype=np.int64).reshape(-1, 2)  # fmt: skip
        self._prev_at = np.array([prev_at.get(s, now) for s in self._slots.tolist()], dtype=np.float64)
        self._debt = {wid: d for wid, d in self._debt.items() if wid in new}

    def _cgroup_rule(self, shards: dict[str, _KernelShard], table: ProcessTable,
                     slot_of: dict[frozenset[str], int]) -> dict[int, int] | None:  # fmt: skip
        """cgroup id -> slot, for every cgroup of the watched paths and of
        the watched containers (where a member is), and every cgroup below
        them, as the unified hierarchy has them (none where the host's tree is
        not v2 alone). A cgroup's slot is the set of shards whose selectors
        name it, as a process in it would have. None, the walk alone
        deciding, where there are more than the kernel's map holds."""
        tops: set[str] = set()
        for w in shards.values():
            if w.spec.selector.kind == "cgroup":
                tops.add(w.spec.selector.value)
                continue
            for pid in w.pids:
                path = table.unified_cgroup(pid)
                if path is not None and (top := container_dir(path)) is not None:
                    tops.add(top)
        out: dict[int, int] = {}
        for top in sorted(tops):
            below = unified_ids_below(top, table.cgroup_root, CGROUP_SLOTS_MAX - len(out))
            if below is None:
                if self._said_cgroups.first("too many"):
                    log.warning("more than %d cgroups watched: moves between them are seen at each window's walk",
                                CGROUP_SLOTS_MAX)  # fmt: skip
                return None
            for path, cgroup in below.items():
                names = frozenset(wid for wid, w in shards.items() if w.spec.selector.names_cgroup(path))
                if (slot := slot_of.get(names)) is not None:
                    out[cgroup] = slot
        return out

    def groups_run(self) -> GroupsRun | None:
        """The groups that ran since the last call; None where the kernel
        cannot say (no BTF for a task's group)."""
        if self._group_ticks is None:
            return None
        ticks, complete = self._group_ticks.take()
        return GroupsRun(ticks, complete, self._following, TICK_NS / 1e9)

    def member_pids(self) -> set[int]:
        """The processes the kernel counts for some shard now."""
        return self.members.pids()

    # --- samples ----------------------------------------------------------------

    def sample(self) -> dict[str, ShardReading]:
        short_before = self._read_short
        current, now = self.counters.totals()
        self._read_short = self.counters.left_out > 0
        return self._readings(current, now, short_before, self._read_short)

    def _readings(self, current: np.ndarray, now: float, short_before: bool,
                  short: bool) -> dict[str, ShardReading]:  # fmt: skip
        """Each shard's reading from its slots' totals at `now` ([slot, (ns, late ns)]);
        `short_before`, `short`: the reading before, this one, left a CPU
        mid-switch out."""
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
        self._prev_at = np.full(len(current), now)
        used_s, late_s = (self._member_of @ ((current - previous).astype(np.float64) / 1e9)).T
        return {w.spec.id: ShardReading(self._credit(w, float(used_s[i]), float(late_s[i]), elapsed, short_before,
                                                     short), None, elapsed)
                for i, w in enumerate(self._specs.values())}  # fmt: skip

    def _credit(self, w: _KernelShard, used_s: float, late_s: float, elapsed: float | None,
                short_before: bool = False, short: bool = False) -> float | None:  # fmt: skip
        """One sample of one shard: `used_s` seconds counted for its slots,
        `late_s` of them credited late, in `elapsed` seconds: its cores, or
        None where not measured. `short_before`, `short`: the sample before,
        this one, was read with a CPU mid-switch left out."""
        wid = w.spec.id
        late = min(max(0.0, late_s), max(0.0, used_s))
        settled = self._debt.pop(wid, 0.0)
        used, debt = settle(used_s - late, settled)
        if debt:
            self._debt[wid] = debt
        valid = elapsed is not None and elapsed > 0 and not w.fresh and bool(w.pids)
        w.fresh = False
        if not valid or not elapsed:
            return None
        capacity = min(w.threads, w.cpus) * elapsed
        # A sample after one read short (a CPU left out mid-switch, or a slice
        # counted ahead of the kernel and settled here) holds the time the
        # sample before missed: passed on as measured it read up to twice the
        # threads' time (2.04 cores of a one-thread engine in a 1 ms sample),
        # and time carried once, passed on with the next sample's, twenty.
        credit, w.carried, w.room = credit_sample(used, w.carried, w.room, capacity, w.cpus * elapsed, elapsed,
                                                  bool(settled) or short_before, short)  # fmt: skip
        credit, w.late = place_late(credit, w.late + late, capacity)
        return credit / elapsed

    def samples_in_kernel(self, hz: float) -> bool:
        """Whether the kernel takes the samples, at `hz` from now on: where
        on_sample loaded and a sample holds every slot in use; else its event
        is stopped, and the caller samples."""
        ring = self.ring
        if ring is None:
            return False
        if self.agent_samples_why is not None:
            if ring.hz is not None:
                ring.stop()
            return False
        if ring.hz != hz:
            ring.start(hz)
            self._machine_at = None  # what came before was not sampled by the kernel
        return True

    def take_kernel_samples(self) -> KernelSamples:
        """The samples the kernel took since the last call (the ring must be
        started): each one's time, what it covers, the machine's busy and
        stolen shares and each shard's cores, as `sample` reads them (a
        thousand a second: whole arrays at a time, one shard's sample at a
        time only where it carries something into the next)."""
        assert self.ring is not None
        got = self.ring.take(self._slots)
        n = len(got.at)
        previous_at = math.nan if self._last_at is None else self._last_at
        elapsed = np.diff(got.at, prepend=previous_at)
        if n:
            self._last_at = float(got.at[-1])
        filled, measured, base = held_through(got.at, got.totals - self._prev_ns[None], got.held, self._prev_at,
                                              previous_at)  # fmt: skip
        steps = np.diff(np.concatenate([base[None], filled]), axis=0) / 1e9
        for j in np.flatnonzero(got.held.any(axis=0)).tolist():
            last = int(np.flatnonzero(got.held[:, j])[-1])
            self._prev_ns[j], self._prev_at[j] = got.totals[last, j], got.at[last]
        used, late = steps[..., 0] @ self._member_of.T, steps[..., 1] @ self._member_of.T
        unheld = (~measured).astype(np.float64) @ self._member_of.T > 0
        shards = {w.spec.id: self._credit_samples(w, used[:, i], late[:, i], elapsed, unheld[:, i])
                  for i, w in enumerate(self._specs.values())}  # fmt: skip
        machine, steal = self._machine_shares(got)
        if n and not got.cpus.any():
            # No CPU's time read in any sample: the machine's figures would be
            # missing every window; the agent's loop samples from the next.
            self._no_machine = (f"the kernel's samples read no CPU's busy time (failed: "
                                f"{self.ring.machine_misses() or 'nothing counted'})")  # fmt: skip
            self.agent_samples_why = self._no_machine
            log.warning("%s: sampled by the agent", self._no_machine)
        return KernelSamples(got.at, elapsed, machine, steal, shards, got.lost)

    def _credit_samples(self, w: _KernelShard, used: np.ndarray, late: np.ndarray, elapsed: np.ndarray,
                        unheld: np.ndarray) -> np.ndarray:  # fmt: skip
        """_credit over a shard's samples, in order: its cores in each (NaN:
        not measured). A sample that neither carries anything in nor out (no
        late credit, no debt, within its threads' time) is its used time over
        its length, taken a run of them at once."""
        n = len(used)
        cores = np.full(n, np.nan)
        capacity = min(w.threads, w.cpus) * elapsed
        used = into_room_before(used, capacity)
        with np.errstate(invalid="ignore"):
            plain = ~unheld & (late == 0) & (used >= 0) & (used <= capacity) & (elapsed > 0)
        stops = np.flatnonzero(~plain)
        i = 0
        while i < n:
            if plain[i] and not (w.fresh or w.carried or w.late or self._debt.get(w.spec.id) or not w.pids):
                end = int(stops[np.searchsorted(stops, i)]) if len(stops) and stops[-1] > i else n
                cores[i:end] = used[i:end] / elapsed[i:end]
                w.room = max(0.0, float(capacity[end - 1] - used[end - 1]))
                i = end
                continue
            if not unheld[i]:
                seconds = float(elapsed[i])
                got = self._credit(w, float(used[i]), float(late[i]), None if math.isnan(seconds) else seconds)
                if got is not None:
                    cores[i] = got
            i += 1
        return cores

    def _machine_shares(self, got: RingSamples) -> tuple[np.ndarray, np.ndarray]:
        """The machine's busy and stolen shares of its online CPUs' time in
        each sample, percent (NaN: not measured, as where a CPU's counters
        were not all read). The counters move a tick at a time: what a
        sample's time cannot hold goes into the next, never over its CPUs'
        time, nothing lost."""
        # Every possible CPU where the way from a task to each CPU holds; the
        # CPUs whose ticks have run where each tick finds its own (7.2).
        online = os.sysconf("SC_NPROCESSORS_ONLN")
        # One loop over plain floats, within_capacity written out: a thousand
        # samples a second (profiled: a call and a numpy store per sample was
        # a millisecond a second).
        busy_out: list[float] = []
        steal_out: list[float] = []
        carry_busy, carry_steal = self._machine_carry
        known = self._machine_at is not None
        last_at, last_busy, last_steal, last_cpus = self._machine_at or (0.0, 0.0, 0.0, 0)
        for at, busy, steal, cpus in zip(got.at.tolist(), got.busy.tolist(), got.steal.tolist(), got.cpus.tolist(),
                                         strict=True):  # fmt: skip
            if known and at > last_at and cpus == last_cpus and cpus >= online and busy >= last_busy \
                    and steal >= last_steal:  # fmt: skip
                capacity = (at - last_at) * 1e9 * online
                used, carry_busy = busy - last_busy + carry_busy, 0.0
                if used > capacity:  # the counters' tick-sized steps: the rest into the next sample
                    used, carry_busy = capacity, used - capacity
                stolen, carry_steal = steal - last_steal + carry_steal, 0.0
                if stolen > capacity:
                    stolen, carry_steal = capacity, stolen - capacity
                busy_out.append(100.0 * used / capacity)
                steal_out.append(100.0 * stolen / capacity)
            else:
                carry_busy = carry_steal = 0.0
                busy_out.append(math.nan)
                steal_out.append(math.nan)
            known, last_at, last_busy, last_steal, last_cpus = True, at, busy, steal, cpus
        if known:
            self._machine_at = (last_at, last_busy, last_steal, last_cpus)
        self._machine_carry = (carry_busy, carry_steal)
        return np.array(busy_out, dtype=np.float64), np.array(steal_out, dtype=np.float64)

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
            if (st := program_stats(fd)) is not None:
                out[name] = st
        return out

    # --- waiting for a CPU -------------------------------------------------------------

    def runqueue_waits(self) -> dict[str, dict[str, float] | None] | None:
        """Per shard, the waits for a CPU since the last call (sampler/kernel/waits.py).
        None when this kernel has no run_delay (the caller falls back to schedstat)."""
        if self._waits is None:
            return None
        shards = list(self._specs.values())
        return self._waits.since_last(self._slots.tolist(), self._member_of, [w.spec.id for w in shards],
                                      [bool(w.pids) for w in shards])  # fmt: skip

    def dropped_forks(self) -> int | None:
        return int(np.frombuffer(self._dropped_table.lookup(0), dtype=np.uint64).sum())
