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
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, cast

import aiohttp
import numpy as np

from controlplane.export.series import FlatLabels, SeriesKey, SeriesLabels, label_pairs, series_of
from controlplane.state.registry import Received

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


def _stats(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At each instant (column), over the series (rows) measured then (NaN: not):
    their sum, how many, and the largest."""
    present = ~np.isnan(values)
    return (np.where(present, values, 0.0).sum(axis=0, dtype=np.float64), present.sum(axis=0),
            np.where(present, values, -np.inf).max(axis=0, initial=-np.inf).astype(np.float64))  # fmt: skip


def _combined(agg: str, sums: np.ndarray, counts: np.ndarray, maxima: np.ndarray) -> np.ndarray:
    """The aggregate where anything was measured; NaN where nothing was (absent is not zero)."""
    out = {"sum": sums, "max": maxima, "avg": sums / np.maximum(counts, 1)}[agg]
    return np.where(counts > 0, out, np.nan)


def step_grid(start: float, end: float, step: float, most: int = 10_000) -> np.ndarray:
    """The instants a chart combining nodes is evaluated at: every `step`
    counted back from `end` (so the newest heartbeat is on it), as Prometheus'
    range queries are, and never more than `most` of them."""
    step = max(step, (end - start) / most, 1e-3)
    n = math.floor((end - start) / step + 1e-9)
    return end - step * np.arange(max(n, 0), -1, -1)


@dataclass
class _NodeRing:
    """One node's hour: heartbeat times, and one float32 row of them per series
    (a series' hour is contiguous: charts read a few series of many nodes)."""

    node: str
    capacity: int
    t: np.ndarray = field(init=False)
    values: np.ndarray = field(init=False)  # (series, capacity)
    columns: dict[SeriesKey, int] = field(default_factory=dict)
    # The series by family, with their labels and the node's name as a query matches them. Flat
    # tuples of strings, not dicts: a tuple holding a dict is never untracked by the collector, and
    # these were 65 of a node's 101 objects every full collection walked (0.82 s at 20,000 nodes).
    # Tuples, not lists: a tuple of strings and numbers leaves the collector's
    # lists, and a node's 21 lists were most of what a full collection walked.
    # Each entry its labels, the node's, then its row, in one flat tuple: two levels of tuples in
    # all, untracked by the young generations' collections before a full one sees them.
    families: dict[str, tuple[tuple[str | int, ...], ...]] = field(default_factory=dict)
    n: int = 0  # heartbeats recorded, ever
    free: list[int] = field(default_factory=list)  # rows given up by series gone for the hour
    swept_at: int = -1  # n at the last look for series gone
    labels: SeriesLabels = field(default_factory=SeriesLabels)
    # The last heartbeat's series and their rows: most heartbeats have the
    # same series as the one before, found so by identity (`SeriesLabels`).
    _last_keys: tuple[SeriesKey, ...] | None = None
    _last_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.intp))
    _last: tuple[tuple[int, float, float, int, float], tuple[np.ndarray, np.ndarray]] | None = None
    _model: tuple[tuple[tuple[str | int, ...], ...] | None, str] = (None, "")  # gpu_model's answer, by its series

    def __post_init__(self) -> None:
        self.t = np.full(self.capacity, np.nan)
        # Rows are made as series come, the first heartbeat's all at once, and
        # slots as heartbeats come, doubling until the hour is held: a node's
        # first heartbeat made a whole hour of every series (230 KiB for 8 GPUs
        # and 4 engines, touched page by page), which took 64% of the control
        # plane's time while a restarted fleet's nodes came back
        # (bench/heartbeat_throughput.py --fresh). A row is NaN as a series
        # takes it; slots no heartbeat has written are never read (`slots`).
        self.values = np.empty((0, 0), dtype=np.float32)

    def record(self, at: float, received: Received) -> None:
        slot = self.n % self.capacity
        if slot >= self.values.shape[1]:
            self._resize(self.values.shape[0], min(self.capacity, max(8, 2 * self.values.shape[1])))
        keys, values = series_of(received, self.labels)
        if keys == self._last_keys:
            rows = self._last_rows
        else:
            rows, values = self._rows(keys, values)
        self.values[:, slot] = np.nan
        # One write: a heartbeat's 80 series took 80 numpy item writes.
        self.values[rows, slot] = np.array(values, dtype=np.float32)
        self.t[slot] = at
        self.n += 1

    def _rows(self, keys: tuple[SeriesKey, ...], values: list[float | int]) -> tuple[np.ndarray, list[float | int]]:
        """The rows of a heartbeat's series, new series given theirs; and the
        values that have one."""
        columns = self.columns
        rows, kept = [], []
        new: dict[str, list[tuple[str | int, ...]]] = {}
        for key, value in zip(keys, values, strict=True):
            row = columns.get(key)
            if row is None:
                row = self._take_row(len(keys))
                if row is None:  # as many series, all with a value in the hour: this one waits
                    continue
                # Not measured at the heartbeats held before it came: a row is NaN
                # there as it is taken (made NaN by `_resize`, or given up as NaN).
                columns[key] = row
                family, labels = key
                new.setdefault(family, []).append((*labels, "node", self.node, row))
            rows.append(row)
            kept.append(value)
        for family, entries in new.items():  # a family's tuple made once, not once a series (a node's first: 80)
            self.families[family] = (*self.families.get(family, ()), *entries)
        found = np.array(rows, dtype=np.intp)
        whole = len(rows) == len(keys)
        self._last_keys, self._last_rows = (keys, found) if whole else (None, found[:0])
        return found, kept

    def _take_row(self, wanted: int) -> int | None:
        """A row for a new series; `wanted`, the heartbeat's series, sizes the
        first allocation."""
        used = len(self.columns) + len(self.free)  # every row taken is a series' or free again
        if not self.free and used >= MAX_SERIES_PER_NODE and self.swept_at != self.n:
            self.swept_at = self.n  # at most one look a heartbeat
            self._give_up_unused()
        if self.free:
            return self.free.pop()
        if used >= MAX_SERIES_PER_NODE:
            return None
        if used >= self.values.shape[0]:
            self._resize(min(MAX_SERIES_PER_NODE, max(2 * self.values.shape[0], wanted)), self.values.shape[1])
        return used

    def _resize(self, rows: int, slots: int) -> None:
        """New rows NaN, so that a series taking one was not measured before it
        came (one fill, not one a series: a node's first heartbeat filled 80
        rows one by one, 9% of the control plane's time while a restarted
        fleet came back); new slots are written before they are read."""
        grown = np.empty((rows, slots), dtype=np.float32)
        kept_rows, kept_slots = min(rows, self.values.shape[0]), min(slots, self.values.shape[1])
        grown[:kept_rows, :kept_slots] = self.values[:kept_rows, :kept_slots]
        grown[kept_rows:] = np.nan
        self.values = grown

    def _give_up_unused(self) -> None:
        """Series with no value in the hour held (an engine gone for the hour,
        a card removed) give their rows up to new ones: evicted, not refused."""
        held, _ = self.slots()
        unused = np.isnan(self.values[:, held]).all(axis=1)
        gone = {col for col in self.columns.values() if unused[col]}
        if not gone:
            return
        self.columns = {k: c for k, c in self.columns.items() if c not in gone}
        for family in list(self.families):
            kept = tuple(entry for entry in self.families[family] if entry[-1] not in gone)
            if kept:
                self.families[family] = kept
            else:
                del self.families[family]
        self.free.extend(sorted(gone, reverse=True))

    def gpu_model(self) -> str:
        """The model of the node's first card in the hour, "" for a node without."""
        entries = self.families.get("llmgw_gpu_utilization_percent", ())
        if self._model[0] is not entries:  # the node's cards changed (its series are a new tuple then)
            model = label_pairs(cast(FlatLabels, entries[0][:-1])).get("gpu_model", "") if entries else ""
            self._model = (entries, model)
        return self._model[1]

    def slots(self) -> tuple[np.ndarray, np.ndarray]:
        """The slots holding heartbeats, oldest first, and their times."""
        held = min(self.n, self.capacity)
        order = (self.n - held + np.arange(held)) % self.capacity
        return order, self.t[order]

    def last_at(self, grid: np.ndarray, within: float) -> tuple[np.ndarray, np.ndarray]:
        """At each instant of the grid, the slot of the last heartbeat at or
        before it, if that is at most `within` old: (which instants, slots).
        The last answer is kept: a page's charts ask it for the same grid."""
        key = (self.n, float(grid[0]), float(grid[-1]), len(grid), within)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        slots, t = self.slots()
        last = np.searchsorted(t, grid, side="right") - 1
        known = (last >= 0) & (grid - t[last] <= within)  # t[-1] where last is -1: masked by the first term
        self._last = (key, (known, slots[last[known]]))
        return self._last[1]


