"""The loader child's entry point (`python -m sampler.kernel.loader_child`):
compiles and attaches the kernel programs with bcc, hands their descriptors
to the agent over the socket it was given (sampler/kernel/handoff.py), and exits
without bcc's cleanup, which would detach them."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from typing import Any

from sampler.backend_unavailable import BackendUnavailable
from sampler.kernel import build
from sampler.kernel.handoff import FDS_PER_MESSAGE, MAPS


def _send(sock: socket.socket, header: dict[str, Any], fds: list[int]) -> None:
    sock.sendall(json.dumps(dict(header, fds=len(fds))).encode())
    for i in range(0, len(fds), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"."], fds[i : i + FDS_PER_MESSAGE])


def _child(options: dict[str, Any], sock: socket.socket) -> None:
    try:
        attached = build.compile_and_attach(**options)
    except BackendUnavailable as e:
        _send(sock, {"error": str(e)}, [])
        return
    bpf = attached.bpf
    maps, fds = [], []
    for name in MAPS:
        try:
            table = bpf.get_table(name.encode())
        except KeyError:  # compiled out on this kernel (wait_* without run_delay)
            continue
        percpu = hasattr(table, "sLeaf")  # bcc's per-CPU tables: Leaf is every CPU's, sLeaf one CPU's
        size = ctypes.sizeof(table.sLeaf if percpu else table.Leaf)
        maps.append({"name": name, "value_size": size, "percpu": percpu})
        fds.append(table.map_fd)
    # bpf.funcs: the programs bcc loaded (a function dumped for loading
    # elsewhere is not among them); own_programs: those loaded without bcc.
    programs = {name.decode(): fn.fd for name, fn in bpf.funcs.items()} | attached.own_programs
    fds.extend(programs.values())
    fds.extend(bpf.raw_tracepoint_fds.values())
    fds.extend(attached.own_attachments)
    for events in bpf.open_perf_events.values():
        fds.extend(events.values())
    sample: dict[str, Any] = {"error": attached.sample_error}
    if attached.sample_event is not None:  # last, apart from the attachments: the agent sets its period
        fds.append(attached.sample_event)
        sample = {"cpu": attached.sample_cpu, "ring_len": build.RING_LEN, "ring_slots": build.RING_SLOTS}
    _send(sock, {"maps": maps, "programs": list(programs), "pid_max": attached.pid_max, "cpus": attached.cpus,
                 "tickless_cpus": attached.tickless_cpus, "notes": attached.notes, "peak_kib": _peak_kib(),
                 "sample": sample}, fds)  # fmt: skip


def _peak_kib() -> int | None:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)


if __name__ == "__main__":
    with socket.socket(fileno=int(sys.argv[2])) as out:
        try:
            _child(json.loads(sys.argv[1]), out)
        except Exception as e:  # anything else bcc raises: the agent falls back with it
            _send(out, {"error": f"loading the kernel programs failed: {type(e).__name__}: {e}"}, [])
    # Not through bcc's atexit cleanup: it would detach what the agent now holds.
    sys.stdout.flush()
    os._exit(0)
