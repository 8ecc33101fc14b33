"""The live view (controlplane/samples/live.py, wire/raw.py): raw
samples encoded as the summary counted them, fitted to the body, checked
item by item, asked for only while someone watches, and streamed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

import wire
from controlplane import pages_api
from controlplane.ingest import agent_api
from controlplane.samples.live import (
    BEHIND,
    MAX_BYTES_PER_NODE,
    MAX_VIEWERS_PER_PEER,
    VIEWER_QUEUE,
    LiveRefused,
    LiveSamples,
)
from controlplane.state.registry import NodeRegistry
from sampler.window.series import RateSeries
from tests.agent_fleet import INTERVAL, Fleet, fresh_with_seq
from tests.conftest import unavailable
from tests.fakeproc import FakeClock
from tests.test_controlplane_api import SECRET, Client, auth, heartbeat, post, registration
from tests.workloads import busy_threads, start_group
from wire import raw as raw_samples
from wire.schema import Heartbeat


def p95_fits(series: dict[str, Any], p95: float) -> bool:
    """Whether `p95` is the time-weighted 95th percentile of the series as the
    summary defines it (sampler/window/series.py): the samples below it cover at most
    95% of the measured time and those at or below it at least 95%, within
    the wire's rounding (values to 1e-4, lengths to 0.5 us each)."""
    us = np.array(series["us"], dtype=float)
    v = np.array([np.nan if x is None else x for x in series["v"]])
    ok = ~np.isnan(v)
    us, v = us[ok], v[ok]
    total, slack = us.sum(), 0.5 * len(us) + 1
    below, at_or_below = us[v < p95 - 6e-5].sum(), us[v <= p95 + 6e-5].sum()
    return bool(below <= 0.95 * total + slack and at_or_below >= 0.95 * total - slack)


def weighted_mean(series: dict[str, Any]) -> float:
    us = np.array(series["us"], dtype=float)
    v = np.array([np.nan if x is None else x for x in series["v"]])
    ok = ~np.isnan(v)
    return float(np.sum(v[ok] * us[ok]) / np.sum(us[ok]))


# --- the samples as the summary counted them ----------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0, 64)), st.floats(1e-4, 0.2)), min_size=1, max_size=300),
       st.sampled_from([0.0, 0.01]))  # fmt: skip
def test_a_series_mean_is_its_summary_mean(samples: list[tuple[float | None, float]], min_seconds: float) -> None:
    """Any samples (unmeasured ones, short ones merged when the series has a
    resolution): the mean of what crosses the wire is the summary's mean,
    within the summary's rounding; its max is the summary's max."""
    series = RateSeries(8, min_seconds)
    for value, seconds in samples:
        series.add(value, seconds)
    summary = series.summary()
    raw = raw_samples.rate_series(-0.01, *series.samples(), digits=5)
    assert len(raw["us"]) == len(raw["v"])
    if summary is None:
        assert all(v is None for v in raw["v"])
        return
    # The summary's mean is rounded to 1e-4 (5e-5 off at most); each value on the
    # wire to 1e-5 (5e-6 off, and so their mean), each length to 0.5 us (0.25 us
    # off), which moves the weighted mean by at most the largest value times
    # the measured lengths' whole error over their sum.
    us = np.array([u for u, v in zip(raw["us"], raw["v"], strict=True) if v is not None], dtype=float)
    top = max(v for v in raw["v"] if v is not None)
    rounding = 5e-5 + 5e-6 + top * 0.25 * len(us) / us.sum() + 1e-9
    assert weighted_mean(raw) == pytest.approx(summary["mean"], abs=rounding)
    assert p95_fits(raw, summary["p95"])
    assert max(v for v in raw["v"] if v is not None) == pytest.approx(summary["max"], abs=6e-5)


