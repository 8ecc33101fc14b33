"""Sampling a machine window after window: the loop `sample` and the agent run.

Each window starts by finding the watched groups' members, and the busiest
groups when none are configured (a walk of /proc, or only what the kernel
says matters: sampler/window/process_view.py), then samples at `hz` until
the window ends, then summarises. No walk runs between samples.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import msgspec.structs
import numpy as np

import wire
from sampler.backend import BackendChoice, ShardSampler
from sampler.gpu.nvml import GpuReader, GpuReading
from sampler.off_thread import Said
from sampler.shards.engine_metrics import EngineMetricsReader
from sampler.shards.kubelet import KubeletPods
from sampler.shards.proc_shards import USER_HZ, ShardReading
from sampler.shards.selectors import (
    CGROUP_KINDS,
    GROUP_KINDS,
    ShardSpec,
    busiest_groups,
    named_by_command,
    pod_watches,
)
from sampler.sources.cfs import CfsBandwidthReader
from sampler.sources.cgroup_view import host_cgroup_root
from sampler.sources.machine import MachineCpuSampler, MachineGaugeReader, PressureReader
from sampler.sources.runqueue import RunQueueWaitSampler
from sampler.window.hindsight import HINDSIGHT_GPU_POINTS, MACHINE, HindsightRing
from sampler.window.process_view import ProcessView
from sampler.window.series import RateSeries
from sampler.window.span_sender import SpanSender
from wire import raw as raw_samples
from wire.schema import Machine, ProgramCost, Shard, Window, WindowSummary

BUSIEST_GROUPS = 5
KERNEL_READ_S = 1.0  # how often the agent reads the samples the kernel takes (the ring holds 4 s at 1000 Hz)

log = logging.getLogger(__name__)

# (card index, its point series' wire field: wire/raw.py's GPU_POINTS) -> the points' times (us) and values
GpuSamples = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


@dataclass
class _WindowSamples:
    """A window's samples, each weighted by the time it covers."""

    machine: RateSeries  # the machine's CPU utilisation
    steal: RateSeries  # its steal
    shards: dict[str, RateSeries]  # each shard's cores
    taken: int
    first_from: float  # where the first sample begins: the previous window's last, if any
    last_at: float = 0.0  # where the last ends (monotonic, as first_from)


