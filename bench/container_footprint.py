"""What the shipped pods use, measured from outside as an operator would:
the control plane's and an agent's containers run as deploy/kubernetes says
(tests/podman_pods.py), the agent sampling this machine at the manifest's
rate and heartbeating to the control plane over TLS.

Prints, per container: the main process's peak resident memory (VmHWM: for
the agent, reached while bcc compiles the kernel programs), its resident
memory and CPU (cores) over a steady minute after the first heartbeats, and
the cgroup's peak usage (page cache included: the kernel headers bcc reads
are charged to it, and are reclaimable). The manifests' requests and limits
are set from these figures with headroom.

Root, podman. Usage: PYTHONPATH=. .venv/bin/python bench/container_footprint.py [STEADY_SECONDS]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests import podman_pods as pods
from tests.test_containers import Cluster, until


def main_pid(name: str) -> int:
    out = subprocess.run(["podman", "inspect", "--format", "{{.State.Pid}}", name], capture_output=True, text=True)
    return int(out.stdout.strip())


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def cpu_seconds(pid: int) -> float:
    """The process's CPU (all threads, and children it reaped), from /proc/PID/stat."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def cgroup_peak_bytes(pid: int) -> int | None:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.max_usage_in_bytes"
            return int(f.read_text()) if f.exists() else None
        if controllers == "":
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.peak"
            if f.exists():
                return int(f.read_text())
    return None


def main() -> None:
    steady = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    image = subprocess.run(["bash", "deploy/build-image.sh"], capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory() as work:
        cluster = Cluster(Path(work), image.stdout.strip().splitlines()[-1])
        try:
            cluster.start_controlplane()
            agent = cluster.start_agent("bench-node", cluster.issuer.token("bench-node"))
            until("the first heartbeat", lambda: cluster.heartbeat("bench-node"))
            pids = {"agent": main_pid(agent), "controlplane": main_pid("nodesampler-test-cp")}
            start = {k: cpu_seconds(p) for k, p in pids.items()}
            t0 = time.monotonic()
            time.sleep(steady)
            elapsed = time.monotonic() - t0
            hb = cluster.heartbeat("bench-node")
            print(f"steady window {elapsed:.0f} s; the agent at the manifest's rate, "
                  f"{hb['window']['samples'] if hb else '?'} samples a window")  # fmt: skip
            for k, pid in pids.items():
                peak_cg = cgroup_peak_bytes(pid)
                print(f"{k:13s} peak RSS {status_kib(pid, 'VmHWM') / 1024:6.1f} MiB   "
                      f"steady RSS {status_kib(pid, 'VmRSS') / 1024:6.1f} MiB   "
                      f"CPU {(cpu_seconds(pid) - start[k]) / elapsed:.3f} cores   "
                      f"cgroup peak {'-' if peak_cg is None else f'{peak_cg / 2**20:.1f} MiB'}")  # fmt: skip
        finally:
            for name in cluster.names:
                pods.remove(name)
            cluster.api.close()


if __name__ == "__main__":
    main()
