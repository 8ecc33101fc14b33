"""The fleet's picture drawn from Prometheus (`--prometheus`): the same rows,
bands and colours as from the embedded history (controlplane/history/heatmap.py),
asked of Prometheus so that what crosses the network is the picture's size,
not the fleet's.

First three instant queries at the picture's end, at once:

1. each node's hour, one number a node (the mean of its scrapes), which
   orders the rows;
2. the nodes Prometheus has now (`llmgw_node_up`: a node without the
   measure is a grey row, as in the embedded picture) and each one's GPU
   model (the cards it exports now), which groups them;
3. the scrape interval (the densest `llmgw_node_up` of the last ten
   minutes): a column's range is a column or a scrape, whichever is
   longer, so that a scrape rarer than a column widens a burst to its
   scrape rather than leaving columns between scrapes empty.

Then the cells: with no more nodes than `MAX_ROWS`, one range query of each
node's highest value a column; with more, a range query a band of its worst
node a column (`topk(1, ...)` over the band's nodes), `ASKED_AT_ONCE` in
flight. A query a band, not the bands joined by `or`: Prometheus (2.42)
evaluates a chain of `or` in time quadratic in its arms (measured at 300
nodes: 150 bands joined, 1.3 s; asked one by one, 0.16 s in all; as a
balanced tree of `or`, 0.37 s), and the whole fleet a node a row is 13 MB
of answer at 3,000 nodes.

A column is a scrape at Prometheus' default 15 s (`PrometheusHistory.interval`):
240 an hour. The answers' JSON is parsed on the page thread (PageWorker), as
the embedded picture is drawn there; each answer is read to
`MAX_ANSWER_BYTES` at most.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np

from controlplane.history.backends import HOUR_S, HistoryError, PrometheusHistory, range_grid, regex_alternatives
from controlplane.history.heatmap import ABSENT, Heatmap, Measure, Row, bands, levels_of
from controlplane.listen.page_worker import PageWorker
from wire.limits import NODE_ID

MAX_ANSWER_BYTES = 32 << 20  # an answer: 200 rows of 240 columns with their labels is a few MB at worst
ASKED_AT_ONCE = 8  # band queries in flight to Prometheus at a time (its own default limit is 20)
GPU_FAMILY = "llmgw_gpu_utilization_percent"  # carries each card's gpu_model
NODES_NOW = f"group by (node, gpu_model) ({GPU_FAMILY}) or group by (node) (llmgw_node_up)"
SCRAPES = "max(count_over_time(llmgw_node_up[600s]))"  # the densest node's scrapes in ten minutes
MAX_RANGE_S = 300.0  # a scrape rarer than Prometheus' own lookback: the range stops there


def highest(family: str, matcher: str, range_ms: int) -> str:
    """The highest value of `family` in the range ending at each step."""
    return f"max_over_time({family}{{{matcher}}}[{range_ms}ms])"


def band_query(family: str, names: list[str], range_ms: int) -> str:
    """A band's worst node in each column (its series names the node)."""
    matcher = f'node=~"{_escaped(regex_alternatives(tuple(names)))}"'
    return f"topk(1, {highest(family, matcher, range_ms)})"


def scrape_range_ms(body: bytes, step_s: float) -> int:
    """A column's range: its width, or the scrape interval the densest node's
    scrapes show if longer (at most `MAX_RANGE_S`)."""
    results = _results(body, "vector")
    value = results[0].get("value") if results else None
    count = _value(value[1]) if isinstance(value, list) and len(value) == 2 else math.nan
    interval = 600.0 / count if count >= 1 else step_s
    return round(1000 * min(MAX_RANGE_S, max(step_s, interval)))


def _escaped(regex: str) -> str:
    """A regex as a PromQL double-quoted string's contents."""
    return regex.replace("\\", "\\\\").replace('"', '\\"')


def _results(body: bytes, kind: str) -> list[dict[str, Any]]:
    """A Prometheus answer's results, checked to be `kind` ("vector" or "matrix")."""
    try:
        answer = json.loads(body)
    except ValueError as e:
        raise HistoryError(f"Prometheus answered something other than JSON: {e}") from None
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error", "query failed") if isinstance(answer, dict) else "not an object"
        raise HistoryError(f"Prometheus: {error}")
    data = answer.get("data")
    if not isinstance(data, dict) or data.get("resultType") != kind or not isinstance(data.get("result"), list):
        raise HistoryError(f"Prometheus: not a {kind}")
    return [r for r in data["result"] if isinstance(r, dict) and isinstance(r.get("metric"), dict)]


def _value(text: object) -> float:
    try:
        v = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) else math.nan