def test_unmeasured_samples_cross_as_null_and_samples_of_no_length_not_at_all() -> None:
    raw = raw_samples.rate_series(-0.5, np.array([1.0, np.nan, 2.0, 3.0]), np.array([0.01, 0.01, 0.0, 0.0100004]), 4)
    assert raw == {"start": -0.5, "us": [10000, 10000, 10000], "v": [1.0, None, 3.0]}


def test_the_raw_block_keeps_the_body_within_its_limit() -> None:
    """1000 Hz for 5 s on 30 shards does not fit: the machine and the GPUs go,
    then shards in the summary's order while they fit; the rest are counted."""
    rng = np.random.default_rng(7)
    summary = heartbeat()
    summary["shards"] = [{"id": f"s{i}", "cpu_cores": {"mean": 1.0, "p95": 1.0, "max": 1.0}} for i in range(30)]
    one = raw_samples.rate_series(-0.001, rng.uniform(0, 8, 5000), np.full(5000, 0.001), 5)
    gpus = [(0, {"utilization_percent": raw_samples.gpu_points(np.arange(30) / 6, rng.uniform(0, 100, 30))})]
    raw = raw_samples.fit_raw(len(wire.dumps(summary)), one, gpus, [(s["id"], one) for s in summary["shards"]])
    kept = len(raw["shards"])
    assert 0 < kept < 30 and raw["shards_left_out"] == 30 - kept
    assert [s["id"] for s in raw["shards"]] == [f"s{i}" for i in range(kept)]
    assert raw["machine"]["cpu_percent"] is one and len(raw["gpus"]) == 1
    body = wire.dumps({**summary, "raw": raw})
    assert len(body) <= wire.MAX_BODY_BYTES
    dropped: wire.Dropped = []
    parsed = wire.parse_heartbeat(body, dropped, lambda node: True)
    assert dropped == [] and len(parsed["raw"]["shards"]) == kept and parsed["raw"]["shards_left_out"] == 30 - kept


# --- what the control plane accepts -------------------------------------------------


def series(n: int = 3, value: Any = 0.5) -> dict[str, Any]:
    return {"start": -0.01, "us": [10000] * n, "v": [value] * n}


def with_raw(raw: Any) -> bytes:
    body = heartbeat()
    body["shards"].append({"id": "s1", "cpu_cores": {"mean": 0.5, "p95": 0.5, "max": 0.5}})
    return json.dumps({**body, "raw": raw}).encode()


