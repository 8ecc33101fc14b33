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


def test_a_card_s_sms_clocks_and_faults_where_it_says_them() -> None:
    """A Hopper card's SMs and what held its clocks back; faults only when
    something broke; an older card beside it has neither line (not 0)."""
    hopper = {"index": 0, "name": "NVIDIA H200", "gpm_interval_seconds": 0.1, "sm_activity_percent": 38.4,
              "sm_activity_p95_percent": 61.0, "sm_activity_max_percent": 72.0, "sm_occupancy_percent": 21.0,
              "tensor_activity_percent": 27.0, "dram_bandwidth_percent": 41.0,
              "clock_event_sw_power_cap_ratio": 0.12, "clock_event_hw_thermal_slowdown_ratio": 0.0,
              "xid_errors": 2, "xid_errors_total": 2, "xid_last": 79, "pcie_replays": 1, "row_remap_pending": True}
    older = {"index": 1, "name": "NVIDIA A10", "utilization_percent": 50.0, "xid_errors": 0, "pcie_replays": 0}
    text = render(window_summary(backend="bpf", gpus=[hopper, older]))
    lines = text.splitlines()
    card0 = next(i for i, line in enumerate(lines) if line.startswith("GPU 0"))
    assert lines[card0 + 1].split() == ["SMs", "active", "38%", "(p95", "61,", "max", "72)", "occupancy", "21%",
                                        "tensor", "27%", "dram", "41%", "(GPM", "every", "0.1", "s)"]  # fmt: skip
    assert lines[card0 + 2].strip() == "clocks held back by power cap 12%"
    assert lines[card0 + 3].strip() == ("faults 2 XID errors (the last 79), 1 PCIe replay, "
                                        "a row remapping waits for a reset")  # fmt: skip
    assert lines[card0 + 4].startswith("GPU 1") and (len(lines) == card0 + 5 or not lines[card0 + 5].startswith("  "))


def test_a_mig_card_s_instances_are_lines_under_it() -> None:
    """Each MIG instance under its card: its memory and, where GPM says, its
    SMs; an instance without GPM figures has none (not 0)."""
    card = {"index": 0, "name": "NVIDIA H100 80GB HBM3",
            "mig_instances": [{"gpu_instance_id": 1, "memory_used_bytes": 6 << 30, "memory_total_bytes": 20 << 30,
                               "gpm_interval_seconds": 0.1, "sm_activity_percent": 90.0,
                               "sm_activity_p95_percent": 95.0, "sm_activity_max_percent": 99.0,
                               "tensor_activity_percent": 40.0},
                              {"gpu_instance_id": 5, "memory_total_bytes": 10 << 30}]}  # fmt: skip
    lines = render(window_summary(backend="bpf", gpus=[card])).splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith("MIG instance 1"))
    assert lines[first].split() == ["MIG", "instance", "1", "mem", "6.0", "GiB", "/", "20.0", "GiB", "SMs", "active",
                                    "90%", "(p95", "95,", "max", "99)", "tensor", "40%"]  # fmt: skip
    assert lines[first + 1].split() == ["MIG", "instance", "5", "mem", "—", "/", "10.0", "GiB"]
