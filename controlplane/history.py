"""An hour of history behind one interface, answered by either backend.

A chart is described once, as a `ChartSpec`: a metric (one of the exported
families), a filter on its labels and the labels to group by. The embedded
history answers it from numpy ring buffers fed by heartbeats (the default:
nothing else needs to run); `PrometheusHistory` answers the same spec with a
range query. Neither parses PromQL: the spec is built by the pages, and only
nodes the registry knows reach a query.
"""

from __future__ import annotations

import math
import re
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import numpy as np

Json = dict[str, Any]
Labels = tuple[tuple[str, str], ...]

HOUR_S = 3600.0
MAX_SERIES_PER_NODE = 512  # columns: bounds a node's memory whatever its heartbeats hold
AGGREGATIONS = ("sum", "avg", "max")


@dataclass(frozen=True)
class ChartSpec:
    metric: str
    filter: tuple[tuple[str, str], ...] = ()  # label = value, all must hold
    group_by: tuple[str, ...] = ()  # one series per distinct value set; () one series
    agg: str = "sum"  # how the series of a group combine
    one_of: tuple[tuple[str, tuple[str, ...]], ...] = ()  # label in a set of values, all must hold

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"agg {self.agg!r}")


@dataclass
class Series:
    label: str
    t: np.ndarray  # unix seconds
    v: np.ndarray  # NaN: not measured


class HistoryError(Exception):
    """History could not be read; the page says so and shows current figures."""


class History(Protocol):
    async def query(self, spec: ChartSpec, start: float, end: float, step: float) -> list[Series]: ...


def flatten(hb: Json) -> Iterator[tuple[str, Labels, float]]:
    """A heartbeat as (family, labels, value) samples, named as /metrics names them."""
    m = hb.get("machine") or {}
    cpu = m.get("cpu_percent") or {}
    for stat, family in (("mean", "llmgw_node_cpu_utilization_percent"),
                         ("p95", "llmgw_node_cpu_utilization_p95_percent"),
                         ("max", "llmgw_node_cpu_utilization_max_percent")):  # fmt: skip
        if stat in cpu:
            yield family, (), cpu[stat]
    for key, family in (("memory_used_bytes", "llmgw_node_memory_used_bytes"),
                        ("memory_bytes", "llmgw_node_memory_bytes"), ("cpus", "llmgw_node_cpus")):  # fmt: skip
        if m.get(key) is not None:
            yield family, (), m[key]
    for window, value in (m.get("load") or {}).items():
        yield "llmgw_node_load", (("window", window),), value
    for s in hb.get("shards") or ():
        labels: Labels = (("model", s.get("model") or ""), ("replica", s.get("replica") or ""), ("shard", s["id"]))
        labels += tuple((key, s[key]) for key in ("namespace", "pod", "container") if s.get(key) is not None)
        cores = s.get("cpu_cores") or {}
        if "mean" in cores:
            yield "llmgw_shard_cpu_cores", labels, cores["mean"]
        if "max" in cores:
            yield "llmgw_shard_cpu_cores_max", labels, cores["max"]
        for key, family in (("memory_bytes", "llmgw_shard_memory_bytes"),
                            ("gpu_memory_bytes", "llmgw_shard_gpu_memory_bytes"),
                            ("requests_waiting", "llmgw_shard_requests_waiting"),
                            ("requests_running", "llmgw_shard_requests_running"),
                            ("kv_cache_usage_ratio", "llmgw_shard_kv_cache_usage_ratio")):  # fmt: skip
            if s.get(key) is not None:
                yield family, labels, s[key]
        wait = s.get("runqueue_wait_seconds") or {}
        if "p99" in wait:
            yield "llmgw_shard_runqueue_wait_seconds", (*labels, ("quantile", "0.99")), wait["p99"]
        if "mean" in wait:
            yield "llmgw_shard_runqueue_wait_per_slice_seconds", labels, wait["mean"]
    for g in hb.get("gpus") or ():
        card: Labels = (("gpu", str(g["index"])), ("gpu_model", g.get("name") or ""))
        for key, family in (("utilization_percent", "llmgw_gpu_utilization_percent"),
                            ("memory_used_bytes", "llmgw_gpu_memory_used_bytes"),
                            ("memory_total_bytes", "llmgw_gpu_memory_total_bytes"),
                            ("temperature_celsius", "llmgw_gpu_temperature_celsius"),
                            ("power_watts", "llmgw_gpu_power_watts")):  # fmt: skip
            if g.get(key) is not None:
                yield family, card, g[key]


def _combine(values: np.ndarray, agg: str) -> np.ndarray:
    """Combine columns row by row; a row where every column is NaN stays NaN."""
    present = ~np.isnan(values)
    any_present = present.any(axis=1)
    if agg == "sum":
        out = np.nansum(values, axis=1)
    elif agg == "max":
        out = np.nanmax(np.where(present, values, -np.inf), axis=1)
    else:
        out = np.nansum(values, axis=1) / np.maximum(present.sum(axis=1), 1)
    return np.where(any_present, out, np.nan)


