// The node page's live view: every sample of the node while the toggle is on
// (controlplane/live.py). Each window arrives as one server-sent event with
// its series and their summaries; the last minute is drawn, one chart per
// series, the samples as a line and each window's mean, p95 and max over it.
// Labels are shard ids from the node: text nodes only, never markup.
(() => {
  const section = document.getElementById("live");
  if (!section) return;
  const button = document.getElementById("live-toggle");
  const status = document.getElementById("live-status");
  const charts = document.getElementById("live-charts");
  const SPAN_S = 60, W = 640, H = 150, LEFT = 44, BOTTOM = 18, TOP = 6;
  const SVG = "http://www.w3.org/2000/svg";
  let source = null, windows = [];

  button.hidden = false;
  status.textContent = "Off. On, it draws every sample of the last minute as the node sends them.";
  button.addEventListener("click", () => (source ? stop("Off.") : start()));

  function start() {
    windows = [];
    source = new EventSource(section.dataset.url);
    button.textContent = "Stop the live view";
    status.textContent = "Asking the node for every sample; the first come with its next heartbeat or the one after.";
    source.addEventListener("window", (e) => {
      windows.push(JSON.parse(e.data));
      const end = windows[windows.length - 1].end;
      windows = windows.filter((w) => w.end > end - SPAN_S);
      draw();
    });
    source.addEventListener("refused", (e) => stop(JSON.parse(e.data).error));
    source.onerror = () => { if (source) status.textContent = "Connection lost; trying again."; };
  }

  function stop(why) {
    if (source) source.close();
    source = null;
    button.textContent = "Watch every sample";
    status.textContent = why;
  }

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Each series' points (null: a sample that measured nothing) and windows.
  function gather() {
    const byKey = new Map();
    for (const w of windows) {
      for (const s of w.series) {
        if (!byKey.has(s.key)) byKey.set(s.key, { label: s.label, unit: s.unit, points: [], spans: [] });
        const k = byKey.get(s.key);
        if (s.us) {
          let t = w.start + s.start;
          for (let i = 0; i < s.us.length; i++) {
            t += s.us[i] / 1e6;
            k.points.push(s.v[i] === null ? null : [t, s.v[i]]);
          }
        } else {
          for (let i = 0; i < s.t.length; i++) k.points.push([w.start + s.t[i], s.v[i]]);
        }
        if (s.summary) k.spans.push({ from: w.start, to: w.end, ...s.summary });
        k.points.push(null); // windows are not joined: a gap between heartbeats stays a gap
      }
    }
    return byKey;
  }

  function draw() {
    // The last minute, or as much of it as has come: a new viewer sees its first window whole.
    const end = windows[windows.length - 1].end, from = Math.max(end - SPAN_S, windows[0].start);
    const span = Math.max(end - from, 1);
    const x = (t) => LEFT + ((t - from) / span) * (W - LEFT - 4);
    let samples = 0;
    charts.replaceChildren();
    for (const [key, k] of gather()) {
      const values = k.points.filter((p) => p).map((p) => p[1]);
      samples += values.length;
      const top = k.unit === "%" ? 100 : Math.max(0.1, ...values, ...k.spans.map((s) => s.max || 0)) * 1.1;
      const y = (v) => TOP + (1 - v / top) * (H - TOP - BOTTOM);
      const svg = el("svg", { class: "chart live", "data-key": key, viewBox: `0 0 ${W} ${H}`, width: W, height: H });
      svg.append(el("text", { class: "tick", x: 2, y: y(top) + 8 }, top.toFixed(k.unit === "%" ? 0 : 2)));
      svg.append(el("text", { class: "tick", x: 2, y: y(0) }, "0"));
      svg.append(el("text", { class: "tick", x: LEFT, y: H - 4 }, `−${Math.round(end - from)} s`));
      svg.append(el("text", { class: "tick", x: W - 30, y: H - 4 }, "now"));
      let d = "", pen = false;
      for (const p of k.points) {
        if (!p || p[0] < from) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${x(p[0]).toFixed(1)} ${y(p[1]).toFixed(1)}`;
        pen = true;
      }
      svg.append(el("path", { class: "samples", d }));
      for (const s of k.spans) {
        for (const which of ["mean", "p95", "max"]) {
          if (s[which] === null || s[which] === undefined || s.to < from) continue;
          svg.append(el("line", { class: `summary ${which}`, x1: x(Math.max(s.from, from)), x2: x(s.to),
                                  y1: y(s[which]), y2: y(s[which]) }));
        }
      }
      const fig = document.createElement("figure");
      fig.className = "chart";
      const cap = document.createElement("figcaption");
      cap.textContent = `${k.label} (${k.unit}): every sample; lines: each window's mean (solid), p95 (dashed), max (dotted)`;
      fig.append(cap, svg);
      charts.append(fig);
    }
    const last = windows[windows.length - 1];
    status.textContent = `${samples} samples in the last minute; window ${last.seq}` +
      (last.shards_left_out ? `; ${last.shards_left_out} shards left out to fit the heartbeat` : "") + ".";
  }
})();
