"""Which processes make up an engine: selectors and the process table
they are resolved against.

A selector names processes the way an operator knows an engine:
- `pgid:N`       the process group N;
- `pid:N`        the process group that process N belongs to;
- `cmdline:RE`   every process group whose leader's command line matches RE
                 (searched, so a fragment of the command line is enough),
                 judged on the line's first CMDLINE_PREFIX_BYTES (32 KiB) with
                 RE2, in time linear in that prefix: any user on the node
                 writes command lines (up to about 2 MB), and Python's `re`
                 took 0.32 s on 44k characters of `vllm serve ` against the
                 README's own `vllm serve .*llama-70b` (quadratic; 2 MB is
                 minutes, holding the GIL). A pattern RE2 cannot run
                 (backreferences, lookaround) is refused when the config loads;
- `comm:NAME`    every process group whose leader's command name (the
                 kernel's 15-character `comm`) is NAME: how the agent names
                 the busiest groups without a config, so that an engine's
                 series outlive its process group (as process-exporter does);
- `cgroup:PATH`  every process in the cgroup PATH or below it (v2 path, or the
                 path in any v1 hierarchy), e.g. a pod's or a systemd unit's;
- `k8s:NAMESPACE/LABEL_SELECTOR[#CONTAINER]`  each pod on this node that
                 matches, one shard per pod (sampler/shards/pods.py): the agent turns
                 it into one `containers:` shard per pod at each walk.

`containers:ID,ID` (the processes in those containers, by the ids their
cgroup paths name) is what a pod becomes; it is not for configs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import re2

from sampler.shards import container_ids
from sampler.shards.pods import Pod, PodSelector
from sampler.sources import cgroup_view, procfs

KINDS = ("pgid", "pid", "cmdline", "comm", "cgroup", "k8s")
# The kinds that name whole process groups: where every shard's selector is
# one, a group alone decides which shards count its processes.
GROUP_KINDS = frozenset({"pgid", "pid", "cmdline", "comm"})
# The kinds that name whole cgroups: where every shard's selector is one, a
# process's cgroup alone decides which shards count it.
CGROUP_KINDS = frozenset({"cgroup", "containers"})
T = TypeVar("T")
# How much of a leader's command line is read and matched: enough for any
# engine's flags (a vLLM line with every option is about 2 KiB), small enough
# that a tenant's 2 MB line costs what 32 KiB does.
CMDLINE_PREFIX_BYTES = 32 * 1024


class Pattern(Protocol):
    """A compiled `cmdline:` regex: RE2's, searched in linear time."""

    def search(self, text: str) -> object | None: ...


def compile_cmdline_pattern(text: str) -> Pattern:
    """RE2, with its own error log off: a refused pattern is one line of ours."""
    options = re2.Options()
    options.log_errors = False
    try:
        pattern: Pattern = re2.compile(text, options)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"{reason} (cmdline: patterns are RE2: no backreferences or lookaround)") from None
    return pattern


@dataclass(frozen=True)
class Selector:
    kind: str
    value: str
    pattern: Pattern | None = field(default=None, compare=False)
    pods: PodSelector | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, text: str) -> Selector:
        kind, sep, value = text.partition(":")
        if not sep or kind not in KINDS:
            raise ValueError(f"selector {text!r}: expected one of {', '.join(k + ':...' for k in KINDS)}")
        if kind in ("pgid", "pid"):
            if not value.isdigit() or int(value) <= 0:
                raise ValueError(f"selector {text!r}: {kind} must be a positive integer")
            return cls(kind, str(int(value)))
        if kind == "cmdline":
            try:
                return cls(kind, value, compile_cmdline_pattern(value))
            except ValueError as e:
                raise ValueError(f"selector {text!r}: bad regular expression: {e}") from None
        if kind == "k8s":
            return cls(kind, value, pods=PodSelector.parse(value))
        if kind == "comm":
            if not 0 < len(value.encode()) <= 15:
                raise ValueError(f"selector {text!r}: a command name is 1-15 bytes")
            return cls(kind, value)
        if not value.startswith("/"):
            raise ValueError(f"selector {text!r}: cgroup path must start with '/'")
        return cls(kind, value.rstrip("/") or "/")

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"

    def names_cgroup(self, path: str) -> bool:
        """Whether a process in the cgroup at this host path is the
        selector's (a `cgroup:` or `containers:` one)."""
        if self.kind == "containers":
            return container_ids.from_cgroup_path(path) in self.value.split(",")
        prefix = "" if self.value == "/" else self.value
        return self.kind == "cgroup" and (path == self.value or path.startswith(prefix + "/"))


@dataclass(frozen=True)
class ShardSpec:
    """One engine to report: a shard of the heartbeat."""

    id: str
    selector: Selector
    model: str | None = None
    replica: str | None = None
    metrics_url: str | None = None  # the engine's own Prometheus endpoint: its queue, read once a window
    # A `k8s:` shard: which pod labels give its pods' model and replica.
    model_label: str | None = None
    replica_label: str | None = None
    # Who the engine is to Kubernetes (a pod's shard): shown and exported as labels.
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None


