"""The control for the 6.1 stall (vagrant/README.md): what loading the kernel
backend does to the kernel's own code, with no BPF program and no bcc.

Attaching our programs enables three scheduler tracepoints, whose static keys
the kernel turns on by rewriting the call sites in place (`text_poke_bp`:
an int3 over the first byte, an IPI to every CPU, the rest, another IPI), and
opens a cpu-clock perf event on each CPU (an IPI to that CPU to install it).
Closing undoes both. This does the same through tracefs and perf_event_open,
round after round, while every CPU switches tasks as fast as it can (the
patched sites are in `__schedule`), and says every tenth round on the
console. Run by guest-init.sh for `nodesampler.poke_loop=N`.

    python3 vagrant/text_poke_loop.py ROUNDS [tracepoints,cpu-clock]

The second argument takes the round apart: only the tracepoints, or only
the cpu-clock events (`nodesampler.poke_parts=` on the guest's command line).
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import sys
import time

TRACEPOINTS = ("sched/sched_switch", "sched/sched_process_fork", "sched/sched_process_exit")
PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK = 1, 0
PERF_ATTR_SIZE = 112  # PERF_ATTR_SIZE_VER5
PERF_FLAG_FD_CLOEXEC = 8
SYS_PERF_EVENT_OPEN = 298  # x86_64
TICK_NS = 10_000_000  # sampler.kernel.build.TICK_NS

libc = ctypes.CDLL(None, use_errno=True)


def perf_event_open_cpu_clock(cpu: int) -> int:
    # perf_event_attr: type, size, config, sample_period; the rest zero
    # (enabled, no sampling fields: the event only runs its hrtimer).
    attr = struct.pack("IIQQ", PERF_TYPE_SOFTWARE, PERF_ATTR_SIZE, PERF_COUNT_SW_CPU_CLOCK, TICK_NS)
    buf = ctypes.create_string_buffer(attr.ljust(PERF_ATTR_SIZE, b"\0"), PERF_ATTR_SIZE)
    fd: int = libc.syscall(SYS_PERF_EVENT_OPEN, buf, -1, cpu, -1, PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"perf_event_open(cpu-clock, cpu {cpu})")
    return fd


def switch_forever(cpu: int) -> None:
    # Two processes on one CPU passing a byte back and forth: a context switch
    # each way, so the CPU is in __schedule thousands of times a second.
    os.sched_setaffinity(0, {cpu})
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    if os.fork() == 0:
        while True:
            os.read(a_r, 1)
            os.write(b_w, b"x")
    while True:
        os.write(a_w, b"x")
        os.read(b_r, 1)


def set_tracepoints(on: bool) -> None:
    for event in TRACEPOINTS:
        with open(f"/sys/kernel/tracing/events/{event}/enable", "w") as f:
            f.write("1" if on else "0")


def main() -> int:
    rounds = int(sys.argv[1])
    parts = set((sys.argv[2] if len(sys.argv) > 2 else "tracepoints,cpu-clock").split(","))
    if not parts or parts - {"tracepoints", "cpu-clock"}:
        raise SystemExit(f"text_poke_loop: parts are tracepoints and cpu-clock, not {sys.argv[2]!r}")
    cpus = sorted(os.sched_getaffinity(0))
    os.setpgid(0, 0)
    for cpu in cpus:
        if os.fork() == 0:
            switch_forever(cpu)
    t0 = time.monotonic()
    try:
        for i in range(1, rounds + 1):
            if "tracepoints" in parts:
                set_tracepoints(True)
            fds = [perf_event_open_cpu_clock(cpu) for cpu in cpus] if "cpu-clock" in parts else []
            for fd in fds:
                os.close(fd)
            if "tracepoints" in parts:
                set_tracepoints(False)
            if i % 10 == 0:
                print(f"NODESAMPLER-POKE={i} {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
