"""Charts as server-rendered SVG: no chart library for the browser to load.

Each series is binned into the chart's pixel columns with numpy, keeping the
minimum and maximum of every column as well as its mean: the band between
them is drawn under the mean's line, so a spike narrower than a pixel still
shows.

A gap is the data saying "not measured": the line breaks where two
consecutive points are farther apart than the series' own step (the median
spacing of its points: the heartbeat interval, or the query's step) with a
margin, and no farther than the stale period allows. It never breaks because
a pixel column happens to hold no point: points a few columns apart are
joined.
"""

from __future__ import annotations

import html
import time

import numpy as np

from controlplane.history.backends import Series

# Paul Tol's "muted" scheme and black: ten colours that stay apart for the
# common colour blindnesses (tests/test_pages.py measures it: at least 15
# CIELAB units between any two, with and without deutan, protan and tritan
# vision simulated; the eight before came to 6 under protan).
PALETTE = ("#332288", "#DDCC77", "#117733", "#CC6677", "#88CCEE", "#882255", "#44AA99", "#999933", "#AA4499",
           "#000000")  # fmt: skip
WIDTH, HEIGHT = 560, 150
# The widths a chart is drawn at (`?width=`): the pages' script asks for the
# one nearest its column's, and redraws on resize (web/static/charts.js); a
# handful, so that views share their renders (controlplane/listen/page_worker.py).
WIDTHS = (400, 480, 560, 640, 800, 960, 1200, 1600)
LEFT, RIGHT, TOP, BOTTOM = 56, 8, 8, 20


def format_value(value: float, unit: str) -> str:
    if unit == "bytes":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(value) < 1024 or suffix == "TiB":
                return f"{value:.0f} {suffix}" if suffix == "B" else f"{value:.1f} {suffix}"
            value /= 1024
    if unit == "percent":
        return f"{value:.0f}%"
    if unit == "ratio":  # 0-1, shown as a percent
        return f"{100 * value:.0f}%"
    if unit == "celsius":
        return f"{value:.0f} °C"
    if unit == "watts":
        return f"{value:.0f} W"
    if unit == "seconds":
        return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.1f} s"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.0f}"


def _display(unit: str, top: float) -> tuple[float, str, bool]:
    """How an axis of `unit` up to `top` is read: the divisor to its display
    unit, the suffix, and whether its steps go by twos (bytes)."""
    if unit == "bytes":
        k = 0
        while k < 4 and top >= 1024 ** (k + 1):
            k += 1
        return 1024**k, (" B", " KiB", " MiB", " GiB", " TiB")[k], True
    if unit == "seconds":
        return (1e-3, " ms", False) if top < 1 else (1.0, " s", False)
    return {"percent": (1.0, "%", False), "ratio": (0.01, "%", False), "celsius": (1.0, " °C", False),
            "watts": (1.0, " W", False)}.get(unit, (1.0, "", False))  # fmt: skip


def _nice_step(x: float, binary: bool) -> float:
    """The least step of the axis' kind at or above `x`: 1, 2, 2.5, 5 times a
    power of ten; for bytes 1, 1.5, 2, 3 times a power of two (64 GiB, 96 GiB)."""
    if binary:
        k = 2.0 ** np.floor(np.log2(x))
        return float(next(m * k for m in (1, 1.5, 2, 3, 4) if m * k >= x * (1 - 1e-9)))
    k = 10.0 ** np.floor(np.log10(x))
    # To 12 digits: 5 x 1e-6 is 4.9999999999999996e-06 in floats, and twice it short of 1e-5.
    return float(f"{next(m * k for m in (1, 2, 2.5, 5, 10) if m * k >= x * (1 - 1e-9)):.12g}")


