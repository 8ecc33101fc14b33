"""The kernel programs compiled, loaded and attached by a short-lived child,
and handed to the agent as file descriptors.

bcc brings LLVM and clang into the process that compiles: about 60 MiB
resident once imported, 90 while compiling, and they stay mapped for the
process's life. The agent needs none of it once the programs run. So a child
(`python -m sampler.kernel.loader_child`) does everything bcc is needed for, sends
the agent the descriptors of the maps, the programs and their attachments
(raw tracepoints, cpu-clock perf events) over a Unix socket (SCM_RIGHTS), and
exits without bcc's cleanup, which would detach them. The agent holds the
programs attached for as long as it keeps the descriptors, maps what it
shares with the kernel and reads the rest through libbpf, the C library bcc
is built on (a few hundred KiB). No pin is left in bpffs: an agent that dies
takes its programs with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sampler.backend_unavailable import BackendUnavailable
from sampler.kernel.libbpf import BpfMap, libbpf

MAPS = ("task_slot", "slot_ns", "cpu_run", "dropped_forks", "wait_log", "sample_config", "sample_head", "sample_time",
        "sample_slots", "group_slot", "group_keyed", "tick_moves", "group_ticks", "group_ticks_full",
        "cgroup_slot", "cgroup_keyed")
FDS_PER_MESSAGE = 200  # the kernel takes at most 253 descriptors in one message (SCM_MAX_FD)
CHILD_SECONDS = 600  # compiling under emulation takes a minute; a child stuck in the kernel is given up on


@dataclass
class LoadedPrograms:
    """What the child handed over: the maps by name, the programs' descriptors
    by name, the attachments (closing them detaches the programs), and what
    the child learnt while loading."""

    maps: dict[str, BpfMap]
    programs: dict[str, int]
    attachments: list[int]
    pid_max: int
    cpus: int  # rows of the per-CPU arrays: the highest possible CPU id + 1
    tickless_cpus: list[int]
    notes: list[str]
    loader_peak_kib: int | None = None  # the child's peak resident memory (VmHWM): the compile's
    # on_sample's perf event, disabled, and where and how it samples (the CPU,
    # ring_len and ring_slots): None where the kernel takes no samples, and
    # `sample` says why ("error").
    sample_event: int | None = None
    sample: dict[str, Any] | None = None

    def close(self) -> None:
        """Detach first, then let the programs and maps go."""
        events = [self.sample_event] if self.sample_event is not None else []
        for fd in [*events, *self.attachments, *self.programs.values(), *(m.fd for m in self.maps.values())]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.attachments, self.programs, self.maps, self.sample_event = [], {}, {}, None


def scratch_file(name: str) -> BinaryIO:
    """A file in memory (memfd): the agent's root filesystem is read-only
    and the pod has no /tmp."""
    return os.fdopen(os.memfd_create(name, os.MFD_CLOEXEC), "w+b")


def load_programs(options: dict[str, Any]) -> LoadedPrograms:
    """Runs the child with `options` (build.compile_and_attach's
    arguments, as JSON) and receives the programs, or BackendUnavailable with
    the child's reason."""
    libbpf()  # what this process reads the maps with: missing, nothing is loaded
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message, one read
    package_root = str(Path(__file__).resolve().parents[2])
    # PYTHONFAULTHANDLER: a child that dies of a signal in bcc or LLVM still
    # says where, in its stderr.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
               PYTHONFAULTHANDLER="1")  # fmt: skip
    # The child's stderr goes to a file, not a pipe: read only on failure, a
    # pipe it filled would stall the hand-off.
    with parent, scratch_file("loader-stderr") as err:
        try:
            proc = subprocess.Popen([sys.executable, "-m", "sampler.kernel.loader_child", json.dumps(options),
                                     str(child.fileno())], pass_fds=(child.fileno(),), env=env,
                                    stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        finally:
            child.close()
        parent.settimeout(CHILD_SECONDS)
        try:
            header, fds = _receive(parent)
        except (OSError, ValueError) as e:
            proc.kill()
            how = _how_it_ended(proc.wait())
            err.seek(0)
            detail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            said = "; ".join(detail) or "no output"
            raise BackendUnavailable(f"the loader process failed ({e}; {how}): {said}") from None
        finally:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=CHILD_SECONDS)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if "error" in header:
        raise BackendUnavailable(header["error"])
    it = iter(fds)
    maps = {m["name"]: BpfMap(m["name"], next(it), m["value_size"], m["percpu"]) for m in header["maps"]}
    programs = {name: next(it) for name in header["programs"]}
    attachments = list(it)
    sample = header.get("sample")
    sample_event = attachments.pop() if sample is not None and "error" not in sample else None
    return LoadedPrograms(maps, programs, attachments, header["pid_max"], header["cpus"], header["tickless_cpus"],
                          header["notes"], header.get("peak_kib"), sample_event, sample)  # fmt: skip


def _how_it_ended(returncode: int) -> str:
    """A child's end in words: its exit status, or the signal that ended it
    (ours, SIGKILL, when it was still running)."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A JSON header, then its descriptors in messages of FDS_PER_MESSAGE."""
    data = sock.recv(1 << 20)
    if not data:
        raise ValueError("the loader process exited before answering")
    header = json.loads(data)
    fds: list[int] = []
    while len(fds) < header.get("fds", 0):
        msg, got, _flags, _addr = socket.recv_fds(sock, 1, FDS_PER_MESSAGE, socket.MSG_CMSG_CLOEXEC)
        if not msg:
            raise ValueError("the loader process exited while handing over")
        fds.extend(got)
    return header, fds
