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
import math
import re
from collections.abc import Callable
from typing import Any

MAX_BODY_BYTES = 512 * 1024
MAX_SHARDS = 256
MAX_GPUS = 64
MAX_DISKS = 128
MAX_PGIDS = 1024
MAX_NAME = 128  # model, replica and shard names: free printable text
MAX_TEXT = 512
MAX_K8S_NAME = 253  # a pod's name; namespaces and containers are 63
MAX_BYTES = 2**62  # an exabyte and more; keeps every count an exact int64
MAX_CORES = 100_000.0
# A CFS quota is a setting, not a use: the kernel takes up to 2^44-1 us of quota
# per period of at least 1 ms, "unlimited" written as a number (17,592,186,044 cores).
MAX_QUOTA_CORES = 2**44 / 1000

NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,253}")

Json = dict[str, Any]


Field = str | tuple[Any, ...]  # a field's path; a tuple is joined only when an error names it


def field_name(path: Field) -> str:
    if isinstance(path, str):
        return path
    out = ""
    for part in path:
        if isinstance(part, tuple):
            out += ("." if out else "") + field_name(part) if part else ""
        elif isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out += ("." if out else "") + part
    return out


class WireError(ValueError):
    def __init__(self, field: Field, reason: str) -> None:
        self.field, self.reason = field_name(field), reason
        super().__init__(f"{self.field}: {reason}")


# --- scalar checks ---------------------------------------------------------------


def node_id(value: Any, field: Field = "node") -> str:
    if not isinstance(value, str) or not NODE_ID.fullmatch(value):
        raise WireError(field, "must be 1-253 letters, digits, '.', '-' or '_'")
    return value


def name(value: Any, field: Field, limit: int = MAX_NAME) -> str:
    """Free printable text (kept as given; escaped wherever it is shown)."""
    if not isinstance(value, str):
        raise WireError(field, "must be a string")
    if not 0 < len(value) <= limit:
        raise WireError(field, f"must be 1-{limit} characters")
    if not value.isprintable():
        raise WireError(field, "must be printable text (no control characters)")
    return value


def number(value: Any, field: Field, lo: float, hi: float) -> float:
    kind = type(value)
    if kind is not float and kind is not int:  # bool is neither
        raise WireError(field, "must be a number")
    if not lo <= value <= hi:  # NaN fails this too; json.loads refused it already
        if not math.isfinite(value):
            raise WireError(field, "must be finite")
        raise WireError(field, f"must be within {lo:g}..{hi:g}")
    return float(value)


def integer(value: Any, field: Field, lo: int, hi: int) -> int:
    if type(value) is not int:  # bool is not
        raise WireError(field, "must be an integer")
    if not lo <= value <= hi:
        raise WireError(field, f"must be within {lo}..{hi}")
    return value


def obj(value: Any, field: Field) -> Json:
    if not isinstance(value, dict):
        raise WireError(field, "must be an object")
    return value


def items(value: Any, field: Field, limit: int) -> list[Any]:
    if not isinstance(value, list):
        raise WireError(field, "must be a list")
    if len(value) > limit:
        raise WireError(field, f"at most {limit} entries")
    return value


def optional(src: Json, key: str, field: Field, check: Callable[[Any, Field], Any], out: Json) -> None:
    """Copy src[key] into out if present and not null, checked."""
    value = src.get(key)
    if value is not None:
        out[key] = check(value, (field, key))


def _bytes(value: Any, field: Field) -> int:
    return integer(value, field, 0, MAX_BYTES)


def _stats(lo: float, hi: float) -> Callable[[Any, Field], dict[str, float]]:
    def check(value: Any, field: Field) -> dict[str, float]:
        o = obj(value, field)
        return {"mean": number(o.get("mean"), (field, "mean"), lo, hi),
                "p95": number(o.get("p95"), (field, "p95"), lo, hi),
                "max": number(o.get("max"), (field, "max"), lo, hi)}  # fmt: skip

    return check


def _text(value: Any, field: Field) -> str:
    return name(value, field, MAX_TEXT)


# --- bodies -------------------------------------------------------------------


def _disk(value: Any, field: Field) -> Json:
    d = obj(value, field)
    return {"mount": _text(d.get("mount"), (field, "mount")), "bytes": _bytes(d.get("bytes"), (field, "bytes")),
            "used_bytes": _bytes(d.get("used_bytes"), (field, "used_bytes"))}  # fmt: skip


