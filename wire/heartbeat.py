"""The wire format: what may cross it, for both sides.

The agent fits what it sends to it (`fit_heartbeat`, `fit_registration`):
text from the machine (process names, mount points, GPU names) is made
printable by escaping, and lists are trimmed to their limits, most important
first, with a count of what was left out. The control plane accepts nothing
it has not checked (`parse_heartbeat`, `parse_registration`): every field for
type, range, finiteness, length and characters, every list for its length.

Identity, structure and the machine's numbers are strict: the first problem
is raised as `WireError(field, reason)`, answered 400. One bad entry of a
list (a shard, a disk, a GPU) costs that entry alone: it is left out, and
named with its reason in the `dropped` list the parser is given.

Keys this version does not know are ignored (a newer agent may add keys;
none may be renamed). A value may be `null` or absent wherever the summary
says "not measured".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from wire.checks import (
    Dropped,
    Field,
    Json,
    WireError,
    byte_count,
    integer,
    items,
    name,
    node_id,
    number,
    obj,
    optional,
    stats,
    text,
)
from wire.limits import (
    MAX_BODY_BYTES,
    MAX_BYTES,
    MAX_CORES,
    MAX_DISKS,
    MAX_GPUS,
    MAX_K8S_NAME,
    MAX_PGIDS,
    MAX_QUOTA_CORES,
    MAX_SHARDS,
)


def _disk(value: Any, field: Field) -> Json:
    d = obj(value, field)
    return {"mount": text(d.get("mount"), (field, "mount")), "bytes": byte_count(d.get("bytes"), (field, "bytes")),
            "used_bytes": byte_count(d.get("used_bytes"), (field, "used_bytes"))}  # fmt: skip


def _each(value: Any, field: Field, limit: int, check: Callable[[Any, Field], Json],
          dropped: Dropped | None) -> list[Json]:  # fmt: skip
    """A list's entries, each checked on its own: with `dropped`, a bad entry
    is left out and named there; without, it fails the whole body."""
    out = []
    for i, v in enumerate(items(value, field, limit)):
        try:
            out.append(check(v, (field, i)))
        except WireError as e:
            if dropped is None:
                raise
            dropped.append({"field": e.field, "reason": e.reason})
    return out


def _disks(value: Any, field: Field, dropped: Dropped | None = None) -> list[Json]:
    return _each(value, field, MAX_DISKS, _disk, dropped)


def _machine(value: Any, field: Field, dropped: Dropped | None = None) -> Json:
    m = obj(value, field)
    out: Json = {}
    optional(m, "cpus", field, lambda v, f: integer(v, f, 1, 1 << 20), out)
    optional(m, "cpu_percent", field, stats(0.0, 100.0), out)
    optional(m, "cpu_steal_percent", field, stats(0.0, 100.0), out)
    if m.get("load") is not None:
        load = obj(m["load"], (field, "load"))
        out["load"] = {k: number(load.get(k), (field, "load", k), 0.0, 1e7) for k in ("1m", "5m", "15m")}
    for key in ("memory_bytes", "memory_used_bytes", "memory_available_bytes"):
        optional(m, key, field, byte_count, out)
    if m.get("disks") is not None:
        out["disks"] = _disks(m["disks"], (field, "disks"), dropped)
    optional(m, "disks_left_out", field, lambda v, f: integer(v, f, 0, 1 << 31), out)
    if m.get("pressure") is not None:
        pressure = obj(m["pressure"], (field, "pressure"))
        out["pressure"] = {}
        for resource in ("cpu", "memory", "io"):
            if pressure.get(resource) is None:
                continue
            kinds = obj(pressure[resource], (field, "pressure", resource))
            share: Json = {}
            for key in ("some", "full"):
                optional(kinds, key, (field, "pressure", resource), lambda v, f: number(v, f, 0.0, 1.0), share)
            out["pressure"][resource] = share
    return out


def _shard(value: Any, field: Field) -> Json:
    s = obj(value, field)
    out: Json = {"id": name(s.get("id"), (field, "id"))}
    optional(s, "model", field, name, out)
    optional(s, "replica", field, name, out)
    for key in ("namespace", "pod", "container"):  # Kubernetes' names, for a pod's shard
        optional(s, key, field, lambda v, f: name(v, f, MAX_K8S_NAME), out)
    optional(s, "selector", field, text, out)
    optional(s, "command", field, text, out)
    optional(s, "metrics_error", field, text, out)  # why the engine's own metrics gave no figures
    optional(s, "pgid", field, lambda v, f: integer(v, f, 1, 1 << 31), out)
    if s.get("pgids") is not None:
        out["pgids"] = [integer(p, (field, "pgids", i), 1, 1 << 31)
                        for i, p in enumerate(items(s["pgids"], (field, "pgids"), MAX_PGIDS))]  # fmt: skip
    optional(s, "cpu_cores", field, stats(0.0, MAX_CORES), out)
    if s.get("runqueue_wait_seconds") is not None:
        wait = obj(s["runqueue_wait_seconds"], (field, "runqueue_wait_seconds"))
        w: Json = {}
        out["runqueue_wait_seconds"] = w
        for key in ("p50", "p99", "mean", "total", "cumulative"):
            optional(wait, key, (field, "runqueue_wait_seconds"), lambda v, f: number(v, f, 0.0, 1e12), w)
    for key in ("memory_bytes", "gpu_memory_bytes"):
        optional(s, key, field, byte_count, out)
    _numbers(s, _SHARD_NUMBERS, field, out)
    return out


# A shard's CPU bandwidth (CFS quota and throttling), sizing, share of its GPUs and queue, checked in one loop.
_SHARD_NUMBERS: tuple[tuple[str, float, float, bool], ...] = (
    ("cpu_quota_cores", 0, MAX_QUOTA_CORES, False), ("cpu_throttled_ratio", 0, 1, False),
    ("cpu_throttled_seconds", 0, 1e9, False), ("cpu_throttled_seconds_total", 0, 1e15, False),
    ("threads", 0, 1 << 31, True), ("cpu_affinity_cores", 0, 1 << 20, True),
    ("threads_per_quota_core", 0, 1e12, False),
    ("gpu_utilization_percent", 0, 100, False), ("gpu_utilization_max_percent", 0, 100, False),
    ("gpu_memory_bandwidth_percent", 0, 100, False), ("gpu_memory_bandwidth_max_percent", 0, 100, False),
    ("requests_waiting", 0, 1e9, False), ("requests_running", 0, 1e9, False), ("kv_cache_usage_ratio", 0, 1, False),
)  # fmt: skip


# (key, lo, hi, integer?): a GPU's measurements, checked in one loop.
_GPU_NUMBERS: tuple[tuple[str, float, float, bool], ...] = (
    ("utilization_percent", 0, 100, False), ("utilization_p95_percent", 0, 100, False),
    ("utilization_max_percent", 0, 100, False), ("memory_bandwidth_percent", 0, 100, False),
    ("sm_clock_hz", 0, 1e11, False), ("temperature_celsius", -100, 500, False), ("power_watts", 0, 1e6, False),
    ("energy_joules", 0, 1e18, False), ("memory_used_bytes", 0, MAX_BYTES, True),
    ("memory_total_bytes", 0, MAX_BYTES, True), ("ecc_uncorrected", 0, MAX_BYTES, True),
)  # fmt: skip


def _numbers(src: Json, spec: tuple[tuple[str, float, float, bool], ...], field: Field, out: Json) -> None:
    """The numbers of `spec` present in src, into out. The common case (right
    type, in range) costs one comparison; anything else goes through the
    checker that names the problem."""
    for key, lo, hi, whole in spec:
        value = src.get(key)
        if value is None:
            continue
        kind = type(value)
        if (kind is int or (kind is float and not whole)) and lo <= value <= hi:
            out[key] = value if whole else float(value)
        elif whole:
            out[key] = integer(value, (field, key), int(lo), int(hi))
        else:
            out[key] = number(value, (field, key), lo, hi)


def _gpu(value: Any, field: Field) -> Json:
    g = obj(value, field)
    out: Json = {"index": integer(g.get("index"), (field, "index"), 0, 4095)}
    optional(g, "uuid", field, text, out)
    optional(g, "name", field, name, out)
    optional(g, "pci_bus_id", field, text, out)
    optional(g, "driver_version", field, text, out)
    if g.get("lost") is not None:
        if not isinstance(g["lost"], bool):
            raise WireError((field, "lost"), "must be true or false")
        out["lost"] = g["lost"]
    _numbers(g, _GPU_NUMBERS, field, out)
    return out


def _gpus(value: Any, field: Field, dropped: Dropped | None = None) -> list[Json]:
    return _each(value, field, MAX_GPUS, _gpu, dropped)


def _decode(data: bytes) -> Json:
    if len(data) > MAX_BODY_BYTES:
        raise WireError("body", f"larger than {MAX_BODY_BYTES} bytes")
    try:
        # NaN and Infinity are not JSON, but Python writes them: read as floats,
        # they fail the range check of the field they are in, which names it
        # (and costs only that entry when it is one of a list's).
        body = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise WireError("body", f"not JSON: {str(e)[:120]}") from None
    return obj(body, "body")


def parse_registration(data: bytes, dropped: Dropped | None = None) -> Json:
    b = _decode(data)
    out: Json = {"node": node_id(b.get("node"))}
    for key in ("hostname", "kernel", "agent_version", "backend", "backend_reason"):
        optional(b, key, "", text, out)
    optional(b, "cpus", "", lambda v, f: integer(v, f, 1, 1 << 20), out)
    optional(b, "memory_bytes", "", byte_count, out)
    if b.get("disks") is not None:
        out["disks"] = _disks(b["disks"], "disks", dropped)
    if b.get("gpus") is not None:
        out["gpus"] = _gpus(b["gpus"], "gpus", dropped)
    return out


def parse_heartbeat(data: bytes, dropped: Dropped | None = None,
                    raw_for: Callable[[str], bool] | None = None) -> Json:  # fmt: skip
    """A heartbeat, checked. Its raw samples are read only for a node
    `raw_for` says is watched live; for any other they are not read (`raw`
    is then None, saying only that they came)."""
    b = _decode(data)
    out: Json = {"node": node_id(b.get("node")), "seq": integer(b.get("seq"), "seq", 0, 2**62)}
    backend = b.get("backend")
    if backend not in ("bpf", "proc"):
        raise WireError("backend", "must be 'bpf' or 'proc'")
    out["backend"] = backend
    optional(b, "backend_reason", "", text, out)
    w = obj(b.get("window"), "window")
    start = number(w.get("start"), "window.start", 0.0, 1e11)
    out["window"] = {"start": start, "end": number(w.get("end"), "window.end", start, 1e11),
                     "samples": integer(w.get("samples"), "window.samples", 0, 10_000_000)}  # fmt: skip
    out["machine"] = _machine(b.get("machine"), "machine", dropped)
    shards = _each(b.get("shards", []), "shards", MAX_SHARDS, _shard, dropped)
    ids = [s["id"] for s in shards]
    if len(set(ids)) != len(ids):
        if dropped is None:
            raise WireError("shards", "shard ids must be unique")
        first: dict[str, Json] = {}
        for s in shards:
            if s["id"] in first:
                dropped.append({"field": "shards", "reason": "shard ids must be unique"})
            else:
                first[s["id"]] = s
        shards = list(first.values())
    out["shards"] = shards
    optional(b, "shards_left_out", "", lambda v, f: integer(v, f, 0, 1 << 31), out)
    if b.get("gpus") is not None:
        out["gpus"] = _gpus(b["gpus"], "gpus", dropped)
    optional(b, "gpu_error", "", text, out)
    if b.get("raw") is not None:  # None when not read, or left out whole
        out["raw"] = None
        if raw_for is not None and raw_for(out["node"]):
            from wire.raw import parse_raw

            out["raw"] = parse_raw(b["raw"], {s["id"] for s in shards}, dropped)
    return out
