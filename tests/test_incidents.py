"""Incidents (controlplane/samples/incidents.py): started by Alertmanager's webhook,
a starvation verdict turning on, or an operator; every sample of the nodes
named fetched from their rings and written whole beside the state file,
within budgets, oldest dropped first; listed, read back as JSON and CSV,
and kept across a restart. The last test runs a real Prometheus evaluating
the shipped rules and a real Alertmanager posting to the receiver."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

import wire
from controlplane import pages_api
from controlplane.listen.page_access import PageAccess
from controlplane.listen.web_config import ReloadingWebConfig
from controlplane.samples.hindsight import HindsightFetches, Refused
from controlplane.samples.incidents import EMPTY_KEPT_S, MAX_EXPORTS, START_BUDGETS, STARVED_AGAIN_S, Incidents, to_csv
from controlplane.state.registry import NodeRegistry
from sampler.window.span_sender import SpanSender
from tests.agent_fleet import PASSWORD, Fleet, basic, fresh_with_seq, web_config_file
from tests.conftest import free_port
from tests.test_controlplane_api import heartbeat, registration
from tests.test_hindsight_fetch import T0, filled_ring
from tests.workloads import busy_threads, start_group
from wire.hindsight import parse_piece
from wire.schema import Heartbeat, Registration

ROOT = Path(__file__).resolve().parent.parent


def known(registry: NodeRegistry, node: str, held: float | None = 900.0) -> None:
    """A node registered, its last heartbeat saying its ring holds `held` seconds."""
    registry.register(msgspec.convert(registration(node), Registration))
    hb = heartbeat(node) | {"hindsight_held_seconds": held}
    registry.heartbeat(msgspec.convert(hb, Heartbeat))


class Node:
    """An agent's side of the fetch for one node: its ring, and the pieces it sends."""

    def __init__(self, fetches: HindsightFetches, node: str, seconds: float = 60.0) -> None:
        self.fetches, self.node = fetches, node
        self.ring = filled_ring(seconds=seconds)
        self.sender = SpanSender()

    def heartbeat(self, room: int = 200_000) -> None:
        self.sender.asked = self.fetches.asked(self.node)
        if self.sender.asked is None:
            return
        body = self.sender.next_piece(self.ring, room)
        if body is not None:
            dropped: wire.Dropped = []
            piece = parse_piece(json.loads(body), self.sender.asked, dropped)
            assert piece is not None and dropped == []
            self.fetches.received(self.node, piece)


@pytest.fixture
def registry() -> NodeRegistry:
    r = NodeRegistry(stale_after=60)
    for node in ("n1", "n2", "n3"):
        known(r, node)
    return r


def incidents_at(tmp_path: Path, registry: NodeRegistry, **kw: Any) -> tuple[Incidents, HindsightFetches]:
    fetches = HindsightFetches(wall=lambda: T0 + 60)
    incidents = Incidents(tmp_path / "incidents", fetches, registry, before_s=50, after_s=0,
                          wall=lambda: T0 + 60, **kw)  # fmt: skip
    incidents.load()
    return incidents, fetches


async def captured(incidents: Incidents, nodes: list[Node], incident_id: str) -> None:
    """The nodes' heartbeats go on until the incident is written."""
    for _ in range(200):
        for n in nodes:
            n.heartbeat()
        incident = incidents.get(incident_id)
        if incident is None or incident.state != "capturing":
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the incident was not written")