Dropped = list[dict[str, str]]  # {"field": ..., "reason": ...} of each entry left out


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
    optional(m, "cpu_percent", field, _stats(0.0, 100.0), out)
    optional(m, "cpu_steal_percent", field, _stats(0.0, 100.0), out)
    if m.get("load") is not None:
        load = obj(m["load"], (field, "load"))
        out["load"] = {k: number(load.get(k), (field, "load", k), 0.0, 1e7) for k in ("1m", "5m", "15m")}
    for key in ("memory_bytes", "memory_used_bytes", "memory_available_bytes"):
        optional(m, key, field, _bytes, out)
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
    optional(s, "selector", field, _text, out)
    optional(s, "command", field, _text, out)
    optional(s, "metrics_error", field, _text, out)  # why the engine's own metrics gave no figures
    optional(s, "pgid", field, lambda v, f: integer(v, f, 1, 1 << 31), out)
    if s.get("pgids") is not None:
        out["pgids"] = [integer(p, (field, "pgids", i), 1, 1 << 31)
                        for i, p in enumerate(items(s["pgids"], (field, "pgids"), MAX_PGIDS))]  # fmt: skip
    optional(s, "cpu_cores", field, _stats(0.0, MAX_CORES), out)
    if s.get("runqueue_wait_seconds") is not None:
        wait = obj(s["runqueue_wait_seconds"], (field, "runqueue_wait_seconds"))
        w: Json = {}
        out["runqueue_wait_seconds"] = w
        for key in ("p50", "p99", "mean", "total", "cumulative"):
            optional(wait, key, (field, "runqueue_wait_seconds"), lambda v, f: number(v, f, 0.0, 1e12), w)
    for key in ("memory_bytes", "gpu_memory_bytes"):
        optional(s, key, field, _bytes, out)
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
    optional(g, "uuid", field, _text, out)
    optional(g, "name", field, name, out)
    optional(g, "pci_bus_id", field, _text, out)
    optional(g, "driver_version", field, _text, out)
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
        optional(b, key, "", _text, out)
    optional(b, "cpus", "", lambda v, f: integer(v, f, 1, 1 << 20), out)
    optional(b, "memory_bytes", "", _bytes, out)
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
    optional(b, "backend_reason", "", _text, out)
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
    optional(b, "gpu_error", "", _text, out)
    if b.get("raw") is not None:  # None when not read, or left out whole
        out["raw"] = None
        if raw_for is not None and raw_for(out["node"]):
            from nodesampler.raw_samples import parse_raw  # built on this module's checks

            out["raw"] = parse_raw(b["raw"], {s["id"] for s in shards}, dropped)
    return out


# --- what the agent sends -------------------------------------------------------


def printable(text: str | None, limit: int = MAX_TEXT) -> str | None:
    """Machine text as it may cross the wire: every character that is not
    printable escaped as Python writes it (a tab as `\\t`, a non-breaking
    space as `\\xa0`), never dropped, so two names that differ still differ;
    cut to `limit` characters with an ellipsis. None for nothing to say."""
    if not text:
        return None
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _fit_text(src: Json, keys: tuple[str, ...], limit: int) -> None:
    for key in keys:
        if isinstance(src.get(key), str):
            if (text := printable(src[key], limit)) is None:
                del src[key]
            else:
                src[key] = text


def _fit_disks(disks: list[Json]) -> tuple[list[Json], int]:
    for d in disks:
        d["mount"] = printable(d.get("mount")) or "?"
    if len(disks) <= MAX_DISKS:
        return disks, 0
    kept = sorted(disks, key=lambda d: -d.get("bytes", 0))[:MAX_DISKS]  # the largest
    return kept, len(disks) - MAX_DISKS


def _fit_gpus(gpus: list[Json]) -> list[Json]:
    for g in gpus[:MAX_GPUS]:
        _fit_text(g, ("name",), MAX_NAME)
        _fit_text(g, ("uuid", "pci_bus_id", "driver_version"), MAX_TEXT)
    return gpus[:MAX_GPUS]


def fit_registration(body: Json) -> Json:
    """A registration made fit for the wire, in place."""
    _fit_text(body, ("hostname", "kernel", "agent_version", "backend_reason"), MAX_TEXT)
    if isinstance(body.get("disks"), list):
        body["disks"], _ = _fit_disks(body["disks"])
    if isinstance(body.get("gpus"), list):
        body["gpus"] = _fit_gpus(body["gpus"])
    return body


def fit_heartbeat(summary: Json) -> Json:
    """A window's summary made fit for the wire, in place: text escaped and
    cut, lists trimmed (the busiest shards, the largest disks), and what was
    left out counted (`shards_left_out`, `machine.disks_left_out`)."""
    _fit_text(summary, ("backend_reason", "gpu_error"), MAX_TEXT)
    machine = summary.get("machine")
    if isinstance(machine, dict) and isinstance(machine.get("disks"), list):
        machine["disks"], left_out = _fit_disks(machine["disks"])
        if left_out:
            machine["disks_left_out"] = left_out
    shards = summary.get("shards")
    if isinstance(shards, list):
        if len(shards) > MAX_SHARDS:
            busiest = sorted(shards, key=lambda s: -((s.get("cpu_cores") or {}).get("mean") or 0.0))
            summary["shards_left_out"] = len(shards) - MAX_SHARDS
            shards = summary["shards"] = busiest[:MAX_SHARDS]
        seen: set[str] = set()
        for s in shards:
            sid = base = printable(s.get("id"), MAX_NAME) or "?"
            n = 0
            while sid in seen:  # cut names may meet: keep each shard, and its id unique
                n += 1
                sid = base[: MAX_NAME - len(f"~{n}")] + f"~{n}"
            seen.add(sid)
            s["id"] = sid
            _fit_text(s, ("model", "replica"), MAX_NAME)
            _fit_text(s, ("namespace", "pod", "container"), MAX_K8S_NAME)
            _fit_text(s, ("selector", "command", "metrics_error"), MAX_TEXT)
            if isinstance(s.get("pgids"), list) and len(s["pgids"]) > MAX_PGIDS:
                s["pgids"] = s["pgids"][:MAX_PGIDS]
    if isinstance(summary.get("gpus"), list):
        summary["gpus"] = _fit_gpus(summary["gpus"])
    return summary


def dumps(body: Json) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
