"""The wire format: registration and heartbeat bodies, validated in one pass.

Both sides import this module: the agent builds what it sends from it, the
control plane accepts nothing it has not checked. A body is JSON; every field
is checked for type, range, finiteness, length and characters, and every list
for its length. The first problem found is raised as `WireError(field,
reason)`, which the control plane answers with 400.

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
MAX_BYTES = 2**62  # an exabyte and more; keeps every count an exact int64
MAX_CORES = 100_000.0

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


def _disks(value: Any, field: Field) -> list[Json]:
    return [_disk(d, (field, i)) for i, d in enumerate(items(value, field, MAX_DISKS))]


def _machine(value: Any, field: Field) -> Json:
    m = obj(value, field)
    out: Json = {}
    optional(m, "cpus", field, lambda v, f: integer(v, f, 1, 1 << 20), out)
    optional(m, "cpu_percent", field, _stats(0.0, 100.0), out)
    if m.get("load") is not None:
        load = obj(m["load"], (field, "load"))
        out["load"] = {k: number(load.get(k), (field, "load", k), 0.0, 1e7) for k in ("1m", "5m", "15m")}
    for key in ("memory_bytes", "memory_used_bytes", "memory_available_bytes"):
        optional(m, key, field, _bytes, out)
    optional(m, "disks", field, _disks, out)
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
    optional(s, "selector", field, _text, out)
    optional(s, "command", field, _text, out)
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
    return out


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


def _gpus(value: Any, field: Field) -> list[Json]:
    return [_gpu(g, (field, i)) for i, g in enumerate(items(value, field, MAX_GPUS))]


def _decode(data: bytes) -> Json:
    if len(data) > MAX_BODY_BYTES:
        raise WireError("body", f"larger than {MAX_BODY_BYTES} bytes")
    try:
        # parse_constant: NaN and Infinity are not JSON; refuse them at the door.
        body = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise WireError("body", f"not JSON: {str(e)[:120]}") from None
    return obj(body, "body")


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number")


def parse_registration(data: bytes) -> Json:
    b = _decode(data)
    out: Json = {"node": node_id(b.get("node"))}
    for key in ("hostname", "kernel", "agent_version", "backend", "backend_reason"):
        optional(b, key, "", _text, out)
    optional(b, "cpus", "", lambda v, f: integer(v, f, 1, 1 << 20), out)
    optional(b, "memory_bytes", "", _bytes, out)
    optional(b, "disks", "", _disks, out)
    optional(b, "gpus", "", _gpus, out)
    return out


def parse_heartbeat(data: bytes) -> Json:
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
    out["machine"] = _machine(b.get("machine"), "machine")
    shards = items(b.get("shards", []), "shards", MAX_SHARDS)
    out["shards"] = [_shard(s, ("shards", i)) for i, s in enumerate(shards)]
    ids = [s["id"] for s in out["shards"]]
    if len(set(ids)) != len(ids):
        raise WireError("shards", "shard ids must be unique")
    optional(b, "gpus", "", _gpus, out)
    optional(b, "gpu_error", "", _text, out)
    return out


def dumps(body: Json) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
