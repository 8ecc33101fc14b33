"""The engines' own queues: fake engines (aiohttp) serving metrics shaped like
vLLM's, SGLang's and TGI's, read by the agent's reader once a window; an
engine that is slow, huge, malformed or down costs that window its figures
and one log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from sampler.agent import ConfigError, parse_config
from sampler.backend import BackendChoice
from sampler.engine_metrics import EngineMetricsError, EngineMetricsReader, parse
from sampler.proc_groups import ProcGroupSampler
from sampler.window_sampler import WindowSampler
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
    for bad in (b"vllm:num_requests_waiting{ 1\n", b"\xff\xfe", b"vllm:num_requests_waiting one\n"):
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
                          huge=b"vllm:num_requests_waiting 1\n" + b"# padding\n" * (1 << 20),
                          malformed=b"vllm:num_requests_waiting{model=\n")
    urls = {name: engines.url(name) for name in ("vllm", "sglang", "tgi", "huge", "malformed", "error", "slow",
                                                 "drip")}  # fmt: skip
    urls["down"] = f"http://127.0.0.1:{free_port()}/metrics"
    reader = EngineMetricsReader(deadline_s=1.0, max_bytes=4 << 20)
    with caplog.at_level(logging.WARNING, logger="sampler.engine_metrics"):
        first = read_window(reader, urls)
        second = read_window(reader, urls)
    for got in (first, second):
        assert got == {"vllm": parse(VLLM.encode()), "sglang": parse(SGLANG.encode()), "tgi": parse(TGI.encode())}
    records = [r for r in caplog.records if r.name == "sampler.engine_metrics"]
    said = {r.getMessage().split(":", 1)[0]: r.getMessage() for r in records}
    assert set(said) == {f"engine {n}" for n in ("huge", "malformed", "error", "slow", "drip", "down")}
    assert "more than 4 MiB" in said["engine huge"] and "not Prometheus text" in said["engine malformed"]
    assert "HTTP 500" in said["engine error"] and "ConnectionRefusedError" in said["engine down"]
    assert "timed out" in said["engine slow"] or "no answer" in said["engine slow"]
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
    ws = WindowSampler(proc.root, BackendChoice("proc", None), ProcGroupSampler(proc.root, clock),
                       parse_config(config.encode()), hz=10, node="n1", clock=clock, wall_clock=clock,
                       sleep=clock.advance, gpu_grace=5.0)  # fmt: skip
    s0, s1 = ws.run_window(1.0)["shards"]
    assert {k: s0[k] for k in ("requests_waiting", "requests_running", "kv_cache_usage_ratio")} == \
        {"requests_waiting": 15.0, "requests_running": 12.0, "kv_cache_usage_ratio": 0.82}  # fmt: skip
    assert not {"requests_waiting", "requests_running", "kv_cache_usage_ratio"} & set(s1)
