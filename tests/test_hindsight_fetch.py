"""Fetching a span of hindsight after the fact (wire/hindsight.py, the
agent's sampler/window/span_sender.py, the control plane's
controlplane/samples/hindsight.py): the pieces, cut to any room, put back together
are exactly the ring's samples of the span; a lost piece is named missing
and never filled; a span not asked for is not read; every ask is bounded."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wire
from controlplane import pages_api
from controlplane.ingest import agent_api
from controlplane.samples.hindsight import (
    AROUND_S,
    ASK_BURST,
    ASK_EVERY_S,
    GRACE_S,
    HELD_BYTES_A_PIECE,
    HELD_BYTES_A_WINDOW,
    HINDSIGHT,
    MAX_WAITING_PER_NODE,
    Fetch,
    HindsightFetches,
    Refused,
)
from controlplane.state.registry import NodeRegistry
from sampler.window.hindsight import HindsightRing
from sampler.window.span_sender import SpanSender
from tests.fakeproc import FakeClock
from tests.test_controlplane_api import SECRET, Client, heartbeat, post, registration
from wire.hindsight import MAX_SPAN_S, MAX_WINDOWS, SpanRequest, parse_piece, parse_request
from wire.raw import window_stats

T0 = 1_764_000_000.0  # a wall time of 2025


def filled_ring(seconds: float = 60.0, hz: float = 100.0, shards: int = 3, gpus: int = 1,
                window_s: float = 5.0, seed: int = 1) -> HindsightRing:  # fmt: skip
    """A ring of `seconds` of samples: the machine, `shards` shards (the last
    absent for a while), `gpus` GPUs' points, in windows of `window_s`."""
    rng = np.random.default_rng(seed)
    ring = HindsightRing(minutes=seconds / 60 + 1, mib=16, hz=hz)
    n = int(window_s * hz)
    for w in range(int(seconds / window_s)):
        start, end = T0 + w * window_s, T0 + (w + 1) * window_s
        lengths = np.full(n, 1 / hz)
        values = rng.uniform(0, 100, n)
        values[rng.integers(0, n)] = np.nan
        ring.keep("machine", end, lengths, values)
        for s in range(shards):
            if s == shards - 1 and 2 <= w < 5:
                continue  # a shard that left and came back: its absence is one unmeasured sample
            ring.keep(f"shard:s{s}", end, lengths, rng.uniform(0, 4, n))
        for g in range(gpus):
            ring.keep_points(f"gpu:{g}", start + np.arange(1, 31) * window_s / 30, rng.uniform(0, 100, 30))
            # GPM's intervals: its SM activity at 10 a second
            ring.keep_points(f"gpu:{g}:sm_activity_percent", start + np.arange(1, int(window_s * 10) + 1) / 10,
                             rng.uniform(0, 100, int(window_s * 10)))  # fmt: skip
        ring.keep_window(start, end)
    return ring


def fetch_all(ring: HindsightRing, asked: SpanRequest, room: int, lose: frozenset[int] = frozenset()) -> Fetch:
    """The agent's pieces, each checked as the control plane checks them and
    added to a fetch; the pieces numbered in `lose` never arrive."""
    fetches = HindsightFetches(wall=lambda: T0 + 1000)
    fetch = fetches.ask("n1", asked.t_from, asked.t_to, "test", held_seconds=1e6)
    sender = SpanSender()
    sender.asked = SpanRequest(fetch.id, asked.t_from, asked.t_to)
    for number in range(10_000):
        body = sender.next_piece(ring, room)
        if body is None:
            break
        assert len(body) <= room
        dropped: wire.Dropped = []
        checked = parse_piece(json.loads(body), fetches.asked("n1") or sender.asked, dropped)
        assert dropped == [] and checked is not None
        if number not in lose:
            fetches.received("n1", checked)
    return fetch


def expanded(series: dict[str, Any], t_from: float) -> list[tuple[float, float]]:
    """A rate series as (end, value) per sample; NaN: not measured."""
    ends = t_from + series["start"] + np.cumsum(series["us"]) / 1e6
    return [(e, math.nan if v is None else v) for e, v in zip(ends.tolist(), series["v"], strict=True)]