class WindowSampler:
    def __init__(
        self,
        proc: Path,
        backend: BackendChoice,
        shard_sampler: ShardSampler,
        specs: list[ShardSpec] | None = None,
        hz: float = 10.0,
        node: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        gpus: GpuReader | None = None,
        gpu_grace: float = 0.0,
        host_root: Path | None = None,
        cgroup_root: Path | None = None,
        kubelet: KubeletPods | None = None,
        kernel_samples: bool = True,
    ) -> None:
        if hz <= 0:
            raise ValueError("hz must be positive")
        self.proc = proc
        self.backend = backend
        self.specs = specs  # None: the busiest groups
        self.hz = hz
        self.node = node or socket.gethostname()
        self._clock, self._wall, self._sleep = clock, wall_clock, sleep
        self.cpu = MachineCpuSampler(proc)
        self.gauges = MachineGaugeReader(proc, host_root)
        self.pressure = PressureReader(proc)
        self.runqueue = RunQueueWaitSampler(proc)
        cgroup_tree = cgroup_root or host_cgroup_root(host_root)
        self.cfs = CfsBandwidthReader(proc, cgroup_tree)
        self.engine_metrics = EngineMetricsReader()
        self.shard_sampler = shard_sampler
        self.gpus = gpus
        self.kubelet = kubelet  # this node's pods, for `k8s:` shards
        self._said = Said()  # problems of the config, and impossible samples, already logged
        # How long a window's end may wait for its GPU reading: 0 for the
        # agent's endless loop; a one-shot `sample` can afford to wait.
        self.gpu_grace = gpu_grace
        self._members: dict[str, set[int]] = {}  # shard id -> its pids at the last walk, for GPU memory
        # The table each window resolves its selectors against: a walk of /proc, or what the kernel says matters.
        self.view = ProcessView(proc, shard_sampler, clock, sleep, cgroup_tree)
        self._group_ticks: dict[int, int] | None = None
        self._last_sample_at: float | None = None
        self._last_end: tuple[float, float] | None = None  # the last window's last sample: (monotonic, wall)
        self._program_stats: dict[str, tuple[int, int]] = {}
        self._wait_cumulative: dict[str, float] = {}
        self._seq = 0
        self.last_gauges = Machine()
        self._cpus = os.cpu_count() or 1
        # Set by the agent while the control plane asks for raw samples (someone
        # watches this node live): the window's samples go with its summary.
        self.raw_wanted = False
        # Every sample of the last minutes, kept for the control plane to fetch
        # after the fact (the agent's --hindsight); None: none kept.
        self.hindsight: HindsightRing | None = None
        # The span of it the control plane asked for, sent a piece a window (set by the agent).
        self.spans = SpanSender()
        # Samples taken by the kernel where the backend can (it says so each
        # window); False: by this process's loop, whatever the backend.
        self.kernel_samples = kernel_samples

    def close(self) -> None:
        """Its backend, readers and pollers closed."""
        self.shard_sampler.close()
        if self.kubelet is not None:
            self.kubelet.close()
        self.runqueue.close()
        if self.gpus is not None:
            self.gpus.close()

    def prime(self, seconds: float) -> None:
        """Take the first readings, so that the first window has something to
        compare with; with no configured groups, also learn which groups are
        busy (a walk at each end of `seconds`)."""
        if self.kubelet is not None and any(w.selector.kind == "k8s" for w in self.specs or ()):
            self.kubelet.wait_for_poll(0, self.kubelet.deadline_s + 1)  # the first window knows the pods
        self._discover()
        if self.specs is None and seconds > 0:
            # Between the two walks that rank the groups. The first readings
            # are taken after it: the first window's first sample covers from
            # here, not from before the wait (a 2 s window held 3 s of samples).
            self._sleep(seconds)
        if self.kernel_samples and self.shard_sampler.samples_in_kernel(self.hz):
            self.shard_sampler.take_kernel_samples()  # taken before this sampler was: none of its windows'
        # Stamped where the machine's counters are read, as in run_window: the
        # first window's first sample covers the readings that follow too.
        self._last_sample_at = self._clock()
        self.cpu.sample()
        self.shard_sampler.sample()
        self._waits()  # a first reading, for the first window to compare with
        self.cfs.read(self._members)  # likewise the cgroups' throttling counters

    def _discover(self) -> None:
        specs = self.specs
        if specs is not None and any(w.selector.kind == "k8s" for w in specs):
            specs = self._with_pods(specs)
        kinds = {w.selector.kind for w in specs or ()}
        named = [int(w.selector.value) for w in specs or () if w.selector.kind == "pid"]
        cgroups = [w.selector.value for w in specs or () if w.selector.kind == "cgroup"]
        # The containers the selectors name (pods' included); None where no
        # selector names a container or a pod, and the node's are not looked for.
        containers = None
        if self.specs is not None and any(w.selector.kind in ("containers", "k8s") for w in self.specs):
            containers = {cid for w in specs or () if w.selector.kind == "containers"
                          for cid in w.selector.value.split(",")}  # fmt: skip
        by_group = specs is None or (kinds <= GROUP_KINDS and containers is None)
        # Tables lend the next their `cmdline:` verdicts: a leader is matched once.
        table, ran = self.view.table(by_group, named, kinds <= CGROUP_KINDS, cgroups, containers)
        if specs is None:
            # Ranked by the kernel's ticks where it counts them, else by the
            # CPU time two walks saw each group's processes use. The ticks
            # count groups that have exited since (a shard of nothing to
            # measure) and groups whose leader has, whose other processes a
            # window between walks does not read: only groups with a live
            # leader are ranked by them.
            ticks = ran if ran is not None else table.group_ticks()
            before = self._group_ticks if ran is None else {}
            gone = set() if ran is None else {g for g in ran if g not in table.stats}
            top = [] if self._group_ticks is None else busiest_groups(before or {}, ticks, BUSIEST_GROUPS, gone)
            self._group_ticks = ticks
            specs = named_by_command(table, top)
        elif self.kubelet is not None and "k8s" in {w.selector.kind for w in self.specs or ()}:
            self._note_unknown_containers()
        self.shard_sampler.discover(specs, table)
        self._members = {w.id: set(table.resolve(w.selector)) for w in specs}
        self.view.watched(table.stats[pid].pgrp for pids in self._members.values() for pid in pids)

    def _with_pods(self, specs: list[ShardSpec]) -> list[ShardSpec]:
        """Each `k8s:` shard as one shard per pod it matches now; a shard id
        met twice (two selectors matching one pod) is the first's."""
        pods = self.kubelet.pods() if self.kubelet is not None else None
        if self.kubelet is None:
            self._say("no kubelet: k8s: selectors need the agent's --kubelet-url")
        out, ids = [], set()
        for w in specs:
            for made in [w] if w.selector.kind != "k8s" else pod_watches(w, pods or []):
                if made.id in ids:
                    self._say(f"shard {made.id} matched by more than one selector: the first counts it")
                    continue
                ids.add(made.id)
                out.append(made)
        return out

    def _note_unknown_containers(self) -> None:
        """Containers on the node that the kubelet's last answer does not name: a new pod's, polled for."""
        assert self.kubelet is not None
        pods = self.kubelet.pods()
        if pods is not None:
            known = {cid for pod in pods for cid in pod.containers.values()}
            self.kubelet.note_unknown(self.view.containers_on_node() - known)

    def _say(self, problem: str) -> None:
        if self._said.first(problem):
            log.warning("%s", problem)

    def run_window(self, seconds: float) -> WindowSummary:
        """One window: the walk, `seconds` of samples at `hz`, and their summary with
        every source's figures merged, fit for the wire (docs/wire-format.md)."""
        start_wall = self._wall()
        start = self._clock()
        self._discover()
        pressure_start, pressure_at = self.pressure.read(), self._clock()
        reason = self.backend.reason
        if self.kernel_samples and self.shard_sampler.samples_in_kernel(self.hz):
            samples = self._take_kernel_samples(start, seconds)
        else:
            samples = self._take_samples(start, seconds)
            if (why := self.shard_sampler.agent_samples_why) is not None and self.kernel_samples:
                reason = f"samples taken by the agent, not the kernel: {why}"
        self._seq += 1
        end_wall = self._wall()
        if end_wall < start_wall:  # the wall clock was stepped back during the window: its length is the monotonic one
            self._say("the wall clock went back during a window: its start is taken as its end less its length")
            start_wall = end_wall - (self._clock() - start)
        # The window is the time its samples cover: from the previous window's
        # last sample (or the first readings) to its own last, so that every
        # sample lies within its start and end and one window ends where the
        # next begins. Its end stamped after the last reading overlapped the
        # next window's start by the milliseconds between them, and the
        # hindsight view drew every other window (tests/test_browser.py).
        offset = start_wall - start  # wall less monotonic, as the samples kept in hindsight are placed
        last = samples.last_at if samples.taken else self._clock()
        end_of_window = offset + last
        # A window that goes on from the last one's last sample begins at that
        # window's end, to the letter: each window's offset is read anew, and
        # the two clocks' readings drift apart by a fraction of a millisecond
        # (0.2 ms in an emulated guest), which would leave a gap or an overlap.
        begins = self._last_end[1] if self._last_end is not None and self._last_end[0] == samples.first_from \
            else offset + samples.first_from  # fmt: skip
        window = Window(start=min(begins, end_of_window), end=end_of_window, samples=samples.taken)
        self._last_end = (last, end_of_window) if samples.taken else None
        gauges = self.gauges.read()
        pressure = PressureReader.share(pressure_start, self.pressure.read(), self._clock() - pressure_at)
        machine = wire.fit_machine({**gauges, "cpu_percent": samples.machine.summary(),
                                    "cpu_steal_percent": samples.steal.summary(), "pressure": pressure})  # fmt: skip
        self.last_gauges = machine  # for registration, which must not read disks on the event loop
        memory = self.shard_sampler.memory()
        figures = {w.id: self._shard(w, samples.shards[w.id], memory.get(w.id)) for w in self.shard_sampler.specs}
        gpus, gpu_samples = self._merge_sources(figures)
        shards, shards_left_out = wire.fit_shards([(wire.made(Shard, f), samples.shards[wid])
                                                   for wid, f in figures.items()])  # fmt: skip
        held = None
        if self.hindsight is not None:
            self._keep_in_hindsight(self.hindsight, samples, gpu_samples, start_wall - start)
            self.hindsight.keep_window(window.start, window.end)
            held = self.hindsight.held_seconds()
        summary = wire.made(WindowSummary, {
            "node": self.node, "seq": self._seq, "backend": self.backend.name, "backend_reason": reason,
            "window": window, "machine": machine, "shards": [shard for shard, _ in shards],
            "shards_left_out": shards_left_out, "bpf": self._program_cost(), "hindsight_held_seconds": held, **gpus,
        })  # fmt: skip
        if self.raw_wanted:
            raw = self._raw(len(wire.encode(summary)), samples.first_from - start, samples.machine, shards,
                            gpu_samples, start_wall)  # fmt: skip
            summary = msgspec.structs.replace(summary, raw=msgspec.Raw(wire.dumps(raw)))
        if self.hindsight is not None and self.spans.asked is not None:
            room = wire.MAX_BODY_BYTES - len(wire.encode(summary)) - raw_samples.BODY_ROOM
            if (piece := self.spans.next_piece(self.hindsight, room)) is not None:
                summary = msgspec.structs.replace(summary, hindsight=msgspec.Raw(piece))
        return summary

    def _keep_in_hindsight(self, ring: HindsightRing, samples: _WindowSamples, gpu_samples: GpuSamples,
                           to_wall: float) -> None:  # fmt: skip
        """The window's samples into the ring, every series as the summary
        counted it: its last sample ends at the window's last (a wall time)."""
        assert self._last_sample_at is not None
        end = self._last_sample_at + to_wall
        values, seconds = samples.machine.samples()
        ring.keep(MACHINE, end, seconds, values)
        for wid, series in samples.shards.items():
            values, seconds = series.samples()
            ring.keep(f"shard:{wid}", end, seconds, values)
        for (index, field), (t_us, values) in gpu_samples.items():
            if field in HINDSIGHT_GPU_POINTS:
                ring.keep_points(raw_samples.gpu_key(index, field), t_us / 1e6, values)

    def _take_samples(self, start: float, seconds: float) -> _WindowSamples:
        """The window's samples, one every 1/hz from `start`; the GPUs and the
        engines' endpoints asked for on their own threads before it ends."""
        n = max(1, round(seconds * self.hz))
        # /proc's counters move in clock ticks: a shorter sample is merged, not made a rate.
        tick = 1.0 / USER_HZ
        shard_tick = tick if self.shard_sampler.finest_hz is not None else 0.0  # counted in ticks
        # A sample covers the time since the one before it, which may have been
        # the previous window's last: its weight must say so.
        last = start if self._last_sample_at is None else self._last_sample_at
        shards = {w.id: RateSeries(n, shard_tick) for w in self.shard_sampler.specs}
        samples = _WindowSamples(RateSeries(n, tick), RateSeries(n, tick), shards, taken=0, first_from=last)
        # The GPU reading is asked for before the window ends, on NVML's own
        # thread, and taken at the end only if it is ready: a slow or hung
        # driver costs this window its GPU figures, never its cadence.
        gpu_at = max(1, n - max(1, round(min(0.5, seconds / 2) * self.hz)))
        gpu_asked = False
        k = 1  # the slot: sample k is due at start + k / hz
        while True:
            delay = start + k / self.hz - self._clock()
            if delay > 0:
                self._sleep(delay)
            now = self._clock()
            cpu = self.cpu.sample()
            readings = self.shard_sampler.sample()
            for wid, r in readings.items():
                if r.cores is not None and r.cores > self._cpus * 1.01:
                    self._impossible(wid, r)
                samples.shards[wid].add(r.cores, now - last if r.seconds is None else r.seconds)
            samples.machine.add(cpu, now - last)
            samples.steal.add(self.cpu.steal, now - last)
            last = samples.last_at = now
            samples.taken += 1
            if k >= gpu_at and not gpu_asked:
                if self.gpus is not None:
                    self.gpus.request(self._members)
                # The engines' own queues, read once a window on threads of their own.
                self.engine_metrics.request((w.id, w.metrics_url) for w in self.shard_sampler.specs if w.metrics_url)
                gpu_asked = True
            if k >= n:
                break
            # Behind schedule (a slow walk, a GC pause, a busy CPU, this very
            # reading): the slots missed are skipped, not taken back to back;
            # the next sample's weight covers the gap. Judged after the reading,
            # so a slow one is not followed by one a few ms long. The window's
            # last slot is always taken.
            k = min(n, max(k + 1, int((self._clock() - start) * self.hz + 1e-6) + 1))
        self._last_sample_at = last
        return samples

    def _take_kernel_samples(self, start: float, seconds: float) -> _WindowSamples:
        """The window's samples as the kernel took them (sampler/kernel/sample_ring.py),
        read once a second: this process does not wake for each. The GPUs and
        the engines' endpoints asked for before it ends, as in _take_samples."""
        n = max(1, round(seconds * self.hz))
        tick = 1.0 / USER_HZ  # the machine's counters move a scheduler tick at a time
        last = start if self._last_sample_at is None else self._last_sample_at
        shards = {w.id: RateSeries(n, 0.0) for w in self.shard_sampler.specs}  # nanoseconds: no tick to merge
        samples = _WindowSamples(RateSeries(n, tick), RateSeries(n, tick), shards, taken=0, first_from=last)
        end = start + seconds
        # A sample is written a little after its time (the timer's latency,
        # and in an emulated guest the time before the write shows), so the
        # window's last can be due just before its end and not yet readable:
        # where the kernel's next sample was due by the end, the window waits
        # up to half a period more for it (none at all where each is on time).
        deadline = end
        gpu_at = end - min(0.5, seconds / 2)
        gpu_asked = False
        while True:
            now = self._clock()
            wake = min(now + KERNEL_READ_S, deadline if gpu_asked else gpu_at)
            if wake > now:
                self._sleep(wake - now)
            got = self.shard_sampler.take_kernel_samples()
            if got.lost:
                self._say("the agent read the kernel's samples too late: some were written over "
                          "(their time is in the next sample read)")  # fmt: skip
            if len(got.at) and got.at[0] <= last:
                # Taken between the last window's reading and its stamp: its time is
                # the window's before this one, counted there from the stamp on.
                got = got.after(last)
            if len(got.at):
                covers = np.diff(got.at, prepend=last)
                samples.machine.extend(got.machine, covers)
                samples.steal.extend(got.steal, covers)
                for wid, cores in got.shards.items():
                    if (over := np.flatnonzero(cores > self._cpus * 1.01)).size:
                        self._impossible(wid, ShardReading(float(cores[over[0]]), None, float(covers[over[0]])))
                    samples.shards[wid].extend(cores, covers)
                last = samples.last_at = float(got.at[-1])
                samples.taken += len(got.at)
            if not gpu_asked and self._clock() >= gpu_at:
                if self.gpus is not None:
                    self.gpus.request(self._members)
                self.engine_metrics.request((w.id, w.metrics_url) for w in self.shard_sampler.specs if w.metrics_url)
                gpu_asked = True
            if (now := self._clock()) >= end:
                if last + 1.0 / self.hz > end or now >= deadline > end:
                    break
                deadline = end + 0.5 / self.hz
        self._last_sample_at = last
        return samples

    def _merge_sources(self, figures: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], GpuSamples]:
        """Into each shard's figures, those of the window's other sources: its
        waits for a CPU, its cgroup's throttling, its GPUs, its own queues.
        The summary's GPU fields (the node's cards, or why there are none),
        and the GPUs' utilisation samples, for the raw block."""
        waits = self._waits()
        bandwidth = self.cfs.read(self._members)  # once a window: cumulative counters
        for sid, shard in figures.items():
            if (wait := waits.get(sid)) is not None:
                shard["runqueue_wait_seconds"] = wait
            shard.update(bandwidth.get(sid, {}))
        gpus: dict[str, Any] = {}
        gpu_samples: GpuSamples = {}
        if self.gpus is not None:
            if self.gpu_grace > 0:
                self.gpus.wait(self.gpu_grace)
            reading = self.gpus.take()
            gpus = self._add_gpus(figures, reading)
            if reading is not None:
                gpu_samples = {(index, "utilization_percent"): points
                               for index, points in reading.utilisation_samples.items()}  # fmt: skip
                gpu_samples.update(((index, f"{stem}_percent"), points) for index, by_stem in
                                   reading.gpm_samples.items() for stem, points in by_stem.items())  # fmt: skip
        if self.gpu_grace > 0:
            self.engine_metrics.wait(self.gpu_grace)
        queues = self.engine_metrics.take()
        for sid, shard in figures.items():
            shard.update(queues.get(sid, {}))
        return gpus, gpu_samples

    @staticmethod
    def _raw(summary_bytes: int, first_from: float, machine: RateSeries, shards: list[tuple[Shard, RateSeries]],
             gpu_samples: GpuSamples, start_wall: float) -> dict[str, Any]:  # fmt: skip
        """The window's samples for a live viewer, as the summary counted them
        (wire/raw.py): machine CPU, each sent shard's cores
        (by its id as sent), and the GPUs' points: NVML's utilisation samples
        and GPM's intervals."""
        cpu = raw_samples.rate_series(first_from, *machine.samples(), digits=4)
        by_card: dict[int, dict[str, Any]] = {}
        for (index, field), (t_us, v) in sorted(gpu_samples.items()):
            by_card.setdefault(index, {})[field] = raw_samples.gpu_points(t_us / 1e6 - start_wall, v)
        series = [(shard.id, raw_samples.rate_series(first_from, *cores.samples(), digits=5))
                  for shard, cores in shards]  # fmt: skip
        return raw_samples.fit_raw(summary_bytes, cpu, sorted(by_card.items()), series)

    def _impossible(self, wid: str, r: ShardReading) -> None:
        """A sample of more cores than the machine has is a bug in a backend, not
        a burst: said once per engine with what it came from, and kept as measured
        (clipping it would hide the bug and the time it holds)."""
        if self._said.first(("impossible", wid)):
            span = f"{r.seconds * 1e3:.3g} ms" if r.seconds is not None else "one"
            log.warning("engine %s: %.3f cores in a %s sample, more than the machine's %d CPUs can run in it. "
                        "The engine did not do this: the %s backend counted time into the wrong sample (a bug in "
                        "nodesampler, please report this line with the kernel's version). The sample is kept as "
                        "measured, so that no time is lost", wid, r.cores, span, self._cpus,
                        self.backend.name)  # fmt: skip

    def _waits(self) -> dict[str, dict[str, Any] | None]:
        """Each engine's waits for a CPU in this window: the kernel histogram where
        the backend has one, else the members' schedstat (once per window: cost
        follows the engines, not the machine)."""
        kernel = self.shard_sampler.runqueue_waits()
        if kernel is None:
            waits = self.runqueue.read(self._members)
        else:
            waits = {}
            for wid, wait in kernel.items():
                if wait is None:
                    waits[wid] = None
                    continue
                self._wait_cumulative[wid] = self._wait_cumulative.get(wid, 0.0) + wait["total"]
                waits[wid] = {**wait, "cumulative": round(self._wait_cumulative[wid], 6)}
        return waits

    @staticmethod
    def _add_gpus(figures: dict[str, dict[str, Any]], reading: GpuReading | None) -> dict[str, Any]:
        if reading is None or reading.gpus is None:
            # Not measured: no "gpus" at all, which would read as a node without GPUs.
            error = reading.error if reading is not None else "NVML did not answer before the window ended"
            return {"gpu_error": error}
        by_index = {g["index"]: g for g in reading.gpus if not g.get("lost")}
        instances = {(g["index"], i["gpu_instance_id"]): i
                     for g in by_index.values() for i in g.get("mig_instances", ())}  # fmt: skip
        for sid, shard in figures.items():
            if (used := reading.shard_memory.get(sid)) is not None:
                shard["gpu_memory_bytes"] = used
            shard.update(reading.shard_utilisation.get(sid, {}))
            if cards := reading.shard_cards.get(sid):
                shard["gpu_indices"] = sorted(cards)
                # Its cards' SMs beside its own share of them (GPM): the mean over the cards that say; on a
                # MIG card, over the instances it runs on (the whole card's is its neighbours' too).
                on = reading.shard_instances.get(sid, [])
                rows = [instances.get(k, {}) for k in on] + [by_index.get(i, {}) for i in cards
                                                             if not any(index == i for index, _ in on)]  # fmt: skip
                for key, card_key in (("gpu_sm_activity_percent", "sm_activity_percent"),
                                      ("gpu_tensor_activity_percent", "tensor_activity_percent")):
                    said = [row[card_key] for row in rows if card_key in row]
                    if said:
                        shard[key] = round(sum(said) / len(said), 2)
        return {"gpus": wire.fit_gpus(reading.gpus), "gpu_read_seconds": round(reading.seconds, 4)}

    def _program_cost(self) -> ProgramCost | None:
        """The kernel backend's forks it could not count, and (with
        --bpf-stats) its programs' run count and run time in this window, from
        the kernel's own BPF statistics."""
        dropped, now = self.shard_sampler.dropped_forks(), self.shard_sampler.program_stats()
        if dropped is None and not now:
            return None
        out: dict[str, Any] = {"dropped_forks": dropped}
        if tickless := self.shard_sampler.tickless_cpus:
            out["tickless_cpus"] = tickless  # a running task is learnt there at its next switch, not at the tick
        if not now:
            return wire.made(ProgramCost, out)
        before, self._program_stats = self._program_stats, now
        programs = {}
        for name, (ns, runs) in now.items():
            ns0, runs0 = before.get(name, (0, 0))
            d_ns, d_runs = ns - ns0, runs - runs0
            programs[name] = {"runs": d_runs, "run_time_ns": d_ns,
                              "ns_per_run": round(d_ns / d_runs, 1) if d_runs > 0 else None}  # fmt: skip
        return wire.made(ProgramCost, {**out, "programs": programs})

    def _shard(self, w: ShardSpec, cores: RateSeries, memory: int | None) -> dict[str, Any]:
        pgids, command = self.shard_sampler.describe(w.id)
        out: dict[str, Any] = {"id": w.id, "selector": str(w.selector)}
        if w.model is not None:
            out["model"] = w.model
        if w.replica is not None:
            out["replica"] = w.replica
        for key in ("namespace", "pod", "container"):
            if (value := getattr(w, key)) is not None:
                out[key] = value
        if len(pgids) == 1:
            out["pgid"] = pgids[0]
        out["pgids"] = pgids
        if command is not None:
            out["command"] = command
        out["cpu_cores"] = cores.summary()
        out["memory_bytes"] = memory
        return out
