"""Raw samples on the wire: a window's samples themselves, which the agent
adds to its heartbeat while someone watches the node live
(docs/wire-format.md, "Raw samples").

A rate series (the machine's CPU, a shard's cores) is where its first sample
begins (seconds from `window.start`), each sample's length in whole
microseconds and each value (`null`: not measured): exactly the samples and
weights the window's summary was computed from, so a series' time-weighted
mean is the summary's mean. A GPU's points are NVML's own utilisation
samples and GPM's intervals (SM activity, SM occupancy, tensor activity,
DRAM bandwidth, at GPM's own rate): each one's time (seconds from
`window.start`; an interval's end) and value, percent.

The agent fits the block to the body's limit (`fit_raw`): the machine and
the GPUs first, then the shards in the summary's order while they fit, with
a count of those left out. The control plane checks it item by item
(`parse_raw`): a bad series costs that item alone, like a bad shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from wire.checks import Dropped, Field, Json, WireError, integer, items, name, number, obj
from wire.limits import MAX_BODY_BYTES, MAX_CORES, MAX_GPUS, MAX_SHARDS

MAX_RAW_SAMPLES = 20_000  # one series: 1000 Hz for 20 s
MAX_SAMPLE_US = 3_600_000_000  # one sample: an hour
MAX_OFFSET_S = 3600.0  # a time's distance from the window's start
BODY_ROOM = 16 * 1024  # what the raw block leaves free in the body, besides the summary

# A GPU's point series: its field on the wire (the summary's mean field of the
# same figure) -> what a chart calls it.
GPU_POINTS = {
    "utilization_percent": "utilisation",
    "sm_activity_percent": "SM activity",
    "sm_occupancy_percent": "SM occupancy",
    "tensor_activity_percent": "tensor activity",
    "dram_bandwidth_percent": "DRAM bandwidth",
}


def gpu_key(index: int, field: str) -> str:
    """A GPU point series' key, in hindsight's rows and the live view:
    `gpu:<index>` for its utilisation, `gpu:<index>:<field>` for the rest."""
    return f"gpu:{index}" if field == "utilization_percent" else f"gpu:{index}:{field}"


def gpu_key_parts(key: str) -> tuple[int, str]:
    """gpu_key's card and field."""
    _, index, field = (key + ":utilization_percent").split(":")[:3]
    return int(index), field


def gpu_label(index: int, field: str) -> str:
    return f"GPU {index}" if field == "utilization_percent" else f"GPU {index} {GPU_POINTS[field]}"


def window_stats(values: np.ndarray, seconds: np.ndarray) -> dict[str, float] | None:
    """A window's summary of a rate from its samples (each value, NaN: not
    measured; each length): the time-weighted mean, the p95 (the value the
    samples at or below it cover 95% of the measured time with) and the max,
    to four digits. None where nothing was measured. The one definition: the
    agent's summaries (sampler/window/series.py) and the control plane's lines
    over a fetched span (controlplane/samples/hindsight.py) are both this."""
    ok = ~np.isnan(values) & (seconds > 0)
    if not ok.any():
        return None
    v, w = values[ok], seconds[ok]
    order = np.argsort(v, kind="stable")
    covered = np.cumsum(w[order])
    p95 = v[order][min(int(np.searchsorted(covered, 0.95 * covered[-1] - 1e-12)), len(v) - 1)]
    return {
        "mean": round(float(np.average(v, weights=w)), 4),
        "p95": round(float(p95), 4),
        "max": round(float(v.max()), 4),
    }


def rate_series(start: float, values: np.ndarray, seconds: np.ndarray, digits: int) -> Json:
    """One rate series as it crosses the wire (samples of no length carry no
    weight and are left out)."""
    keep = seconds > 0
    us = np.maximum(1, np.rint(seconds[keep] * 1e6)).astype(np.int64).tolist()
    v = [None if x != x else x for x in np.round(values[keep], digits).tolist()]  # NaN: not measured
    return {"start": round(start, 6), "us": us, "v": v}


def gpu_points(times_s: np.ndarray, values: np.ndarray) -> Json:
    return {"t": np.round(times_s, 4).tolist(), "v": np.round(values, 2).tolist()}


def fit_raw(summary_bytes: int, machine: Json | None, gpus: Iterable[tuple[int, dict[str, Json]]],
            shards: Iterable[tuple[str, Json]]) -> Json:  # fmt: skip
    """The raw block for a heartbeat whose summary takes `summary_bytes`:
    the machine's series, the GPUs' (each card's points by field), then each
    shard's while the body stays within its limit; `shards_left_out` counts
    the rest."""
    room = MAX_BODY_BYTES - summary_bytes - BODY_ROOM
    out: Json = {}
    if machine is not None:
        out["machine"] = {"cpu_percent": machine}
        room -= _size(out["machine"])
    out["gpus"] = []
    for index, points in gpus:
        entry = {"index": index, **points}
        if (size := _size(entry)) <= room:
            out["gpus"].append(entry)
            room -= size
    out["shards"] = []
    left_out = 0
    for sid, series in shards:
        entry = {"id": sid, "cpu_cores": series}
        if left_out == 0 and (size := _size(entry)) <= room:
            out["shards"].append(entry)
            room -= size
        else:
            left_out += 1  # the summary's order is the busiest first: once one does not fit, neither do the rest
    if left_out:
        out["shards_left_out"] = left_out
    return out


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"))) + 1