@settings(max_examples=25, deadline=None)
@given(st.floats(0, 50), st.floats(0.5, 60), st.integers(4096, 300_000))
def test_the_pieces_put_back_are_the_rings_samples_of_the_span(offset: float, length: float, room: int) -> None:
    ring = filled_ring()
    asked = SpanRequest("x", T0 + offset, min(T0 + offset + length, T0 + 60))
    fetch = fetch_all(ring, asked, room)
    assert fetch.finished_at is not None and fetch.missing == []
    got = fetch.samples()
    for key, series in [("machine", got["machine"]["cpu_percent"])] + [
            (f"shard:{s['id']}", s["cpu_cores"]) for s in got["shards"]]:  # fmt: skip
        want = ring.ending_in(key, asked.t_from, asked.t_to)
        assert want is not None
        pairs = [(e, v) for e, v in expanded(series, asked.t_from)]
        # An absence that began before the span is cut to the span: its end and its being unmeasured kept.
        assert [round(e, 5) for e, _ in pairs] == pytest.approx(
            (want.start + np.cumsum(want.us) / 1e6).round(5).tolist(), abs=2e-6)
        assert [v for _, v in pairs] == pytest.approx(want.values.astype(float).tolist(), nan_ok=True, abs=1e-4)
    for field, key in [("utilization_percent", "gpu:0"), ("sm_activity_percent", "gpu:0:sm_activity_percent")]:
        points = got["gpus"][0][field]
        want = ring.ending_in(key, asked.t_from, asked.t_to)
        assert want is not None and points["v"] == pytest.approx(want.values.astype(float).tolist(), abs=0.01)


def test_a_lost_piece_is_named_missing_and_never_filled() -> None:
    ring = filled_ring()
    asked = SpanRequest("x", T0, T0 + 60)
    fetch = fetch_all(ring, asked, room=60_000, lose=frozenset({1}))
    assert fetch.pieces >= 3
    [gap] = fetch.missing
    assert "lost" in gap["why"] and T0 < gap["from"] < gap["to"] < T0 + 60
    machine = expanded(fetch.samples()["machine"]["cpu_percent"], T0)
    inside = [v for e, v in machine if gap["from"] < e <= gap["to"]]
    assert len(inside) == 1 and math.isnan(inside[0])  # one unmeasured stretch, not zeros
    assert [v for e, v in machine if e > gap["to"]] != []


def test_a_span_older_than_the_ring_is_missing_there() -> None:
    ring = filled_ring(seconds=30)
    fetches = HindsightFetches(wall=lambda: T0 + 30)
    fetch = fetches.ask("n1", T0 - 100, T0 + 30, "test", held_seconds=30)
    assert fetch.missing == [{"from": T0 - 100, "to": T0, "why": "older than the node keeps (its --hindsight)"}]
    asked = fetches.asked("n1")
    assert asked is not None and asked.t_from == T0
    sender = SpanSender()
    sender.asked = asked
    while (body := sender.next_piece(ring, 400_000)) is not None:
        fetches.received("n1", parse_piece(json.loads(body), asked, None) or {})
    assert fetch.finished_at is not None and len(fetch.missing) == 1
    assert fetch.describe()["from"] == T0 - 100  # the span as asked, its first 100 s said missing


def test_a_span_ahead_of_the_ring_comes_as_the_windows_bring_it() -> None:
    ring = filled_ring(seconds=30)
    sender = SpanSender()
    sender.asked = SpanRequest("x", T0 + 20, T0 + 40)
    first = json.loads(sender.next_piece(ring, 400_000) or b"{}")
    assert first["to"] == T0 + 30 and first["done"] is False
    assert sender.next_piece(ring, 400_000) is None  # nothing new held
    more = filled_ring(seconds=45)
    last = json.loads(sender.next_piece(more, 400_000) or b"{}")
    assert (last["from"], last["to"], last["done"]) == (T0 + 30, T0 + 40, True)
    assert sender.next_piece(more, 400_000) is None  # sent whole