def test_hostile_raw_items_are_refused_one_by_one() -> None:
    nan = {"start": -0.01, "us": [10000, 10000], "v": [0.5, "NAN"]}
    raw = {
        "machine": {"cpu_percent": nan},
        "shards": [
            {"id": "s0", "cpu_cores": {"start": 0, "us": [1] * (raw_samples.MAX_RAW_SAMPLES + 1),
                                       "v": [0.1] * (raw_samples.MAX_RAW_SAMPLES + 1)}},
            {"id": "s1", "cpu_cores": {"start": 0, "us": [10000, 10000], "v": [0.5]}},
            {"id": "nobody", "cpu_cores": series()},
            {"id": "s1", "cpu_cores": {"start": 0, "us": [10000, 0], "v": [0.5, 0.5]}},
            {"id": "s1", "cpu_cores": series(value=200_000)},
            {"id": "s1", "cpu_cores": series()},
            {"id": "s1", "cpu_cores": series()},
        ],
        "gpus": [{"index": 0, "utilization_percent": {"t": [0.1, 0.2], "v": [50, 101]}},
                 {"index": 0, "utilization_percent": {"t": [0.1, "x"], "v": [50, 60]}},
                 {"index": 1, "utilization_percent": {"t": [0.1, 0.2], "v": [50, 60]}},
                 {"index": 2, "sm_activity_percent": {"t": [0.1], "v": [-1]}},
                 {"index": 3, "sm_activity": {"t": [0.1], "v": [5]}}],
        "shards_left_out": -1,
    }  # fmt: skip
    data = with_raw(raw).replace(b'"NAN"', b"NaN")
    dropped: wire.Dropped = []
    hb = wire.parse_heartbeat(data, dropped, lambda node: True)
    assert [s["id"] for s in hb["shards"]] == ["s0", "s1"]  # the summary itself is whole
    assert hb["raw"] == {"shards": [{"id": "s1", "cpu_cores": series()}],
                         "gpus": [{"index": 1, "utilization_percent": {"t": [0.1, 0.2], "v": [50, 60]}}]}  # fmt: skip
    assert dropped == [
        {"field": "raw.machine.cpu_percent.v[1]", "reason": "must be finite"},
        {"field": "raw.shards[0].cpu_cores.us", "reason": f"at most {raw_samples.MAX_RAW_SAMPLES} entries"},
        {"field": "raw.shards[1].cpu_cores", "reason": "2 lengths but 1 values"},
        {"field": "raw.shards[2].id", "reason": "no such shard in this heartbeat"},
        {"field": "raw.shards[3].cpu_cores.us[1]", "reason": "must be within 1..3600000000"},
        {"field": "raw.shards[4].cpu_cores.v[0]", "reason": "must be within 0..100000"},
        {"field": "raw.shards[6].id", "reason": "a shard's samples twice"},
        {"field": "raw.gpus[0].utilization_percent.v[1]", "reason": "must be within 0..100"},
        {"field": "raw.gpus[1].utilization_percent.t[1]", "reason": "must be a number"},
        {"field": "raw.gpus[3].sm_activity_percent.v[0]", "reason": "must be within 0..100"},
        {"field": "raw.gpus[4]", "reason": "none of a GPU's point series (utilization_percent, sm_activity_percent, "
                                           "sm_occupancy_percent, tensor_activity_percent, dram_bandwidth_percent)"},
        {"field": "raw.shards_left_out", "reason": "must be within 0..2147483648"},
    ]


@pytest.mark.parametrize("raw", [5, "x", [], None])
def test_a_raw_block_that_is_none_is_left_out_whole(raw: Any) -> None:
    dropped: wire.Dropped = []
    hb = wire.parse_heartbeat(with_raw(raw), dropped, lambda node: True)
    assert hb.get("raw") is None and len(hb["shards"]) == 2
    assert dropped == ([] if raw is None else [{"field": "raw", "reason": "must be an object"}])


def test_raw_samples_of_a_node_nobody_watches_are_not_read() -> None:
    dropped: wire.Dropped = []
    hb = wire.parse_heartbeat(with_raw({"machine": {"cpu_percent": "hostile"}}), dropped, lambda node: False)
    assert "raw" in hb and hb["raw"] is None and dropped == []


# --- who watches ----------------------------------------------------------------------


def test_a_node_is_live_while_watched_and_a_minute_after() -> None:
    clock = FakeClock()
    live = LiveSamples(max_nodes=2, linger_s=60, clock=clock)
    assert not live.wanted("a")
    queue, backlog = live.watch("a")
    assert backlog == [] and live.wanted("a")
    clock.advance(3600)
    assert live.wanted("a")  # watched: no limit
    live.leave("a", queue)
    clock.advance(59.9)
    assert live.wanted("a")
    clock.advance(0.2)
    assert not live.wanted("a") and live.live_nodes() == []


def test_at_most_max_nodes_are_live_and_a_lingering_node_counts() -> None:
    clock = FakeClock()
    live = LiveSamples(max_nodes=2, linger_s=60, clock=clock)
    qa, _ = live.watch("a")
    live.watch("b")
    live.watch("b")  # a second viewer of a live node is not another node
    with pytest.raises(LiveRefused, match="2 nodes are live already.*--max-live-nodes"):
        live.watch("c")
    live.leave("a", qa)
    with pytest.raises(LiveRefused):
        live.watch("c")  # a's minute lingers
    clock.advance(61)
    live.watch("c")
    assert sorted(live.live_nodes()) == ["b", "c"]