def value_axis(top: float, unit: str, fixed: bool = False) -> tuple[float, list[tuple[float, str]]]:
    """A chart's value axis: its top (a whole number of steps above the data,
    unless `fixed`) and its ticks at 0, half and the top, labelled in a unit
    a person reads (`0, 64 GiB, 128 GiB`; `0, 50%, 100%`), no two alike."""
    divisor, suffix, binary = _display(unit, top)
    shown = top / divisor
    if not fixed:
        half = _nice_step(max(shown / 2, 1e-12), binary)
        if unit == "bytes" and divisor == 1:
            half = max(half, 1.0)  # no half bytes
        shown = max(2 * half, shown)  # a step found within a rounding below the data's half: the data's top
    half = shown / 2
    decimals = next((d for d in range(13) if abs(round(half, d) - half) <= 1e-9 * max(1.0, half)), 12)
    ticks = [(v * divisor, "0" if v == 0 else f"{v:.{decimals}f}{suffix}") for v in (0.0, half, shown)]
    return shown * divisor, ticks


STALE_AFTER_S = 60.0  # the control plane's default: a node silent this long is not measured
GAP_MARGIN = 2.5  # a point may come this many steps late and still be joined


def gap_after(t: np.ndarray, stale_after: float = STALE_AFTER_S) -> float:
    """The distance between two consecutive points beyond which the line breaks:
    a margin over the series' own step, at most the stale period, but never
    less than one and a half steps (a day's chart asks for points minutes apart)."""
    if len(t) < 2:
        return float("inf")
    step = float(np.median(np.diff(t)))
    return min(GAP_MARGIN * step, max(stale_after, 1.5 * step))


