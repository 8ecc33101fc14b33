"""The engines' own queues, read from their metrics endpoints on the node.

A shard may name its engine's Prometheus endpoint (`metrics_url` in the
config). Once a window the agent reads it, with a deadline and a size cap,
parses it with prometheus-client's own text parser and takes the families
it knows: requests waiting, requests running and KV-cache use, whichever
engine published them (vLLM, SGLang, TGI: `FAMILIES`, one line each to add
another).

Each read runs on a daemon thread of its own: an engine that is slow, huge,
malformed or down costs that window its queue figures, never the sampling
loop's cadence, and says so in one log line (again only when it recovers
and fails anew). A read still running when the next window asks is not
started twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sampler.http_fetch import FetchError, fetch

log = logging.getLogger(__name__)

DEADLINE_S = 2.0
ACCEPT = {"Accept": "text/plain;version=0.0.4"}
MAX_BYTES = 8 << 20  # a vLLM's /metrics is ~100 KiB; histograms per model and LoRA adapter grow it

# Our field -> the families engines publish it as, first found wins. Requests
# are summed over a family's series (one per engine of a data-parallel
# server); KV-cache use is its highest series (the fullest cache is the one
# that refuses requests). vLLM's and SGLang's are already ratios (0..1).
FAMILIES: dict[str, tuple[str, ...]] = {
    "requests_waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size"),
    "requests_running": ("vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size"),
    "kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
}
_SUMMED = {"requests_waiting", "requests_running"}
_WANTED = {name: field for field, names in FAMILIES.items() for name in names}


class EngineMetricsError(FetchError):
    """Why an engine's metrics gave no figures this window."""


def parse(body: bytes) -> dict[str, float]:
    """The queue figures in a metrics text; a figure no known family gave is absent."""
    try:
        families = list(text_string_to_metric_families(body.decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as e:
        raise EngineMetricsError(f"not Prometheus text: {str(e)[:120]}") from None
    found: dict[str, tuple[int, list[float]]] = {}  # field -> (rank of the family that gave it, values)
    for family in families:
        field = _WANTED.get(family.name)
        if field is None:
            continue
        rank = FAMILIES[field].index(family.name)
        values = [float(s.value) for s in family.samples if s.name == family.name]
        values = [v for v in values if v == v and v not in (float("inf"), float("-inf"))]  # NaN, ±Inf: no figure
        if values and (field not in found or rank < found[field][0]):
            found[field] = (rank, values)
    out = {}
    for field, (_, values) in found.items():
        value = sum(values) if field in _SUMMED else max(values)
        if value < 0 or (field == "kv_cache_usage_ratio" and value > 1):
            continue  # not a count, not a ratio: left out rather than shown wrong
        out[field] = value
    return out


@dataclass
class _Read:
    url: str
    result: dict[str, float] | None = None
    error: str | None = None
    thread: threading.Thread | None = None

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class EngineMetricsReader:
    """Reads each shard's endpoint once a window, off the sampling loop."""

    def __init__(self, deadline_s: float = DEADLINE_S, max_bytes: int = MAX_BYTES) -> None:
        self.deadline_s, self.max_bytes = deadline_s, max_bytes
        self._reads: dict[str, _Read] = {}
        self._failing: dict[str, str] = {}  # shard -> the problem last said

    def request(self, urls: Iterable[tuple[str, str]]) -> None:
        """Start reading (shard id, url) pairs, but not a shard whose read still runs."""
        for sid, url in urls:
            if (running := self._reads.get(sid)) is not None and running.running():
                continue
            read = self._reads[sid] = _Read(url)
            read.thread = threading.Thread(target=self._run, args=(read,), name=f"metrics {sid}", daemon=True)
            read.thread.start()

    def _run(self, read: _Read) -> None:
        try:
            read.result = parse(fetch(read.url, self.deadline_s, self.max_bytes, ACCEPT))
        except FetchError as e:
            read.error = str(e)
        except Exception as e:  # a bug in the parser: this window only
            read.error = f"{type(e).__name__}: {e}"

    def take(self) -> dict[str, dict[str, Any]]:
        """Per shard, the figures of a read that has finished (never waits).
        A read not finished, or failed, gives that shard no figures."""
        out: dict[str, dict[str, Any]] = {}
        for sid, read in list(self._reads.items()):
            if read.running():
                self._say(sid, f"{read.url}: no answer within the window")
                continue
            del self._reads[sid]
            if read.error is not None:
                self._say(sid, f"{read.url}: {read.error}")
                continue
            assert read.result is not None
            if sid in self._failing:
                log.info("engine %s: metrics read again from %s", sid, read.url)
                del self._failing[sid]
            out[sid] = read.result
        return out

    def _say(self, sid: str, problem: str) -> None:
        if self._failing.get(sid) != problem:
            log.warning("engine %s: no queue figures this window: %s", sid, problem)
            self._failing[sid] = problem

    def wait(self, timeout: float) -> None:
        """For a one-shot `sample`: let running reads finish, up to `timeout`."""
        end = time.monotonic() + timeout
        for read in list(self._reads.values()):
            if read.thread is not None:
                read.thread.join(max(0.0, end - time.monotonic()))