async def test_an_incident_holds_every_sample_of_its_nodes_written_whole(tmp_path: Path,
                                                                          registry: NodeRegistry) -> None:  # fmt: skip
    incidents, fetches = incidents_at(tmp_path, registry)
    nodes = [Node(fetches, "n1"), Node(fetches, "n2")]
    incident = incidents.start("a test", "operator", ["n1", "n2", "n1"], at=T0 + 60)
    assert incident.nodes == ["n1", "n2"] and incident.state == "capturing"
    assert json.loads((tmp_path / "incidents" / f"{incident.id}.json").read_text())["state"] == "capturing"
    await captured(incidents, nodes, incident.id)
    assert incident.state == "done" and incident.missing == {}
    files = sorted(p.name for p in (tmp_path / "incidents").iterdir())
    assert files == [f"{incident.id}.0.json", f"{incident.id}.1.json", f"{incident.id}.json"]  # no temporaries
    assert {(tmp_path / "incidents" / f).stat().st_mode & 0o777 for f in files} == {0o600}
    assert (tmp_path / "incidents").stat().st_mode & 0o777 == 0o700
    [(node, body), _] = list(incidents.parts(incident))
    samples = json.loads(body)
    machine = samples["machine"]["cpu_percent"]
    want = nodes[0].ring.ending_in("machine", T0 + 10, T0 + 60)
    assert want is not None and machine["us"] == want.us.tolist()
    rows = list(csv.reader(io.StringIO(to_csv(incidents.parts(incident)).decode())))
    assert rows[0] == ["node", "series", "begin", "end", "value"]
    per_node = sum(len(s["us"]) for s in [machine] + [x["cpu_cores"] for x in samples["shards"]]) + sum(
        len(g["utilization_percent"]["t"]) for g in samples["gpus"])
    assert sum(1 for r in rows if r[0] == "n1") == per_node
    assert any(r[4] == "" for r in rows[1:])  # unmeasured samples are empty, never 0
    # A restart: the incidents come back from the directory as they were.
    again, _ = incidents_at(tmp_path, registry)
    assert again.listed() == incidents.listed()


async def test_a_restart_while_capturing_says_so(tmp_path: Path, registry: NodeRegistry) -> None:
    incidents, _ = incidents_at(tmp_path, registry)
    incident = incidents.start("a test", "operator", ["n1"], at=T0 + 60)
    await incidents.close()
    again, _ = incidents_at(tmp_path, registry)
    [listed] = again.listed()
    assert listed["id"] == incident.id and listed["state"] == "interrupted"
    assert listed["missing"]["n1"][0]["why"] == "the control plane stopped while capturing"


async def test_a_claim_the_kubelet_gave_to_the_pods_group_is_its_own(tmp_path: Path, registry: NodeRegistry) -> None:
    """The kubelet makes a claim's directories group-writable and setgid for
    the pod's fsGroup at every mount (2770): a group this process is in is
    its own, and the incidents come back. Writable by another group or by
    anyone: refused, with the mode said."""
    from tests.podman_pods import kubelet_ownership

    incidents, _ = incidents_at(tmp_path, registry)
    incident = incidents.start("a test", "operator", ["n1"], at=T0 + 60)
    await incidents.close()
    directory = incidents.directory
    kubelet_ownership(tmp_path, os.getegid())  # remounted: every directory 2770, the process's group
    assert directory.stat().st_mode & 0o7777 == 0o2770
    again, _ = incidents_at(tmp_path, registry)
    assert [i["id"] for i in again.listed()] == [incident.id]
    others = max(os.getgroups() + [os.getegid()]) + 1000  # a group this process is not in
    os.chown(directory, -1, others)
    with pytest.raises(OSError, match="mode 2770"):
        incidents_at(tmp_path, registry)
    os.chown(directory, -1, os.getegid())
    directory.chmod(0o2772)  # anyone may write
    with pytest.raises(OSError, match="not the control plane's own"):
        incidents_at(tmp_path, registry)


async def test_a_node_without_hindsight_is_missing_whole(tmp_path: Path, registry: NodeRegistry) -> None:
    known(registry, "bare", held=None)
    incidents, fetches = incidents_at(tmp_path, registry)
    incident = incidents.start("a test", "operator", ["bare", "n1"], at=T0 + 60)
    await captured(incidents, [Node(fetches, "n1")], incident.id)
    assert list(incident.missing) == ["bare"] and "--hindsight" in incident.missing["bare"][0]["why"]
    assert list(incident.bytes) == ["n1"]


