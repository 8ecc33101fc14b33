"""The fleet's picture from a real Prometheus (`--prometheus`) at 10,000
nodes, an hour each at a 15 s scrape: what one picture asks of Prometheus
and what it costs the control plane. Target (#50): the page's request under
300 ms and 2 MB; its PNG and legend are the embedded picture's (bench/heatmap.py),
so what differs is making the picture.

Prometheus holds the hour backfilled with promtool (the CPU's window max
and `llmgw_node_up` of every node, as the control plane exports them).
Printed, cold (each a column later, so nothing is kept):
- the picture from Prometheus: its asks' answers in bytes, the time to the
  last answer and the time parsing and drawing them on the page thread;
- beside it, in the same run, the same fleet's picture from the embedded
  history, the reference the ratio is taken against.

    PYTHONPATH=. .venv/bin/python bench/heatmap_prometheus.py [--nodes 10000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.history.backends import PrometheusHistory  # noqa: E402
from controlplane.history.heatmap import MEASURES, _kept, column_end, heatmap  # noqa: E402
from controlplane.history.heatmap_prometheus import prometheus_heatmap  # noqa: E402
from controlplane.listen.page_worker import PageWorker  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.heatmap_fleet import fleet_with_history, node_name, openmetrics  # noqa: E402

INTERVAL = 15.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    end = column_end(time.time(), INTERVAL)
    now, bursts = end - INTERVAL / 2, {node_name(args.nodes // 2): 100}
    t = time.perf_counter()
    _, history, _ = fleet_with_history(args.nodes, 240, bursts, interval=INTERVAL, now=now, varied=True, gpus=False)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "fleet.om"
        metrics.write_text(openmetrics(args.nodes, 240, bursts, INTERVAL, now, varied=True, gpus=False))
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(metrics), f"{tmp}/tsdb"],
                       check=True, capture_output=True)  # fmt: skip
        metrics.unlink()
        print(f"{args.nodes} nodes x 240 heartbeats recorded and backfilled in {time.perf_counter() - t:.0f} s")
        (Path(tmp) / "prometheus.yml").write_text("global: {}\n")
        port = free_port()
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/tsdb",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        break
                time.sleep(0.5)
            asyncio.run(measure(base, history, end, args.runs))
        finally:
            prom.kill()
            prom.wait()


async def measure(base: str, history: object, end: float, runs: int) -> None:
    import aiohttp

    worker = PageWorker()
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            prometheus = PrometheusHistory(base, session)
            answered: list[int] = []
            ask = prometheus.ask

            async def counted(path: str, form: dict[str, str], most: int) -> bytes:
                body = await ask(path, form, most)
                answered.append(len(body))
                return body

            prometheus.ask = counted  # type: ignore[method-assign]
            reference, made, drawn = [], [], []
            for run in range(runs + 1):  # the first warms Prometheus' caches: not counted
                at = end - run * INTERVAL  # a column earlier each run: nothing kept
                _kept.clear()
                t = time.perf_counter()
                embedded = heatmap(history, MEASURES["cpu"], at, INTERVAL)  # type: ignore[arg-type]
                reference.append((time.perf_counter() - t) * 1e3)
                answered.clear()
                t = time.perf_counter()
                picture = await prometheus_heatmap(prometheus, worker, MEASURES["cpu"], at, embedded.columns)
                made.append((time.perf_counter() - t) * 1e3)
                drawn.append(sum(answered))
                same = [r.levels.tobytes() for r in picture.rows] == [r.levels.tobytes() for r in embedded.rows]
                if run == 0:
                    print(f"{picture.nodes} nodes, {len(picture.rows)} rows; the same picture as the embedded one: "
                          f"{same}; {len(answered)} asks")  # fmt: skip
            ref, ms = statistics.median(reference[1:]), statistics.median(made[1:])
            print(f"reference: the embedded history's picture, cold: {ref:.0f} ms")
            print(f"from Prometheus, cold: {ms:.0f} ms ({ms / ref:.2f} x reference); "
                  f"its answers {statistics.median(drawn[1:]) / 2**20:.2f} MB")  # fmt: skip
    finally:
        worker.close()


if __name__ == "__main__":
    main()
