"""The fleet as one picture: a row per node, a column per window of the
last hour, each cell coloured by the window's highest figure.

Drawn from the embedded history (controlplane/history/backends.py; with
`--prometheus`, from Prometheus: controlplane/history/heatmap_prometheus.py, the
same rows and colours): each node's heartbeats in the hour, binned into
columns a heartbeat interval wide, the largest of its series (its cards,
its engines) in each. Rows are grouped by
GPU model (CPU nodes last), the busiest group and node first; a fleet of
more nodes than `MAX_ROWS` has its rows merged into bands of consecutive
nodes of one group, a band's cell the worst of its nodes (so a burst on one
node in ten thousand still colours its band's cell), and the node that was
worst is what a click on the cell opens (`Heatmap.cell`).

The answer is a palette PNG, one pixel a cell: at most `MAX_ROWS` plus a
row per group by 720 columns, whatever the fleet (145 KiB before zlib at
most; 1-3 KiB at 10,000 nodes in bench/heatmap.py). The page scales it; the click's cell is asked of
the server, which keeps the picture's rows for it.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import threading
import weakref
import zlib
from dataclasses import dataclass

import numpy as np

from controlplane.history.backends import HOUR_S, EmbeddedHistory
from wire.limits import NODE_ID

MAX_ROWS = 200  # a picture an operator sees without scrolling, at 2 px a row and up
MAX_COLUMNS = 720  # an hour at the default 5 s heartbeat
LEVELS = 250  # colour levels for values; 255: nothing measured (absent is not zero)
ABSENT = 255


@dataclass(frozen=True)
class Measure:
    """What a cell's colour says: the highest of a family's series on a node
    in the window, against `full_scale` (the top colour)."""

    key: str
    title: str
    family: str
    full_scale: float
    unit: str  # "percent": the value times 100 / full_scale reads as a percentage


MEASURES = {
    m.key: m
    for m in (
        Measure("cpu", "CPU busy, the window's highest sample", "llmgw_node_cpu_utilization_max_percent", 100.0,
                "percent"),
        Measure("gpu", "GPU utilisation, the busiest card's window", "llmgw_gpu_utilization_percent", 100.0,
                "percent"),
        Measure("sm", "SMs busy (GPM), the busiest card's window", "llmgw_gpu_sm_active_ratio", 1.0, "percent"),
        Measure("starved", "Engines starved: any in the window", "llmgw_shard_starved", 1.0, "percent"),
    )
}  # fmt: skip


def palette() -> bytes:
    """LEVELS colours from pale to dark (ColorBrewer's YlOrRd, interpolated:
    sequential, and read in grey and by the common colour blindnesses as
    light to dark), then grey for what was not measured."""
    stops = np.array([(255, 255, 204), (254, 217, 118), (253, 141, 60), (227, 26, 28), (128, 0, 38)], dtype=float)
    at = np.linspace(0, len(stops) - 1, LEVELS)
    low = np.minimum(at.astype(int), len(stops) - 2)
    frac = (at - low)[:, None]
    colours = np.rint(stops[low] * (1 - frac) + stops[low + 1] * frac).astype(np.uint8)
    table = np.full((256, 3), 224, dtype=np.uint8)  # 250-255 grey: absent
    table[:LEVELS] = colours
    return table.tobytes()


PALETTE = palette()


def level_colour(level: int) -> tuple[int, int, int]:
    r, g, b = PALETTE[3 * level : 3 * level + 3]
    return r, g, b


@dataclass
class Row:
    """A row of the picture: one node, or a band of a group's nodes."""

    group: str
    nodes: list[str]
    levels: np.ndarray  # uint8 per column
    worst: np.ndarray  # int16 per column: which of `nodes` was worst; -1 where none was measured