def test_pieces_stop_coming_and_the_rest_is_given_up() -> None:
    clock = FakeClock(T0 + 30)
    fetches = HindsightFetches(wall=clock)
    fetch = fetches.ask("n1", T0, T0 + 30, "test", held_seconds=60)
    ring = filled_ring(seconds=30)
    sender = SpanSender()
    sender.asked = fetches.asked("n1")
    body = sender.next_piece(ring, 20_000)
    assert body is not None and sender.asked is not None
    fetches.received("n1", parse_piece(json.loads(body), sender.asked, None) or {})
    clock.advance(GRACE_S - 1)
    assert fetches.asked("n1") is not None and fetch.finished_at is None
    clock.advance(2)
    assert fetches.asked("n1") is None and fetch.finished_at is not None
    [tail] = fetch.missing
    assert "not received" in tail["why"] and tail["to"] == T0 + 30


def test_asks_are_bounded() -> None:
    clock = FakeClock(T0)
    fetches = HindsightFetches(wall=clock)
    with pytest.raises(Refused, match="--hindsight"):
        fetches.ask("n1", T0 - 10, T0, "test", held_seconds=None)
    with pytest.raises(Refused, match="at most 3600"):
        fetches.ask("n1", T0 - 4000, T0, "test", held_seconds=900)
    for _ in range(MAX_WAITING_PER_NODE):
        fetches.ask("n1", T0 - 10, T0, "test", held_seconds=900)
    with pytest.raises(Refused, match="being fetched"):
        fetches.ask("n1", T0 - 10, T0, "test", held_seconds=900)
    for _ in range(ASK_BURST):  # each fetched at once: the queue never fills, the asks run out
        fetches.ask("n2", T0 - 10, T0, "test", held_seconds=900)
        head = fetches.asked("n2")
        assert head is not None
        fetches.received("n2", {"id": head.id, "from": head.t_from, "to": head.t_to, "done": True,
                                "held_from": None, "windows": [], "shards": [], "gpus": []})  # fmt: skip
    with pytest.raises(Refused, match="more often"):
        fetches.ask("n2", T0 - 10, T0, "test", held_seconds=900)
    clock.advance(ASK_EVERY_S)
    fetches.ask("n2", T0 - 10, T0, "test", held_seconds=900)  # a token back


def test_a_piece_is_checked_item_by_item() -> None:
    asked = SpanRequest("x", T0, T0 + 60)
    good = {"id": "x", "from": T0, "to": T0 + 5, "done": False, "held_from": T0 - 100,
            "windows": [[0, 5]], "machine": {"cpu_percent": {"start": 0, "us": [5_000_000], "v": [50.0]}},
            "shards": [{"id": "a", "cpu_cores": {"start": 0, "us": [1], "v": [1, 2]}},
                       {"id": "b", "cpu_cores": {"start": 0, "us": [5_000_000], "v": [1.5]}}],
            "gpus": [{"index": 0, "utilization_percent": {"t": [1.0], "v": [101]}}]}  # fmt: skip
    dropped: wire.Dropped = []
    checked = parse_piece(good, asked, dropped)
    assert checked is not None and [s["id"] for s in checked["shards"]] == ["b"] and checked["gpus"] == []
    assert {d["field"] for d in dropped} == {"hindsight.shards[0].cpu_cores",
                                             "hindsight.gpus[0].utilization_percent.v[0]"}
    bads: list[Any] = [{**good, "id": "y"}, {**good, "from": T0 - 1}, {**good, "to": T0 + 61}, {**good, "done": 1}, []]
    for bad in bads:
        dropped = []
        assert parse_piece(bad, asked, dropped) is None and len(dropped) == 1


@pytest.mark.parametrize("answer", [
    {"id": "a b", "from": T0, "to": T0 + 1}, {"id": "a", "from": T0, "to": T0 + 3601},
    {"id": "a", "from": T0 + 1, "to": T0}, {"id": "a", "from": 5, "to": 6}, "x"])  # fmt: skip
def test_the_agent_reads_only_a_span_it_can_send(answer: Any) -> None:
    with pytest.raises(wire.WireError):
        parse_request(answer)


