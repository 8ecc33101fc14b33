"""Member offsets of kernel structs, from the running kernel's BTF.

The kernel backend reads fields of tasks other than the current one (the
child in `sched_process_fork`, the tasks in `sched_switch`), which no
helper returns: `pid`, `tgid` and the scheduler's own on-CPU time. The
headers bcc compiles against are not the running kernel's (a distribution's
headers for a VM kernel built elsewhere), so their offsets may be wrong;
`/sys/kernel/btf/vmlinux` describes the running kernel itself.

BTF layout: include/uapi/linux/btf.h (a header, then `btf_type` records, each
followed by kind-specific data, then a string table).
"""

from __future__ import annotations

import struct
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")
MAGIC = 0xEB9F

KIND_STRUCT, KIND_UNION = 4, 5

# Bytes that follow a btf_type record, per kind: a fixed part, and a part per vlen entry.
_TRAILER = {
    1: (4, 0),  # INT
    2: (0, 0),  # PTR
    3: (12, 0),  # ARRAY
    4: (0, 12),  # STRUCT: btf_member
    5: (0, 12),  # UNION
    6: (0, 8),  # ENUM
    7: (0, 0),  # FWD
    8: (0, 0),  # TYPEDEF
    9: (0, 0),  # VOLATILE
    10: (0, 0),  # CONST
    11: (0, 0),  # RESTRICT
    12: (0, 0),  # FUNC
    13: (0, 8),  # FUNC_PROTO: btf_param
    14: (4, 0),  # VAR
    15: (0, 12),  # DATASEC
    16: (0, 0),  # FLOAT
    17: (4, 0),  # DECL_TAG
    18: (0, 0),  # TYPE_TAG
    19: (0, 12),  # ENUM64
}


class BtfError(Exception):
    """BTF missing, malformed, or without the struct or member asked for."""


def struct_member_offsets(data: bytes, wanted: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """Byte offsets of named (non-bitfield, top-level) members of structs, in
    one pass over the types: {struct: {member: offset}}."""
    if len(data) < 24:
        raise BtfError("BTF too short")
    magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
    if magic != MAGIC:
        raise BtfError(f"not BTF (magic {magic:#x})")
    type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
    types = data[hdr_len + type_off : hdr_len + type_off + type_len]
    strings = data[hdr_len + str_off : hdr_len + str_off + str_len]

    def name(off: int) -> bytes:
        return strings[off : strings.find(b"\0", off)]

    want = {k.encode(): k for k in wanted}
    out: dict[str, dict[str, int]] = {}
    pos = 0
    while pos + 12 <= len(types) and len(out) < len(wanted):
        name_off, info, _size = struct.unpack_from("<III", types, pos)
        kind, vlen, kind_flag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        if kind not in _TRAILER:
            raise BtfError(f"unknown BTF kind {kind} at {pos}")
        fixed, per = _TRAILER[kind]
        body = pos + 12
        pos = body + fixed + per * vlen
        if kind != KIND_STRUCT or (struct_name := want.get(name(name_off))) is None or struct_name in out:
            continue
        found: dict[str, int] = {}
        for i in range(vlen):
            m_name, _m_type, m_offset = struct.unpack_from("<III", types, body + 12 * i)
            found[name(m_name).decode()] = m_offset & 0xFFFFFF if kind_flag else m_offset
        members = {}
        for m in wanted[struct_name]:
            if m not in found:
                raise BtfError(f"struct {struct_name} has no member {m!r}")
            if found[m] % 8:
                raise BtfError(f"{struct_name}.{m} is a bitfield")
            members[m] = found[m] // 8
        out[struct_name] = members
    for struct_name in wanted:
        if struct_name not in out:
            raise BtfError(f"no struct {struct_name} in BTF")
    return out


def task_offsets(path: Path = VMLINUX) -> dict[str, int]:
    """Where a task keeps its pid, its tgid, its scheduling policy, the CPU
    time the scheduler has accounted to it (se.sum_exec_runtime, ns) and that
    time when the fair class last picked it (se.prev_sum_exec_runtime), and
    its process's count of live threads (signal->live), in the running
    kernel."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BtfError(f"kernel BTF unreadable ({path}: {e.strerror}); needs CONFIG_DEBUG_INFO_BTF") from None
    found = struct_member_offsets(data, {"task_struct": ["pid", "tgid", "policy", "se", "signal"],
                                         "sched_entity": ["sum_exec_runtime", "prev_sum_exec_runtime"],
                                         "signal_struct": ["live"]})  # fmt: skip
    task, se = found["task_struct"], found["sched_entity"]
    out = {"pid": task["pid"], "tgid": task["tgid"], "policy": task["policy"],
           "runtime": task["se"] + se["sum_exec_runtime"], "picked_runtime": task["se"] + se["prev_sum_exec_runtime"],
           # The process's live threads (an atomic_t: its counter first), for its last thread's exit.
           "signal": task["signal"], "live": found["signal_struct"]["live"]}  # fmt: skip
    try:
        # The scheduler's run-queue wait per task (CONFIG_SCHED_INFO): optional,
        # its absence only leaves the wait histogram out.
        info = struct_member_offsets(data, {"task_struct": ["sched_info"], "sched_info": ["run_delay"]})
        out["run_delay"] = info["task_struct"]["sched_info"] + info["sched_info"]["run_delay"]
    except BtfError:
        pass
    return out
