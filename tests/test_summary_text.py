"""`sample`'s text: what holds each engine back, beside its cores."""

from __future__ import annotations

from typing import Any

from sampler.window.summary_text import render
from tests.heartbeats import window_summary
from wire.schema import WindowSummary


def summary(*shards: dict[str, Any]) -> WindowSummary:
    return window_summary(backend="bpf", shards=[{"pgids": [100 + i], "cpu_cores": {"mean": 1.0}, "memory_bytes": 1,
                                                  **s} for i, s in enumerate(shards)])  # fmt: skip


def test_the_host_side_of_each_engine_where_any_is_known() -> None:
    text = render(summary({"id": "vllm", "cpu_quota_cores": 0.5, "cpu_throttled_ratio": 0.93, "threads": 172,
                           "gpu_utilization_percent": 8.0, "requests_waiting": 12.0, "kv_cache_usage_ratio": 0.8},
                          {"id": "sidecar"}))  # fmt: skip
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("ENGINE") and "QUOTA" in line)
    # Only the columns some engine has a figure for: nobody reported requests running.
    assert lines[header].split() == ["ENGINE", "QUOTA", "THROTTLED", "THREADS", "GPU", "BUSY", "WAITING", "KV",
                                     "CACHE"]  # fmt: skip
    assert lines[header + 1].split() == ["vllm", "0.50", "93%", "172", "8%", "12", "80%"]
    assert lines[header + 2].split() == ["sidecar"] + ["—"] * 6  # not measured: a dash, never 0


def test_no_such_table_when_nothing_is_known() -> None:
    assert "QUOTA" not in render(summary({"id": "s0"}))