def test_window_events_carry_each_windows_stats_of_its_samples() -> None:
    ring = filled_ring(seconds=20)
    fetch = fetch_all(ring, SpanRequest("x", T0, T0 + 20), room=400_000)
    events, truncated = fetch.window_events()
    assert not truncated
    assert [(e["start"], e["end"]) for e in events] == [(T0 + 5 * i, T0 + 5 * (i + 1)) for i in range(4)]
    for e in events:
        machine = next(s for s in e["series"] if s["key"] == "machine")
        span = ring.ending_in("machine", e["start"], e["end"])
        assert span is not None
        want = window_stats(span.values.astype(np.float64), span.us / 1e6)
        assert want is not None and machine["summary"] == pytest.approx(want, abs=2e-4)
        assert len(machine["us"]) == len(span.us)
        # A card's SM activity (GPM's intervals, 10 a second) beside its utilisation, named as a person reads it.
        sm = next(s for s in e["series"] if s["key"] == "gpu:0:sm_activity_percent")
        points = ring.ending_in("gpu:0:sm_activity_percent", e["start"], e["end"])
        assert points is not None and len(points.us) >= 49  # the row's first point only dates the next
        assert (sm["label"], sm["unit"], len(sm["t"])) == ("GPU 0 SM activity", "%", len(points.us))
        if e is not events[0]:  # there, the row's first point dates the next; the line weighs it from the start
            want = window_stats(points.values.astype(np.float64), points.us / 1e6)
            assert sm["summary"] == pytest.approx(want, abs=0.01)


# --- through both listeners -------------------------------------------------------


@pytest.fixture
async def cluster(aiohttp_client: Any) -> tuple[Client, Client]:
    registry = NodeRegistry(stale_after=60)
    fetches = HindsightFetches(wall=lambda: heartbeat()["window"]["end"])  # the wall time the heartbeats say
    agents = await aiohttp_client(agent_api.create_app(registry, SECRET, fetches=fetches))
    pages = await aiohttp_client(pages_api.create_app(registry, fetches=fetches))
    return agents, pages


async def test_a_span_asked_on_the_pages_is_fetched_through_the_heartbeats(cluster: tuple[Client, Client]) -> None:
    agents, pages = cluster
    assert (await post(agents, "/v1/register", registration()))[0] == 200
    hb = heartbeat(seq=1)
    assert (await post(agents, "/v1/heartbeat", hb))[0] == 200
    now = hb["window"]["end"]
    r = await pages.post("/api/nodes/gpu-17/hindsight", json={"at": now})
    assert r.status == 503 and "--hindsight 0" in await r.text()  # its agent said it keeps nothing: turned off
    hb = heartbeat(seq=2) | {"hindsight_held_seconds": 600.0}
    status, answer = await post(agents, "/v1/heartbeat", hb)
    assert status == 200 and "hindsight" not in answer
    r = await pages.post("/api/nodes/gpu-17/hindsight", data=json.dumps({"at": now}))
    assert r.status == 415  # not JSON: a form another site posts is not an ask
    assert (await pages.post("/api/nodes/nobody/hindsight", json={"at": now})).status == 404
    # Each a request that can never succeed: 400, saying what is wrong, and nothing asked of the node.
    for bad, says in [({"at": "soon"}, "could not convert"), ({"at": "NaN"}, "not finite"),
                      ({"at": 1e300}, "ahead of now"), ({"from": now, "to": now - 1}, "from is not before to"),
                      ({"at": now + 3600}, "ahead of now"), ([now], "not a JSON object"),
                      ({"at": 1}, "ends before what gpu-17's ring holds: its last 600 s"),
                      ({"from": now - 590 - MAX_SPAN_S, "to": now}, "at most"),
                      ({"to": now}, "'from'")]:  # fmt: skip
        r = await pages.post("/api/nodes/gpu-17/hindsight", json=bad)
        text = await r.text()
        assert r.status == 400 and says in text and '{"at": T} or {"from": T0, "to": T1}' in text, (bad, text)
    assert pages.app[HINDSIGHT].asked("gpu-17") is None
    r = await pages.post("/api/nodes/gpu-17/hindsight", json={"at": now - 100})
    assert r.status == 202
    asked = await r.json()
    status, answer = await post(agents, "/v1/heartbeat", heartbeat(seq=3) | {"hindsight_held_seconds": 600.0})
    assert answer["hindsight"] == {"id": asked["id"], "from": now - 130, "to": now - 70}
    # A piece of another span is not taken; one of this span is.
    foreign = {"id": "other", "from": now - 130, "to": now - 70, "done": True, "windows": []}
    status, answer = await post(agents, "/v1/heartbeat", heartbeat(seq=4) | {"hindsight": foreign})
    assert status == 200 and answer["dropped"][0]["field"] == "hindsight.id" and "hindsight" in answer
    whole = {"id": asked["id"], "from": now - 130, "to": now - 70, "done": True, "held_from": now - 600,
             "windows": [[0, 30], [30, 60]],
             "machine": {"cpu_percent": {"start": 0, "us": [30_000_000, 30_000_000], "v": [10.0, 90.0]}}}
    status, answer = await post(agents, "/v1/heartbeat", heartbeat(seq=5) | {"hindsight": whole})
    assert status == 200 and "hindsight" not in answer  # done: no longer asked
    got = await (await pages.get(asked["url"])).json()
    assert got["state"] == "done" and got["missing"] == []
    assert got["machine"]["cpu_percent"] == {"start": 0.0, "us": [30_000_000, 30_000_000], "v": [10.0, 90.0]}
    windows = await (await pages.get(asked["url"] + "?view=windows")).json()
    assert [w["series"][0]["summary"]["mean"] for w in windows["windows"]] == [10.0, 90.0]
    assert (await pages.get("/api/hindsight/nope")).status == 404


