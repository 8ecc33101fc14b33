"""The agent's memory and CPU over a steady run, measured from outside as an
operator would: `nodesampler up` (a control plane and an agent on this
machine) at --hz, the agent process's resident memory read from
/proc/PID/status every --every seconds.

Prints the agent's peak (VmHWM, reached while it starts), its resident
memory at the first and last readings after the first minute and their
median (flat: no leak), its anonymous and file-backed parts, and the CPU it
used over the steady period (cores).

Root for the kernel backend (else /proc is measured, and said). Not a test:
no thresholds.

    .venv/bin/python bench/agent_steady.py [--hz 100] [--seconds 240] [--every 10] [--processes 3000] [--profile SVG]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


_LIBC = ctypes.CDLL(None, use_errno=True)


def cpu_seconds(pid: int) -> float:
    """The process's CPU time, every thread's (those that ended too), to the
    nanosecond: its CPU-time clock (clock_getcpuclockid). /proc/PID/stat's
    utime and stime move in ticks of 10 ms: an agent that uses 60 ms in a
    25 s measurement read 1.33 in one run and 1.83 in the next for the
    same ratio."""
    clock = ctypes.c_int()
    if err := _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)):
        raise OSError(err, f"clock_getcpuclockid({pid}): {os.strerror(err)}")
    return time.clock_gettime(clock.value)


def agent_of(up: int, deadline: float) -> int:
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{up}/task/{up}/children").read_text().split():
            if b"\0agent\0" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
        time.sleep(0.2)
    raise SystemExit("agent_steady: no agent process appeared")


# N sleeping processes in a session of their own, which the bench kills whole.
CROWD = """
import os, signal, sys
for _ in range(int(sys.argv[1])):
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
print("forked", flush=True)
signal.pause()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hz", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--every", type=float, default=10.0)
    ap.add_argument("--listen", default="127.0.0.1:18480")
    ap.add_argument("--processes", type=int, default=0, help="sleeping processes to add to the machine's")
    ap.add_argument("--profile", type=Path, default=None, metavar="SVG",
                    help="also record the agent with py-spy over the steady period (a flame graph)")
    args = ap.parse_args()
    crowd = subprocess.Popen([sys.executable, "-c", CROWD, str(args.processes)], stdout=subprocess.PIPE,
                             start_new_session=True) if args.processes else None  # fmt: skip
    if crowd is not None and crowd.stdout is not None:
        crowd.stdout.readline()  # all forked
    state = tempfile.TemporaryDirectory(prefix="agent-steady-")  # not the user's own state directory
    up = subprocess.Popen([sys.executable, "-m", "nodesampler", "up", "--listen", args.listen, "--hz", str(args.hz),
                           "--state-dir", state.name],
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        agent = agent_of(up.pid, time.monotonic() + 60)
        time.sleep(60)  # started, the first heartbeats sent
        readings = []
        spy = None
        if args.profile is not None:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(agent),
                                    "--duration", str(int(args.seconds)), "--output", str(args.profile),
                                    "--nonblocking", "--rate", "50"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)  # fmt: skip
        cpu0, t0 = cpu_seconds(agent), time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            readings.append(status(agent))
            time.sleep(args.every)
        cores = (cpu_seconds(agent) - cpu0) / (time.monotonic() - t0)
        peak = status(agent)["VmHWM"]
        backend = "kernel" if os.geteuid() == 0 else "/proc (not root)"
        processes = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit())
        if spy is not None:
            spy.wait()
    finally:
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=30)
        if crowd is not None:
            os.killpg(crowd.pid, signal.SIGKILL)
            crowd.wait()
    rss = [r["VmRSS"] / 1024 for r in readings]
    print(f"agent at {args.hz:g} Hz, {backend} backend, {args.seconds:g} s steady after a minute, "
          f"{len(readings)} readings, {processes} processes on the machine at the end")  # fmt: skip
    print(f"peak (VmHWM)      {peak / 1024:7.1f} MiB")
    print(f"resident first    {rss[0]:7.1f} MiB")
    print(f"resident last     {rss[-1]:7.1f} MiB")
    print(f"resident median   {statistics.median(rss):7.1f} MiB "
          f"(anonymous {readings[-1]['RssAnon'] / 1024:.1f}, files {readings[-1]['RssFile'] / 1024:.1f})")  # fmt: skip
    print(f"CPU               {cores * 100:7.2f} % of a core")
    if "kernel backend unavailable" in err:
        print("note: the kernel backend did not load:", err.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