def scores_and_groups(scores_body: bytes, groups_body: bytes) -> tuple[list[str], list[str], list[float]]:
    """The nodes Prometheus has the measure of in the hour or has now, in
    name order, with their GPU model ("" for none) and their hour's mean (-1
    for none). A series without a node id for its node is left out, it alone."""
    score: dict[str, float] = {}
    for r in _results(scores_body, "vector"):
        node, value = r["metric"].get("node"), r.get("value")
        if isinstance(node, str) and NODE_ID.fullmatch(node) and isinstance(value, list) and len(value) == 2:
            v = _value(value[1])
            score[node] = -1.0 if math.isnan(v) else v
    model: dict[str, str] = {}
    for r in _results(groups_body, "vector"):
        node, gpu_model = r["metric"].get("node"), r["metric"].get("gpu_model", "")
        if not (isinstance(node, str) and NODE_ID.fullmatch(node)):
            continue
        score.setdefault(node, -1.0)
        good = isinstance(gpu_model, str) and gpu_model.isprintable() and 0 < len(gpu_model) <= 256
        if good and (node not in model or gpu_model < model[node]):
            model[node] = gpu_model  # a node of two models: the first by name, whichever card answered first
    names = sorted(score)
    return names, [model.get(n, "") for n in names], [score[n] for n in names]


def _columns_of(values: object, start: float, step: float, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """A range result's points as (column, value): the point at a column's end is that column's."""
    if not isinstance(values, list):
        return np.empty(0, dtype=np.int64), np.empty(0)
    at, got = [], []
    for point in values:
        if isinstance(point, list) and len(point) == 2:
            t, v = _value(point[0]), _value(point[1])
            if not (math.isnan(t) or math.isnan(v)):
                at.append(round((t - start) / step) - 1)
                got.append(v)
    cols = np.array(at, dtype=np.int64)
    keep = (cols >= 0) & (cols < columns)
    return cols[keep], np.array(got)[keep]


def picture(measure: Measure, end: float, columns: int, names: list[str], groups: list[str], score: list[float],
            cells: list[bytes | None]) -> Heatmap:  # fmt: skip
    """The picture from the nodes' order and the cells' answers: one of a
    row a node, or (banded) one a band, in the bands' order (None: not asked)."""
    start, step = end - HOUR_S, HOUR_S / columns
    order = bands(names, groups, score)
    index = {n: i for i, n in enumerate(names)}
    values = np.full((len(order), columns), np.nan, dtype=np.float32)  # as the embedded history holds figures
    worst = np.full((len(order), columns), -1, dtype=np.int16)
    banded = any(len(members) > 1 for _, members in order)
    row_of = {} if banded else {members[0]: r for r, (_, members) in enumerate(order)}
    for number, body in enumerate(cells):
        if body is None:
            continue
        for result in _results(body, "matrix"):
            i = index.get(result["metric"].get("node"), -1)
            if banded:
                r, members = number, order[number][1] if number < len(order) else []
                k = members.index(i) if i in members else -1
            else:
                r, k = row_of.get(i, -1), 0
            if r < 0 or k < 0:
                continue  # a node not in this band, or not in the picture (it came since the first asks)
            at, v = _columns_of(result.get("values"), start, step, columns)
            higher = np.isnan(values[r, at]) | (v > values[r, at])  # topk's ties, a node's two series: the higher
            values[r, at[higher]] = v[higher]
            worst[r, at[higher]] = k
    levels = levels_of(measure, values)
    rows = [Row(group, [names[i] for i in members], levels[r], np.where(levels[r] == ABSENT, -1, worst[r]))
            for r, (group, members) in enumerate(order)]  # fmt: skip
    return Heatmap(measure, start, step, columns, rows, len(names))


async def prometheus_heatmap(prometheus: PrometheusHistory, worker: PageWorker, measure: Measure, end: float,
                             columns: int) -> Heatmap:  # fmt: skip
    """The picture of the hour ending at `end`, on `columns` columns, from Prometheus."""
    step = HOUR_S / columns
    hourly = f"max by (node) (avg_over_time({measure.family}[{round(HOUR_S)}s]))"
    at_end = f"{end:.3f}"
    scores_body, groups_body, scrapes_body = await asyncio.gather(
        *(prometheus.ask("query", {"query": q, "time": at_end}, MAX_ANSWER_BYTES)
          for q in (hourly, NODES_NOW, SCRAPES)))  # fmt: skip
    names, groups, score = await worker.run(scores_and_groups, scores_body, groups_body)
    range_ms = scrape_range_ms(scrapes_body, step)
    grid = range_grid(end - HOUR_S + step, end, step)
    order = bands(names, groups, score)
    if len(order) == len(names):  # a row a node
        queries: list[str | None] = [f"max by (node) ({highest(measure.family, '', range_ms)})"] if names else []
    else:  # a band none of whose nodes had the measure in the hour is grey without asking
        queries = [None if all(score[i] < 0 for i in members) else
                   band_query(measure.family, [names[i] for i in members], range_ms) for _, members in order]
    at_once = asyncio.Semaphore(ASKED_AT_ONCE)

    async def cells(query: str | None) -> bytes | None:
        if query is None:
            return None
        async with at_once:
            return await prometheus.ask("query_range", {"query": query, **grid}, MAX_ANSWER_BYTES)

    answers = await asyncio.gather(*(cells(q) for q in queries))
    return await worker.run(picture, measure, end, columns, names, groups, score, answers)
