"""The engines' own queues, read from their metrics endpoints on the node.

A shard may name its engine's Prometheus endpoint (`metrics_url` in the
config). Once a window the agent reads it, under one deadline for the whole
exchange and a size cap (sampler/shards/http_fetch.py), and takes the families it
knows: requests waiting, requests running and KV-cache use, whichever
engine published them (vLLM, SGLang, TGI: `FAMILIES`, one line each to add
another).

Whoever runs the engine's pod writes that text, so the work it can cause is
bounded by what the agent wants, not by what it is sent. prometheus-client's
parser builds every family of a text: 1 MiB of `a 1\n` became 262k samples,
about 100 MiB and 2.3 s of CPU, and the 8 MiB the download allowed would be
twice the DaemonSet's memory limit, every window. So the text is scanned as
it arrives, in C-speed searches for the wanted families' names at the start
of a line (`_WantedLines`), and only those lines go to the library's parser.
Caps on lines, a line's length and wanted samples end the read at the first
one reached; that shard then has no queue figures this window, and its
`metrics_error` says which cap.

Each read runs on a daemon thread of its own: an engine that is slow, huge,
malformed or down costs that window its queue figures, never the sampling
loop's cadence, and says so in one log line (again only when it recovers
and fails anew). A read still running when the next window asks is not
started twice.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sampler.off_thread import InFlight, Said, on_own_thread
from sampler.shards.http_fetch import FetchError, fetch_chunks

log = logging.getLogger(__name__)

DEADLINE_S = 2.0
ACCEPT = {"Accept": "text/plain;version=0.0.4"}
MAX_BYTES = 8 << 20  # a vLLM's /metrics is ~100 KiB; histograms per model and LoRA adapter grow it
# A vLLM's /metrics is about 1,500 lines; per model and adapter, a few thousand.
MAX_LINES = 100_000
MAX_LINE_BYTES = 64 << 10  # a line is a name, labels and a value: a label value of 64 KiB is no engine's
# The wanted families' series: one per engine of a data-parallel server.
MAX_SAMPLES = 1024

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


class _WantedLines:
    """The lines of a metrics text whose metric is a wanted family, picked
    out chunk by chunk as the text arrives; every line counted, none kept
    but the wanted."""

    # A line of a wanted sample starts with its family's name and a `{` or a blank.
    _NAMES = tuple(sorted(_WANTED, key=len, reverse=True))
    _NEEDLES = tuple(b"\n" + n.encode() for n in _NAMES)

    def __init__(self, max_lines: int, max_samples: int) -> None:
        self.max_lines, self.max_samples = max_lines, max_samples
        self.lines = 0
        self.wanted: list[bytes] = []
        self._pending = b"\n"  # a line starts after each newline: the text's first after this one

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        cut = data.rfind(b"\n")
        if cut > 0:
            self._take(data[:cut])
        self._pending = data[cut:]
        if len(self._pending) > MAX_LINE_BYTES:
            raise EngineMetricsError(f"a line longer than {MAX_LINE_BYTES >> 10} KiB")

    def end(self) -> None:
        if len(self._pending) > 1:
            self._take(self._pending)
        self._pending = b""

    def _take(self, text: bytes) -> None:
        """`text`: complete lines, each after a newline (the first at 0)."""
        self.lines += text.count(b"\n")
        if self.lines > self.max_lines:
            raise EngineMetricsError(f"more than {self.max_lines} lines")
        for needle in self._NEEDLES:
            at = text.find(needle)
            while at >= 0:
                start = at + 1
                stop = text.find(b"\n", start)
                line = text[start:] if stop < 0 else text[start:stop]
                # A longer name with this one as its prefix (`tgi_queue_size_x`) is another family.
                if line[len(needle) - 1 : len(needle)] in (b"{", b" ", b"\t"):
                    self.wanted.append(line)
                    if len(self.wanted) > self.max_samples:
                        raise EngineMetricsError(f"more than {self.max_samples} samples of the queue's families")
                at = text.find(needle, start) if stop >= 0 else -1


def read_text(chunks: Iterable[bytes], max_lines: int = MAX_LINES, max_samples: int = MAX_SAMPLES) -> dict[str, float]:
    """The queue figures in a metrics text that arrives in chunks; the first
    cap reached ends the read (closing the chunks' source) with its reason."""
    lines = _WantedLines(max_lines, max_samples)
    try:
        for chunk in chunks:
            lines.feed(chunk)
        lines.end()
    finally:
        if isinstance(chunks, Iterator) and hasattr(chunks, "close"):
            chunks.close()  # a fetch stops reading, and its connection closes
    return _figures(lines.wanted)


def parse(body: bytes) -> dict[str, float]:
    """The queue figures in a whole metrics text; a figure no known family gave is absent."""
    return read_text([body])


def _figures(wanted: list[bytes]) -> dict[str, float]:
    """The figures of the wanted families' lines, parsed by prometheus-client."""
    try:
        families = list(text_string_to_metric_families(b"\n".join(wanted).decode("utf-8") + "\n"))
    except (UnicodeDecodeError, ValueError) as e:
        raise EngineMetricsError(f"not Prometheus text: {str(e)[:120]}") from None
    # Without their TYPE lines, each sample is a family of its own: gathered by name.
    by_name: dict[str, list[float]] = {}
    for family in families:
        if family.name in _WANTED:
            by_name.setdefault(family.name, []).extend(
                float(s.value) for s in family.samples if s.name == family.name)  # fmt: skip
    found: dict[str, tuple[int, list[float]]] = {}  # field -> (rank of the family that gave it, values)
    for family_name, values in by_name.items():
        field = _WANTED[family_name]
        rank = FAMILIES[field].index(family_name)
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


class EngineMetricsReader:
    """Reads each shard's endpoint once a window, off the sampling loop."""

    def __init__(self, deadline_s: float = DEADLINE_S, max_bytes: int = MAX_BYTES) -> None:
        self.deadline_s, self.max_bytes = deadline_s, max_bytes
        self._reads: dict[str, tuple[str, InFlight[dict[str, float]]]] = {}  # shard -> its url, its read
        self._said = Said()  # shard -> the problem last said

    def request(self, urls: Iterable[tuple[str, str]]) -> None:
        """Start reading (shard id, url) pairs, but not a shard whose read still runs."""
        for sid, url in urls:
            if (last := self._reads.get(sid)) is not None and last[1].running():
                continue
            read = InFlight[dict[str, float]]()
            read.start(on_own_thread(functools.partial(self._read, url), f"metrics {sid}"), time.monotonic())
            self._reads[sid] = (url, read)

    def _read(self, url: str) -> dict[str, float]:
        return read_text(fetch_chunks(url, self.deadline_s, self.max_bytes, ACCEPT))

    def take(self) -> dict[str, dict[str, Any]]:
        """Per shard, the figures of a read that has finished (never waits).
        A read not finished, or failed, gives that shard no figures and its
        reason, as `metrics_error`."""
        out: dict[str, dict[str, Any]] = {}
        for sid, (url, read) in list(self._reads.items()):
            done = read.take()
            if done is None:
                out[sid] = {"metrics_error": self._say(sid, url, "no answer within the window")}
                continue
            del self._reads[sid]
            try:
                figures = done.result()
            except FetchError as e:
                out[sid] = {"metrics_error": self._say(sid, url, str(e))}
                continue
            except Exception as e:  # a bug in the parser: this window only
                out[sid] = {"metrics_error": self._say(sid, url, f"{type(e).__name__}: {e}")}
                continue
            if self._said.changed(sid, None):
                log.info("engine %s: metrics read again from %s", sid, url)
            out[sid] = figures
        return out

    def _say(self, sid: str, url: str, problem: str) -> str:
        """Log a shard's problem when it is new; the problem, for its heartbeat."""
        if self._said.changed(sid, problem):
            log.warning("engine %s: no queue figures this window: %s: %s", sid, url, problem)
        return problem

    def wait(self, timeout: float) -> None:
        """For a one-shot `sample`: let running reads finish, up to `timeout`."""
        end = time.monotonic() + timeout
        for _, read in list(self._reads.values()):
            read.wait(max(0.0, end - time.monotonic()))
