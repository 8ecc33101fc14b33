"""A hostile node against a real control plane process: its own token, the
heartbeats it writes itself, and hindsight pieces made to cost the control
plane memory and time (controlplane/samples/hindsight.py's bounds). Pieces that do
not advance the span are refused and do not put its deadline off; pieces
of spans it was not asked for are not read; a flood of windows and samples
stops at the span's budget, and the process's memory with it."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.samples.hindsight import MAX_BYTES_PER_FETCH
from tests.agent_fleet import Fleet
from tests.test_controlplane_api import heartbeat, registration
from wire.hindsight import MAX_WINDOWS

pytestmark = pytest.mark.live

NODE = "hostile"
SAMPLES_A_PIECE = 30_000  # with MAX_WINDOWS windows: ~250 KB of JSON, within the body's 512 KiB


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.stop()


class HostileNode:
    """Writes its own heartbeats (no agent), as fast as the control plane takes them."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.token = subprocess.run(fleet.cli("token", NODE, "--secret-file", str(fleet.secret)), capture_output=True,
                                    text=True, check=True).stdout.strip()  # fmt: skip
        self.seq = 0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.fleet.agent_port}{path}"
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer

    def heartbeat(self, piece: dict[str, Any] | None = None) -> dict[str, Any]:
        self.seq += 1
        body = heartbeat(NODE, self.seq) | {"hindsight_held_seconds": 900.0}
        if piece is not None:
            body["hindsight"] = piece
        return self.post("/v1/heartbeat", body)


def piece(span_id: str, t_from: float, t_to: float) -> dict[str, Any]:
    """As heavy as a body allows: every window the wire takes, and tens of thousands of samples."""
    return {"id": span_id, "from": t_from, "to": t_to, "done": False,
            "windows": [[0, 0]] * MAX_WINDOWS,
            "machine": {"cpu_percent": {"start": 0, "us": [1] * SAMPLES_A_PIECE,
                                        "v": [1.5] * SAMPLES_A_PIECE}}}  # fmt: skip


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M)
    assert match is not None
    return int(match[1]) * 1024


def counted(fleet: Fleet, name: str) -> float:
    status, text = fleet.pages("/metrics")
    assert status == 200
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match is not None, name
    return float(match[1])


def test_a_hostile_node_costs_a_span_its_budget_and_no_more(fleet: Fleet) -> None:
    # Its heartbeat rate raised: the flood is the pieces, not the 429s (whose bound is tested elsewhere).
    fleet.start_control_plane("--max-heartbeats-per-second", "1000")
    assert fleet.control is not None
    node = HostileNode(fleet)
    node.post("/v1/register", registration(NODE))
    node.heartbeat()
    status, body = fleet.pages(f"/api/nodes/{NODE}/hindsight", method="POST")  # no body: not JSON, refused
    assert status == 415
    now = time.time()
    request = urllib.request.Request(f"http://127.0.0.1:{fleet.pages_port}/api/nodes/{NODE}/hindsight",
                                     data=json.dumps({"from": now - 300, "to": now - 1}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as r:
        span = json.loads(r.read())
    asked = node.heartbeat()["hindsight"]
    assert asked["id"] == span["id"]
    start = asked["from"]
    baseline = rss_bytes(fleet.control.pid)

    def described() -> dict[str, Any]:
        status, text = fleet.pages(span["url"])
        assert status == 200
        answer: dict[str, Any] = json.loads(text)
        return answer

    assert "hindsight" in node.heartbeat(piece(span["id"], start, start + 1))
    first = described()
    assert first["pieces"] == 1
    # The same piece again (before where the span stands: not read), and pieces of no length at
    # its end (read, and refused): none of them kept, and the deadline stays where it was.
    for _ in range(50):
        node.heartbeat(piece(span["id"], start, start + 1))
        node.heartbeat(piece(span["id"], start + 1, start + 1))
    again = described()
    assert (again["pieces"], again["deadline"], again["hard_end"]) == (1, first["deadline"], first["hard_end"])
    assert again["bytes"] == first["bytes"]
    # Pieces of a span it was not asked for: not read.
    for _ in range(10):
        answer = node.heartbeat(piece("not-asked", start, start + 1))
        assert answer["dropped"][0]["field"] == "hindsight.id"
    # Pieces that advance, each as heavy as a body can be: kept up to the span's budget, then refused.
    for k in range(1, 101):
        node.heartbeat(piece(span["id"], start + k, start + k + 1))
    flooded = described()
    assert flooded["bytes"] <= MAX_BYTES_PER_FETCH
    assert any("over the 16 MiB" in m["why"] for m in flooded["missing"])
    assert flooded["hard_end"] == first["hard_end"]  # no piece puts the hard end off
    grown = rss_bytes(fleet.control.pid) - baseline
    # Offered: 201 pieces of ~1 MiB as held (10,000 windows and 30,000 samples each); kept: 16 MiB.
    assert grown < 3 * MAX_BYTES_PER_FETCH, f"the control plane grew {grown / 2**20:.0f} MiB"
    assert counted(fleet, 'nodesampler_hindsight_pieces_refused_total{reason="bad"}') == 50
    assert counted(fleet, 'nodesampler_hindsight_pieces_refused_total{reason="no_advance"}') == 50
    assert counted(fleet, 'nodesampler_hindsight_pieces_refused_total{reason="not_asked"}') == 10
    assert counted(fleet, 'nodesampler_hindsight_pieces_refused_total{reason="span_budget"}') >= 80
    assert counted(fleet, "nodesampler_hindsight_held_bytes") == flooded["bytes"]
    try:
        node.post("/v1/heartbeat", {"not": "a heartbeat"})
    except urllib.error.HTTPError as e:
        assert e.code == 400
