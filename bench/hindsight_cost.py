"""What hindsight (the agent's --hindsight ring of the last minutes'
samples) costs while nobody asks for it, measured from outside as an
operator would: the agent with 16 shards at each of --rates, the ring on
(the defaults, 15 minutes in 16 MiB) and off (--hindsight 0), one after the
other in the same run (our machines' speed varies several-fold from day to
day: the difference in one run is the figure).

Then, in this process, the ring itself: its arrays filled to the brim at
100 Hz, 32 series (the resident memory they take, against the budget), and
the time one window's samples take to keep (16 shards and the machine, a
5 s window at each rate).

Targets (issue #35): the ring costs at most 0.1% of a core more at 100 Hz;
its memory is within the budget. Not a test: no thresholds.

    .venv/bin/python bench/hindsight_cost.py [--rates 10,100,1000] [--seconds 30] [--warmup 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, suppress
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_rate_cost import ROOT, SECRET, Measured, free_port, measure, stop  # noqa: E402
from agent_steady import status  # noqa: E402

from sampler.window.hindsight import HindsightRing  # noqa: E402

SHARDS = 16
# Sixteen engines, each its own process group, each a little busy.
ENGINES = """
import os, sys, time
for _ in range(int(sys.argv[1])):
    if os.fork() == 0:
        os.setpgid(0, 0)
        while True:
            end = time.monotonic() + 0.001
            while time.monotonic() < end:
                pass
            time.sleep(0.05)
print("ready", flush=True)
time.sleep(3600)
"""


def start_engines() -> tuple[subprocess.Popen[bytes], list[int]]:
    p = subprocess.Popen([sys.executable, "-c", ENGINES, str(SHARDS)], stdout=subprocess.PIPE,
                         start_new_session=True)  # fmt: skip
    assert p.stdout is not None
    p.stdout.readline()
    deadline = time.monotonic() + 10
    while True:
        children = [int(c) for c in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
        if len(children) == SHARDS or time.monotonic() > deadline:
            return p, children
        time.sleep(0.05)


def ring_filled_mib() -> tuple[float, float, float]:
    """The resident memory a ring takes made, and filled to the brim (100
    Hz, every row), and its budget, MiB. The arrays a keep makes on the way
    are made once before, so that the heap already holds them."""
    capacity = HindsightRing(minutes=15, mib=16, hz=100).capacity
    ones = np.full(capacity, 0.01)
    HindsightRing(minutes=15, mib=16, hz=100, rows=1).keep("warm", 1e9, ones, ones)
    before = status_self()
    ring = HindsightRing(minutes=15, mib=16, hz=100)
    made = status_self()
    for row in range(len(ring.us)):
        ring.keep(f"shard:{row}", 1e9, ones, ones)
    filled = status_self()
    return (made - before) / 1024, (filled - before) / 1024, 16.0


def status_self() -> int:
    return status(int(Path("/proc/self").resolve().name))["VmRSS"]


def keep_window_us(hz: float) -> float:
    """Microseconds one 5 s window's samples (the machine and 16 shards) take to keep, the median of 20."""
    ring = HindsightRing(minutes=15, mib=16, hz=hz)
    n = int(5 * hz)
    seconds, values = np.full(n, 1 / hz), np.random.default_rng(0).random(n)
    times = []
    for k in range(20):
        t0 = time.perf_counter()
        end = 1e9 + 5 * (k + 1)
        ring.keep("machine", end, seconds, values)
        for s in range(SHARDS):
            ring.keep(f"shard:{s}", end, seconds, values)
        times.append(time.perf_counter() - t0)
    return sorted(times)[10] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10,100,1000", help="the agent's --hz, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured, each case")
    ap.add_argument("--warmup", type=float, default=20.0, help="before measuring, each case")
    ap.add_argument("--interval", type=float, default=5.0, help="the agent's seconds per heartbeat")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows: dict[tuple[float, bool], Measured] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        secret, token, config = Path(tmp) / "secret", Path(tmp) / "token", Path(tmp) / "shards.toml"
        secret.write_bytes(SECRET)
        node = "bench-node"
        token.write_text(subprocess.run([sys.executable, "-m", "nodesampler", "token", node, "--secret-file",
                                         str(secret)], cwd=ROOT, check=True, capture_output=True,
                                        text=True).stdout.strip())  # fmt: skip
        engines, pgids = start_engines()
        stack.callback(lambda: (engines.kill(), [_kill(p) for p in pgids]))
        config.write_text("".join(f'[[shard]]\nid = "engine-{i}"\nselect = "pgid:{pgid}"\n\n'
                                  for i, pgid in enumerate(pgids)))  # fmt: skip
        port, pages = free_port(), free_port()
        cp = subprocess.Popen([sys.executable, "-m", "nodesampler", "controlplane", "--listen", f"127.0.0.1:{port}",
                               "--pages-listen", f"127.0.0.1:{pages}", "--secret-file", str(secret)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        stack.callback(stop, cp)
        print(f"{len(pgids)} shards; {'what':<40} {'CPU % of a core':>15} {'RSS MiB':>8}", flush=True)
        for hz in rates:
            for on in (False, True):
                agent = subprocess.Popen([sys.executable, "-m", "nodesampler", "agent", "--control-plane",
                                          f"http://127.0.0.1:{port}", "--token-file", str(token), "--node", node,
                                          "--hz", f"{hz:g}", "--interval", f"{args.interval:g}", "--config",
                                          str(config), *([] if on else ["--hindsight", "0"])],
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
                try:
                    what = f"agent, {hz:g} Hz, hindsight {'on' if on else 'off'}"
                    rows[hz, on] = measure(what, agent.pid, args.warmup, args.seconds, programs=False)
                finally:
                    stop(agent)
                m = rows[hz, on]
                print(f"{m.what:<54} {100 * m.cores:15.2f} {m.rss_mib:8.1f}", flush=True)
    made, filled, budget = ring_filled_mib()
    print(f"\nthe ring (100 Hz, 32 series), resident: {made:.1f} MiB made, {filled:.1f} MiB filled to the brim; "
          f"budget {budget:.0f} MiB")
    for hz in rates:
        print(f"keeping one 5 s window at {hz:g} Hz (the machine and {SHARDS} shards): {keep_window_us(hz):.0f} us")
    print("\ntargets (issue #35), this run:")
    for hz in rates:
        off, on = rows[hz, False], rows[hz, True]
        print(f"- {hz:g} Hz: the ring costs {100 * (on.cores - off.cores):+.2f}% of a core "
              f"({on.cores / off.cores if off.cores else float('nan'):.2f}x), RSS {on.rss_mib - off.rss_mib:+.1f} MiB"
              + (" (target at 100 Hz: at most +0.10%)" if hz == 100 else ""))  # fmt: skip
    print(f"- memory filled: {filled:.1f} MiB against a budget of {budget:.0f} (target: within it)")


def _kill(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