def hb_with_raw(end: float, n: int = 100) -> tuple[Heartbeat, dict[str, Any]]:
    hb = heartbeat()
    hb["window"] = {"start": end - 5, "end": end, "samples": n}
    raw = {"machine": {"cpu_percent": series(n)}, "shards": [{"id": "s0", "cpu_cores": series(n)}], "gpus": []}
    return msgspec.convert(hb, Heartbeat), raw


def test_a_new_viewer_starts_with_the_last_minute_and_memory_is_bounded() -> None:
    clock = FakeClock()
    live = LiveSamples(max_nodes=1, clock=clock)
    first, _ = live.watch("gpu-17")
    for end in range(1000, 1100, 5):  # 20 windows of 5 s
        live.record("gpu-17", *hb_with_raw(float(end)))
    _, backlog = live.watch("gpu-17")
    ends = [json.loads(e)["end"] for e in backlog]
    assert ends == [float(e) for e in range(1040, 1100, 5)]  # within a minute of the newest
    # A viewer that reads nothing is let go one window past its queue: BEHIND is the last it gets.
    assert first.qsize() == VIEWER_QUEUE + 1 and list(first._queue)[-1] == BEHIND  # type: ignore[attr-defined]
    event = json.loads(backlog[-1])
    machine, shard = event["series"]
    assert machine["key"] == "machine" and machine["summary"] == {"mean": 37.5, "p95": 80.1, "max": 100.0}
    assert shard["label"] == "s0" and shard["unit"] == "cores" and shard["summary"]["mean"] == 1.0
    for end in range(2000, 2060):  # a minute of heavy one-second windows: the bytes bound trims first
        live.record("gpu-17", *hb_with_raw(float(end), n=20_000))
    described = live.describe("gpu-17")
    assert described is not None and MAX_BYTES_PER_NODE / 2 < described["bytes_kept"] <= MAX_BYTES_PER_NODE
    assert described["windows_kept"] < 40


def test_one_address_holds_at_most_a_few_live_views() -> None:
    """Ten viewers from one client took every --max-live-nodes slot; now an
    address holds MAX_VIEWERS_PER_PEER, and gets its views back as they close."""
    live = LiveSamples(max_nodes=10)
    held = [live.watch(f"n{i}", "10.0.0.9") for i in range(MAX_VIEWERS_PER_PEER)]
    with pytest.raises(LiveRefused, match="for this user or address"):
        live.watch("n9", "10.0.0.9")
    live.watch("n9", "10.0.0.10")  # another address is not held back
    live.leave("n0", held[0][0], "10.0.0.9")
    live.watch("n8", "10.0.0.9")
    assert len(live.live_nodes()) == MAX_VIEWERS_PER_PEER + 2


# --- through both listeners -------------------------------------------------------


@pytest.fixture
async def cluster(aiohttp_client: Any) -> tuple[Client, Client, LiveSamples]:
    registry = NodeRegistry(stale_after=60)
    live = LiveSamples(max_nodes=1, linger_s=0.5)
    agents = await aiohttp_client(agent_api.create_app(registry, SECRET, live=live))
    pages = await aiohttp_client(pages_api.create_app(registry, live=live))
    return agents, pages, live


async def read_event(stream: Any) -> tuple[str, Any]:
    """The next event of a text/event-stream: (its name, its data as JSON)."""
    name, data = "", ""
    while True:
        line = (await stream.readline()).decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and name:
            return name, json.loads(data)