def test_a_span_wholly_older_than_the_ring_is_done_at_once_and_holds_up_no_other() -> None:
    fetches = HindsightFetches(wall=lambda: T0)
    old = fetches.ask("n1", T0 - 2000, T0 - 1900, "test", held_seconds=600)
    assert old.finished_at is not None
    assert [m["why"] for m in old.missing] == ["older than the node keeps (its --hindsight)"]
    recent = fetches.ask("n1", T0 - 60, T0, "test", held_seconds=600)
    assert fetches.asked("n1") == recent.request


def test_a_span_waiting_its_turn_is_not_late_and_a_restarted_agent_resumes() -> None:
    clock = FakeClock(T0 + 60)
    fetches = HindsightFetches(wall=clock)
    first = fetches.ask("n1", T0, T0 + 60, "test", held_seconds=600)
    second = fetches.ask("n1", T0, T0 + 30, "test", held_seconds=600)
    ring = filled_ring(seconds=60)
    sender = SpanSender()
    for _ in range(3):  # the first span comes slowly: a piece a heartbeat, a minute apart (within its hard end)
        sender.asked = fetches.asked("n1")
        assert sender.asked is not None and sender.asked.id == first.id
        body = sender.next_piece(ring, 20_000)
        assert body is not None
        fetches.received("n1", parse_piece(json.loads(body), sender.asked, None) or {})
        clock.advance(60)
    asked = fetches.asked("n1")
    assert asked is not None and asked.t_from == first.received_to > T0  # an agent that restarted resumes here
    restarted = SpanSender()
    restarted.asked = asked
    while (body := restarted.next_piece(ring, 400_000)) is not None:
        fetches.received("n1", parse_piece(json.loads(body), asked, None) or {})
    assert first.finished_at is not None and first.missing == []
    assert fetches.asked("n1") == second.request and second.finished_at is None  # its turn only now


