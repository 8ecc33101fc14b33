// The node page's views of every sample, drawn alike: one chart per series,
// the samples as a line and each window's mean, p95 and max over it.
// - The live view (controlplane/samples/live.py): while the toggle is on, each window
//   arrives as one server-sent event; the last minute is drawn.
// - Every sample around a moment (controlplane/samples/hindsight.py): a click on a
//   chart of the hour (or a time chosen) asks the node for the minute around
//   it from what it keeps; the windows are drawn as its pieces come.
// Labels are shard ids from the node: text nodes only, never markup.
(() => {
  const W = 640, H = 150, LEFT = 44, BOTTOM = 18, TOP = 6;
  const SVG = "http://www.w3.org/2000/svg";

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Each series' points (null: a sample that measured nothing) and windows.
  function gather(windows) {
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

  // The windows' series between `from` and `to` (wall seconds) into `charts`;
  // `labels`: the time axis' left and right ends; `mark`: a moment to draw.
  // Returns the samples drawn.
  function drawWindows(charts, windows, from, to, labels, mark) {
    const span = Math.max(to - from, 1);
    const x = (t) => LEFT + ((t - from) / span) * (W - LEFT - 4);
    let samples = 0;
    charts.replaceChildren();
    for (const [key, k] of gather(windows)) {
      const values = k.points.filter((p) => p && p[0] >= from && p[0] <= to).map((p) => p[1]);
      samples += values.length;
      const top = k.unit === "%" ? 100 : Math.max(0.1, ...values, ...k.spans.map((s) => s.max || 0)) * 1.1;
      const y = (v) => TOP + (1 - v / top) * (H - TOP - BOTTOM);
      const svg = el("svg", { class: "chart live", "data-key": key, viewBox: `0 0 ${W} ${H}`, width: W, height: H });
      svg.append(el("text", { class: "tick", x: 2, y: y(top) + 8 }, top.toFixed(k.unit === "%" ? 0 : 2)));
      svg.append(el("text", { class: "tick", x: 2, y: y(0) }, "0"));
      svg.append(el("text", { class: "tick", x: LEFT, y: H - 4 }, labels[0]));
      svg.append(el("text", { class: "tick", x: W - 60, y: H - 4 }, labels[1]));
      if (mark !== undefined) svg.append(el("line", { class: "moment", x1: x(mark), x2: x(mark), y1: TOP, y2: H - BOTTOM }));
      let d = "", pen = false;
      for (const p of k.points) {
        if (!p || p[0] < from || p[0] > to) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${x(p[0]).toFixed(1)} ${y(p[1]).toFixed(1)}`;
        pen = true;
      }
      svg.append(el("path", { class: "samples", d }));
      for (const s of k.spans) {
        for (const which of ["mean", "p95", "max"]) {
          if (s[which] === null || s[which] === undefined || s.to < from || s.from > to) continue;
          svg.append(el("line", { class: `summary ${which}`, x1: x(Math.max(s.from, from)), x2: x(Math.min(s.to, to)),
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
    return samples;
  }

  // --- the live view ---------------------------------------------------------------
  const live = document.getElementById("live");
  if (live) {
    const SPAN_S = 60;
    const button = document.getElementById("live-toggle");
    const status = document.getElementById("live-status");
    const charts = document.getElementById("live-charts");
    let source = null, windows = [];

    button.hidden = false;
    status.textContent = "Off. On, it draws every sample of the last minute as the node sends them.";
    button.addEventListener("click", () => (source ? stop("Off.") : start()));

    function start() {
      windows = [];
      source = new EventSource(live.dataset.url);
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

    function draw() {
      // The last minute, or as much of it as has come: a new viewer sees its first window whole.
      const end = windows[windows.length - 1].end, from = Math.max(end - SPAN_S, windows[0].start);
      const samples = drawWindows(charts, windows, from, end, [`−${Math.round(end - from)} s`, "now"]);
      const last = windows[windows.length - 1];
      status.textContent = `${samples} samples in the last minute; window ${last.seq}` +
        (last.shards_left_out ? `; ${last.shards_left_out} shards left out to fit the heartbeat` : "") + ".";
    }
  }

  // --- every sample around a moment ---------------------------------------------------
  const around = document.getElementById("hindsight");
  if (around) {
    const AROUND_S = 30, POLL_MS = 1000, GIVE_UP_MS = 5 * 60 * 1000;
    const form = document.getElementById("hindsight-form");
    const input = document.getElementById("hindsight-at");
    const status = document.getElementById("hindsight-status");
    const charts = document.getElementById("hindsight-charts");
    let asking = 0; // the latest ask: an older one's answers are not drawn
    const clock = (t) => new Date(t * 1000).toLocaleTimeString();
    const local = (t) => new Date(t * 1000 - new Date(t * 1000).getTimezoneOffset() * 60000).toISOString().slice(0, 19);

    form.hidden = false;
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const t = new Date(input.value).getTime() / 1000;
      if (Number.isFinite(t)) ask(t);
    });
    // A click on a chart of the hour (rendered anew every refresh: the listener is on the document).
    document.addEventListener("click", (e) => {
      const svg = e.target.closest && e.target.closest("main svg.chart[data-from]");
      if (!svg) return;
      const box = svg.getBoundingClientRect(), scale = box.width / svg.viewBox.baseVal.width;
      const x0 = Number(svg.dataset.x0), x1 = Number(svg.dataset.x1);
      const f = ((e.clientX - box.left) / scale - x0) / (x1 - x0);
      if (f < 0 || f > 1) return;
      const t = Number(svg.dataset.from) + f * (Number(svg.dataset.to) - Number(svg.dataset.from));
      input.value = local(t);
      ask(t);
      around.scrollIntoView({ block: "start" });
    });

    // Opened at a moment (?at=, from the fleet's picture): every sample around
    // it, asked at once while the node's ring still holds it.
    if (around.dataset.at) {
      const at = Number(around.dataset.at), held = Number(around.dataset.held);
      input.value = local(at);
      if (Date.now() / 1000 - at <= held) ask(at);
      else status.textContent = `The node keeps its last ${(held / 60).toFixed(1)} minutes of samples; ` +
        `${clock(at)} is older. The charts of the hour show that moment.`;
    }

    async function ask(at) {
      const mine = ++asking;
      status.textContent = `Asking the node for every sample from ${clock(at - AROUND_S)} to ${clock(at + AROUND_S)}…`;
      charts.replaceChildren();
      let r;
      try {
        r = await fetch(around.dataset.url, { method: "POST", headers: { "Content-Type": "application/json" },
                                             body: JSON.stringify({ at }) });
      } catch (e) { status.textContent = "The control plane could not be reached."; return; }
      if (r.status !== 202) { status.textContent = (await r.text()).trim(); return; }
      const span = await r.json();
      around.dataset.span = span.id;
      const started = Date.now();
      while (mine === asking) {
        const got = await fetch(`${span.url}?view=windows`, { cache: "no-store" });
        if (!got.ok) { status.textContent = (await got.text()).trim(); return; }
        const view = await got.json();
        const samples = drawWindows(charts, view.windows, view.from, view.to, [clock(view.from), clock(view.to)], at);
        const missing = view.missing.map((m) => `${clock(m.from)}–${clock(m.to)}: ${m.why}`);
        status.textContent = `${samples} samples from ${clock(view.from)} to ${clock(view.to)}` +
          (view.state === "done" ? "." : `; ${view.pieces} pieces so far, more with the node's next heartbeats.`) +
          (missing.length ? ` Missing: ${missing.join("; ")}.` : "");
        around.dataset.state = view.state;
        if (view.state === "done" || Date.now() - started > GIVE_UP_MS) return;
        await new Promise((done) => setTimeout(done, POLL_MS));
      }
    }
  }
})();