@dataclass
class Heatmap:
    measure: Measure
    start: float  # column c covers (start + c * step, start + (c + 1) * step]
    step: float
    columns: int
    rows: list[Row]
    nodes: int

    def cell(self, row: int, column: int) -> tuple[str, float] | None:
        """The node worst in a cell and the middle of its window; None where the
        cell is outside the picture or nothing was measured there."""
        if not (0 <= row < len(self.rows) and 0 <= column < self.columns):
            return None
        r = self.rows[row]
        worst = int(r.worst[column])
        if worst < 0:
            return None
        return r.nodes[worst], self.start + (column + 0.5) * self.step

    def png(self) -> bytes:
        """One pixel a cell, in `PALETTE`'s colours."""
        height = max(1, len(self.rows))
        pixels = np.full((height, self.columns + 1), ABSENT, dtype=np.uint8)
        pixels[:, 0] = 0  # each scanline's filter byte: none
        for i, r in enumerate(self.rows):
            pixels[i, 1:] = r.levels
        header = struct.pack(">IIBBBBB", self.columns, height, 8, 3, 0, 0, 0)  # 8-bit palette
        return b"".join([b"\x89PNG\r\n\x1a\n", _chunk(b"IHDR", header), _chunk(b"PLTE", PALETTE),
                         _chunk(b"IDAT", zlib.compress(pixels.tobytes(), 6)), _chunk(b"IEND", b"")])  # fmt: skip

    def legend(self) -> dict[str, object]:
        """What the page's script names a cell under the pointer with: each
        row's group and nodes, its levels (a byte a column) and which of its
        nodes was worst in each (two bytes a column, little-endian), in
        base64: about 0.5 MB at 10,000 nodes (bench/heatmap.py)."""
        return {
            "measure": self.measure.key, "title": self.measure.title, "unit": self.measure.unit,
            "levels": LEVELS, "absent": ABSENT, "start": self.start, "step": self.step, "columns": self.columns,
            "nodes": self.nodes,
            "rows": [{"group": r.group, "nodes": r.nodes, "levels": base64.b64encode(r.levels.tobytes()).decode(),
                      "worst": base64.b64encode(r.worst.astype("<i2").tobytes()).decode()} for r in self.rows],
        }  # fmt: skip


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def column_grid(end: float, interval: float, span: float = HOUR_S) -> tuple[float, float, int]:
    """(start, step, columns): a column a heartbeat interval wide, `MAX_COLUMNS` at most, ending at `end`."""
    columns = max(1, min(MAX_COLUMNS, math.ceil(span / interval)))
    step = span / columns
    return end - span, step, columns


def node_maxima(history: EmbeddedHistory, family: str, start: float, step: float,
                columns: int) -> tuple[list[str], list[str], np.ndarray]:  # fmt: skip
    """Each node's highest value of the family in each column (NaN: none
    measured), with its group: (nodes, groups, values[node, column]). The
    nodes' heartbeats are binned together, in one call: a node's own numpy
    calls were most of a cold picture's time at 10,000 nodes."""
    names: list[str] = []
    groups: list[str] = []
    highest: list[np.ndarray] = []
    times: list[np.ndarray] = []
    for name, model, values, t in history.node_highest(family):
        names.append(name)
        groups.append(model)
        highest.append(values)
        times.append(t[: len(values)])
    cells = len(names) * columns
    out = np.full(cells + 1, np.nan, dtype=np.float32)  # and a cell for what falls outside the hour
    if names:
        # In place, in int32, and what falls outside sent to the last cell rather than masked
        # out: 62 ms for 7.2 million heartbeats against 167 ms filtered in int64.
        column = np.concatenate(times) - start
        column /= step
        np.ceil(column, out=column)  # heartbeat at t: the column (start + (c - 1) step, start + c step]
        with np.errstate(invalid="ignore"):  # NaN (a slot never written): sent outside next
            at = column.astype(np.int32)
        at -= 1
        at += np.repeat(np.arange(0, cells, columns, dtype=np.int32), [len(v) for v in highest])
        at[~((column >= 1) & (column <= columns))] = cells
        np.fmax.at(out, at, np.concatenate(highest))
    return names, groups, out[:cells].reshape(len(names), columns)


@dataclass
class Part:
    """A replica's nodes in the picture: their names, groups (GPU model, ""
    for none) and levels[node, column] (what `build` combines, and what a
    peer sends: `part_json`)."""

    names: list[str]
    groups: list[str]
    levels: np.ndarray  # uint8


def levels_of(measure: Measure, values: np.ndarray) -> np.ndarray:
    """Values as colour levels: 0 to LEVELS - 1 over the measure's scale, ABSENT where none was measured."""
    scaled = np.clip(np.rint(values * ((LEVELS - 1) / measure.full_scale)), 0, LEVELS - 1)  # NaN stays NaN
    return np.where(np.isnan(values), ABSENT, scaled).astype(np.uint8)


def build(measure: Measure, parts: list[Part], end: float, columns: int) -> Heatmap:
    """The picture's rows from every replica's part: a node in two parts (it
    moved in the hour) one row, each cell the higher; grouped, busiest first,
    banded past MAX_ROWS."""
    start, step = end - HOUR_S, HOUR_S / columns
    index: dict[str, int] = {}
    names: list[str] = []
    groups: list[str] = []
    ranked = np.full((sum(len(p.names) for p in parts), columns), -1, dtype=np.int16)  # -1: not measured
    for part in parts:
        theirs = np.where(part.levels == ABSENT, -1, part.levels.astype(np.int16))
        into = np.empty(len(part.names), dtype=np.intp)  # each of the part's nodes' row in `ranked`
        for i, (name, group) in enumerate(zip(part.names, part.groups, strict=True)):
            at = index.get(name)
            if at is None:
                at = index[name] = len(names)
                names.append(name)
                groups.append(group)
            elif not groups[at]:
                groups[at] = group
            into[i] = at
        # One call for the part, not one a node (a part's nodes are distinct: parse_part).
        ranked[into] = np.maximum(ranked[into], theirs)
    ranked = ranked[: len(names)]
    measured = ranked >= 0
    counts = measured.sum(axis=1)
    # A node's hour: the mean of its windows' levels; one with none, -1 (last of its group).
    score = np.where(counts > 0, np.where(measured, ranked, 0).sum(axis=1) / np.maximum(counts, 1), -1.0)
    rows = []
    for group, banded in bands(names, groups, score.tolist()):
        worst = ranked[banded].argmax(axis=0).astype(np.int16)
        top = ranked[banded][worst, np.arange(columns)]
        rows.append(Row(group, [names[i] for i in banded], np.where(top < 0, ABSENT, top).astype(np.uint8),
                        np.where(top < 0, -1, worst).astype(np.int16)))  # fmt: skip
    return Heatmap(measure, start, step, columns, rows, len(names))


