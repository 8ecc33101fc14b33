"""A small fleet in a registry with a fake clock: a GPU node, a CPU node, a
stale node and a node that registered but never sent a heartbeat. Bodies go
through the wire format's validation, as they would over HTTP."""

from __future__ import annotations

import json
from typing import Any

import wire
from controlplane.state.registry import NodeRegistry
from tests.fakeproc import FakeClock

GiB = 1024**3


def _heartbeat(node: str, gpus: list[dict[str, Any]] | None, shards: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "node": node, "seq": 7, "backend": "bpf",
        "window": {"start": 1764445200.0, "end": 1764445205.0, "samples": 50},
        "machine": {"cpus": 64, "cpu_percent": {"mean": 37.5, "p95": 80.125, "max": 100.0},
                    "cpu_steal_percent": {"mean": 1.5, "p95": 4.0, "max": 6.25},
                    "load": {"1m": 0.5, "5m": 0.4, "15m": 0.3}, "memory_bytes": 512 * GiB,
                    "memory_used_bytes": 100 * GiB, "memory_available_bytes": 412 * GiB,
                    "disks": [{"mount": "/", "bytes": 1000 * GiB, "used_bytes": 250 * GiB},
                              {"mount": "/mnt/models", "bytes": 4000 * GiB, "used_bytes": 3000 * GiB}],
                    "pressure": {"cpu": {"some": 0.25, "full": 0.0}, "io": {"some": 0.5, "full": 0.125}}},
        "shards": shards,
    }  # fmt: skip
    if gpus is not None:
        body["gpus"] = gpus
    return body


def _gpu(index: int, **fields: Any) -> dict[str, Any]:
    return {"index": index, "uuid": f"GPU-{index}", "name": "NVIDIA H200", "memory_used_bytes": 80 * GiB,
            "memory_total_bytes": 141 * GiB, "memory_bandwidth_percent": 41.0, "sm_clock_hz": 1980000000,
            "ecc_uncorrected": 0, "temperature_celsius": 61, "power_watts": 512.3, "energy_joules": 123456.7,
            **fields}  # fmt: skip


def fleet_registry() -> tuple[NodeRegistry, FakeClock]:
    clock = FakeClock(1000.0)
    registry = NodeRegistry(stale_after=60, clock=clock)

    def register(node: str, backend: str = "bpf") -> None:
        body = {"node": node, "hostname": f"{node}.example", "kernel": "6.1.0-28-amd64", "agent_version": "0.1.0",
                "backend": backend, "cpus": 64, "memory_bytes": 512 * GiB}  # fmt: skip
        registry.register(wire.decode_registration(json.dumps(body).encode()))

    def beat(body: dict[str, Any]) -> None:
        registry.heartbeat(wire.decode_heartbeat(json.dumps(body).encode()).heartbeat)

    register("stale-3")
    beat(_heartbeat("stale-3", None, [{"id": "s0", "cpu_cores": {"mean": 1.0, "p95": 1.0, "max": 1.0}}]))
    clock.advance(100)  # stale-3 has been silent for 100 s from here on
    register("gpu-1")
    # Card 0 with GPM and its clocks capped a fifth of the window; card 1 says neither: absent, not 0.
    gpm = {"gpm_interval_seconds": 0.1, "sm_activity_percent": 38.5, "sm_activity_max_percent": 72.0,
           "sm_occupancy_percent": 21.0, "tensor_activity_percent": 27.5, "tensor_activity_max_percent": 55.0,
           "tensor_hmma_activity_percent": 25.0, "dram_bandwidth_percent": 41.0,
           "pcie_tx_bytes_per_second": 1.5e9, "pcie_rx_bytes_per_second": 2.5e8,
           "nvlink_tx_bytes_per_second": 1.2e11, "nvlink_rx_bytes_per_second": 1.1e11,
           **{f"clock_event_{r}_ratio": 0.0 for r in ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                                     "power_brake", "sync_boost")},
           "clock_event_sw_power_cap_ratio": 0.2,
           # And what breaks it: two XIDs (the last a 79, fallen off the bus) and a row remapping pending.
           "xid_errors": 1, "xid_errors_total": 2, "xid_last": 79, "pcie_replays": 0, "pcie_replays_total": 12,
           "remapped_rows_correctable": 3, "remapped_rows_uncorrectable": 0, "row_remap_pending": True,
           "row_remap_failed": False}  # fmt: skip
    # Card 1 is cut in two MIG instances: one with GPM figures, one idle without them.
    instances = [{"gpu_instance_id": 1, "memory_used_bytes": 6 * GiB, "memory_total_bytes": 20 * GiB,
                  "gpm_interval_seconds": 0.1, "sm_activity_percent": 62.5, "sm_occupancy_percent": 30.0,
                  "tensor_activity_percent": 12.5, "dram_bandwidth_percent": 20.0},
                 {"gpu_instance_id": 5, "memory_used_bytes": 0, "memory_total_bytes": 10 * GiB}]  # fmt: skip
    cards = [_gpu(0, utilization_percent=97.0, **gpm), _gpu(1, mig_instances=instances),
             {"index": 2, "uuid": "GPU-2", "lost": True}]  # fmt: skip
    beat(_heartbeat("gpu-1", cards, [
        {"id": "s0", "model": 'llama "70b"\\ {x="y"}', "replica": "r1", "pgid": 1234,
         "cpu_cores": {"mean": 7.5, "p95": 8.0, "max": 8.25}, "memory_bytes": 12 * GiB, "gpu_memory_bytes": 70 * GiB,
         "runqueue_wait_seconds": {"p50": 0.0001, "p99": 0.004, "total": 0.02, "mean": 0.0005, "cumulative": 12.5},
         "gpu_utilization_percent": 92.5, "gpu_utilization_max_percent": 100.0},
        {"id": "s1", "model": "mistral-7b", "replica": "r2", "pgid": 2000,
         "cpu_cores": {"mean": 0.5, "p95": 0.75, "max": 1.0}, "memory_bytes": 4 * GiB, "gpu_memory_bytes": 10 * GiB,
         "cpu_quota_cores": 6.0, "cpu_throttled_ratio": 0.875, "cpu_throttled_seconds": 2.5,
         "cpu_throttled_seconds_total": 4242.5, "threads": 172, "cpu_affinity_cores": 64,
         "threads_per_quota_core": 28.67, "gpu_utilization_percent": 9.5, "gpu_utilization_max_percent": 31.0,
         "requests_waiting": 12.0, "requests_running": 4.0, "kv_cache_usage_ratio": 0.25,
         # On card 0, whose power cap held it a fifth of the window: not held back (card_held_back 0).
         "gpu_indices": [0], "gpu_sm_activity_percent": 38.5, "gpu_tensor_activity_percent": 27.5},
    ]))  # fmt: skip
    register("cpu-2", backend="proc")
    beat(_heartbeat("cpu-2", [], [
        {"id": "pgid:77", "pgid": 77, "cpu_cores": {"mean": 2.0, "p95": 3.0, "max": 4.0}, "memory_bytes": GiB},
        {"id": "llm/engine-0/vllm", "namespace": "llm", "pod": "engine-0", "container": "vllm",
         "model": "qwen-0.5b", "pgids": [90, 91], "cpu_cores": {"mean": 1.5, "p95": 1.75, "max": 2.0},
         "memory_bytes": 2 * GiB},
    ]))  # fmt: skip
    register("new-4")
    clock.advance(2.5)
    return registry, clock