async def test_the_budgets_drop_the_oldest_first(tmp_path: Path, registry: NodeRegistry) -> None:
    incidents, fetches = incidents_at(tmp_path, registry)
    nodes = [Node(fetches, n) for n in ("n1", "n2", "n3")]
    first = incidents.start("one", "operator", ["n1", "n2"], at=T0 + 60)
    await captured(incidents, nodes, first.id)
    size = first.bytes["n1"]
    # Room for three nodes' samples in all, two of one node's.
    incidents.max_bytes, incidents.per_node_bytes = int(3.5 * size), int(2.5 * size)
    later = []
    for i in range(2):
        clock = T0 + 61 + i
        incidents.wall = fetches.wall = lambda clock=clock: clock  # type: ignore[misc]
        later.append(incidents.start(f"n1 again {i}", "operator", ["n1"], at=T0 + 60))
        await captured(incidents, nodes, later[-1].id)
    # n1's oldest went for its own budget; the first incident keeps n2's.
    assert first.dropped == ["n1"] and list(first.bytes) == ["n2"]
    assert [i["reason"] for i in incidents.listed()] == ["n1 again 1", "n1 again 0", "one"]
    incidents.max_bytes = int(1.5 * size)
    incidents._keep_within_budget()
    assert [i["reason"] for i in incidents.listed()] == ["n1 again 1"]  # an incident with nothing left goes whole
    assert sorted(p.name for p in (tmp_path / "incidents").iterdir()) == [f"{later[1].id}.0.json",
                                                                         f"{later[1].id}.json"]


def alert(node: str, name: str = "NodeCPUSaturated", fingerprint: str = "f1", status: str = "firing") -> dict[str, Any]:
    return {"status": status, "labels": {"alertname": name, "node": node}, "annotations": {},
            "startsAt": "2025-11-24T16:00:30.123456789Z", "endsAt": "0001-01-01T00:00:00Z", "fingerprint": fingerprint}


def webhook(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "groupKey": "{}:{}", "status": "firing", "receiver": "nodesampler",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am",
            "alerts": list(alerts), "truncatedAlerts": 0}  # fmt: skip


async def test_alertmanagers_webhook_starts_one_incident_per_new_alert(tmp_path: Path,
                                                                        registry: NodeRegistry) -> None:  # fmt: skip
    incidents, _ = incidents_at(tmp_path, registry)
    done = incidents.alerts(webhook(alert("n1"), alert("n2", fingerprint="f2"), alert("ghost", fingerprint="f3"),
                                    alert("n3", fingerprint="f4", status="resolved")))  # fmt: skip
    assert done["nodes"] == ["n1", "n2"] and done["unknown_nodes"] == ["ghost"]
    incident = incidents.get(done["started"])
    assert incident is not None and incident.reason == "alert NodeCPUSaturated" and incident.source == "alertmanager"
    # Alertmanager sends the group again at each group_interval: the same alerts start nothing.
    assert incidents.alerts(webhook(alert("n1"), alert("n2", fingerprint="f2")))["started"] is None
    bads: list[Any] = [{"version": "3", "alerts": []}, {"version": "4"}, []]
    for bad in bads:
        with pytest.raises(ValueError, match="version 4"):
            incidents.alerts(bad)


async def test_a_verdict_turning_starved_starts_one_incident(tmp_path: Path, registry: NodeRegistry) -> None:
    incidents, _ = incidents_at(tmp_path, registry)
    incidents.verdicts_changed("n1", {"s0": False}, {"s0": False, "s1": False}, T0)
    assert incidents.listed() == []
    incidents.verdicts_changed("n1", {"s0": False}, {"s0": True}, T0)
    [one] = incidents.listed()
    assert one["source"] == "starvation" and one["reason"] == "starved: s0 on n1" and one["to"] == T0
    incidents.verdicts_changed("n1", {"s0": True}, {"s0": False}, T0 + 5)
    incidents.verdicts_changed("n1", {"s0": False}, {"s0": True}, T0 + 10)  # flapping: the same incident
    assert len(incidents.listed()) == 1
    for i in range(20):  # a node that renames its starved engine each heartbeat: still the one incident
        incidents.verdicts_changed("n1", {}, {f"renamed-{i}": True}, T0 + 15 + i)
    assert len(incidents.listed()) == 1
    incidents.wall = lambda: T0 + 60 + STARVED_AGAIN_S
    incidents.verdicts_changed("n1", {}, {"renamed-again": True}, T0 + STARVED_AGAIN_S)
    assert len(incidents.listed()) == 2


