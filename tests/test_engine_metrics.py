"""The engines' own queues: fake engines (aiohttp) serving metrics shaped like
vLLM's, SGLang's and TGI's, read by the agent's reader once a window; an
engine that is slow, huge, malformed or down costs that window its figures
and one log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from sampler.agent.config import ConfigError, parse_config
from sampler.backend import BackendChoice
from sampler.shards.engine_metrics import FAMILIES, EngineMetricsError, EngineMetricsReader, parse, read_text
from sampler.shards.http_fetch import FetchError, fetch
from sampler.shards.proc_shards import ProcShardSampler
from sampler.window.sampler import WindowSampler
from tests.conftest import free_port
from tests.fakeproc import FakeClock, FakeProc

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-70B"} 7.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-70B"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-70B"} 12.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-70B"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-70B"} 0.82
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-70B"} 0.64
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="meta-llama/Llama-3.1-70B"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-70B"} 9.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-70B"} 9.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-70B"} 31.5
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-70B"} 123456.0
vllm:prompt_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-70B"} 1.7e+09
"""

# An older vLLM: the KV cache as gpu_cache_usage_perc, one engine.
VLLM_OLD = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="mistral"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="mistral"} 1.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="mistral"} 0.5
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 16.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.37
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="qwen",tp_rank="0"} 3.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="qwen",tp_rank="0"} 5.0
sglang:time_to_first_token_seconds_sum{model_name="qwen",tp_rank="0"} 0.9
sglang:time_to_first_token_seconds_count{model_name="qwen",tp_rank="0"} 5.0
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 24
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="0.5"} 10
tgi_request_duration_bucket{le="+Inf"} 12
tgi_request_duration_sum 4.2
tgi_request_duration_count 12
"""


def test_each_engines_families() -> None:
    assert parse(VLLM.encode()) == {"requests_waiting": 15.0, "requests_running": 12.0, "kv_cache_usage_ratio": 0.82}
    assert parse(VLLM_OLD.encode()) == {"requests_waiting": 2.0, "requests_running": 1.0, "kv_cache_usage_ratio": 0.5}
    assert parse(SGLANG.encode()) == {"requests_waiting": 4.0, "requests_running": 16.0, "kv_cache_usage_ratio": 0.37}
    assert parse(TGI.encode()) == {"requests_waiting": 6.0, "requests_running": 24.0}  # no KV figure: absent
    assert parse(b"# an engine we do not know\nfoo_bar 1\n") == {}
    # A value that is no count or ratio is left out, not shown wrong.
    assert parse(b"vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 3.5\nvllm:num_requests_running -1\n") == {}
    # Only the wanted families' lines are parsed: text elsewhere is not read at all.
    assert parse(b"\xff\xfe garbage {{\nvllm:num_requests_waiting 2\n") == {"requests_waiting": 2.0}
    for bad in (b"vllm:num_requests_waiting{ 1\n", b'vllm:num_requests_waiting{a="\xff"} 1\n',
                b"vllm:num_requests_waiting one\n"):
        with pytest.raises(EngineMetricsError):
            parse(bad)


class FakeEngines:
    """aiohttp on a thread of its own: the reader's threads block on sockets."""

    def __init__(self) -> None:
        self.port = free_port()
        self.bodies: dict[str, bytes] = {}
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.release = asyncio.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(10)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}/metrics"

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "slow":  # answers when the test ends
            await self.release.wait()
            return web.Response(status=503)
        if name == "drip":  # headers at once, then a byte every 100 ms, until the reader gives up
            resp = web.StreamResponse()
            await resp.prepare(request)
            with contextlib.suppress(ConnectionError):
                while not self.release.is_set():
                    await resp.write(b"#")
                    await asyncio.sleep(0.1)
            return resp
        if name == "error":
            return web.Response(status=500, text="engine overloaded")
        return web.Response(body=self.bodies[name], content_type="text/plain")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/{name}/metrics", self._metrics)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def engines() -> Iterator[FakeEngines]:
    e = FakeEngines()
    yield e
    e.stop()


def read_window(reader: EngineMetricsReader, urls: dict[str, str]) -> dict[str, dict[str, float]]:
    reader.request(urls.items())
    reader.wait(reader.deadline_s + 1)
    return reader.take()


