"""What the agent costs as its sampling rate and the machine's process count
grow, measured from outside as an operator would, beside the floor of any
userspace sampler measured in the same run (our machines' speed varies
several-fold from day to day: the figures that mean something are the
ratios).

Cases, one after another on this machine:
- the floor: a bare Python loop that wakes 100 times a second on an
  absolute schedule and reads /proc/stat;
- the agent (`nodesampler agent`, heartbeats every --interval seconds to a
  control plane on this machine) at each of --rates, with each of --crowds
  sleeping processes added to the machine's.

The agent runs without hindsight (`--hindsight 0`): what it keeps of the
last minutes, and what that costs, is bench/hindsight_cost.py's.

Each case runs --warmup seconds (the kernel programs compiled, the first
windows sent), then its process's CPU time (user and system, all threads)
is read over --seconds. With each crowd, one full walk of /proc is timed in
this process: the agent walks at start and every few minutes (between, the
kernel says which processes matter), so the measured stretch holds none,
and the crowd's ratio is printed again with the walks' cost spread in. Printed for each: CPU as a share of one core, the
resident memory at the end, and the kernel programs' own run time a second
(the agent runs with --bpf-stats; read from the agent's program fds'
fdinfo). Then the targets of the issue that asked for this table, as
ratios of this run's figures:
- the agent at 100 Hz against the bare 100 Hz loop (target: below 1);
- the agent at 1000 Hz against itself at 10 Hz (target: at most 1.5);
- with the largest crowd against the smallest, at 100 Hz (at most 1.1);
- its resident memory at 100 Hz (within 10% of 56 MiB).

Root for the kernel backend (else /proc is measured, and said). Not a test:
no thresholds.

    .venv/bin/python bench/agent_rate_cost.py [--rates 10,100,1000] [--crowds 100,10000]
                                              [--seconds 30] [--warmup 20] [--interval 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_steady import CROWD, cpu_seconds, status  # noqa: E402

from sampler.shards.selectors import ProcessTable  # noqa: E402
from sampler.window.process_view import FULL_WALK_EVERY_S  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"bench secret, long enough to use"

# The floor: what any userspace sampler at 100 Hz pays to wake and read one file.
BARE_LOOP = """
import time
period, next_at = 0.01, time.monotonic()
print("ready", flush=True)
while True:
    with open("/proc/stat", "rb") as f:
        f.read()
    next_at += period
    time.sleep(max(0.0, next_at - time.monotonic()))