class ProcessTable:
    """One full walk of /proc: every process's stat, and (read only when a
    selector needs them) leaders' command lines and processes' cgroups.

    This walk is what makes /proc expensive: about 40 us a process from Python.
    It runs at most once per window; the samples in between read only the
    members it found.

    A `cmdline:` selector is matched against a leader once, not once a walk:
    a table given the walk before keeps that walk's verdicts for each leader
    (the same pid and start time) whose command line prefix reads the same.
    Reading a prefix is a bounded copy; matching it is the work worth saving
    (about 50 us for 32 KiB with RE2, for thousands of leaders).
    """

    def __init__(self, proc: Path, stats: dict[int, procfs.PidStat], before: ProcessTable | None = None,
                 cgroup_root: Path = cgroup_view.CGROUP_ROOT) -> None:  # fmt: skip
        self.proc = proc
        self.cgroup_root = cgroup_root  # the host's cgroup tree
        self.stats = stats
        self.by_group: dict[int, list[int]] = {}
        for pid, st in stats.items():
            self.by_group.setdefault(st.pgrp, []).append(pid)
        self._cgroups: dict[int, list[tuple[bytes, bytes, str]] | None] = {}
        self._containers: dict[int, str] | None = None
        # (pid, start ticks) -> (a digest of the prefix read, {pattern: verdict})
        self._verdicts: dict[tuple[int, int], tuple[bytes, dict[str, bool]]] = {}
        self._verdicts_before = before._verdicts if before is not None else {}

    @classmethod
    def walk(cls, proc: Path, before: ProcessTable | None = None,
             cgroup_root: Path = cgroup_view.CGROUP_ROOT) -> ProcessTable:  # fmt: skip
        return cls.of(proc, procfs.list_pids(proc), before, cgroup_root)

    @classmethod
    def of(cls, proc: Path, pids: Iterable[int], before: ProcessTable | None = None,
           cgroup_root: Path = cgroup_view.CGROUP_ROOT) -> ProcessTable:  # fmt: skip
        """A table of these processes alone (those that still exist): where
        the kernel says which processes and groups matter, a window reads
        those, not the whole of /proc (sampler/window/process_view.py)."""
        stats = {}
        for pid in pids:
            try:
                stats[pid] = procfs.read_pid_stat(proc, pid)
            except (procfs.ProcessGone, procfs.ProcParseError):
                # Gone between listing and reading, or half-written: not a member this time.
                continue
        return cls(proc, stats, before, cgroup_root)

    def cmdline_bytes(self, pid: int) -> bytes | None:
        """The first CMDLINE_PREFIX_BYTES of the process's command line, as the kernel has it."""
        try:
            return procfs.read_pid_file(self.proc, pid, "cmdline", CMDLINE_PREFIX_BYTES)
        except (procfs.ProcessGone, OSError):
            return None

    def cmdline(self, pid: int) -> str | None:
        """The command line's prefix, its arguments joined by spaces."""
        data = self.cmdline_bytes(pid)
        return None if data is None else procfs.parse_cmdline(data)

    def cmdline_matches(self, pid: int, sel: Selector) -> bool:
        """Whether the leader's command line prefix matches the `cmdline:` selector.

        Only a digest of each prefix is kept, never the text: 2,000 leaders'
        32 KiB lines kept as bytes and text held 128 MiB in the agent."""
        st = self.stats.get(pid)
        if st is None:
            return False
        key, data = (pid, st.start_ticks), None
        seen = self._verdicts.get(key)
        if seen is None:  # the first look this walk: is it the line the walk before judged?
            data = self.cmdline_bytes(pid)
            if not data:
                return False
            digest = hashlib.blake2b(data, digest_size=16).digest()
            before = self._verdicts_before.get(key)
            seen = self._verdicts[key] = (digest, dict(before[1]) if before is not None and before[0] == digest else {})
        verdict = seen[1].get(sel.value)
        if verdict is None:
            assert sel.pattern is not None
            if data is None:
                data = self.cmdline_bytes(pid) or b""
            verdict = seen[1][sel.value] = sel.pattern.search(procfs.parse_cmdline(data)) is not None
        return verdict

    def cgroups(self, pid: int) -> list[str] | None:
        lines = self._read_once(self._cgroups, pid, "cgroup", cgroup_view.lines)
        return None if lines is None else [path for _, _, path in lines]

    def unified_cgroup(self, pid: int) -> str | None:
        """The process's cgroup in the unified hierarchy (v2's `0::` line), as the host names it."""
        lines = self._read_once(self._cgroups, pid, "cgroup", cgroup_view.lines)
        return next((path for h, c, path in lines or () if h == b"0" and c == b""), None)

    def container_id(self, pid: int) -> str | None:
        paths = self.cgroups(pid)
        return None if paths is None else container_ids.from_cgroup_paths(paths)

    def container_ids(self) -> dict[int, str]:
        """Each process's container, where its cgroup path names one (once per walk)."""
        if self._containers is None:
            self._containers = {pid: cid for pid in self.stats if (cid := self.container_id(pid)) is not None}
        return self._containers

    def _read_once(self, cache: dict[int, T | None], pid: int, name: str, parse: Callable[[bytes], T]) -> T | None:
        """/proc/<pid>/<name>, parsed, read at most once per walk; None once the process is gone."""
        if pid not in cache:
            try:
                cache[pid] = parse(procfs.read_pid_file(self.proc, pid, name))
            except (procfs.ProcessGone, OSError):
                cache[pid] = None
        return cache[pid]

    def resolve(self, sel: Selector) -> list[int]:
        """The pids the selector names now."""
        if sel.kind == "pgid":
            return list(self.by_group.get(int(sel.value), ()))
        if sel.kind == "pid":
            st = self.stats.get(int(sel.value))
            return [] if st is None or st.pgrp <= 0 else list(self.by_group.get(st.pgrp, ()))
        if sel.kind == "cmdline":
            out = []
            for pgid, pids in self.by_group.items():
                # Only a live leader speaks for its group; pgid 0 is the kernel's threads.
                if pgid > 0 and pgid in self.stats and self.cmdline_matches(pgid, sel):
                    out.extend(pids)
            return out
        if sel.kind == "comm":
            return [pid for pgid, pids in self.by_group.items()
                    if pgid > 0 and (leader := self.stats.get(pgid)) is not None and leader.comm == sel.value
                    for pid in pids]  # fmt: skip
        if sel.kind == "containers":
            wanted = set(sel.value.split(","))
            return [pid for pid, cid in self.container_ids().items() if cid in wanted]
        if sel.kind == "k8s":
            return []  # a pod selector names pods, each resolved as its `containers:` shard
        return [pid for pid in self.stats if any(sel.names_cgroup(p) for p in (self.cgroups(pid) or ()))]

    def group_ticks(self) -> dict[int, int]:
        """CPU ticks used so far by each process group's live processes,
        their reaped children included. Kernel threads (group 0) left out."""
        out: dict[int, int] = {}
        for st in self.stats.values():
            if st.pgrp > 0:
                out[st.pgrp] = out.get(st.pgrp, 0) + st.self_ticks + st.child_ticks
        return out


