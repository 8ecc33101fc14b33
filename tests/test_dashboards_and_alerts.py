"""The Grafana dashboard and the alert rules name only what the control plane exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.export.series import FAMILY_NAMES

ROOT = Path(__file__).resolve().parent.parent
METRIC = re.compile(r"\bllmgw_[a-z0-9_]+")


def queries(dashboard: dict[str, Any]) -> list[str]:
    out = []
    for panel in dashboard["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["query"]["query"])
    return out


def test_dashboard_queries_name_only_exported_families() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "Node $node", "Engines on $node", "Is the host holding the GPUs back on $node",
                    "GPUs on $node"]  # fmt: skip
    exprs = queries(dashboard)
    named = {m for e in exprs for m in METRIC.findall(e)}
    assert named and named <= FAMILY_NAMES, named - FAMILY_NAMES
    assert any("$node" in e for e in exprs)


def test_alert_rules_name_only_exported_families() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert set(alerts) == {"NodeDown", "NodeCPUSaturated", "GPUUncorrectedECCErrors", "GPUTemperatureHigh",
                           "GPUMemoryHeldButIdle", "EngineHostBound", "NodesamplerControlPlaneAbsent",
                           "GPUClocksHeldBackWhileQueued",
                           "NodesamplerReplicaDown", "KubernetesNodeWithoutSampler"}  # fmt: skip
    assert {m for e in alerts.values() for m in METRIC.findall(e)} <= FAMILY_NAMES
    # Beyond the fleet's families: the control plane's own, and kube-state-metrics' node list.
    assert "absent(nodesampler_registered_nodes)" in alerts["NodesamplerControlPlaneAbsent"]
    assert "nodesampler_peer_up" in alerts["NodesamplerReplicaDown"]
    # A node is one alert whichever replicas export it (docs/deployment.md, "Replicas").
    assert all("max by (node)" in e or "max without (instance, job)" in e for name, e in alerts.items()
               if "llmgw_" in e and name != "KubernetesNodeWithoutSampler")  # fmt: skip
    assert alerts["KubernetesNodeWithoutSampler"].startswith("kube_node_info unless on (node)")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool missing: make setup installs Debian's prometheus")
    return path


def test_promtool_checks_the_rules() -> None:
    r = subprocess.run([promtool(), "check", "rules", str(ROOT / "deploy" / "alerts.yml")], capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_each_alert_fires_and_clears() -> None:
    r = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], cwd=ROOT / "tests", capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_every_alert_has_a_runbook_section() -> None:
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    sections = {h.lower() for h in re.findall(r"^## (\w+)$", runbooks, re.M)}
    for rule in _rules():
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/runbooks.md#{rule['alert'].lower()}" and rule["alert"].lower() in sections, rule["alert"]
    assert sections == {rule["alert"].lower() for rule in _rules()}  # no runbook of an alert that is gone


def test_every_summary_states_the_time_its_rule_waits() -> None:
    """NodeDown's said "over a minute" and fired after three: a node turns
    stale after --stale-after (60 s by default), then the rule waits."""
    stale_after_minutes = 1
    for rule in _rules():
        if "for" not in rule:
            continue
        waits = int(rule["for"].removesuffix("m"))
        if "llmgw_node_up" in rule["expr"]:  # up is 0 once the node is stale
            waits += stale_after_minutes if rule["alert"] == "NodeDown" else 0
        said = re.findall(r"(\d+) minutes", rule["annotations"]["summary"])
        assert said and int(said[0]) == waits, (rule["alert"], rule["annotations"]["summary"], waits)


def test_the_dashboard_charts_the_verdict_s_inputs_one_unit_a_panel() -> None:
    """What the starvation verdict reads (requests waiting and running, KV
    cache, run-queue wait, pressure, steal) beside the engine's cores and
    its GPUs' share; every panel with a unit and one unit per axis (watts
    and error counts once shared one)."""
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    for panel in panels:
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit and unit not in ("short", "none"), (panel["title"], unit)
        overridden = [prop["value"] for o in panel["fieldConfig"]["overrides"] for prop in o.get("properties", [])
                      if prop["id"] == "unit"]  # fmt: skip
        assert overridden in ([], [unit]), panel["title"]
    charted = {m for p in panels for t in p["targets"] for m in METRIC.findall(t["expr"])}
    assert {"llmgw_shard_requests_waiting", "llmgw_shard_requests_running", "llmgw_shard_kv_cache_usage_ratio",
            "llmgw_shard_runqueue_wait_seconds_total", "llmgw_shard_runqueue_wait_seconds", "llmgw_node_pressure_ratio",
            "llmgw_node_cpu_steal_percent", "llmgw_shard_cpu_cores", "llmgw_shard_gpu_utilization_ratio"} <= charted
    engines = next(i for i, p in enumerate(dashboard["panels"]) if p["title"] == "Engines on $node")
    host = next(i for i, p in enumerate(dashboard["panels"]) if p["title"].startswith("Is the host"))
    beside = {m for p in dashboard["panels"][engines:host] for t in p.get("targets", [])
              for m in METRIC.findall(t["expr"])}  # fmt: skip
    assert {"llmgw_shard_requests_waiting", "llmgw_shard_cpu_cores", "llmgw_shard_gpu_utilization_ratio"} <= beside
    assert dashboard["graphTooltip"] == 1  # one crosshair across the panels
