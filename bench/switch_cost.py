"""What the kernel backend adds to each context switch.

A two-process pipe ping-pong pinned to one CPU (bench/pingpong.c) switches as
fast as the machine can. Measured in the same run:
- the cost of one switch, from the ping-pong's own timing, programs unloaded;
- the programs' run time per switch, from the kernel's BPF statistics
  (run_time_ns / run count, via each program's fdinfo while BPF_ENABLE_STATS
  is held), with the ping-pong outside any shard and inside one,
  with sched_switch attached as tp_btf (the default) and as a raw
  tracepoint (the fallback), each run in turn;
- that as a share of one switch;
- the floor of that measurement: the run time the kernel's statistics report
  for an empty program attached the same way (the clock reads around each
  run are inside run_time_ns), so that the programs' own cost can be told
  apart from the cost of measuring it;
- the ping-pong's own timing with the programs loaded and the statistics off,
  as the agent runs: what a switch costs with them, seen from outside
  (noisier: the machine's drift is of the same order), and the same with
  only an empty program attached: the cost of attaching anything at all.

With `--against OTHER.bpf.c` it compares two versions of the program
instead (a change to it against the one before, for example from
`git show HEAD~1:bpf/sched_groups.bpf.c`, from the version with
on_switch on): each loaded in turn, `--runs`
times, in one process, so that the machine's drift falls on both alike;
beside the programs' run time per switch, on_sample's per sample (1000 a
second for a second, the ping-pong's group watched), and what the agent's
reads of the kernel's shared memory pay for their order
(sampler/kernel/memory_order.py): its fence as called here and libatomic's,
as a weakly ordered CPU calls it.

Needs root and a C compiler (gcc). Not a test: no thresholds.

    .venv/bin/python bench/switch_cost.py [--round-trips 200000] [--runs 5] [--against FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sampler.kernel import build, memory_order, sched
from sampler.kernel.build import SWITCH_PROGRAMS
from sampler.kernel.program_stats import enable_bpf_stats, program_stats
from sampler.shards.selectors import ProcessTable, Selector, ShardSpec

PROC = Path("/proc")
SOURCE = Path(__file__).resolve().parent / "pingpong.c"


def build_pingpong(tmp: Path) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("switch_cost: needs gcc to build bench/pingpong.c")
    exe = tmp / "pingpong"
    subprocess.run([cc, "-O2", "-o", str(exe), str(SOURCE)], check=True)
    return exe


def pingpong(exe: Path, trips: int, groups: sched.KernelShardSampler | None = None) -> tuple[int, float]:
    """(switches, ns per switch). With `groups`, the ping-pong is watched: its
    shell is made a member before it execs the ping-pong, whose child then
    joins at fork, as an engine's workers do."""
    p = subprocess.Popen(["sh", "-c", f"read go; exec {exe} {trips}"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, process_group=0)  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    if groups is not None:
        groups.discover([ShardSpec("pp", Selector.parse(f"pgid:{p.pid}"))], ProcessTable.walk(PROC))
    p.stdin.write("go\n")
    p.stdin.close()
    switches, ns = p.stdout.read().split()
    p.wait()
    return int(switches), float(ns)


def program_cost(groups: sched.KernelShardSampler, exe: Path, trips: int, watched: bool) -> tuple[float, float]:
    """(programs' ns per switch, ping-pong's ns per switch with them loaded)."""
    before = groups.program_stats()
    switches, ns = pingpong(exe, trips, groups if watched else None)
    after = groups.program_stats()
    run_ns = sum(after[n][0] - before[n][0] for n in after)
    [switch] = [n for n in SWITCH_PROGRAMS if n in after]
    runs = after[switch][1] - before[switch][1]
    # The ping-pong's switches dominate; the machine's others are in the count too.
    return run_ns / max(runs, switches), ns


EMPTY_RAW = b"RAW_TRACEPOINT_PROBE(sched_switch) { return 0; }"
EMPTY_INSNS = bytes([0xB7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])  # r0 = 0; exit


def empty_program(exe: Path, trips: int, raw: bool) -> tuple[float, float]:
    """A program that does nothing, attached as the switch program is (tp_btf,
    or a raw tracepoint): the ping-pong's ns per switch with it, timed from
    outside with the statistics off (the cost of attaching anything at all),
    then the run time the statistics report for it (their floor)."""
    from bcc import BPF

    from sampler.kernel import tp_btf

    b, fds = None, []
    try:
        if raw:
            b = BPF(text=EMPTY_RAW)
            fd = b.funcs[b"raw_tracepoint__sched_switch"].fd
        else:
            fd, link = tp_btf.load_and_attach(EMPTY_INSNS, "empty", "sched_switch")
            fds = [link, fd]
        outside = pingpong(exe, trips)[1]
        stats = enable_bpf_stats()
        if stats is None:
            raise SystemExit("switch_cost: the kernel's BPF statistics cannot be turned on (BPF_ENABLE_STATS)")
        fds.append(stats)
        before = program_stats(fd)
        pingpong(exe, trips)
        after = program_stats(fd)
    finally:
        for f in fds:
            os.close(f)
        if b is not None:
            b.cleanup()
    assert before is not None and after is not None
    return (after[0] - before[0]) / (after[1] - before[1]), outside


def sample_cost(groups: sched.KernelShardSampler) -> float | None:
    """on_sample's run time per sample: 1000 a second for a second (None where it did not load)."""
    if groups.ring is None:
        return None
    before = groups.program_stats()
    groups.ring.start(1000)
    time.sleep(1.0)  # the kernel samples meanwhile
    groups.ring.stop()
    after = groups.program_stats()
    runs = after["on_sample"][1] - before["on_sample"][1]
    return (after["on_sample"][0] - before["on_sample"][0]) / runs if runs else None


def fence_cost(fence: Callable[[], None], calls: int = 200_000) -> float:
    """ns a call."""
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fence()
    return (time.perf_counter_ns() - t0) / calls


def compare(exe: Path, trips: int, runs: int, other: Path) -> None:
    """The programs' run time per switch and on_sample's per sample, this
    version against `other`, each loaded in turn `runs` times; the agent's
    fences' cost a call."""
    sources = {"this program": build.SOURCE, str(other): other}
    cost: dict[str, dict[bool, list[float]]] = {name: {False: [], True: []} for name in sources}
    sample: dict[str, list[float]] = {name: [] for name in sources}
    for _ in range(runs):
        for name, source in sources.items():
            groups = sched.load(PROC, bpf_stats=True, source=source)
            try:
                for watched in (False, True):
                    cost[name][watched].append(program_cost(groups, exe, trips, watched)[0])
                if (ns := sample_cost(groups)) is not None:
                    sample[name].append(ns)
            finally:
                groups.close()
    for name, by in cost.items():
        per_sample = f"{statistics.median(sample[name]):5.0f} ns" if sample[name] else "not loaded"
        print(f"{name:<40} programs' run time per switch: not watched {statistics.median(by[False]):4.0f} ns "
              f"({min(by[False]):.0f}..{max(by[False]):.0f}), watched {statistics.median(by[True]):4.0f} ns "
              f"({min(by[True]):.0f}..{max(by[True]):.0f}); on_sample per sample {per_sample}; "
              f"median of {runs}")  # fmt: skip
    print(f"the agent's fence as called on this CPU ({platform.machine()}): "
          f"{fence_cost(memory_order.reader_fence()):.0f} ns a call; libatomic's, as a weakly ordered CPU calls it: "
          f"{fence_cost(memory_order.libatomic_fence()):.0f} ns a call (two a read of the ring, two a reading of "
          "the counters)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--round-trips", type=int, default=200000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--against", type=Path, help="another version of bpf/sched_groups.bpf.c to compare with")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_pingpong(Path(tmp))
        if args.against is not None:
            compare(exe, args.round_trips, args.runs, args.against)
            return
        # Each run: the bare switch, then both ways of attaching sched_switch
        # in turn, so that the machine's drift falls on all alike; for each,
        # the ping-pong timed from outside with the statistics off (as the
        # agent runs), then the programs' run time with them on.
        bare: list[float] = []
        floors: dict[bool, list[float]] = {False: [], True: []}
        outside: dict[tuple[bool, bool | None], list[float]] = {}  # None: the empty program
        costs: dict[tuple[bool, bool], list[float]] = {}
        for _ in range(args.runs):
            bare.append(pingpong(exe, args.round_trips)[1])
            for raw in (False, True):
                groups = sched.load(PROC, raw_switch=raw)
                try:
                    for watched in (False, True):
                        outside.setdefault((raw, watched), []).append(
                            pingpong(exe, args.round_trips, groups if watched else None)[1])
                finally:
                    groups.close()
                floor, empty_outside = empty_program(exe, args.round_trips, raw)
                floors[raw].append(floor)
                outside.setdefault((raw, None), []).append(empty_outside)
                groups = sched.load(PROC, bpf_stats=True, raw_switch=raw)
                try:
                    for watched in (False, True):
                        costs.setdefault((raw, watched), []).append(program_cost(groups, exe, args.round_trips,
                                                                                 watched)[0])  # fmt: skip
                finally:
                    groups.close()
    switch_ns = statistics.median(bare)
    print(f"one context switch, programs unloaded: {switch_ns:.0f} ns "
          f"(median of {args.runs}, {min(bare):.0f}..{max(bare):.0f})")  # fmt: skip
    for raw in (False, True):
        kind = "raw tracepoint (fallback)" if raw else "tp_btf (default)"
        floor = statistics.median(floors[raw])
        empty = outside[raw, None]
        e = statistics.median(empty)
        print(f"sched_switch as {kind}: an empty program's run time as the BPF statistics report it "
              f"(their floor) {floor:.0f} ns per run; from outside, statistics off: {e:.0f} ns per switch "
              f"({min(empty):.0f}..{max(empty):.0f}), {e - switch_ns:+.0f} ns = "
              f"{100 * (e - switch_ns) / switch_ns:+.1f}%")  # fmt: skip
        for watched in (False, True):
            cost, loaded = costs[raw, watched], outside[raw, watched]
            label = "ping-pong in a shard" if watched else "ping-pong not watched"
            c, o = statistics.median(cost), statistics.median(loaded)
            print(f"  {label:<30} programs' run time per switch {c:4.0f} ns ({min(cost):.0f}..{max(cost):.0f}) "
                  f"= {100 * c / switch_ns:4.1f}% of a switch; above the floor {c - floor:4.0f} ns "
                  f"= {100 * (c - floor) / switch_ns:4.1f}%; from outside, statistics off: {o:.0f} ns per switch "
                  f"({min(loaded):.0f}..{max(loaded):.0f}), {o - switch_ns:+.0f} ns = "
                  f"{100 * (o - switch_ns) / switch_ns:+.1f}%")  # fmt: skip

if __name__ == "__main__":
    main()