# --- what the control plane accepts ------------------------------------------------


def _values(value: Any, field: Field, lo: float, hi: float, nulls: bool, most: int) -> list[float | None]:
    out = items(value, field, most)
    for i, x in enumerate(out):
        kind = type(x)
        if (kind is float or kind is int) and lo <= x <= hi:
            continue
        if x is None and nulls:
            continue
        number(x, (field, i), lo, hi)  # raises, naming the problem
    return out


def checked_series(value: Any, field: Field, hi: float, most: int = MAX_RAW_SAMPLES) -> Json:
    """A rate series (values from 0 to `hi`, at most `most` samples), checked."""
    s = obj(value, field)
    start = number(s.get("start"), (field, "start"), -MAX_OFFSET_S, MAX_OFFSET_S)
    us = items(s.get("us"), (field, "us"), most)
    for i, x in enumerate(us):
        if type(x) is not int or not 1 <= x <= MAX_SAMPLE_US:
            integer(x, (field, "us", i), 1, MAX_SAMPLE_US)
    v = _values(s.get("v"), (field, "v"), 0.0, hi, nulls=True, most=most)
    if len(v) != len(us):
        raise WireError(field, f"{len(us)} lengths but {len(v)} values")
    return {"start": start, "us": us, "v": v}


def checked_points(value: Any, field: Field, most: int = MAX_RAW_SAMPLES) -> Json:
    """A GPU's points (percent), checked."""
    p = obj(value, field)
    t = _values(p.get("t"), (field, "t"), -MAX_OFFSET_S, MAX_OFFSET_S, nulls=False, most=most)
    v = _values(p.get("v"), (field, "v"), 0.0, 100.0, nulls=False, most=most)
    if len(v) != len(t):
        raise WireError(field, f"{len(t)} times but {len(v)} values")
    return {"t": t, "v": v}


def kept(dropped: Dropped | None, check: Any, *args: Any) -> Any:
    """check(*args), or None with its reason in `dropped`."""
    try:
        return check(*args)
    except WireError as e:
        if dropped is None:
            raise
        dropped.append({"field": e.field, "reason": e.reason})
        return None


def parse_raw(value: Any, shard_ids: set[str], dropped: Dropped | None) -> Json | None:
    """A heartbeat's raw block, checked item by item: a bad series, shard or
    GPU is left out and named in `dropped`; a block that is not one at all is
    left out whole (None)."""
    r = kept(dropped, obj, value, "raw")
    if r is None:
        return None
    out = checked_series_of(r, "raw", dropped, shard_ids, MAX_RAW_SAMPLES)
    left = kept(dropped, lambda: None if r.get("shards_left_out") is None else
                 integer(r["shards_left_out"], ("raw", "shards_left_out"), 0, 1 << 31))  # fmt: skip
    if left is not None:
        out["shards_left_out"] = left
    return out


def checked_series_of(block: Json, where: str, dropped: Dropped | None, shard_ids: set[str] | None,
                      most: int) -> Json:  # fmt: skip
    """The machine's, the shards' and the GPUs' series of a raw block (or a
    hindsight piece: wire/hindsight.py), each checked: a bad one is left out
    and named in `dropped`. `shard_ids`: the shards a series may be of
    (None: any); `most`: samples a series may have."""
    out: Json = {}
    m = block.get("machine")
    field = (where, "machine", "cpu_percent")
    cpu = None if m is None else kept(dropped, lambda: checked_series(obj(m, field[:2]).get("cpu_percent"), field,
                                                                      100, most))  # fmt: skip
    if cpu:
        out["machine"] = {"cpu_percent": cpu}
    out["shards"], seen = [], set[str]()
    for i, entry in enumerate(kept(dropped, items, block.get("shards", []), (where, "shards"), MAX_SHARDS) or []):
        shard = kept(dropped, _shard_series, entry, (where, "shards", i), shard_ids, seen, most)
        if shard is not None:
            seen.add(shard["id"])
            out["shards"].append(shard)
    out["gpus"], indices = [], set[int]()
    for i, entry in enumerate(kept(dropped, items, block.get("gpus", []), (where, "gpus"), MAX_GPUS) or []):
        gpu = kept(dropped, _gpu_points, entry, (where, "gpus", i), indices, most)
        if gpu is not None:
            indices.add(gpu["index"])
            out["gpus"].append(gpu)
    return out


def _shard_series(value: Any, field: Field, shard_ids: set[str] | None, seen: set[str], most: int) -> Json:
    s = obj(value, field)
    sid = name(s.get("id"), (field, "id"))
    if shard_ids is not None and sid not in shard_ids:
        raise WireError((field, "id"), "no such shard in this heartbeat")
    if sid in seen:
        raise WireError((field, "id"), "a shard's samples twice")
    return {"id": sid, "cpu_cores": checked_series(s.get("cpu_cores"), (field, "cpu_cores"), MAX_CORES, most)}


def _gpu_points(value: Any, field: Field, indices: set[int], most: int) -> Json:
    g = obj(value, field)
    index = integer(g.get("index"), (field, "index"), 0, 4095)
    if index in indices:
        raise WireError((field, "index"), "a GPU's samples twice")
    out: Json = {"index": index}
    for series in GPU_POINTS:
        if g.get(series) is not None:
            out[series] = checked_points(g[series], (field, series), most)
    if len(out) == 1:
        raise WireError(field, f"none of a GPU's point series ({', '.join(GPU_POINTS)})")
    return out