def bands(names: list[str], groups: list[str], score: list[float]) -> list[tuple[str, list[int]]]:
    """The picture's rows as (group, the nodes' indices), top to bottom:
    grouped by GPU model ("" for none: "CPU nodes", last), the group whose
    busiest node scores highest first, each group's nodes by score (their
    hour's mean, -1 for none measured) then name; bands of consecutive nodes
    of one group when there are more than `MAX_ROWS`."""
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    for members in by_group.values():
        members.sort(key=lambda i: (-score[i], names[i]))
    order = sorted(by_group, key=lambda g: (g == "", -score[by_group[g][0]], g))  # CPU nodes ("") last
    band = max(1, math.ceil(len(names) / MAX_ROWS))
    return [(g or "CPU nodes", by_group[g][first : first + band])
            for g in order for first in range(0, len(by_group[g]), band)]  # fmt: skip


# Parts kept by history, measure and grid: every view within a column's
# width, and every peer's ask, is answered from one (as the fleet charts' parts are).
_kept: weakref.WeakKeyDictionary[EmbeddedHistory, dict[tuple[str, float, int], Part]] = weakref.WeakKeyDictionary()
_kept_lock = threading.Lock()


def own_part(history: EmbeddedHistory, measure: Measure, end: float, columns: int) -> Part:
    """This replica's nodes on the grid of `columns` ending at `end`, kept for the next asks."""
    key = (measure.key, end, columns)
    with _kept_lock:
        kept = _kept.setdefault(history, {})
        if (found := kept.get(key)) is not None:
            return found
    step = HOUR_S / columns
    names, groups, values = node_maxima(history, measure.family, end - HOUR_S, step, columns)
    made = Part(names, groups, levels_of(measure, values))
    with _kept_lock:
        kept[key] = made
        while len(kept) > 2 * len(MEASURES):
            del kept[next(iter(kept))]  # the oldest
    return made


def heatmap(history: EmbeddedHistory, measure: Measure, end: float, interval: float) -> Heatmap:
    """One replica's picture ending at `end` (a whole column, `column_end`)."""
    columns = column_grid(end, interval)[2]
    return build(measure, [own_part(history, measure, end, columns)], end, columns)


MAX_PART_NODES = 100_000  # a peer's part: more nodes than any replica holds is refused


def part_json(part: Part) -> bytes:
    """A part as a peer sends it: the levels zlib-compressed (a row of an idle
    node is a few bytes of 720), in base64."""
    packed = base64.b64encode(zlib.compress(part.levels.tobytes(), 6)).decode()
    return json.dumps({"nodes": part.names, "groups": part.groups, "levels": packed}).encode()


def parse_part(value: object, columns: int) -> Part:
    """A peer's part, checked: ValueError unless it is node names and groups
    of the same length and exactly their levels on a grid of `columns`."""
    if not isinstance(value, dict):
        raise ValueError("not a part of the picture")
    names, groups, packed = value.get("nodes"), value.get("groups"), value.get("levels")
    if not (isinstance(names, list) and isinstance(groups, list) and isinstance(packed, str)):
        raise ValueError("nodes, groups and levels: two lists and a string")
    if len(names) != len(groups) or len(names) > MAX_PART_NODES:
        raise ValueError(f"as many groups as nodes, at most {MAX_PART_NODES}")
    if not all(isinstance(n, str) and NODE_ID.fullmatch(n) for n in names):
        raise ValueError("a node's name is not a node id")
    if len(set(names)) != len(names):
        raise ValueError("a node twice in one part")
    if not all(isinstance(g, str) and len(g) <= 256 and g.isprintable() for g in groups):
        raise ValueError("a group is not printable text of at most 256 characters")
    want = len(names) * columns
    inflate = zlib.decompressobj()
    raw = inflate.decompress(base64.b64decode(packed, validate=True), want + 1)  # no more than the grid holds
    if len(raw) != want or inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(f"levels: not {len(names)} rows of {columns}")
    levels = np.frombuffer(raw, dtype=np.uint8).reshape(len(names), columns)
    if ((levels >= LEVELS) & (levels != ABSENT)).any():
        raise ValueError("a level out of range")
    return Part(names, groups, levels)


def column_end(now: float, interval: float) -> float:
    """The picture's last instant: `now` down to a whole column, so that the
    views within a column share one picture and its cells' addresses."""
    step = column_grid(now, interval)[1]
    return math.floor(now / step) * step
