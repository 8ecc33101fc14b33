"""A bcc-compiled function loaded as a BTF-typed tracepoint program (tp_btf),
which bcc cannot do itself: its loader sets a tracing program's attach type
from the function's name prefix, and has none for tp_btf.

A tp_btf program receives the tracepoint's arguments typed by the kernel's
BTF, so the fields of a task it is handed are plain loads the verifier
checks, not a helper call each. bcc compiles the function (its maps already
resolved to descriptors in the instructions); this module loads those
instructions with the bpf system call (BPF_PROG_LOAD, prog type TRACING,
attach type BPF_TRACE_RAW_TP, the tracepoint's BTF id from libbpf) and
attaches them (BPF_RAW_TRACEPOINT_OPEN). Linux 5.5 and later.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import resource
from typing import Any

from sampler.kernel import libbpf

BPF_PROG_LOAD, BPF_RAW_TRACEPOINT_OPEN = 5, 17
BPF_PROG_TYPE_PERF_EVENT, BPF_PROG_TYPE_TRACING, BPF_TRACE_RAW_TP = 7, 26, 23
SYSCALL_NR = {"x86_64": 321, "aarch64": 280}
LOG_BYTES = 1 << 16


class LoadAttr(ctypes.Structure):
    """The BPF_PROG_LOAD part of union bpf_attr, as far as attach_btf_id."""

    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
        ("prog_btf_fd", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32),
        ("func_info", ctypes.c_uint64),
        ("func_info_cnt", ctypes.c_uint32),
        ("line_info_rec_size", ctypes.c_uint32),
        ("line_info", ctypes.c_uint64),
        ("line_info_cnt", ctypes.c_uint32),
        ("attach_btf_id", ctypes.c_uint32),
        ("attach_prog_fd", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class RawTracepointAttr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


def bpf(cmd: int, attr: Any) -> int:
    """The bpf system call: its result, or OSError with errno."""
    nr = SYSCALL_NR.get(platform.machine())
    if nr is None:
        raise OSError(f"no bpf system call number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    r = libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(r)


def tracepoint_btf_id(tracepoint: str) -> int:
    """The kernel's BTF id of a tracepoint's typed arguments (btf_trace_<name>),
    or OSError where the kernel's BTF has no such tracepoint."""
    lib = libbpf.libbpf()
    try:
        find = lib.libbpf_find_vmlinux_btf_id
    except AttributeError:  # a libbpf older than 0.0.6
        raise OSError(errno.ENOSYS, "this libbpf cannot look up the kernel's BTF (no libbpf_find_vmlinux_btf_id)") \
            from None
    find.argtypes = [ctypes.c_char_p, ctypes.c_int]
    find.restype = ctypes.c_int
    found = find(tracepoint.encode(), BPF_TRACE_RAW_TP)
    if found <= 0:
        raise OSError(-found, f"the kernel's BTF has no tracepoint {tracepoint} ({os.strerror(-found)})")
    return int(found)


def _load(attr: LoadAttr) -> int:
    """BPF_PROG_LOAD. Before 5.11 a program's memory counts against
    RLIMIT_MEMLOCK, checked against all the locked memory of the user (the
    maps an agent already holds included): EPERM then, as bcc and libbpf do,
    the limit is lifted and the load tried once more."""
    try:
        return bpf(BPF_PROG_LOAD, attr)
    except OSError as e:
        if e.errno != errno.EPERM:
            raise
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (OSError, ValueError):
            raise e from None
    return bpf(BPF_PROG_LOAD, attr)


def load(insns: bytes, name: str, prog_type: int, what: str, expected_attach_type: int = 0,
         attach_btf_id: int = 0) -> int:  # fmt: skip
    """A program's descriptor: `insns` loaded as `prog_type`; OSError on
    failure, with the verifier's last lines where it refused the program
    (`what` names it in the message)."""
    code = ctypes.create_string_buffer(insns, len(insns))
    license = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(LOG_BYTES)
    attr = LoadAttr(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ctypes.addressof(code),
                    license=ctypes.addressof(license), prog_name=name.encode()[:15],
                    expected_attach_type=expected_attach_type, attach_btf_id=attach_btf_id)  # fmt: skip
    try:
        return _load(attr)
    except OSError as e:
        # Again with the verifier's log, only now: logging slows a load that works.
        attr.log_level, attr.log_size, attr.log_buf = 1, LOG_BYTES, ctypes.addressof(log)
        with contextlib.suppress(OSError):
            os.close(_load(attr))
        said = [ln for ln in log.value.decode(errors="replace").splitlines()
                if ln.strip() and not ln.startswith(("processed ", "verification time"))][-2:]  # fmt: skip
        raise OSError(e.errno, f"loading {name} as {what}: {e.strerror}"
                      + (f": {' / '.join(said)}" if said else "")) from None  # fmt: skip


def load_and_attach(insns: bytes, name: str, tracepoint: str) -> tuple[int, int]:
    """(program fd, attachment fd) of `insns` as tp_btf/<tracepoint>; closing
    the attachment detaches it. OSError on failure, with the verifier's last
    lines where it refused the program."""
    btf_id = tracepoint_btf_id(tracepoint)
    prog = load(insns, name, BPF_PROG_TYPE_TRACING, f"tp_btf/{tracepoint}", BPF_TRACE_RAW_TP, btf_id)
    try:
        link = bpf(BPF_RAW_TRACEPOINT_OPEN, RawTracepointAttr(name=0, prog_fd=prog))
    except OSError as e:
        os.close(prog)
        raise OSError(e.errno, f"attaching {name} to tp_btf/{tracepoint}: {e.strerror}") from None
    return prog, link