def bin_columns(
    t: np.ndarray, v: np.ndarray, start: float, end: float, cols: int, stale_after: float = STALE_AFTER_S
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per pixel column: min, max and mean of the samples falling in it (NaN:
    none), and whether the line breaks before it (a real gap in the data
    between the column's first point and the point before it)."""
    ok = ~np.isnan(v) & (t >= start) & (t <= end)
    t, v = t[ok], v[ok]
    lo, hi, mean = (np.full(cols, np.nan) for _ in range(3))
    breaks = np.zeros(cols, dtype=bool)
    if len(v) == 0:
        return lo, hi, mean, breaks
    order = np.argsort(t, kind="stable")
    t, v = t[order], v[order]
    idx = np.minimum(((t - start) / (end - start) * cols).astype(np.int64), cols - 1)
    lo[:] = np.inf
    hi[:] = -np.inf
    np.minimum.at(lo, idx, v)
    np.maximum.at(hi, idx, v)
    counts = np.bincount(idx, minlength=cols)
    sums = np.bincount(idx, weights=v, minlength=cols)
    empty = counts == 0
    lo[empty], hi[empty] = np.nan, np.nan
    mean = np.where(empty, np.nan, sums / np.maximum(counts, 1))
    # A break before a point farther than the gap from the point before it.
    gap = np.diff(t) > gap_after(t, stale_after)
    breaks[idx[1:][gap]] = True
    return lo, hi, mean, breaks


def _segments(xs: np.ndarray, ys: np.ndarray, breaks: np.ndarray) -> str:
    """An SVG path through the non-empty columns, lifted only at the data's gaps."""
    parts = []
    pen_down = False
    for x, y, gap in zip(xs.tolist(), ys.tolist(), breaks.tolist(), strict=True):
        if y != y:  # NaN: no point in this column; the line goes on to the next
            continue
        parts.append(f"{'L' if pen_down and not gap else 'M'}{x:.0f} {y:.1f}")
        pen_down = True
    return " ".join(parts)


def columns(width: int = WIDTH) -> int:
    return width - LEFT - RIGHT


def chart_note(title: str, why: str) -> str:
    """A chart with nothing to show: one line saying why, in its place (an
    empty frame with axes reads as a fleet idle at zero)."""
    return f'<p class="chart-none"><span class="title">{html.escape(title)}</span>: {html.escape(why)}</p>'


def svg_chart(title: str, series: list[Series], start: float, end: float, unit: str,
              y_max: float | None = None, width: int = WIDTH, height: int = HEIGHT,
              stale_after: float = STALE_AFTER_S) -> str:  # fmt: skip
    cols = columns(width)
    plot_h = height - TOP - BOTTOM
    binned: list[tuple[Series, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = [
        (s, *bin_columns(s.t, s.v, start, end, cols, stale_after)) for s in series
    ]
    top = y_max
    if top is None:
        highs = [np.nanmax(hi) for _, _, hi, _, _ in binned if not np.isnan(hi).all()]
        top = max(highs) if highs else 1.0
        top = top * 1.05 if top > 0 else 1.0
    top, ticks = value_axis(top, unit, fixed=y_max is not None)
    xs = LEFT + np.arange(cols)

    def y_of(values: np.ndarray) -> np.ndarray:
        return TOP + plot_h - np.clip(values / top, 0, 1) * plot_h

    # Its time axis and unit, for the pages' scripts: the pointer reads the
    # values under it (web/static/charts.js), a click opens every sample around that moment.
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{html.escape(title)}" xmlns="http://www.w3.org/2000/svg" data-from="{start:.3f}" '
           f'data-to="{end:.3f}" data-x0="{LEFT}" data-x1="{LEFT + cols}" data-unit="{html.escape(unit)}">',
           f'<rect x="{LEFT}" y="{TOP}" width="{cols}" height="{plot_h}" fill="#fafafa" stroke="#ddd"/>']  # fmt: skip
    for value, label in ticks:
        y = TOP + plot_h - value / top * plot_h
        out.append(f'<line x1="{LEFT}" x2="{LEFT + cols}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end" class="tick">{html.escape(label)}</text>')
    # A time label every 15 minutes (every 5 for shorter spans).
    step = 900 if end - start > 1800 else 300
    for tick in np.arange(np.ceil(start / step) * step, end + 1, step):
        x = LEFT + (tick - start) / (end - start) * cols
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{height - 5}" text-anchor="middle" class="tick">'
                   f"{time.strftime('%H:%M', time.localtime(tick))}</text>")  # fmt: skip
    if all(np.isnan(mean).all() for _, _, _, mean, _ in binned):
        return chart_note(title, "no data in this span")
    for i, (s, lo, hi, mean, breaks) in enumerate(binned):
        if np.isnan(mean).all():
            continue
        colour = PALETTE[i % len(PALETTE)]
        band = ~np.isnan(lo)
        # The band only where a column held samples that differ: elsewhere it is the line itself.
        if band.any() and (hi[band] > lo[band]).any():
            upper = " ".join(f"{x:.0f},{y:.1f}" for x, y in zip(xs[band], y_of(hi[band]), strict=True))
            lower = " ".join(f"{x:.0f},{y:.1f}" for x, y in zip(xs[band][::-1], y_of(lo[band])[::-1], strict=True))
            out.append(f'<polygon points="{upper} {lower}" fill="{colour}" fill-opacity="0.18" stroke="none" '
                       f'data-series="{i}"/>')  # fmt: skip
        # Each column's value, for the pointer's readout (empty: nothing there): 4 significant digits.
        values = ",".join("" if v != v else f"{v:.4g}" for v in mean.tolist())
        out.append(f'<path d="{_segments(xs, y_of(mean), breaks)}" fill="none" stroke="{colour}" stroke-width="1.5" '
                   f'data-series="{i}" data-v="{values}"><title>{html.escape(s.label or title)}</title></path>')
    out.append("</svg>")
    legend = "".join(
        f'<span class="key" data-series="{i}" title="show or hide"><i style="background:{PALETTE[i % len(PALETTE)]}">'
        f"</i>{html.escape(s.label)}</span>"
        for i, (s, *_) in enumerate(binned) if s.label
    )
    return (f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption>{"".join(out)}'
            f'<div class="legend">{legend}</div></figure>')  # fmt: skip