"""


@dataclass
class Measured:
    what: str
    cores: float  # CPU time over wall time
    rss_mib: float
    programs_ns_per_s: float | None  # the kernel programs' run time a second; None: not read


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def program_run_ns(pid: int) -> int | None:
    """The run time of every BPF program the process holds an fd of (fdinfo's
    run_time_ns, counted while BPF statistics are on)."""
    total, found = 0, False
    try:
        fds = list(Path(f"/proc/{pid}/fdinfo").iterdir())
    except OSError:
        return None
    for fd in fds:
        try:
            text = fd.read_text()
        except OSError:
            continue
        if "prog_type:" not in text:
            continue
        for line in text.splitlines():
            if line.startswith("run_time_ns:"):
                total += int(line.split()[1])
                found = True
    return total if found else None


def measure(what: str, pid: int, warmup: float, seconds: float, programs: bool) -> Measured:
    time.sleep(warmup)
    cpu0, ns0, t0 = cpu_seconds(pid), program_run_ns(pid) if programs else None, time.monotonic()
    time.sleep(seconds)
    cpu1, ns1, t1 = cpu_seconds(pid), program_run_ns(pid) if programs else None, time.monotonic()
    per_s = (ns1 - ns0) / (t1 - t0) if ns0 is not None and ns1 is not None else None
    return Measured(what, (cpu1 - cpu0) / (t1 - t0), status(pid)["VmRSS"] / 1024, per_s)


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def with_crowd(n: int) -> subprocess.Popen[bytes]:
    crowd = subprocess.Popen([sys.executable, "-c", CROWD, str(n)], stdout=subprocess.PIPE, start_new_session=True)
    assert crowd.stdout is not None
    crowd.stdout.readline()  # all forked
    return crowd


def full_walk_s() -> float:
    """What one walk of the whole of /proc takes here, in this process (the
    median of three): the agent walks at start and every FULL_WALK_EVERY_S."""
    times = []
    for _ in range(3):
        t0 = time.thread_time()
        ProcessTable.walk(Path("/proc"))
        times.append(time.thread_time() - t0)
    return sorted(times)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10,100,1000", help="the agent's --hz, comma-separated")
    ap.add_argument("--crowds", default="100,10000", help="sleeping processes added, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured, each case")
    ap.add_argument("--warmup", type=float, default=20.0, help="before measuring, each case")
    ap.add_argument("--interval", type=float, default=5.0, help="the agent's seconds per heartbeat")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    crowds = [int(c) for c in args.crowds.split(",")]
    rows: list[Measured] = []
    walks: dict[int, float] = {}  # crowd -> seconds of CPU one full walk of /proc takes
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        secret, token = Path(tmp) / "secret", Path(tmp) / "token"
        secret.write_bytes(SECRET)
        node = "bench-node"
        token.write_text(subprocess.run([sys.executable, "-m", "nodesampler", "token", node, "--secret-file",
                                         str(secret)], cwd=ROOT, check=True, capture_output=True,
                                        text=True).stdout.strip())  # fmt: skip
        port, pages = free_port(), free_port()
        cp = subprocess.Popen([sys.executable, "-m", "nodesampler", "controlplane", "--listen", f"127.0.0.1:{port}",
                               "--pages-listen", f"127.0.0.1:{pages}", "--secret-file", str(secret)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        stack.callback(stop, cp)

        bare = subprocess.Popen([sys.executable, "-c", BARE_LOOP], stdout=subprocess.PIPE)
        assert bare.stdout is not None and bare.stdout.readline()
        try:
            rows.append(measure("bare loop, 100 Hz, reads /proc/stat", bare.pid, min(2.0, args.warmup), args.seconds,
                                programs=False))  # fmt: skip
        finally:
            stop(bare)
        print(f"{'what':<44} {'CPU % of a core':>15} {'RSS MiB':>8} {'programs us/s':>14}", flush=True)
        print(_row(rows[-1]), flush=True)
        backend_said = ""
        for crowd_n in crowds:
            crowd = with_crowd(crowd_n)
            try:
                walks[crowd_n] = full_walk_s()
                what = f"a full walk of /proc, {crowd_n} more processes"
                print(f"{what:<44} {walks[crowd_n] * 1e3:12.1f} ms (every {FULL_WALK_EVERY_S:.0f} s: "
                      f"{100 * walks[crowd_n] / FULL_WALK_EVERY_S:.3f}% of a core)", flush=True)  # fmt: skip
                for hz in rates:
                    agent = subprocess.Popen([sys.executable, "-m", "nodesampler", "agent", "--control-plane",
                                              f"http://127.0.0.1:{port}", "--token-file", str(token), "--node", node,
                                              "--hz", f"{hz:g}", "--interval", f"{args.interval:g}", "--bpf-stats",
                                              "--hindsight", "0"],
                                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
                    try:
                        rows.append(measure(f"agent, {hz:g} Hz, {crowd_n} more processes", agent.pid, args.warmup,
                                            args.seconds, programs=True))  # fmt: skip
                    finally:
                        stop(agent)
                    assert agent.stderr is not None
                    err = agent.stderr.read().decode(errors="replace")
                    if "kernel backend unavailable" in err and not backend_said:
                        backend_said = err.strip().splitlines()[-1]
                    print(_row(rows[-1]), flush=True)
            finally:
                os.killpg(crowd.pid, signal.SIGKILL)
                crowd.wait()
    if backend_said:
        print("note: the kernel backend did not load:", backend_said)
    _targets(rows, rates, crowds, walks)


def _row(m: Measured) -> str:
    programs = "" if m.programs_ns_per_s is None else f"{m.programs_ns_per_s / 1000:14.1f}"
    return f"{m.what:<44} {100 * m.cores:15.2f} {m.rss_mib:8.1f} {programs}"


def _targets(rows: list[Measured], rates: list[float], crowds: list[int], walks: dict[int, float]) -> None:
    by = {m.what: m for m in rows}
    bare = rows[0]

    def agent(hz: float, crowd: int) -> Measured | None:
        return by.get(f"agent, {hz:g} Hz, {crowd} more processes")

    def whole(m: Measured) -> float:
        """The agent's CPU and its kernel programs' run time: a program that
        runs at a perf event's interrupt is charged to whoever it interrupts."""
        return m.cores + (m.programs_ns_per_s or 0.0) / 1e9

    print("\ntargets, as ratios of this run's figures (the agent's CPU; beside it, with its kernel programs' time):")

    def say(what: str, figure: str, target: str, with_programs: str = "") -> None:
        print(f"  {what:<48}{figure:>9}{with_programs:>9}  ({target})")

    if (a := agent(100, crowds[0])) is not None:
        say("agent at 100 Hz / the bare 100 Hz loop", f"{a.cores / bare.cores:.2f}", "target below 1",
            f"{whole(a) / bare.cores:.2f}")
        say("its resident memory at 100 Hz", f"{a.rss_mib:.1f} MiB", "target within 10% of 56 MiB")
    if len(set(rates)) > 1 and (lo := agent(min(rates), crowds[0])) and (hi := agent(max(rates), crowds[0])):
        say(f"agent at {max(rates):g} Hz / at {min(rates):g} Hz", f"{hi.cores / lo.cores:.2f}", "target at most 1.5",
            f"{whole(hi) / whole(lo):.2f}")
    if len(set(crowds)) > 1 and (few := agent(100, min(crowds))) and (many := agent(100, max(crowds))):
        say(f"at 100 Hz, {max(crowds)} / {min(crowds)} more processes", f"{many.cores / few.cores:.2f}",
            "target at most 1.1", f"{whole(many) / whole(few):.2f}")
        # The measured stretch holds no full walk (one at start, then every
        # FULL_WALK_EVERY_S): their cost spread over the time between them.
        every = {n: walks.get(n, 0.0) / FULL_WALK_EVERY_S for n in (min(crowds), max(crowds))}
        say("  the same, the full walks' cost spread in",
            f"{(many.cores + every[max(crowds)]) / (few.cores + every[min(crowds)]):.2f}", "target at most 1.1",
            f"{(whole(many) + every[max(crowds)]) / (whole(few) + every[min(crowds)]):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
