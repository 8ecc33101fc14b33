"""The programs compiled, loaded and attached: what the loader child does
(sampler/kernel/loader_child.py), everything bcc is needed for."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sampler.backend_unavailable import BackendUnavailable
from sampler.kernel import btf, memory_order, tp_btf
from sampler.kernel.capabilities import check_capabilities
from sampler.kernel.headers import find_kernel_headers
from sampler.sources import procfs
from sampler.sources.cpu_lists import format_cpu_list, possible_cpus, tick_cpus

SOURCE = Path(__file__).resolve().parents[2] / "bpf" / "sched_groups.bpf.c"
MAX_SLOTS = 256  # slot 0 is "not watched"; the kernel keeps a slot in one byte
TICK_NS = 10_000_000
# The kernel's samples (on_sample): the ring holds RING_LEN of them, 4 s at
# the highest --hz (4 MiB of kernel memory, mapped by the agent a slot's column
# at a time), and each holds at most RING_SLOTS slots. The verifier walks every
# CPU's loop over them: 64 on 256 possible CPUs loads; 1024 CPUs do not.
RING_LEN = 4096
RING_SLOTS = 64
# The programs as the kernel names them; sched_switch's is on_switch (tp_btf)
# or, where that cannot load, on_switch_raw (a raw tracepoint).
PROGRAMS = ("on_switch", "on_tick", "raw_tracepoint__sched_process_fork", "raw_tracepoint__sched_process_exit",
            "on_sample")
SWITCH_PROGRAMS = ("on_switch", "on_switch_raw")


def compile_flags(offsets: dict[str, int], pid_max: int, cpus: int) -> list[str]:
    return [
        f"-DPID_MAX={pid_max}",
        f"-DNR_CPUS={cpus}",
        f"-DMAX_SLOTS={MAX_SLOTS}",
        f"-DTASK_PID_OFF={offsets['pid']}",
        f"-DTASK_TGID_OFF={offsets['tgid']}",
        f"-DTASK_RUNTIME_OFF={offsets['runtime']}",
        f"-DTASK_PICKED_RUNTIME_OFF={offsets['picked_runtime']}",
        f"-DTASK_POLICY_OFF={offsets['policy']}",
        f"-DTICK_NS={TICK_NS}",
        f"-DTASK_SIGNAL_OFF={offsets['signal']}",
        f"-DSIGNAL_LIVE_OFF={offsets['live']}",
        *([f"-DTASK_RUN_DELAY_OFF={offsets['run_delay']}"] if "run_delay" in offsets else []),
        *([f"-DSIGNAL_PGID_OFF={offsets['pgid']}", f"-DPID_NR_OFF={offsets['pid_nr']}",
           f"-DTASK_FLAGS_OFF={offsets['flags']}"] if "pgid" in offsets else []),
    ]


def read_pid_max(proc: Path) -> int:
    """The largest pid plus one: the size of the kernel's tgid-indexed map.
    Raising pid_max after the programs load leaves the new pids uncounted."""
    try:
        return int(procfs.read_bytes(proc / "sys" / "kernel" / "pid_max"))
    except (OSError, ValueError) as e:
        raise BackendUnavailable(f"cannot read pid_max: {e}") from None


def _compile(bpf_class: Any, source: Path, cflags: list[str], env: dict[str, str | None]) -> Any:
    """BPF(src_file=...), with what clang said read back from fd 2 for a
    failure's reason. fd 2 is not redirected: in the loader child it is the
    agent's scratch file (handoff.py), so that what LLVM prints before a
    fatal error's exit(1), with no exception to catch, still reaches the
    agent."""
    saved_env = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    said_from = _stderr_offset()
    try:
        return bpf_class(src_file=str(source).encode(), cflags=cflags)
    except Exception as e:
        lines = [ln for ln in _stderr_since(said_from).splitlines() if "error" in ln]
        detail = "; ".join(lines[:3]) or str(e).strip()
        raise BackendUnavailable(f"compiling or attaching {source.name} failed: {detail}") from None
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stderr_offset() -> int | None:
    """Where the next write to fd 2 lands, or None where it cannot be read back (a terminal, a pipe)."""
    try:
        return os.lseek(2, 0, os.SEEK_CUR)
    except OSError:
        return None


def _stderr_since(offset: int | None) -> str:
    """What was written to fd 2 from `offset` on: its last MiB at most
    (clang's diagnostics for this source are a few KiB)."""
    if offset is None:
        return ""
    try:
        end = os.fstat(2).st_size
        start = max(offset, end - (1 << 20))
        return os.pread(2, end - start, start).decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Attached:
    """What the loader child attached: bcc's BPF object (its maps, and the
    programs bcc loaded and attached), the programs loaded outside bcc with
    their attachments, and what was learnt on the way."""

    bpf: Any
    own_programs: dict[str, int]
    own_attachments: list[int]
    pid_max: int
    cpus: int  # rows of the per-CPU arrays
    tickless_cpus: list[int]
    notes: list[str]
    sample_event: int | None = None  # on_sample's perf event; None: not attached, for `sample_error`
    sample_cpu: int | None = None  # the CPU it fires on
    sample_error: str | None = None  # why the kernel takes no samples


def attach_sampler(bpf: Any, cpu: int) -> tuple[int, int]:
    """on_sample loaded (by this module, so that a refusal carries the
    verifier's reason) and attached to a cpu-clock perf event on `cpu`, left
    disabled until the agent sets its period (sampler/kernel/sample_ring.py):
    (program, event) descriptors. Through libbcc's attach call rather than
    BPF.attach_perf_event, which keeps one set of events per event type and
    would drop on_tick's."""
    from bcc import PerfSWConfig, PerfType
    from bcc.libbcc import lib

    prog = tp_btf.load(bpf.dump_func(b"on_sample"), "on_sample", tp_btf.BPF_PROG_TYPE_PERF_EVENT, "a perf event")
    fd = int(lib.bpf_attach_perf_event(prog, PerfType.SOFTWARE, PerfSWConfig.CPU_CLOCK, TICK_NS, 0, -1, cpu, -1))
    if fd < 0:
        os.close(prog)
        raise OSError(-fd, f"perf_event_open on CPU {cpu}: {os.strerror(-fd)}")
    fcntl.ioctl(fd, PERF_EVENT_IOC_DISABLE, 0)
    return prog, fd


# linux/perf_event.h: _IO('$', 0), _IO('$', 1), _IOW('$', 4, __u64)
PERF_EVENT_IOC_ENABLE, PERF_EVENT_IOC_DISABLE, PERF_EVENT_IOC_PERIOD = 0x2400, 0x2401, 0x40082404


def attach_switch(bpf: Any, raw: bool) -> tuple[dict[str, int], list[int], str | None]:
    """sched_switch's program attached: on_switch as tp_btf where it loads
    (its own program and attachment descriptors returned), else on_switch_raw
    as a raw tracepoint, through bcc, with a note saying why."""
    why = "asked for"
    if not raw:
        try:
            prog, link = tp_btf.load_and_attach(bpf.dump_func(b"on_switch"), "on_switch", "sched_switch")
            return {"on_switch": prog}, [link], None
        except OSError as e:
            why = e.strerror or str(e)
    try:
        bpf.attach_raw_tracepoint(tp=b"sched_switch", fn_name=b"on_switch_raw")
    except Exception as e:
        raise RuntimeError(f"{e} (as tp_btf: {why})") from None
    return {}, [], f"sched_switch attached as a raw tracepoint ({why}): a task switching in is read through a helper"


def compile_and_attach(
    proc: str, kernel_headers: list[str] | str | None, source: str, btf_path: str, sysfs: str,
    raw_switch: bool = False, rq_from_tick: bool = False,
) -> Attached:  # fmt: skip
    """What the loader child does (everything bcc is needed for): the
    programs compiled, loaded and attached, with pid_max, the per-CPU arrays'
    rows, the CPUs left without the cpu-clock tick, and notes for the agent's
    log; or BackendUnavailable, checked in the order an operator would fix
    things."""
    try:
        from bcc import BPF, PerfSWConfig, PerfType
    except ImportError as e:
        raise BackendUnavailable(f"bcc is not installed ({e}); install python3-bpfcc") from None
    check_capabilities(Path(proc))
    try:
        offsets = btf.task_offsets(Path(btf_path))
    except btf.BtfError as e:
        raise BackendUnavailable(str(e)) from None
    headers = find_kernel_headers(Path(kernel_headers[1]) if isinstance(kernel_headers, list) else kernel_headers)
    pid_max = read_pid_max(Path(proc))
    try:
        cpus = possible_cpus(Path(sysfs))
    except (OSError, ValueError) as e:
        raise BackendUnavailable(f"cannot tell which CPUs are possible: {e}") from None
    cflags = compile_flags(offsets, pid_max, cpus) + memory_order.program_flags() + headers.cflags
    notes = [f"kernel backend compiled against {headers.name}"]
    sample_error = None
    try:
        found = btf.sample_offsets(Path(btf_path))
        if rq_from_tick and "RQ_FROM_TICK" not in found:
            found = {k: v for k, v in found.items() if k not in ("CFS_RQ_TG_OFF", "TG_CFS_RQ_OFF")}
            found["RQ_FROM_TICK"] = 1
            notes.append("the kernel's samples find each CPU's run queue by its tick (asked for)")
        elif "RQ_FROM_TICK" in found:
            notes.append("the kernel's samples find each CPU's run queue by its tick "
                         "(a task group's cfs_rq is one per-CPU pointer here)")  # fmt: skip
        sample_flags = [f"-D{name}={value}" for name, value in found.items()]
        cflags += [*sample_flags, f"-DRING_LEN={RING_LEN}", f"-DRING_SLOTS={RING_SLOTS}"]
    except btf.BtfError as e:
        sample_error = str(e)
    bpf = _compile(BPF, Path(source), cflags, headers.env)
    try:
        ticked, tickless = tick_cpus(Path(sysfs))
    except (OSError, ValueError) as e:
        bpf.cleanup()
        raise BackendUnavailable(f"cannot tell which CPUs are online: {e}") from None
    try:
        own_programs, own_attachments, note = attach_switch(bpf, raw_switch)
    except Exception as e:
        bpf.cleanup()
        raise BackendUnavailable(f"attaching to sched_switch failed: {e}") from None
    if note:
        notes.append(note)
    try:
        # The tick only learns the slot of a task that was already running when
        # it was given one (samples count running slices themselves): 100 a
        # second, on every CPU but those kept free of ticks (nohz_full,
        # isolated), where such a task is learnt at its next switch.
        event = (PerfType.SOFTWARE, PerfSWConfig.CPU_CLOCK)
        if not tickless:
            bpf.attach_perf_event(ev_type=event[0], ev_config=event[1], fn_name=b"on_tick", sample_period=TICK_NS)
        else:
            # bcc keeps one CPU's events per attach: gathered, so all are handed over.
            events = {}
            for cpu in ticked:
                bpf.attach_perf_event(ev_type=event[0], ev_config=event[1], fn_name=b"on_tick",
                                      sample_period=TICK_NS, cpu=cpu)  # fmt: skip
                events.update(bpf.open_perf_events[event])
            bpf.open_perf_events[event] = events
    except Exception as e:
        for fd in [*own_attachments, *own_programs.values()]:
            os.close(fd)
        bpf.cleanup()
        raise BackendUnavailable(f"attaching the cpu-clock perf event failed: {e}") from None
    if tickless:
        notes.append(f"no cpu-clock tick on CPUs {format_cpu_list(tickless)} (nohz_full or isolated)")
    sample_event = sample_cpu = None
    if "-DRQ_FROM_TICK=1" in cflags and tickless and not sample_error:
        sample_error = (f"CPUs {format_cpu_list(tickless)} have no tick, which is what finds a CPU's run queue "
                        "where a task group's cfs_rq is one per-CPU pointer (7.2)")  # fmt: skip
    elif any(f.startswith("-DRING_LEN=") for f in cflags):
        # On a CPU that keeps its ticks: the first housekeeping one.
        cpu = ticked[0] if ticked else 0
        try:
            own_programs["on_sample"], sample_event = attach_sampler(bpf, cpu)
            sample_cpu = cpu
        except Exception as e:
            sample_error = f"on_sample did not load or attach: {str(e).strip()[-300:]}"
    if sample_error:
        notes.append(f"samples taken by the agent, not the kernel: {sample_error}")
    return Attached(bpf, own_programs, own_attachments, pid_max, cpus, tickless, notes, sample_event, sample_cpu,
                    sample_error)  # fmt: skip
