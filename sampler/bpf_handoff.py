"""The kernel programs compiled, loaded and attached by a short-lived child,
and handed to the agent as file descriptors.

bcc brings LLVM and clang into the process that compiles: about 60 MiB
resident once imported, 90 while compiling, and they stay mapped for the
process's life. The agent needs none of it once the programs run. So a child
(`python -m sampler.bpf_handoff`) does everything bcc is needed for, sends
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
import ctypes
import ctypes.util
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from sampler.backend import BackendUnavailable

MAPS = ("task_slot", "slot_ns", "cpu_run", "dropped_forks", "wait_log")
FDS_PER_MESSAGE = 200  # the kernel takes at most 253 descriptors in one message (SCM_MAX_FD)
CHILD_SECONDS = 600  # compiling under emulation takes a minute; a child stuck in the kernel is given up on


@dataclass
class BpfMap:
    """One map of the loaded programs, read by its descriptor through libbpf."""

    name: str
    fd: int
    value_size: int  # one CPU's value for a per-CPU map
    percpu: bool
    _lib: Any = field(default=None, repr=False)
    _key: ctypes.c_uint32 = field(default_factory=ctypes.c_uint32, repr=False)
    _value: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._lib = libbpf()
        cpus = self._lib.libbpf_num_possible_cpus() if self.percpu else 1
        # The kernel lays per-CPU values out at 8-byte strides, one per possible CPU.
        stride = (self.value_size + 7) // 8 * 8 if self.percpu else self.value_size
        self._value = ctypes.create_string_buffer(stride * cpus)

    def lookup(self, key: int) -> bytes:
        """The value at an array index (every CPU's, for a per-CPU map)."""
        self._key.value = key
        if self._lib.bpf_map_lookup_elem(self.fd, ctypes.byref(self._key), self._value) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"reading {self.name}[{key}]: {os.strerror(err)}")
        return bytes(self._value.raw)


_libbpf: Any = None


def libbpf() -> Any:
    """libbpf, as bcc's own packages bring it (Debian's libbpf1)."""
    global _libbpf
    if _libbpf is None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise BackendUnavailable(f"libbpf is not installed ({e}); install libbpf1") from None
        lib.bpf_map_lookup_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.bpf_map_lookup_elem.restype = ctypes.c_int
        lib.libbpf_num_possible_cpus.restype = ctypes.c_int
        _libbpf = lib
    return _libbpf


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

    def close(self) -> None:
        """Detach first, then let the programs and maps go."""
        for fd in [*self.attachments, *self.programs.values(), *(m.fd for m in self.maps.values())]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.attachments, self.programs, self.maps = [], {}, {}


def scratch_file(name: str) -> BinaryIO:
    """A file in memory (memfd): the agent's root filesystem is read-only
    and the pod has no /tmp."""
    return os.fdopen(os.memfd_create(name, os.MFD_CLOEXEC), "w+b")


def load_programs(options: dict[str, Any]) -> LoadedPrograms:
    """Runs the child with `options` (bpf_sched.compile_and_attach's
    arguments, as JSON) and receives the programs, or BackendUnavailable with
    the child's reason."""
    libbpf()  # what this process reads the maps with: missing, nothing is loaded
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message, one read
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    # The child's stderr goes to a file, not a pipe: read only on failure, a
    # pipe it filled would stall the hand-off.
    with parent, scratch_file("loader-stderr") as err:
        try:
            proc = subprocess.Popen([sys.executable, "-m", "sampler.bpf_handoff", json.dumps(options),
                                     str(child.fileno())], pass_fds=(child.fileno(),), env=env,
                                    stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        finally:
            child.close()
        parent.settimeout(CHILD_SECONDS)
        try:
            header, fds = _receive(parent)
        except (OSError, ValueError) as e:
            proc.kill()
            proc.wait()
            err.seek(0)
            detail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            raise BackendUnavailable(f"the loader process failed ({e}): {'; '.join(detail) or 'no output'}") from None
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
    return LoadedPrograms(maps, programs, attachments, header["pid_max"], header["cpus"], header["tickless_cpus"],
                          header["notes"], header.get("peak_kib"))  # fmt: skip


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


def _send(sock: socket.socket, header: dict[str, Any], fds: list[int]) -> None:
    sock.sendall(json.dumps(dict(header, fds=len(fds))).encode())
    for i in range(0, len(fds), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"."], fds[i : i + FDS_PER_MESSAGE])


def _child(options: dict[str, Any], sock: socket.socket) -> None:
    from sampler import bpf_sched

    try:
        attached = bpf_sched.compile_and_attach(**options)
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
    _send(sock, {"maps": maps, "programs": list(programs), "pid_max": attached.pid_max, "cpus": attached.cpus,
                 "tickless_cpus": attached.tickless_cpus, "notes": attached.notes, "peak_kib": _peak_kib()},
          fds)  # fmt: skip


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