def test_the_spans_held_are_bounded_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    import controlplane.samples.hindsight as hindsight

    ring = filled_ring(seconds=30)
    fetches = HindsightFetches(wall=lambda: T0 + 30)

    def fetched_at_once(node: str) -> Fetch:
        fetch = fetches.ask(node, T0, T0 + 30, "test", held_seconds=600, for_incident=True)
        sender = SpanSender()
        sender.asked = fetches.asked(node)
        body = sender.next_piece(ring, 400_000)
        assert body is not None and sender.asked is not None
        fetches.received(node, parse_piece(json.loads(body), sender.asked, None) or {})
        return fetch

    a = fetched_at_once("n1")
    assert a.finished_at is not None and fetches.held_bytes == a.bytes > 0
    monkeypatch.setattr(hindsight, "MAX_BYTES", a.bytes + 100)
    b = fetched_at_once("n2")
    assert b.bytes == 0 and [m["why"] for m in b.missing] == ["the control plane held 0 MiB of spans, all it may"]
    monkeypatch.setattr(hindsight, "MAX_BYTES", a.bytes)  # full: no new span is asked
    with pytest.raises(Refused, match="allowed"):
        fetches.ask("n3", T0, T0 + 30, "test", held_seconds=600, for_incident=True)
    # Viewers may hold half: with the incidents' spans at the whole, a viewer's ask is refused first.
    monkeypatch.setattr(hindsight, "MAX_BYTES", 2 * a.bytes)
    fetches.ask("n3", T0, T0 + 30, "test", held_seconds=600, for_incident=True)
    fetches.ask("n4", T0, T0 + 30, "test", held_seconds=600)
    head = fetches.asked("n4")
    assert head is not None
    sender = SpanSender()
    sender.asked = head
    body = sender.next_piece(ring, 400_000)
    assert body is not None
    fetches.received("n4", parse_piece(json.loads(body), head, None) or {})
    assert fetches.viewer_bytes == a.bytes and fetches.pieces_taken == 2 and fetches.pieces_refused["all_budget"] == 1
    with pytest.raises(Refused, match="allowed"):
        fetches.ask("n5", T0, T0 + 30, "test", held_seconds=600)


# --- bounded as a hostile node would push (#45) ---------------------------------------


def piece(fetch_id: str, t_from: float, t_to: float, windows: int = 0, done: bool = False) -> dict[str, Any]:
    """A checked piece as a node may write it: `windows` windows of no length, one machine sample."""
    return {"id": fetch_id, "from": t_from, "to": t_to, "done": done, "held_from": None,
            "windows": [(0.0, 0.0)] * windows, "shards": [], "gpus": [],
            "machine": {"cpu_percent": {"start": 0.0, "us": [max(1, round((t_to - t_from) * 1e6))],
                                        "v": [5.0]}}}  # fmt: skip


def test_a_piece_that_does_not_advance_is_refused_and_puts_nothing_off() -> None:
    clock = FakeClock(T0 + 60)
    fetches = HindsightFetches(wall=clock)
    fetch = fetches.ask("n1", T0, T0 + 60, "test", held_seconds=600)
    assert fetches.asked("n1") is not None
    fetches.received("n1", piece(fetch.id, T0, T0 + 5, windows=1))
    held, deadline = fetch.bytes, fetch.deadline
    for _ in range(50):  # the same piece forever, each a heartbeat later, with the most windows a piece may carry
        clock.advance(5)
        fetches.received("n1", piece(fetch.id, T0, T0 + 5, windows=MAX_WINDOWS))
        fetches.received("n1", piece(fetch.id, T0 + 5, T0 + 5, windows=MAX_WINDOWS))
    assert fetch.bytes == held and fetch.deadline == deadline and len(fetch.windows) == 1
    assert fetches.pieces_refused["no_advance"] == 100 and fetches.pieces_taken == 1
    clock.advance(deadline - clock())
    assert fetches.asked("n1") is not None
    clock.advance(0.01)
    assert fetches.asked("n1") is None and fetch.finished_at is not None and fetches.given_up["viewer"] == 1


def test_a_span_ends_at_its_hard_end_whatever_comes() -> None:
    clock = FakeClock(T0 + 60)
    fetches = HindsightFetches(wall=clock)
    fetch = fetches.ask("n1", T0, T0 + 60, "test", held_seconds=600)
    assert fetches.asked("n1") is not None and fetch.hard_end == T0 + 60 + GRACE_S + 60
    t = T0
    while fetches.asked("n1") is not None:  # a sliver of the span a heartbeat: it advances, slowly
        fetches.received("n1", piece(fetch.id, t, t + 0.01))
        t += 0.01
        clock.advance(5)
    assert fetch.finished_at is not None and clock() <= fetch.hard_end + 5 and t < T0 + 60
    assert fetch.missing[-1]["why"].startswith("not received")


