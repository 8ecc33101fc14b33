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


def _sections(data: bytes) -> tuple[bytes, bytes]:
    """BTF's type section and its strings."""
    if len(data) < 24:
        raise BtfError("BTF too short")
    magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
    if magic != MAGIC:
        raise BtfError(f"not BTF (magic {magic:#x})")
    type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
    return (data[hdr_len + type_off : hdr_len + type_off + type_len],
            data[hdr_len + str_off : hdr_len + str_off + str_len])  # fmt: skip


def struct_member_offsets(data: bytes, wanted: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """Byte offsets of named (non-bitfield, top-level) members of structs, in
    one pass over the types: {struct: {member: offset}}."""
    types, strings = _sections(data)

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
        # The process group of a task, as the host's pid namespace numbers it
        # (signal->pids[PIDTYPE_PGID]->numbers[0].nr): optional, its absence
        # leaves joins and leaves of watched groups to the walk.
        pids = struct_member_offsets(data, {"signal_struct": ["pids"], "pid": ["numbers"], "upid": ["nr"],
                                            "task_struct": ["flags"]})  # fmt: skip
        pgid_index = enum_values(data, "pid_type")["PIDTYPE_PGID"]
        out["pgid"] = pids["signal_struct"]["pids"] + 8 * pgid_index
        out["pid_nr"] = pids["pid"]["numbers"] + pids["upid"]["nr"]
        out["flags"] = pids["task_struct"]["flags"]
    except (BtfError, KeyError):
        pass
    try:
        # The scheduler's run-queue wait per task (CONFIG_SCHED_INFO): optional,
        # its absence only leaves the wait histogram out.
        info = struct_member_offsets(data, {"task_struct": ["sched_info"], "sched_info": ["run_delay"]})
        out["run_delay"] = info["task_struct"]["sched_info"] + info["sched_info"]["run_delay"]
    except BtfError:
        pass
    return out


KIND_ENUM, KIND_VAR, KIND_DATASEC = 6, 14, 15


def _walk(data: bytes) -> tuple[bytes, bytes, list[tuple[int, int, int, int, int]]]:
    """The type section, the strings, and each type's (id, kind, vlen,
    name offset, where its trailer starts)."""
    types, strings = _sections(data)
    out, pos, type_id = [], 0, 0
    while pos + 12 <= len(types):
        type_id += 1
        name_off, info, _size = struct.unpack_from("<III", types, pos)
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        if kind not in _TRAILER:
            raise BtfError(f"unknown BTF kind {kind} at {pos}")
        fixed, per = _TRAILER[kind]
        out.append((type_id, kind, vlen, name_off, pos + 12))
        pos += 12 + fixed + per * vlen
    return types, strings, out


def enum_values(data: bytes, enum: str) -> dict[str, int]:
    """The values of an enum's names; BtfError where the BTF has no such enum."""
    types, strings, index = _walk(data)

    def name(off: int) -> str:
        return strings[off : strings.find(b"\0", off)].decode()

    for _tid, kind, vlen, name_off, body in index:
        if kind == KIND_ENUM and name(name_off) == enum:
            return {name(v_name): value for v_name, value in
                    (struct.unpack_from("<Ii", types, body + 8 * i) for i in range(vlen))}  # fmt: skip
    raise BtfError(f"the kernel's BTF has no enum {enum}")


def percpu_and_enums(data: bytes, variables: list[str], enum: str) -> tuple[dict[str, int], dict[str, int]]:
    """Where per-CPU variables lie in the kernel's per-CPU section
    (.data..percpu, as every CPU's copy lays them out), and the values of an
    enum's names."""
    types, strings, index = _walk(data)

    def name(off: int) -> str:
        return strings[off : strings.find(b"\0", off)].decode()

    var_names = {tid: name(name_off) for tid, kind, _v, name_off, _b in index if kind == KIND_VAR}
    offsets: dict[str, int] = {}
    values: dict[str, int] = {}
    for _tid, kind, vlen, name_off, body in index:
        if kind == KIND_DATASEC and name(name_off) == ".data..percpu":
            for i in range(vlen):
                var, offset, _size = struct.unpack_from("<III", types, body + 12 * i)
                if var_names.get(var) in variables:
                    offsets[var_names[var]] = offset
        elif kind == KIND_ENUM and name(name_off) == enum:
            for i in range(vlen):
                v_name, value = struct.unpack_from("<Ii", types, body + 8 * i)
                values[name(v_name)] = value
    for v in variables:
        if v not in offsets:
            raise BtfError(f"the kernel's BTF has no per-CPU variable {v}")
    if not values:
        raise BtfError(f"the kernel's BTF has no enum {enum}")
    return offsets, values


CPUTIME_FIELDS = ("CPUTIME_USER", "CPUTIME_NICE", "CPUTIME_SYSTEM", "CPUTIME_SOFTIRQ", "CPUTIME_IRQ", "CPUTIME_STEAL")


def sample_offsets(path: Path = VMLINUX) -> dict[str, int]:
    """What the kernel's sample program (on_sample) reads, in the running
    kernel: the way to every CPU's run queue (se.cfs_rq, then its group's
    per-CPU cfs_rq array, then each one's rq, checked by rq.cpu;
    CONFIG_FAIR_GROUP_SCHED), where kernel_cpustat's counters lie from
    runqueues in every CPU's per-CPU area, and the indices of the busy and stolen time in
    its counters. Where a group's cfs_rq is one per-CPU pointer (7.2), no
    program can index it by CPU: RQ_FROM_TICK, each CPU's tick learns its
    own rq from the task it interrupts. BtfError where any is missing."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BtfError(f"kernel BTF unreadable ({path}: {e.strerror})") from None
    found = struct_member_offsets(data, {"task_struct": ["se"], "sched_entity": ["cfs_rq"],
                                         "cfs_rq": ["tg", "rq"], "task_group": ["cfs_rq"], "rq": ["cpu"],
                                         "kernel_cpustat": ["cpustat"]})  # fmt: skip
    percpu, stats = percpu_and_enums(data, ["kernel_cpustat", "runqueues"], "cpu_usage_stat")
    missing = [f for f in CPUTIME_FIELDS if f not in stats]
    if missing:
        raise BtfError(f"enum cpu_usage_stat has no {', '.join(missing)}")
    out = {"TASK_CFS_RQ_OFF": found["task_struct"]["se"] + found["sched_entity"]["cfs_rq"],
           "CFS_RQ_RQ_OFF": found["cfs_rq"]["rq"], "RQ_CPU_OFF": found["rq"]["cpu"],
           # 7.2 keeps the idle accounting of tickless CPUs ahead of the counters.
           "KCPUSTAT_FROM_RQ": percpu["kernel_cpustat"] + found["kernel_cpustat"]["cpustat"] - percpu["runqueues"],
           "KCPUSTAT_FIELDS": max(stats[f] for f in CPUTIME_FIELDS) + 1}  # fmt: skip
    if _array_of_pointers(data, "task_group", "cfs_rq"):
        out |= {"CFS_RQ_TG_OFF": found["cfs_rq"]["tg"], "TG_CFS_RQ_OFF": found["task_group"]["cfs_rq"]}
    else:
        out["RQ_FROM_TICK"] = 1
    return out | {f.replace("CPUTIME_", "STAT_"): stats[f] for f in CPUTIME_FIELDS}


def _array_of_pointers(data: bytes, struct_name: str, member: str) -> bool:
    """Whether a struct's member is a pointer to pointers (`struct x **`)."""
    types, strings, index = _walk(data)
    by_id = {tid: (kind, body) for tid, kind, _v, _n, body in index}

    def name(off: int) -> str:
        return strings[off : strings.find(b"\0", off)].decode()

    def pointee(type_id: int) -> int | None:
        """The type a pointer points at, through typedefs and qualifiers; None: not a pointer."""
        for _ in range(16):
            kind, body = by_id.get(type_id, (0, 0))
            referred = struct.unpack_from("<I", types, body - 4)[0] if kind else 0
            if kind == 2:
                return int(referred)
            if kind not in (8, 9, 10, 11, 18):  # typedef, volatile, const, restrict, type tag
                return None
            type_id = referred
        return None

    for _tid, kind, vlen, name_off, body in index:
        if kind == KIND_STRUCT and name(name_off) == struct_name:
            for i in range(vlen):
                m_name, m_type, _off = struct.unpack_from("<III", types, body + 12 * i)
                if name(m_name) == member:
                    first = pointee(m_type)
                    return first is not None and pointee(first) is not None
    return False