def test_each_engine_read_and_each_failure_costs_its_own_figures(
    engines: FakeEngines, caplog: pytest.LogCaptureFixture
) -> None:
    engines.bodies.update(vllm=VLLM.encode(), sglang=SGLANG.encode(), tgi=TGI.encode(),
                          huge=b"vllm:num_requests_waiting 1\n" + (b"# " + b"p" * 60_000 + b"\n") * 80,
                          malformed=b"vllm:num_requests_waiting{model=\n")
    urls = {name: engines.url(name) for name in ("vllm", "sglang", "tgi", "huge", "malformed", "error", "slow",
                                                 "drip")}  # fmt: skip
    urls["down"] = f"http://127.0.0.1:{free_port()}/metrics"
    reader = EngineMetricsReader(deadline_s=1.0, max_bytes=4 << 20)
    with caplog.at_level(logging.WARNING, logger="sampler.shards.engine_metrics"):
        first = read_window(reader, urls)
        second = read_window(reader, urls)
    for got in (first, second):
        figures = {sid: got.pop(sid) for sid in ("vllm", "sglang", "tgi")}
        assert figures == {"vllm": parse(VLLM.encode()), "sglang": parse(SGLANG.encode()), "tgi": parse(TGI.encode())}
        # Each failed shard carries its reason, and no figures.
        assert set(got) == {"huge", "malformed", "error", "slow", "drip", "down"}
        assert all(list(v) == ["metrics_error"] for v in got.values()), got
    records = [r for r in caplog.records if r.name == "sampler.shards.engine_metrics"]
    said = {r.getMessage().split(":", 1)[0]: r.getMessage() for r in records}
    assert set(said) == {f"engine {n}" for n in ("huge", "malformed", "error", "slow", "drip", "down")}
    assert "more than 4 MiB" in said["engine huge"] and "not Prometheus text" in said["engine malformed"]
    assert "HTTP 500" in said["engine error"] and "ConnectionRefusedError" in said["engine down"]
    assert "not whole within 1 s" in said["engine slow"] or "no answer" in said["engine slow"]
    assert "not whole within 1 s" in said["engine drip"] or "no answer" in said["engine drip"]
    # One line for each, though both windows failed alike.
    assert len(records) == 6, [r.getMessage() for r in records]


def test_a_shard_names_its_endpoint_in_the_config() -> None:
    [w] = parse_config(b'[[shard]]\nid = "s0"\nselect = "pgid:1"\nmetrics_url = "http://127.0.0.1:8000/metrics"\n')
    assert w.metrics_url == "http://127.0.0.1:8000/metrics"
    for bad in ('"file:///etc/passwd"', "8000", '"http://a b/metrics"', '"http://x/\\u0000"'):
        with pytest.raises(ConfigError, match="metrics_url"):
            parse_config(f'[[shard]]\nid = "s0"\nselect = "pgid:1"\nmetrics_url = {bad}\n'.encode())


def test_the_window_carries_the_queue(tmp_path: Path, engines: FakeEngines) -> None:
    engines.bodies["vllm"] = VLLM.encode()
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=1)
    config = f'[[shard]]\nid = "s0"\nselect = "pgid:100"\nmetrics_url = "{engines.url("vllm")}"\n'
    config += '[[shard]]\nid = "s1"\nselect = "pgid:100"\n'  # no endpoint: no queue figures
    clock = FakeClock()
    ws = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root, clock),
                       parse_config(config.encode()), hz=10, node="n1", clock=clock, wall_clock=clock,
                       sleep=clock.advance, gpu_grace=5.0)  # fmt: skip
    s0, s1 = ws.run_window(1.0).shards
    assert (s0.requests_waiting, s0.requests_running, s0.kv_cache_usage_ratio) == (15.0, 12.0, 0.82)
    assert (s1.requests_waiting, s1.requests_running, s1.kv_cache_usage_ratio) == (None, None, None)


# --- what a hostile engine can send ---------------------------------------------


def library_parse(body: bytes) -> dict[str, float]:
    """The reference: prometheus-client's parser over the whole text, every family
    built (what the agent did before it scanned for the wanted lines alone)."""
    by_name: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        by_name.setdefault(family.name, []).extend(float(s.value) for s in family.samples if s.name == family.name)
    found: dict[str, float] = {}
    for field, names in FAMILIES.items():
        for n in names:
            values = [v for v in by_name.get(n, []) if math.isfinite(v)]
            if values:
                found[field] = sum(values) if field in ("requests_waiting", "requests_running") else max(values)
                break
    return {f: v for f, v in found.items() if v >= 0 and (f != "kv_cache_usage_ratio" or v <= 1)}


_FAMILY = st.sampled_from([n for names in FAMILIES.values() for n in names] + ["vllm:num_requests_waiting_x",
                                                                               "other_total", "tgi_queue"])


@given(st.lists(st.tuples(_FAMILY, st.lists(st.tuples(st.sampled_from(["0", "1", "a b", 'q"x']),
                                                       st.floats(0, 1, allow_nan=False)), min_size=1, max_size=3),
                          st.booleans()), max_size=8, unique_by=lambda f: f[0]),
       st.lists(st.integers(1, 64), max_size=20))  # fmt: skip