async def test_a_viewer_gets_the_samples_the_answers_ask_for(cluster: tuple[Client, Client, LiveSamples]
                                                             ) -> None:  # fmt: skip
    agents, pages, live = cluster
    assert (await post(agents, "/v1/register", registration()))[0] == 200
    status, answer = await post(agents, "/v1/heartbeat", heartbeat(seq=1))
    assert status == 200 and "raw" not in answer  # nobody watches: nothing asked
    assert (await pages.get("/node/nobody/live")).status == 404
    viewer = await pages.get("/node/gpu-17/live")
    assert viewer.headers["Content-Type"] == "text/event-stream"
    status, answer = await post(agents, "/v1/heartbeat", heartbeat(seq=2))
    assert answer == {"ok": True, "raw": True}  # asked for; this one had none
    hb = heartbeat(seq=3)
    hb["raw"] = {"machine": {"cpu_percent": series()}, "shards": [{"id": "s0", "cpu_cores": series(value=1.0)}],
                 "gpus": [{"index": 0, "utilization_percent": {"t": [0.5, 1.5], "v": [96.0, 98.0]},
                           "sm_activity_percent": {"t": [0.1, 0.2, 0.3], "v": [20.0, 30.0, 40.0]}}]}  # fmt: skip
    hb["gpus"][0].update(sm_activity_percent=30.0, sm_activity_p95_percent=40.0, sm_activity_max_percent=40.0)
    status, answer = await post(agents, "/v1/heartbeat", hb)
    assert answer == {"ok": True, "raw": True}
    name, event = await asyncio.wait_for(read_event(viewer.content), 10)
    assert name == "window" and event["seq"] == 3
    assert [s["key"] for s in event["series"]] == ["machine", "shard:s0", "gpu:0", "gpu:0:sm_activity_percent"]
    assert event["series"][2]["summary"] == {"mean": 97.0, "p95": None, "max": None}
    # GPM's intervals beside NVML's samples, with the card's own summary of them.
    sm = event["series"][3]
    assert (sm["label"], sm["unit"], sm["v"]) == ("GPU 0 SM activity", "%", [20.0, 30.0, 40.0])
    assert sm["summary"] == {"mean": 30.0, "p95": 40.0, "max": 40.0}
    nodes = json.loads(await (await pages.get("/api/nodes")).text())["nodes"]
    assert nodes[0]["live"]["viewers"] == 1 and "raw" not in nodes[0]["heartbeat"]  # raw is the view's alone
    # Another node while this one is live: refused, saying why.
    assert (await post(agents, "/v1/register", registration("gpu-18"), auth("gpu-18")))[0] == 200
    other = await pages.get("/node/gpu-18/live")
    name, refusal = await asyncio.wait_for(read_event(other.content), 10)
    assert name == "refused" and "--max-live-nodes" in refusal["error"]
    # The viewer leaves; the control plane finds out at its next write, and the minute (here half a second) runs.
    viewer.close()
    for seq in range(4, 100):
        _, answer = await post(agents, "/v1/heartbeat", heartbeat(seq=seq))
        if "raw" not in answer:
            break
        await asyncio.sleep(0.1)  # the linger's clock is the real one
    assert "raw" not in answer and live.live_nodes() == []


async def test_the_node_page_has_a_live_toggle_only_with_a_live_view(aiohttp_client: Any) -> None:
    from web.pages import add_pages

    for live in (LiveSamples(), None):
        registry = NodeRegistry(stale_after=60)
        registry.register(wire.decode_registration(json.dumps(registration()).encode()))
        app: web.Application = pages_api.create_app(registry, live=live)
        add_pages(app, None)
        client = await aiohttp_client(app)
        html = await (await client.get("/node/gpu-17")).text()
        assert ('id="live-toggle"' in html) == (live is not None)
        assert ('data-url="/node/gpu-17/live"' in html) == (live is not None)
        fragment = await (await client.get("/node/gpu-17?fragment=1")).text()
        assert "live-toggle" not in fragment  # the in-place refresh leaves the live view alone


# --- agent and control plane as processes ------------------------------------------


