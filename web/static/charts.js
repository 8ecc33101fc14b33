// The hour's charts answer the pointer: the time and each series' value
// under it, in the series' unit, with one crosshair across every chart of
// the page (they share their hour); a legend's key shows or hides its
// series. The server draws the charts (web/charts.py): without this script
// they read the same, only silent. Listeners are on the document: <main> is
// rendered anew every refresh.
(() => {
  "use strict";
  const SVG = "http://www.w3.org/2000/svg";

  // Drawn for their column: the server draws a chart at one of a few widths
  // (web/charts.py's WIDTHS, `?width=`); on load and after a resize, a page
  // whose charts were drawn for another than the one nearest their column's
  // asks for <main> again at that one (base.html's refresh), so a chart's
  // columns are the screen's, not a narrow chart's stretched.
  const WIDTHS = [400, 480, 560, 640, 800, 960, 1200, 1600];
  function fitCharts() {
    const figure = document.querySelector("main .charts > figure.chart");
    const svg = figure && figure.querySelector("svg.chart");
    if (!svg || !window.nodesamplerRefresh) return;
    const w = figure.getBoundingClientRect().width;
    const best = WIDTHS.reduce((a, b) => (Math.abs(b - w) < Math.abs(a - w) ? b : a));
    window.nodesamplerChartWidth = best;
    if (svg.viewBox.baseVal.width !== best) window.nodesamplerRefresh();
  }
  let resized = null;
  window.addEventListener("resize", () => { clearTimeout(resized); resized = setTimeout(fitCharts, 200); });
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", fitCharts);
  else fitCharts();
  const columnsOf = new WeakMap(); // a series' path -> its columns' values

  // As web/charts.py's format_value, a digit finer: a readout, not a tick.
  function fmt(v, unit) {
    if (unit === "bytes") {
      const names = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0;
      while (Math.abs(v) >= 1024 && i < names.length - 1) { v /= 1024; i += 1; }
      return i === 0 ? `${v.toFixed(0)} B` : `${v.toFixed(2)} ${names[i]}`;
    }
    if (unit === "percent") return `${v.toFixed(1)}%`;
    if (unit === "ratio") return `${(100 * v).toFixed(1)}%`;
    if (unit === "celsius") return `${v.toFixed(0)} °C`;
    if (unit === "watts") return `${v.toFixed(1)} W`;
    if (unit === "seconds") return v < 1 ? `${(v * 1e3).toFixed(3)} ms` : `${v.toFixed(2)} s`;
    return `${Number(v.toPrecision(4))} ${unit}`;
  }

  function columns(path) {
    let got = columnsOf.get(path);
    if (!got) {
      got = path.dataset.v.split(",").map((x) => (x === "" ? null : Number(x)));
      columnsOf.set(path, got);
    }
    return got;
  }

  let tip = null;
  function tipBox() {
    if (!tip) {
      tip = document.createElement("div");
      tip.className = "chart-tip";
      tip.setAttribute("role", "status");
      document.body.append(tip);
    }
    return tip;
  }

  // Every chart's crosshair at `f` of its width (null: none).
  function crosshairs(f) {
    for (const svg of document.querySelectorAll("main svg.chart[data-from]")) {
      let line = svg.querySelector("line.crosshair");
      if (f === null) { if (line) line.remove(); continue; }
      const frame = svg.querySelector("rect");
      const x0 = Number(svg.dataset.x0), x1 = Number(svg.dataset.x1);
      if (!line) {
        line = document.createElementNS(SVG, "line");
        line.setAttribute("class", "crosshair");
        line.setAttribute("y1", frame.getAttribute("y"));
        line.setAttribute("y2", Number(frame.getAttribute("y")) + Number(frame.getAttribute("height")));
        svg.append(line);
      }
      const x = x0 + f * (x1 - x0);
      line.setAttribute("x1", x);
      line.setAttribute("x2", x);
    }
  }

  function hide() {
    if (tip) tip.hidden = true;
    crosshairs(null);
  }

  // The readout for the pointer at (x, y) over `target`.
  let pointer = null;
  function readout(target, x, y) {
    pointer = { x, y };
    const svg = target && target.closest && target.closest("main svg.chart[data-from]");
    if (!svg) { hide(); return; }
    const box = svg.getBoundingClientRect(), scale = box.width / svg.viewBox.baseVal.width;
    const x0 = Number(svg.dataset.x0), x1 = Number(svg.dataset.x1);
    const col = Math.floor((x - box.left) / scale - x0);
    if (col < 0 || col >= x1 - x0) { hide(); return; }
    const from = Number(svg.dataset.from), to = Number(svg.dataset.to);
    const at = from + ((col + 1) / (x1 - x0)) * (to - from); // a column ends at its last instant
    const figure = svg.closest("figure");
    const lines = [new Date(at * 1000).toLocaleTimeString([], { hour12: false })];
    for (const path of svg.querySelectorAll("path[data-v]")) {
      if (path.style.display === "none") continue;
      const v = columns(path)[col];
      const key = figure && figure.querySelector(`.legend .key[data-series="${path.dataset.series}"]`);
      const label = key ? key.textContent : (figure ? figure.querySelector("figcaption").textContent : "");
      lines.push(`${label}: ${v === null || v === undefined ? "—" : fmt(v, svg.dataset.unit)}`);
    }
    const t = tipBox();
    t.textContent = lines.join("\n");
    t.hidden = false;
    t.style.left = `${Math.min(x + 12, window.innerWidth - t.offsetWidth - 4)}px`;
    t.style.top = `${y + 12}px`;
    crosshairs((col + 0.5) / (x1 - x0));
  }
  document.addEventListener("pointermove", (e) => readout(e.target, e.clientX, e.clientY));
  document.addEventListener("pointerleave", () => { pointer = null; hide(); });

  // The series a reader hid, by chart and series: a refresh draws <main>
  // anew and they stay hidden (base.html says when, "nodesampler-main").
  const hidden = new Set();
  const nameOf = (key) => `${key.closest("figure").querySelector("figcaption").textContent}\u0000${key.dataset.series}`;
  function show(key, off) {
    key.classList.toggle("off", off);
    for (const drawn of key.closest("figure").querySelectorAll(`svg [data-series="${key.dataset.series}"]`)) {
      drawn.style.display = off ? "none" : "";
    }
  }
  document.addEventListener("click", (e) => {
    const key = e.target.closest && e.target.closest("figure.chart .legend .key[data-series]");
    if (!key) return;
    const off = !key.classList.contains("off");
    if (off) hidden.add(nameOf(key)); else hidden.delete(nameOf(key));
    show(key, off);
  });
  // <main> drawn anew: the hidden series stay hidden, and a reader's readout
  // is read again from the new drawing under the pointer.
  document.addEventListener("nodesampler-main", () => {
    for (const key of document.querySelectorAll("main figure.chart .legend .key[data-series]")) {
      if (hidden.has(nameOf(key))) show(key, true);
    }
    if (pointer && tip && !tip.hidden) readout(document.elementFromPoint(pointer.x, pointer.y), pointer.x, pointer.y);
  });
})();