def test_the_scan_gives_what_the_librarys_whole_parse_gives(families: list[tuple[str, list[tuple[str, float]], bool]],
                                                            cuts: list[int]) -> None:  # fmt: skip
    """Any text of gauges (typed or not, labelled or not, names that share a
    prefix), arriving in any chunks: the same figures as the library's parse."""
    lines = []
    for family, samples, typed in families:
        if typed:
            lines += [f"# HELP {family} some help", f"# TYPE {family} gauge"]
        for engine, value in samples:
            label = engine.replace('"', '\\"')
            lines.append(f'{family}{{engine="{label}"}} {value!r}')
    body = ("\n".join(lines) + "\n").encode()
    chunks, at = [], 0
    for n in cuts:
        chunks.append(body[at : at + n])
        at += n
    chunks.append(body[at:])
    assert read_text(iter(chunks)) == library_parse(body)


def serve_once(answer: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    """A raw TCP server of one connection, for what no HTTP framework sends."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def run() -> None:
        conn, _ = listener.accept()
        listener.close()
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            answer(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{port}/metrics", thread


def drip(conn: socket.socket, prefix: bytes, then: bytes) -> None:
    conn.sendall(prefix)
    for byte in then:
        conn.sendall(bytes([byte]))
        time.sleep(0.3)


@pytest.mark.parametrize("where", ["status line", "headers", "chunk size"])
def test_one_deadline_covers_the_whole_exchange(where: str) -> None:
    """A byte every 0.3 s meets every read's timeout, wherever it drips: the
    fetch still ends at its deadline (urllib checked it between body reads
    alone: a status line dripped held the thread for as long as the server liked)."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    prefix, then = {"status line": (b"", head + b"\r\n"),
                    "headers": (b"HTTP/1.1 200 OK\r\n", b"X-Pad: " + b"p" * 200 + b"\r\n\r\n"),
                    "chunk size": (head + b"\r\n", b"00000000000000000000000005\r\n")}[where]  # fmt: skip
    url, server = serve_once(lambda conn: drip(conn, prefix, then * 20))
    started = time.monotonic()
    with pytest.raises(FetchError, match="not whole within 1 s"):
        fetch(url, 1.0, 1 << 20)
    took = time.monotonic() - started
    print(f"\n{where} dripped: the fetch gave up after {took:.2f} s (deadline 1 s)")
    server.join(30)
    assert not server.is_alive()


def test_a_redirect_is_refused_not_followed() -> None:
    """A 302 is the engine's answer, never a request to where it points."""
    asked = threading.Event()

    def answer(conn: socket.socket) -> None:
        asked.set()
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")

    elsewhere, target = serve_once(answer)
    url, _ = serve_once(lambda conn: conn.sendall(
        f"HTTP/1.1 302 Found\r\nLocation: {elsewhere}\r\nContent-Length: 0\r\n\r\n".encode()))
    with pytest.raises(FetchError, match="HTTP 302: redirects are not followed"):
        fetch(url, 2.0, 1 << 20)
    assert not asked.is_set()
    fetch(elsewhere, 2.0, 1 << 20)  # the target was there to be asked
    assert asked.is_set()
    target.join(10)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/metrics", "gopher://x/", "http:///metrics"])
def test_only_http_and_https_are_fetched(url: str) -> None:
    with pytest.raises(FetchError, match="only http:// and https://|scheme"):
        fetch(url, 1.0, 1 << 20)


def eight_mib_of_one_sample() -> bytes:
    return b"a 1\n" * (2 << 20)


def one_line_of_eight_mib() -> bytes:
    return b'vllm:num_requests_waiting{pad="' + b"p" * (8 << 20) + b'"} 1\n'


def families_100k() -> bytes:
    return b"".join(b"# TYPE f%d gauge\nf%d 1\n" % (i, i) for i in range(100_000))


def wanted_samples_5k() -> bytes:
    return b"".join(b'vllm:num_requests_waiting{engine="%d"} 1\n' % i for i in range(5000))


@pytest.mark.parametrize(("body", "reason"), [
    (eight_mib_of_one_sample, "more than 100000 lines"),
    (one_line_of_eight_mib, "a line longer than 64 KiB"),
    (families_100k, "more than 100000 lines"),
    (wanted_samples_5k, "more than 1024 samples of the queue's families"),
])  # fmt: skip
def test_the_first_cap_reached_ends_the_read_with_its_reason(
    engines: FakeEngines, body: Callable[[], bytes], reason: str
) -> None:
    """Each of the issue's bodies, served for real: the shard alone gets no
    figures and says which cap ended its read, and the reader's memory
    stays a chunk's, not the text's (what the library made of 1 MiB of
    `a 1\\n` was 262k samples, ~100 MiB)."""
    engines.bodies["hostile"] = body()
    engines.bodies["vllm"] = VLLM.encode()
    reader = EngineMetricsReader(deadline_s=10.0)
    tracemalloc.start()
    try:
        got = read_window(reader, {"hostile": engines.url("hostile"), "vllm": engines.url("vllm")})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == {"hostile": {"metrics_error": reason}, "vllm": parse(VLLM.encode())}
    print(f"\n{body.__name__}: {len(engines.bodies['hostile']) >> 10} KiB served; "
          f"peak traced memory {peak >> 10} KiB (server included)")
