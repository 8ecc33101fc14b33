"""The fleet's /metrics: a golden exposition, prometheus-client's parser,
promtool on live output, absent-is-not-zero, and a bad node left out."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import msgspec.structs
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane import pages_api
from controlplane.export.exposition import FleetExposition
from controlplane.export.series import FAMILIES, FAMILY_NAMES, label_pairs, series_of
from controlplane.history.backends import EmbeddedHistory
from controlplane.ingest import agent_api
from controlplane.keys import METRICS
from controlplane.state.registry import NodeRegistry
from tests.fakeclock_registry import fleet_registry
from tests.fakeproc import FakeClock
from tests.heartbeats import heartbeat, registration
from web import pages

GOLDEN = Path(__file__).parent / "golden" / "fleet_metrics.txt"

# DESIGN.md's contract: every family and the labels beyond `node`.
CONTRACT: dict[str, set[str]] = {
    "llmgw_node_up": set(), "llmgw_node_info": {"hostname", "kernel", "agent_version", "backend"},
    "llmgw_node_cpus": set(), "llmgw_node_shards_left_out": set(), "llmgw_node_cpu_utilization_percent": set(),
    "llmgw_node_cpu_utilization_p95_percent": set(), "llmgw_node_cpu_utilization_max_percent": set(),
    "llmgw_node_cpu_steal_percent": set(),
    "llmgw_node_load": {"window"}, "llmgw_node_memory_bytes": set(), "llmgw_node_memory_used_bytes": set(),
    "llmgw_node_memory_available_bytes": set(), "llmgw_node_disk_bytes": {"mount"},
    "llmgw_node_disk_used_bytes": {"mount"}, "llmgw_shard_cpu_cores": {"model", "replica", "shard"},
    "llmgw_shard_cpu_cores_max": {"model", "replica", "shard"},
    "llmgw_shard_memory_bytes": {"model", "replica", "shard"},
    "llmgw_shard_gpu_memory_bytes": {"model", "replica", "shard"},
    "llmgw_gpu_utilization_percent": {"gpu", "gpu_model"}, "llmgw_gpu_memory_used_bytes": {"gpu", "gpu_model"},
    "llmgw_gpu_memory_total_bytes": {"gpu", "gpu_model"},
    "llmgw_gpu_memory_bandwidth_utilization_percent": {"gpu", "gpu_model"},
    "llmgw_gpu_sm_clock_hertz": {"gpu", "gpu_model"}, "llmgw_gpu_ecc_uncorrected_errors": {"gpu", "gpu_model"},
    "llmgw_gpu_temperature_celsius": {"gpu", "gpu_model"}, "llmgw_gpu_power_watts": {"gpu", "gpu_model"},
    "llmgw_gpu_energy_joules_total": {"gpu", "gpu_model"},
    **dict.fromkeys(("llmgw_gpu_sm_active_ratio", "llmgw_gpu_sm_active_max_ratio", "llmgw_gpu_sm_occupancy_ratio",
                     "llmgw_gpu_pipe_tensor_active_ratio", "llmgw_gpu_pipe_tensor_active_max_ratio",
                     "llmgw_gpu_pipe_tensor_hmma_active_ratio", "llmgw_gpu_dram_active_ratio",
                     "llmgw_gpu_pcie_tx_bytes_per_second", "llmgw_gpu_pcie_rx_bytes_per_second",
                     "llmgw_gpu_nvlink_tx_bytes_per_second", "llmgw_gpu_nvlink_rx_bytes_per_second"),
                    {"gpu", "gpu_model"}),
    "llmgw_gpu_clock_event_ratio": {"gpu", "gpu_model", "reason"},
    **dict.fromkeys(("llmgw_gpu_instance_memory_used_bytes", "llmgw_gpu_instance_memory_total_bytes",
                     "llmgw_gpu_instance_sm_active_ratio", "llmgw_gpu_instance_sm_occupancy_ratio",
                     "llmgw_gpu_instance_pipe_tensor_active_ratio", "llmgw_gpu_instance_dram_active_ratio"),
                    {"gpu", "gpu_model", "gpu_instance"}),
    **dict.fromkeys(("llmgw_gpu_xid_errors_total", "llmgw_gpu_last_xid", "llmgw_gpu_pcie_replays_total",
                     "llmgw_gpu_remapped_rows_correctable", "llmgw_gpu_remapped_rows_uncorrectable",
                     "llmgw_gpu_row_remap_pending", "llmgw_gpu_row_remap_failed"), {"gpu", "gpu_model"}),
    "llmgw_node_sample_age_seconds": set(),
    "llmgw_node_pressure_ratio": {"resource", "kind"},
    "llmgw_shard_runqueue_wait_seconds": {"model", "replica", "shard", "quantile"},
    "llmgw_shard_runqueue_wait_seconds_total": {"model", "replica", "shard"},
    "llmgw_shard_runqueue_wait_per_slice_seconds": {"model", "replica", "shard"},
    "llmgw_shard_cpu_quota_cores": {"model", "replica", "shard"},
    "llmgw_shard_cpu_throttled_ratio": {"model", "replica", "shard"},
    "llmgw_shard_cpu_throttled_seconds_total": {"model", "replica", "shard"},
    "llmgw_shard_threads": {"model", "replica", "shard"},
    "llmgw_shard_gpu_utilization_ratio": {"model", "replica", "shard"},
    "llmgw_shard_gpu_utilization_max_ratio": {"model", "replica", "shard"},
    "llmgw_shard_starved": {"model", "replica", "shard", "kind"},
    "llmgw_shard_requests_waiting": {"model", "replica", "shard"},
    "llmgw_shard_requests_running": {"model", "replica", "shard"},
    "llmgw_shard_kv_cache_usage_ratio": {"model", "replica", "shard"},
}  # fmt: skip


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_golden_exposition() -> None:
    registry, _ = fleet_registry()
    text = FleetExposition(registry).render()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_families_and_labels_are_the_contract() -> None:
    assert set(CONTRACT) == FAMILY_NAMES
    registry, _ = fleet_registry()
    got = samples(FleetExposition(registry).render())
    assert set(got) == set(CONTRACT)  # the fleet has a sample of every family
    pods = 0
    for name, series in got.items():
        for labels, _ in series:
            # A pod's shard adds who it is to Kubernetes; no other series has those labels, not even empty.
            k8s = {"namespace", "pod", "container"} if name.startswith("llmgw_shard_") and "pod" in labels else set()
            pods += bool(k8s)
            assert set(labels) == {"node"} | CONTRACT[name] | k8s, name
            assert all(value != "" for key, value in labels.items() if key in ("namespace", "pod", "container"))
    assert pods >= 3  # cores, max, memory of the pod's shard


def test_absent_is_not_zero() -> None:
    registry, _ = fleet_registry()
    got = samples(FleetExposition(registry).render())

    def nodes(name: str) -> set[str]:
        return {labels["node"] for labels, _ in got.get(name, [])}

    # The stale node: up 0, its identity and age, no measurement at all.
    assert ("stale-3", 0.0) in [(ls["node"], v) for ls, v in got["llmgw_node_up"]]
    assert "stale-3" in nodes("llmgw_node_info") and "stale-3" in nodes("llmgw_node_sample_age_seconds")
    for name in CONTRACT.keys() - {"llmgw_node_up", "llmgw_node_info", "llmgw_node_sample_age_seconds"}:
        assert "stale-3" not in nodes(name), name
    # The CPU node has no GPU series, and its engine without a GPU memory figure has none either.
    assert "cpu-2" not in nodes("llmgw_gpu_utilization_percent")
    assert "cpu-2" not in nodes("llmgw_shard_gpu_memory_bytes")
    # The GPU whose driver lacks utilisation has no utilisation series, and the lost card has none.
    gpus = {ls["gpu"] for ls, _ in got["llmgw_gpu_utilization_percent"] if ls["node"] == "gpu-1"}
    assert gpus == {"0"}
    # A node registered but not yet heard from is down, not idle.
    assert ("new-4", 0.0) in [(ls["node"], v) for ls, v in got["llmgw_node_up"]]
    assert "new-4" not in nodes("llmgw_node_sample_age_seconds")


def test_hostile_labels_are_escaped() -> None:
    registry, _ = fleet_registry()
    got = samples(FleetExposition(registry).render())
    models = {ls["model"] for ls, _ in got["llmgw_shard_cpu_cores"]}
    assert 'llama "70b"\\ {x="y"}' in models


def test_a_gone_node_loses_everything() -> None:
    registry, clock = fleet_registry()
    clock.advance(registry.gone_after + 1)
    assert set(registry.forget_gone()) == {"gpu-1", "cpu-2", "stale-3", "new-4"}
    got = samples(FleetExposition(registry).render())
    assert got == {}


def test_one_bad_node_never_fails_the_scrape() -> None:
    registry, _ = fleet_registry()
    state = registry.get("cpu-2")
    assert state is not None and state.received is not None
    # Not what validation lets in: a shard that is no Shard.
    state.received = msgspec.structs.replace(state.received, shards=({"no id": True, "cpu_cores": {"mean": 1}},),
                                             verdicts=(None,))  # fmt: skip
    exposition = FleetExposition(registry)
    got = samples(exposition.render())
    assert exposition.errors > 0
    assert "gpu-1" in {ls["node"] for ls, _ in got["llmgw_shard_cpu_cores"]}


async def test_live_metrics_pass_promtool_and_count_the_control_plane_itself(aiohttp_client: Any) -> None:
    registry, _ = fleet_registry()
    pages = await aiohttp_client(pages_api.create_app(registry))
    r = await pages.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = await r.text()
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: make setup installs Debian's prometheus")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    got = samples(text)
    assert ({"state": "fresh"}, 2.0) in got["nodesampler_registered_nodes"]
    assert got["nodesampler_fleet_scrape_errors_total"] == [({}, 0.0)]


async def test_refused_requests_are_counted_by_reason(aiohttp_client: Any) -> None:
    registry = NodeRegistry(clock=FakeClock())
    pages_app = pages_api.create_app(registry)
    agents = await aiohttp_client(agent_api.create_app(registry, b"a cluster secret of some length",
                                                       pages_app[METRICS]))  # fmt: skip
    pages = await aiohttp_client(pages_app)
    await agents.post("/v1/heartbeat", data=b"{}")  # no token
    await agents.post("/v1/heartbeat", data=b"{}", headers={"Authorization": "Bearer x.y"})
    got = samples(await (await pages.get("/metrics")).text())
    rejected = {(ls["kind"], ls["reason"]): v for ls, v in got["nodesampler_requests_rejected_total"]}
    assert rejected[("heartbeat", "unauthorized")] == 2.0
    assert rejected[("heartbeat", "bad_request")] == 0.0


def test_the_metric_reference_names_every_family() -> None:
    reference = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    assert [f for f in sorted(FAMILY_NAMES) if f"`{f}`" not in reference] == []


def test_label_sets_of_engines_gone_for_an_hour_are_dropped() -> None:
    """Engines restarting under new names for a day leave the exposition's
    label cache the size of what the node has now, and every scrape is
    still exact."""
    clock = FakeClock(1000.0)
    registry = NodeRegistry(stale_after=600, clock=clock)
    registry.register(registration("n1"))
    exposition = FleetExposition(registry)
    for minute in range(24 * 60):
        shards = [{"id": f"pgid:{minute}-{i}", "cpu_cores": {"mean": 1.0, "p95": 1.0, "max": 1.0}} for i in range(3)]
        registry.heartbeat(heartbeat(seq=minute, shards=shards))
        text = exposition.render()
        assert sorted(line.split('shard="')[1].split('"')[0] for line in text.splitlines()
                      if line.startswith("llmgw_shard_cpu_cores{")) == [s["id"] for s in shards]  # fmt: skip
        clock.advance(60)
    # At most two hours of names: each minute's three.
    assert len(exposition._labels["n1"].shards) <= 3 * 2 * 60 + 3


def test_the_history_keeps_exactly_what_the_exposition_exports_of_its_families() -> None:
    """One map (controlplane/export/series.py): for every node of the golden fleet, the
    series the embedded history records are the exposition's samples of the
    charted families, label for label and value for value."""
    registry, _ = fleet_registry()
    exported = samples(FleetExposition(registry).render())
    history = EmbeddedHistory(interval=5)
    for state in registry.nodes():
        if state.received is None or not state.fresh(registry.clock(), registry.stale_after):
            continue
        history.record(state.node, state.received, at=1000.0)
        keys, values = series_of(state.received)
        kept = {(family, tuple(sorted(label_pairs(labels).items())), float(value))
                for (family, labels), value in zip(keys, values, strict=True)}  # fmt: skip
        want = {(name, tuple(sorted((k, v) for k, v in labels.items() if k != "node")), value)
                for family in FAMILIES if family.charted
                for name, rows in exported.items() if name == family.name
                for labels, value in rows if labels["node"] == state.node}  # fmt: skip
        assert kept == want, state.node
        assert kept, state.node
    assert {f.name for f in FAMILIES if f.charted} <= FAMILY_NAMES


def test_every_chart_of_the_pages_reads_a_family_the_history_keeps() -> None:
    """The pages' chart specs name families of the table that the embedded
    history keeps (the router's queue is Prometheus' alone: not ours)."""
    registry, _ = fleet_registry()
    state = registry.get("gpu-1")
    assert state is not None
    view = pages._node_view(state, registry.clock(), registry.stale_after)
    view["engines"] = [dict(view["engines"][0], replica="r1", waiting=3)]  # every chart: a queue, a router
    specs = pages.FLEET_SPECS + pages._node_specs("gpu-1", view)[0] + pages._shard_specs("gpu-1", "s0", view)[0]
    metrics = {spec.metric for _, parts, _, _ in specs for spec, _ in parts}
    assert "llmgw_gpu_utilization_percent" in metrics and "llmgw_shard_cpu_cores" in metrics
    assert metrics - {f.name for f in FAMILIES if f.charted} == {"llmgw_endpoint_waiting"}