class Viewer:
    """A live viewer over real HTTP: reads the stream's events on a thread."""

    def __init__(self, url: str) -> None:
        self.response = urllib.request.urlopen(url, timeout=60)
        self.events: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        name = ""
        try:
            for raw in self.response:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: ") and name == "window":
                    self.events.append(json.loads(line[6:]))
        except Exception:  # noqa: BLE001 - closed under it by the test, however http.client says so
            pass

    def close(self) -> None:
        self.response.close()


def live_heartbeats(fleet: Fleet) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.pages_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'^nodesampler_live_heartbeats_total\{used="(true|false)"\} (\S+)$', text, re.M)
    return {used: float(value) for used, value in found}


@pytest.mark.live
@pytest.mark.parametrize("backend, hz", [("proc", 10), ("bpf", 100)])
def test_a_viewer_gets_every_sample_and_the_agent_stops_when_it_leaves(tmp_path: Path, backend: str, hz: int
                                                                       ) -> None:  # fmt: skip
    if backend == "bpf" and os.geteuid() != 0:
        unavailable("the kernel backend needs root")
    fleet = Fleet(tmp_path)
    busy = start_group(busy_threads(1, duty=0.5))  # something to count, with a shape
    try:
        # A request deadline shorter than the stream: the stream is not a request held open.
        fleet.start_control_plane("--live-linger", "2", "--request-deadline", "1")
        fleet.start_agent("--backend", backend, "--hz", str(hz))
        fleet.wait_for(fresh_with_seq)
        viewer = Viewer(f"http://127.0.0.1:{fleet.pages_port}/node/n1/live")
        seq = fleet.nodes()[0]["heartbeat"]["seq"]
        # Within two windows of the viewer's arrival, the samples flow; three windows of them are compared.
        wait_until("three windows of raw samples", lambda: len(viewer.events) >= 3, 3 * INTERVAL + 30)
        assert viewer.events[0]["seq"] <= seq + 2
        for event in viewer.events[:3]:
            kinds = {s["key"].split(":")[0] for s in event["series"]}
            assert kinds == {"machine", "shard"}, event  # no GPU on this machine
            for s in event["series"]:
                assert s["summary"] is not None, s
                # The same samples as the summary: the same mean, within its rounding.
                assert weighted_mean(s) == pytest.approx(s["summary"]["mean"], abs=6e-5, rel=1e-4), s["key"]
                assert p95_fits(s, s["summary"]["p95"]), s
                assert max(v for v in s["v"] if v is not None) == pytest.approx(s["summary"]["max"], abs=6e-5)
                # Every sample, not a summary of them: the kernel backend's series are the
                # window's samples one for one; /proc's and the machine's merge a sample
                # shorter than a clock tick into the next (sampler/window/series.py).
                if s["key"].startswith("shard:") and backend == "bpf":
                    assert len(s["us"]) == event["samples"], s["key"]
                else:
                    assert 0 < len(s["us"]) <= event["samples"], s["key"]
                # Each series covers the same stretch, sample against sample: by its
                # own readings' clock, so an engine's may end a reading's length from
                # the machine's (4 ms on a CI machine whose CPUs were both busy), and
                # well under a period (docs/wire-format.md).
                machine = event["series"][0]
                assert sum(s["us"]) == pytest.approx(sum(machine["us"]), abs=1e6 / hz), s["key"]
        viewer.close()
        # Found out at a write to the closed stream; then the linger (2 s), then the next heartbeat's answer.
        fleet.wait_for_log("raw samples off", timeout=2 + 15 + 4 * INTERVAL + 30)
        before = live_heartbeats(fleet)
        last = fleet.nodes()[0]["heartbeat"]["seq"]
        fleet.wait_for(lambda nodes: fresh_with_seq(nodes, above=last + 2))
        assert live_heartbeats(fleet) == before  # no heartbeat carries raw samples any more
        assert before["true"] >= 3
    finally:
        fleet.stop()
        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait()


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