def busiest_groups(before: dict[int, int], after: dict[int, int], n: int, exclude: set[int]) -> list[int]:
    """The n groups that used the most CPU between two walks (and used some)."""
    used = [(after[g] - before.get(g, 0), g) for g in after if g not in exclude]
    used = [(u, g) for u, g in used if u > 0]
    used.sort(reverse=True)
    return [g for _, g in used[:n]]


def named_by_command(table: ProcessTable, groups: list[int]) -> list[ShardSpec]:
    """The busiest groups as shards named by their leaders' command names
    (`comm:NAME`: every group of that name, summed), so that a restarted
    engine, in a new process group, keeps its shard and its series. A group
    whose leader is gone, or whose name is not printable text, keeps `pgid:N`."""
    out: dict[str, ShardSpec] = {}
    for g in groups:
        leader = table.stats.get(g)
        name = leader.comm if leader is not None else ""
        if name and name.isprintable() and "\ufffd" not in name:
            out.setdefault(f"comm:{name}", ShardSpec(f"comm:{name}", Selector("comm", name)))
        else:
            out.setdefault(f"pgid:{g}", ShardSpec(f"pgid:{g}", Selector("pgid", str(g))))
    return list(out.values())


def pod_watches(w: ShardSpec, pods: list[Pod]) -> list[ShardSpec]:
    """A `k8s:` shard made concrete: one shard per pod it matches, named
    NAMESPACE/POD[/CONTAINER], counting that pod's (or container's) processes.
    A pod whose chosen container is not running is left out until it runs."""
    sel = w.selector.pods
    assert sel is not None
    out = []
    for pod in pods:
        if not sel.matches(pod):
            continue
        if sel.container is not None:
            ids = [pod.containers[sel.container]] if sel.container in pod.containers else []
        else:
            ids = sorted(set(pod.containers.values()))
        if not ids:
            continue
        model = pod.labels.get(w.model_label) if w.model_label else None
        replica = pod.labels.get(w.replica_label) if w.replica_label else None
        url = pod.metrics_url(w.metrics_url) if w.metrics_url else None
        out.append(ShardSpec(
            pod.key + (f"/{sel.container}" if sel.container else ""),
            Selector("containers", ",".join(ids)),
            model or w.model, replica or w.replica, url,
            namespace=pod.namespace, pod=pod.name, container=sel.container,
        ))  # fmt: skip
    return out