def test_windows_and_pieces_count_against_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import controlplane.samples.hindsight as hindsight

    fetches = HindsightFetches(wall=lambda: T0 + 60)
    fetch = fetches.ask("n1", T0, T0 + 60, "test", held_seconds=600)
    fetches.received("n1", piece(fetch.id, T0, T0 + 1, windows=MAX_WINDOWS))
    assert fetch.bytes >= MAX_WINDOWS * HELD_BYTES_A_WINDOW + HELD_BYTES_A_PIECE
    monkeypatch.setattr(hindsight, "MAX_BYTES_PER_FETCH", fetch.bytes + 10)
    fetches.received("n1", piece(fetch.id, T0 + 1, T0 + 2, windows=MAX_WINDOWS))
    assert fetches.pieces_refused["span_budget"] == 1 and len(fetch.windows) == MAX_WINDOWS
    assert fetch.missing[-1]["why"].startswith("over the")


def test_a_span_ends_about_now_and_an_incidents_goes_first() -> None:
    clock = FakeClock(T0 + 600)
    fetches = HindsightFetches(wall=clock)
    ahead = fetches.ask("n1", T0 + 590, T0 + 600 + 3600, "a look an hour ahead", held_seconds=900)
    assert ahead.t_to == T0 + 600 + AROUND_S
    views = [ahead] + [fetches.ask("n1", T0 + 500, T0 + 590, "test", held_seconds=900) for _ in range(3)]
    with pytest.raises(Refused, match="being fetched"):
        fetches.ask("n1", T0 + 500, T0 + 590, "test", held_seconds=900)
    assert fetches.asked("n1") == ahead.request
    fetches.received("n1", piece(ahead.id, T0 + 590, T0 + 595))
    # An incident's span is asked at once, ahead of the viewers' (its own turn and budget) ...
    incident = fetches.ask("n1", T0 + 300, T0 + 660, "incident", held_seconds=900, for_incident=True, ahead_s=60)
    assert fetches.asked("n1") == incident.request
    fetches.received("n1", piece(ahead.id, T0 + 595, T0 + 600))  # the viewer's piece in flight: not taken now
    assert ahead.received_to == T0 + 595 and fetches.pieces_refused["not_asked"] == 1
    fetches.received("n1", piece(incident.id, T0 + 300, T0 + 660, done=True))
    # ... and the viewer's resumes where its pieces ended.
    assert incident.finished_at is not None and fetches.asked("n1") == SpanRequest(ahead.id, T0 + 595, ahead.t_to)
    assert all(v.finished_at is None for v in views)


def test_window_events_are_linear_in_what_they_give() -> None:
    fetches = HindsightFetches(wall=lambda: T0 + 3600)
    fetch = fetches.ask("n1", T0, T0 + 3600, "test", held_seconds=3600)
    # A node's confusion: every window of every piece spans the whole piece (overlapping, and repeated).
    for p in range(3):
        body = piece(fetch.id, T0 + p * 1000, T0 + (p + 1) * 1000, done=p == 2)
        body["windows"] = [(0.0, 1000.0)] * 2000 + [(float(i), float(i + 1)) for i in range(0, 1000, 50)]
        body["shards"] = [{"id": f"s{i}", "cpu_cores": {"start": 0.0, "us": [10**9] * 1, "v": [1.0]}}
                          for i in range(50)]  # fmt: skip
        fetches.received("n1", body)
    events, truncated = fetch.window_events()
    assert not truncated
    starts = [e["start"] for e in events]
    assert starts == sorted(starts)
    assert all(a["end"] <= b["start"] + 1e-3 for a, b in zip(events, events[1:], strict=False))
    drawn = sum(len(s["us"]) for e in events for s in e["series"])
    assert drawn <= 3 * 51  # each sample drawn once at most, however the windows overlap