class EmbeddedHistory:
    """Numpy ring buffers in the control plane, an hour at the heartbeat interval.

    A chart of one node draws its heartbeats as they came (the series of one
    node share its heartbeats' times, so they combine row by row). A chart
    combining nodes, whose heartbeats come at other instants, takes each
    node's last heartbeat at every step of a grid, carried at most
    `stale_after` (as a Prometheus range query does with its lookback), and
    combines those: memory is nodes x steps, and a sum is a sum of every node.

    Heartbeats are recorded on the event loop while pages read on their own
    thread (controlplane/listen/page_worker.py): both hold the lock, a reader one
    node at a time, so a heartbeat waits for one node's copy at most.
    """

    def __init__(self, interval: float = 5.0, span: float = HOUR_S, clock: Callable[[], float] = time.time,
                 stale_after: float = 60.0) -> None:  # fmt: skip
        self.capacity = max(2, math.ceil(span / interval) + 1)
        self.interval = interval
        self.clock = clock
        self.stale_after = stale_after
        self._nodes: dict[str, _NodeRing] = {}
        self._lock = threading.Lock()

    def record(self, node: str, received: Received, at: float | None = None) -> None:
        with self._lock:
            ring = self._nodes.get(node)
            if ring is None:
                ring = self._nodes[node] = _NodeRing(node, self.capacity)
            ring.record(self.clock() if at is None else at, received)

    def forget(self, node: str) -> None:
        with self._lock:
            self._nodes.pop(node, None)

    def __len__(self) -> int:
        return len(self._nodes)

    async def query(self, spec: ChartSpec, start: float, end: float, step: float) -> list[Series]:
        return self.query_now(spec, start, end, step)

    def node_highest(self, family: str) -> Iterator[tuple[str, str, np.ndarray, np.ndarray]]:
        """Each node's highest value of a family's series at each heartbeat
        it holds: the node, its GPU model ("" without), the values (NaN where
        none of its series was measured) and the heartbeats' times, in the
        ring's order, not time's (empty where the node has none of the
        family). A node at a time under the lock, copied: the caller works on
        it with the lock free. A node's work is a few numpy calls: the
        fleet's picture reads 10,000 nodes so (controlplane/history/heatmap.py)."""
        with self._lock:
            rings = list(self._nodes.items())
        for node, ring in rings:
            with self._lock:
                if self._nodes.get(node) is not ring:
                    continue  # forgotten since
                entries = ring.families.get(family, ())
                held = min(ring.n, ring.capacity) if entries else 0
                if len(entries) == 1:  # a node's CPU: a slice, no fancy index
                    highest = ring.values[cast(int, entries[0][-1]), :held].copy()
                else:
                    highest = np.fmax.reduce(ring.values[[cast(int, e[-1]) for e in entries], :held], axis=0) \
                        if held else np.empty(0, dtype=np.float32)  # fmt: skip
                t = ring.t[:held].copy()
                model = ring.gpu_model()
            yield node, model, highest, t

    def _columns(self, spec: ChartSpec) -> dict[tuple[str, ...], dict[str, list[int]]]:
        """The spec's series: by group, then by node (under the lock)."""
        want = dict(spec.filter)
        node_filter = want.pop("node", None)
        one = self._nodes.get(node_filter) if node_filter is not None else None
        rings = self._nodes.values() if node_filter is None else [one] if one is not None else []
        groups: dict[tuple[str, ...], dict[str, list[int]]] = {}
        for ring in rings:
            for entry in ring.families.get(spec.metric, ()):
                labels, col = label_pairs(cast(FlatLabels, entry[:-1])), cast(int, entry[-1])
                if want and any(labels.get(k) != v for k, v in want.items()):
                    continue
                if spec.one_of and any(labels.get(k) not in values for k, values in spec.one_of):
                    continue
                key = tuple([labels.get(k, "") for k in spec.group_by])
                groups.setdefault(key, {}).setdefault(ring.node, []).append(col)
        return groups

    def query_now(self, spec: ChartSpec, start: float, end: float, step: float) -> list[Series]:
        with self._lock:
            groups = self._columns(spec)
        out = []
        for key, by_node in sorted(groups.items()):
            if len(by_node) == 1:
                [(node, cols)] = by_node.items()
                with self._lock:
                    ring = self._nodes.get(node)
                    slots, t = ring.slots() if ring is not None else (np.empty(0, dtype=np.int64), np.empty(0))
                    keep = (t >= start) & (t <= end)
                    values = ring.values[cols][:, slots[keep]] if ring is not None else np.empty((len(cols), 0))
                v = _combined(spec.agg, *_stats(values))
                if not np.isnan(v).all():  # a series with nothing in the span is not on the chart (nor Prometheus')
                    out.append(Series(" ".join(key), t[keep], v))
                continue
            grid = step_grid(start, end, step)
            sums, counts, maxima = self._on_grid(by_node, grid)
            if counts.any():
                out.append(Series(" ".join(key), grid, _combined(spec.agg, sums, counts, maxima)))
        return out

    def _on_grid(self, by_node: dict[str, list[int]], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The nodes' series at the grid's instants, stacked a block at a time
        (a few MiB whatever the fleet) and combined into running totals: the
        sum, how many were measured, and the largest, at each instant."""
        sums, counts, maxima = np.zeros(len(grid)), np.zeros(len(grid), dtype=np.int64), np.full(len(grid), -np.inf)
        block = np.full((MAX_SERIES_PER_NODE, len(grid)), np.nan, dtype=np.float32)  # a node's series fit
        used = 0
        for node, cols in [*by_node.items(), ("", [])]:  # the last: the final block is added
            if used + len(cols) > len(block) or not cols:
                s, c, m = _stats(block[:used])
                sums, counts, maxima = sums + s, counts + c, np.maximum(maxima, m)
                block[:used], used = np.nan, 0
            with self._lock:  # one node at a time: a heartbeat waits for one node's copy at most
                if cols and (ring := self._nodes.get(node)) is not None:
                    known, slots = ring.last_at(grid, self.stale_after)
                    block[used : used + len(cols), known] = ring.values[cols][:, slots]
            used += len(cols)
        return sums, counts, maxima

    def grid_parts(self, spec: ChartSpec, grid: np.ndarray) -> dict[str, GridPart]:
        """Each group's running totals on `grid` (its label values, joined):
        what a replica adds to a peer's chart of the whole fleet
        (controlplane/fleet/peers.py), combined there as its own are (`combine`)."""
        with self._lock:
            groups = self._columns(spec)
        parts = {" ".join(key): self._on_grid(by_node, grid) for key, by_node in sorted(groups.items())}
        return {key: part for key, part in parts.items() if part[1].any()}


GridPart = tuple[np.ndarray, np.ndarray, np.ndarray]  # sums, counts, maxima at each instant of a grid


def combine(spec: ChartSpec, grid: np.ndarray, parts: list[dict[str, GridPart]]) -> list[Series]:
    """Replicas' parts of a chart as one: each group's totals added, then aggregated."""
    totals: dict[str, GridPart] = {}
    for part in parts:
        for key, (s, c, m) in part.items():
            if key in totals:
                ts, tc, tm = totals[key]
                totals[key] = (ts + s, tc + c, np.maximum(tm, m))
            else:
                totals[key] = (s, c, m)
    return [Series(key, grid, _combined(spec.agg, *totals[key])) for key in sorted(totals)]


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

    # The fleet's picture from Prometheus: a column a scrape at its default
    # interval (controlplane/history/heatmap_prometheus.py); and the clock its hour ends by.
    interval = 15.0

    def __init__(self, base_url: str, session: aiohttp.ClientSession,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.clock = clock

    async def ask(self, path: str, form: dict[str, str], most: int) -> bytes:
        """A query's answer as Prometheus wrote it (`path`: `query` or
        `query_range`), POSTed (a query may name thousands of nodes) and read
        to `most` bytes at most; HistoryError for a failure or more."""
        try:
            async with self.session.post(f"{self.base_url}/api/v1/{path}", data=form) as r:
                status, chunks, size = r.status, [], 0
                async for chunk in r.content.iter_any():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > most:
                        raise HistoryError(f"Prometheus at {self.base_url}: an answer over {most} bytes")
                body = b"".join(chunks)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise HistoryError(f"Prometheus at {self.base_url}: {type(e).__name__}: {e}") from None
        if status != 200 and not body.startswith(b"{"):
            raise HistoryError(f"Prometheus at {self.base_url}: HTTP {status}")
        return body

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