@dataclass
class _NodeRing:
    """One node's hour: heartbeat times and one float32 column per series."""

    capacity: int
    t: np.ndarray = field(init=False)
    values: np.ndarray = field(init=False)
    columns: dict[tuple[str, Labels], int] = field(default_factory=dict)
    n: int = 0  # heartbeats recorded, ever

    def __post_init__(self) -> None:
        self.t = np.full(self.capacity, np.nan)
        self.values = np.full((self.capacity, 16), np.nan, dtype=np.float32)

    def record(self, at: float, hb: Json) -> None:
        row = self.n % self.capacity
        self.values[row] = np.nan
        self.t[row] = at
        for family, labels, value in flatten(hb):
            key = (family, labels)
            col = self.columns.get(key)
            if col is None:
                if len(self.columns) >= MAX_SERIES_PER_NODE:
                    continue
                col = self.columns[key] = len(self.columns)
                if col >= self.values.shape[1]:
                    grown = np.full((self.capacity, min(MAX_SERIES_PER_NODE, 2 * self.values.shape[1])), np.nan,
                                    dtype=np.float32)  # fmt: skip
                    grown[:, : self.values.shape[1]] = self.values
                    self.values = grown
            self.values[row, col] = value
        self.n += 1

    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows oldest first."""
        if self.n <= self.capacity:
            return self.t[: self.n], self.values[: self.n]
        start = self.n % self.capacity
        return np.roll(self.t, -start), np.roll(self.values, -start, axis=0)


class EmbeddedHistory:
    """Numpy ring buffers in the control plane, an hour at the heartbeat interval."""

    def __init__(self, interval: float = 5.0, span: float = HOUR_S, clock: Callable[[], float] = time.time) -> None:
        self.capacity = max(2, math.ceil(span / interval) + 1)
        self.clock = clock
        self._nodes: dict[str, _NodeRing] = {}

    def record(self, node: str, hb: Json, at: float | None = None) -> None:
        ring = self._nodes.get(node)
        if ring is None:
            ring = self._nodes[node] = _NodeRing(self.capacity)
        ring.record(self.clock() if at is None else at, hb)

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)

    async def query(self, spec: ChartSpec, start: float, end: float, step: float) -> list[Series]:
        return self.query_now(spec, start, end)

    def query_now(self, spec: ChartSpec, start: float, end: float) -> list[Series]:
        want = dict(spec.filter)
        node_filter = want.pop("node", None)
        groups: dict[tuple[str, ...], list[tuple[np.ndarray, np.ndarray]]] = {}
        for node, ring in self._nodes.items():
            if node_filter is not None and node != node_filter:
                continue
            t, values = ring.ordered()
            keep = (t >= start) & (t <= end)
            for (family, labels), col in ring.columns.items():
                if family != spec.metric:
                    continue
                ls = dict(labels, node=node)
                if any(ls.get(k) != v for k, v in want.items()):
                    continue
                if any(ls.get(k) not in values for k, values in spec.one_of):
                    continue
                key = tuple(ls.get(k, "") for k in spec.group_by)
                groups.setdefault(key, []).append((t[keep], values[keep, col].astype(np.float64)))
        out = []
        for key, parts in sorted(groups.items()):
            # Series of different nodes have different times: bin them on a common grid.
            if len(parts) == 1:
                t, v = parts[0]
            else:
                t = np.unique(np.concatenate([p[0] for p in parts]))
                stacked = np.full((len(t), len(parts)), np.nan)
                for i, (pt, pv) in enumerate(parts):
                    stacked[np.searchsorted(t, pt), i] = pv
                v = _combine(stacked, spec.agg)
            out.append(Series(" ".join(key), t, v))
        return out


_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _string(value: str) -> str:
    """A PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def regex_alternatives(values: tuple[str, ...]) -> str:
    """An RE2 regex matching exactly these values: every ASCII punctuation
    character escaped (RE2 takes `\\` before punctuation only), the rest as it is."""
    return "|".join("".join("\\" + c if c in string.punctuation else c for c in v) for v in values)


def promql(spec: ChartSpec) -> str:
    """The spec as PromQL, built (never parsed): escaped label values, checked names."""
    for name in (spec.metric, *(k for k, _ in spec.filter), *spec.group_by, *(k for k, _ in spec.one_of)):
        if not _LABEL.fullmatch(name):
            raise ValueError(f"not a metric or label name: {name!r}")
    matchers = [f"{k}={_string(v)}" for k, v in spec.filter]
    matchers += [f"{k}=~{_string(regex_alternatives(values))}" for k, values in spec.one_of]
    return f"{spec.agg} by ({','.join(spec.group_by)}) ({spec.metric}{{{','.join(matchers)}}})"


def range_grid(start: float, end: float, step: float) -> dict[str, str]:
    """A range query's start, end and step, so that its last point is `end`.

    Prometheus evaluates at start, start + step, ... up to end, in whole
    milliseconds (a step given as fractional seconds is truncated to them). A
    step that does not divide the span left the last point up to a step before
    `end`, so the newest scrape was missing from the chart until the next step.
    The step is whole milliseconds, at least a second, written as a duration
    (`7259ms`: no float to truncate), and the grid is counted back from `end`.
    """
    step_ms = max(1000, math.ceil(step * 1000))
    end_ms = math.floor(end * 1000)
    start_ms = end_ms - max(0, end_ms - math.ceil(start * 1000)) // step_ms * step_ms
    return {"start": f"{start_ms / 1000:.3f}", "end": f"{end_ms / 1000:.3f}", "step": f"{step_ms}ms"}


class PrometheusHistory:
    """The same specs answered by Prometheus range queries (`--prometheus URL`)."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = session

    async def query(self, spec: ChartSpec, start: float, end: float, step: float) -> list[Series]:
        params = {"query": promql(spec), **range_grid(start, end, step)}
        try:
            async with self.session.get(f"{self.base_url}/api/v1/query_range", params=params) as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise HistoryError(f"Prometheus at {self.base_url}: {type(e).__name__}: {e}") from None
        if body.get("status") != "success":
            raise HistoryError(f"Prometheus at {self.base_url}: {body.get('error', 'query failed')}")
        out = []
        for result in body["data"]["result"]:
            values = result["values"]
            t = np.array([float(x[0]) for x in values])
            v = np.array([float(x[1]) for x in values])
            out.append(Series(" ".join(result["metric"].get(k, "") for k in spec.group_by), t, v))
        return sorted(out, key=lambda s: s.label)