async def test_each_source_starts_incidents_from_a_budget_of_its_own(tmp_path: Path,
                                                                      registry: NodeRegistry) -> None:  # fmt: skip
    incidents, _ = incidents_at(tmp_path, registry)
    for node in range(START_BUDGETS["starvation"][0] + 5):  # a fleet of starving nodes spends the starvation budget
        known(registry, f"s{node}")
        incidents.verdicts_changed(f"s{node}", {}, {"engine": True}, T0)
    assert incidents.started["starvation"] == START_BUDGETS["starvation"][0] and incidents.refused["starvation"] == 5
    for i in range(START_BUDGETS["operator"][0]):
        incidents.start(f"{i}", "operator", ["n1"])
    with pytest.raises(Refused, match="more often"):
        incidents.start("one too many", "operator", ["n1"])
    # ... and the Alertmanager's is its own still.
    assert incidents.alerts(webhook(alert("n2")))["started"] is not None


async def test_the_pages_routes(aiohttp_client: Any, tmp_path: Path, registry: NodeRegistry) -> None:
    incidents, fetches = incidents_at(tmp_path, registry)
    # Without users, starting one (by the webhook too) is refused: anyone who may spends the budget.
    anonymous = await aiohttp_client(pages_api.create_app(registry, fetches=fetches, incidents=incidents))
    r = await anonymous.post("/api/incidents", json={"nodes": ["n1"]})
    assert r.status == 403 and "basic_auth_users" in await r.text()
    r = await anonymous.post("/api/alertmanager", json=webhook(alert("n1")))
    assert r.status == 403 and "http_config.basic_auth" in await r.text()
    assert incidents.listed() == []
    access = PageAccess(ReloadingWebConfig(web_config_file(tmp_path, {"ops": PASSWORD}, tls=False)))
    pages = await aiohttp_client(pages_api.create_app(registry, fetches=fetches, incidents=incidents, access=access))
    user = basic("ops", PASSWORD)
    assert (await pages.post("/api/alertmanager", json=webhook(alert("n1")))).status == 401
    assert (await pages.post("/api/alertmanager", data=b"{}", headers=user)).status == 415
    assert (await pages.post("/api/alertmanager", json={"version": "4"}, headers=user)).status == 400
    # A start that is no time is refused whole, naming the alert and the field; no incident "now" instead.
    not_a_time = webhook(alert("n2", fingerprint="f9"), alert("n1") | {"startsAt": "yesterday"})
    r = await pages.post("/api/alertmanager", json=not_a_time, headers=user)
    assert r.status == 400 and "alerts[1].startsAt: not an RFC 3339 time" in await r.text()
    assert incidents.listed() == [] and incidents._alerts_seen == {}
    r = await pages.post("/api/alertmanager", json=webhook(alert("n1")), headers=user)
    assert r.status == 200
    started = (await r.json())["started"]
    listed = (await (await pages.get("/api/incidents", headers=user)).json())["incidents"]
    assert [i["id"] for i in listed] == [started]
    assert (await (await pages.get("/api/incidents?node=n2", headers=user)).json())["incidents"] == []
    await captured(incidents, [Node(fetches, "n1")], started)
    got = await (await pages.get(f"/api/incidents/{started}", headers=user)).json()
    assert got["state"] == "done" and list(got["samples"]) == ["n1"] and "machine" in got["samples"]["n1"]
    r = await pages.get(f"/api/incidents/{started}?format=csv", headers=user)
    incident = incidents.get(started)
    assert incident is not None and r.content_type == "text/csv"
    assert await r.read() == to_csv(incidents.parts(incident))  # streamed, the same rows
    assert (await pages.get(f"/api/incidents/{started}?format=xml", headers=user)).status == 400
    assert (await pages.get("/api/incidents/nope", headers=user)).status == 404
    # Exports at once are bounded.
    for _ in range(MAX_EXPORTS):
        await incidents._exports.acquire()
    r = await pages.get(f"/api/incidents/{started}?format=csv", headers=user)
    assert r.status == 429 and r.headers["Retry-After"]
    for _ in range(MAX_EXPORTS):
        incidents._exports.release()
    # An operator's `at`: finite, within the nodes' rings' reach; a body that is an object.
    bad: object
    for bad, says in [({"nodes": ["n1"], "at": "NaN"}, "at: a wall time within the last"),
                      ({"nodes": ["n1"], "at": 1e300}, "at: a wall time within the last"),
                      ({"nodes": ["n1"], "at": 1}, "at: a wall time within the last 950 s"),
                      ({"nodes": ["n1"], "at": T0 + 3600}, "at: a wall time"),
                      ([], 'a JSON object: {"nodes": [...], "reason": "...", "at": T}'),
                      ({"nodes": "n1"}, "nodes: a list of node names"), ({"nodes": ["n9"]}, "no such nodes: n9")]:
        r = await pages.post("/api/incidents", json=bad, headers=user)
        assert r.status == 400 and says in await r.text(), bad
    r = await pages.post("/api/incidents", json={"nodes": ["n1"], "at": T0 + 30}, headers=user)
    assert r.status == 202
    assert "NaN" not in await (await pages.get("/api/incidents", headers=user)).text()


