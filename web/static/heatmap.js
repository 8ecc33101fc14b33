// The fleet's picture answers the pointer: the node (or the band's worst
// node), the window's time and its value under the pointer, and a click
// opens that node's page at that moment (the server finds the cell's node:
// controlplane/history/heatmap.py). The picture is the server's PNG: without this
// script it reads the same, only silent. Listeners are on the document:
// <main> is rendered anew every refresh.
(() => {
  "use strict";
  const legends = new Map(); // legend URL -> its promise (one fetch a picture)

  function legendOf(section) {
    const url = section.dataset.legend;
    if (!legends.has(url)) {
      legends.set(url, fetch(url).then((r) => (r.ok ? r.json() : null)).then((legend) => {
        if (!legend) return null;
        for (const row of legend.rows) {
          row.levelBytes = Uint8Array.from(atob(row.levels), (c) => c.charCodeAt(0));
          const worst = Uint8Array.from(atob(row.worst), (c) => c.charCodeAt(0));
          row.worstIndex = new Int16Array(worst.buffer);
        }
        return legend;
      }).catch(() => null));
      while (legends.size > 4) legends.delete(legends.keys().next().value);
    }
    return legends.get(url);
  }

  // The cell under the pointer: {row, column} of the picture, or null outside it.
  function cellAt(img, e, legend) {
    const box = img.getBoundingClientRect();
    const x = (e.clientX - box.left) / box.width, y = (e.clientY - box.top) / box.height;
    if (x < 0 || x >= 1 || y < 0 || y >= 1) return null;
    return { row: Math.floor(y * legend.rows.length), column: Math.floor(x * legend.columns) };
  }

  function describe(legend, cell) {
    const row = legend.rows[cell.row];
    const level = row.levelBytes[cell.column], worst = row.worstIndex[cell.column];
    const from = new Date((legend.start + cell.column * legend.step) * 1000).toLocaleTimeString();
    const to = new Date((legend.start + (cell.column + 1) * legend.step) * 1000).toLocaleTimeString();
    const who = row.nodes.length > 1 ? `${row.nodes.length} nodes of ${row.group}` : `${row.nodes[0]} (${row.group})`;
    if (level === legend.absent || worst < 0) return `${who}, ${from}–${to}: not measured`;
    const value = `${(100 * level / (legend.levels - 1)).toFixed(0)}%`;
    const node = row.nodes.length > 1 ? `; the worst, ${row.nodes[worst]}` : "";
    return `${who}, ${from}–${to}: ${value}${node}. Click for that node at that moment.`;
  }

  document.addEventListener("mousemove", async (e) => {
    const img = e.target.closest && e.target.closest("main #heatmap img.heatmap");
    if (!img) return;
    const section = img.closest("#heatmap");
    const legend = await legendOf(section);
    const readout = section.querySelector("#heatmap-readout");
    if (!legend || !readout) return;
    const cell = cellAt(img, e, legend);
    if (cell) readout.textContent = describe(legend, cell);
  });

  document.addEventListener("click", async (e) => {
    const img = e.target.closest && e.target.closest("main #heatmap img.heatmap");
    if (!img) return;
    const section = img.closest("#heatmap");
    const legend = await legendOf(section);
    if (!legend) return;
    const cell = cellAt(img, e, legend);
    if (!cell) return;
    location.assign(`${section.dataset.cell}&row=${cell.row}&column=${cell.column}`);
  });
})();