async def test_a_long_node_name_and_a_node_that_cannot_be_written_cost_that_node_alone(
        tmp_path: Path, registry: NodeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from controlplane.state.registry_state import write as real_write

    long_name = "n" * 240
    known(registry, long_name)
    incidents, fetches = incidents_at(tmp_path, registry)

    def failing(path: Path, body: bytes) -> None:
        if path.name.endswith(".1.json"):  # the second node's samples: a disk error
            raise OSError(28, "No space left on device")
        real_write(path, body)

    monkeypatch.setattr("controlplane.samples.incidents.write", failing)
    incident = incidents.start("names", "operator", [long_name, "n1", "n2"], at=T0 + 60)
    await captured(incidents, [Node(fetches, n) for n in (long_name, "n1", "n2")], incident.id)
    assert sorted(incident.bytes) == sorted([long_name, "n2"]) and incident.state == "done"
    assert "No space left" in incident.missing["n1"][-1]["why"]
    assert all(len(p.name) < 64 for p in (tmp_path / "incidents").iterdir())


async def test_the_surfaces_are_counted_with_fixed_labels(tmp_path: Path, registry: NodeRegistry) -> None:
    """/metrics' figures for spans, incidents and password checks: every label
    pair there from the start (a rate is never of a series that appears),
    none from what a sender chose, and each figure the one counted."""
    from prometheus_client import CollectorRegistry, generate_latest

    from controlplane.listen.page_access import PasswordChecker
    from controlplane.samples.surface_metrics import SurfacesCollector

    incidents, fetches = incidents_at(tmp_path, registry)
    exported = CollectorRegistry()
    exported.register(SurfacesCollector(fetches, incidents, PasswordChecker()))

    def figures() -> dict[str, float]:
        text = generate_latest(exported).decode()
        return {m[1]: float(m[2]) for m in re.finditer(r"^(nodesampler_\S+) (\S+)$", text, re.M)}

    before = figures()
    assert before['nodesampler_hindsight_pieces_refused_total{reason="no_advance"}'] == 0
    assert before['nodesampler_incidents{source="alertmanager",state="failed"}'] == 0
    assert before['nodesampler_password_checks_total{result="refused"}'] == 0
    assert len([k for k in before if k.startswith("nodesampler_incidents{")]) == 3 * 4
    incident = incidents.start("a test", "operator", ["n1"], at=T0 + 60)
    fetches.refused_piece("not_asked")
    await captured(incidents, [Node(fetches, "n1")], incident.id)
    after = figures()
    assert after['nodesampler_incidents{source="operator",state="done"}'] == 1
    assert after['nodesampler_incidents_started_total{source="operator"}'] == 1
    assert after['nodesampler_hindsight_spans_asked_total{kind="incident"}'] == 1
    assert after['nodesampler_hindsight_pieces_taken_total'] == fetches.pieces_taken > 0
    assert after['nodesampler_hindsight_pieces_refused_total{reason="not_asked"}'] == 1
    assert after["nodesampler_incident_bytes_on_disk"] == incidents.bytes_on_disk() > 0
    assert set(after) == set(before)
    bare = CollectorRegistry()
    bare.register(SurfacesCollector(fetches, None, None))
    assert "nodesampler_incidents" not in generate_latest(bare).decode()  # off: absent, not 0


async def test_incidents_on_disk_are_bounded_in_number_and_bytes(tmp_path: Path, registry: NodeRegistry,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import controlplane.samples.incidents as module

    known(registry, "bare", held=None)
    incidents, _ = incidents_at(tmp_path, registry)
    monkeypatch.setattr(module, "START_BUDGETS", {**START_BUDGETS, "operator": (1000, 1.0)})
    incidents._starts["operator"] = (1000.0, T0)
    empty = [incidents.start(f"{i}", "operator", ["bare"]) for i in range(30)]
    for _ in range(100):  # each captured at once: nothing to fetch
        if all(i.state == "done" for i in empty):
            break
        await asyncio.sleep(0.05)
    directory = tmp_path / "incidents"
    on_disk = sum(p.stat().st_size for p in directory.iterdir())
    assert incidents.bytes_on_disk() == on_disk > 0  # their own files count in the budget
    monkeypatch.setattr(module, "MAX_INCIDENTS", 10)
    incidents._keep_within_budget()
    assert len(incidents.listed()) == 10 and len(list(directory.iterdir())) == 10
    assert {i["reason"] for i in incidents.listed()} == {str(i) for i in range(20, 30)}  # the newest kept
    incidents.max_bytes = incidents.bytes_on_disk() - 1
    incidents._keep_within_budget()
    assert len(incidents.listed()) == 9 and "20" not in {i["reason"] for i in incidents.listed()}
    incidents.wall = lambda: T0 + 61 + EMPTY_KEPT_S
    incidents._keep_within_budget()  # an hour on, incidents that hold no samples go
    assert incidents.listed() == [] and list(directory.iterdir()) == []


# --- a real Prometheus and Alertmanager ---------------------------------------------------


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[Any]]]:
    started: list[subprocess.Popen[Any]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            assert time.monotonic() < deadline, f"{url} did not answer"
            time.sleep(0.2)


@pytest.mark.live
def test_an_alert_from_the_shipped_rules_captures_the_samples_before_it(
        tmp_path: Path, processes: list[subprocess.Popen[Any]], group: list[subprocess.Popen[str]]
) -> None:  # fmt: skip
    """The machine busy: Prometheus, evaluating the shipped rules (their `for`
    durations cut to nothing), fires NodeCPUSaturated; Alertmanager posts it to
    the receiver; the incident holds the node's samples from before the alert."""
    for tool in ("prometheus", "prometheus-alertmanager"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} missing: make setup installs Debian's")
    fleet = Fleet(tmp_path)
    try:
        # Alertmanager posts as a web-config user, as deployment.md's receiver does; Prometheus scrapes as one.
        config = web_config_file(tmp_path, {"ops": PASSWORD}, tls=False)
        fleet.pages_headers = basic("ops", PASSWORD)
        fleet.start_control_plane("--state-file", str(tmp_path / "registry.json"), "--incident-after", "3",
                                  "--web-config-file", str(config))  # fmt: skip
        fleet.start_agent("--hz", "10")
        fleet.wait_for(lambda nodes: fresh_with_seq(nodes, 3))
        rules = tmp_path / "rules.yml"
        rules.write_text(re.sub(r"(?m)^(\s+)for: .*$", r"\1for: 0s", (ROOT / "deploy" / "alerts.yml").read_text()))
        am_port, prom_port = free_port(), free_port()
        (tmp_path / "am.yml").write_text(
            "route: {receiver: nodesampler, group_by: [alertname, node], group_wait: 1s, group_interval: 5s, "
            "repeat_interval: 1h}\n"
            f"receivers:\n  - name: nodesampler\n    webhook_configs:\n"
            f"      - url: http://127.0.0.1:{fleet.pages_port}/api/alertmanager\n"
            f"        http_config: {{basic_auth: {{username: ops, password: '{PASSWORD}'}}}}\n")  # fmt: skip
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{rules}]\n"
            f"alerting: {{alertmanagers: [{{static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]}}]}}\n"
            f"scrape_configs:\n  - job_name: nodesampler\n    basic_auth: {{username: ops, password: '{PASSWORD}'}}\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{fleet.pages_port}']}}]\n")  # fmt: skip
        processes.append(subprocess.Popen(
            ["prometheus-alertmanager", f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "am.log", "w")))  # noqa: SIM115  # fmt: skip
        processes.append(subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prom.log", "w")))  # noqa: SIM115  # fmt: skip
        wait_http(f"http://127.0.0.1:{am_port}/-/ready")
        wait_http(f"http://127.0.0.1:{prom_port}/-/ready")
        busy_from = time.time()
        group.append(start_group(busy_threads(4)))  # every CPU busy: the window's mean over 95%
        deadline = time.monotonic() + 120
        while True:
            status, body = fleet.pages("/api/incidents")
            # The busy threads wait for a CPU too: an incident of their starved group may come first.
            every = json.loads(body)["incidents"] if status == 200 else []
            listed = [i for i in every if i["source"] == "alertmanager"]
            if listed and listed[0]["state"] == "done":
                break
            assert time.monotonic() < deadline, f"no incident: {listed}\n{(tmp_path / 'control.log').read_text()}"
            time.sleep(0.5)
    finally:
        fleet.stop()
    [incident] = listed
    assert incident["source"] == "alertmanager" and incident["reason"] == "alert NodeCPUSaturated"
    assert incident["nodes"] == ["n1"] and incident["from"] < busy_from
    stored = json.loads((tmp_path / "registry.json.incidents" / f"{incident['id']}.0.json").read_text())
    cpu = stored["machine"]["cpu_percent"]
    ends = stored["from"] + cpu["start"] + np.cumsum(cpu["us"]) / 1e6
    values = np.array([np.nan if v is None else v for v in cpu["v"]])
    before = values[ends < busy_from - 0.5]
    assert len(before) >= 10  # the samples from before the alert fired, and before the machine got busy
    assert np.nanmax(values[ends > busy_from + 2]) > 95
    # The span's start is older than the agent's ring: said, not filled.
    assert all(m["why"].startswith("older than the node keeps") for m in incident["missing"].get("n1", []))


async def test_without_incidents_the_webhook_says_which_flag_turns_them_on(aiohttp_client: Any,
                                                                           registry: NodeRegistry) -> None:  # fmt: skip
    """Not a bare 404: Alertmanager retries a 503, and its log says why."""
    pages = await aiohttp_client(pages_api.create_app(registry))
    for method, path in (("POST", "/api/alertmanager"), ("POST", "/api/incidents"), ("GET", "/api/incidents"),
                         ("GET", "/api/incidents/1-abc")):  # fmt: skip
        r = await pages.request(method, path, json={"alerts": []})
        assert r.status == 503 and "--incidents-dir" in await r.text(), (method, path)
