"""The agent and the control plane as the separate processes they are in
production: the control plane killed and restarted, and down for 30 s."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_fleet import Fleet, fresh_with_seq

pytestmark = pytest.mark.live


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.stop()


def test_agent_registers_again_at_once_after_a_restart(fleet: Fleet) -> None:
    fleet.start_control_plane()
    fleet.start_agent()
    [node] = fleet.wait_for(fresh_with_seq)
    assert node["node"] == "n1" and node["registration"]["backend"] == "proc"
    seq = node["heartbeat"]["seq"]
    fleet.kill_control_plane()
    fleet.start_control_plane()  # same ports, empty registry
    [node] = fleet.wait_for(lambda n: fresh_with_seq(n, above=seq))
    # Re-registered at the first heartbeat the new control plane answered 404
    # (or refused while it started): the windows lost are the one or two in flight.
    first_accepted = node["heartbeat"]["seq"] - (node["heartbeats"] - 1)
    assert first_accepted <= seq + 2, (seq, node["heartbeat"]["seq"], node["heartbeats"])


def test_agent_rides_out_a_30_s_outage_alone_without_growing(fleet: Fleet) -> None:
    fleet.start_control_plane()
    fleet.start_agent()
    fleet.wait_for(fresh_with_seq)
    rss_before = fleet.agent_rss_kib()
    fleet.kill_control_plane()
    time.sleep(30)  # the outage itself: the agent keeps sampling, retries, keeps one summary
    rss_during = fleet.agent_rss_kib()
    fleet.start_control_plane()
    [node] = fleet.wait_for(fresh_with_seq)
    assert node["heartbeat"]["seq"] >= 25  # sampling never stopped: ~30 windows passed
    log = fleet.wait_for_log("reachable again")
    assert log.count("unreachable") == 1  # one line for the outage, not one per retry
    assert log.count("reachable again") == 1
    assert rss_during - rss_before < 4096, (rss_before, rss_during)
    assert fleet.agent is not None
    fleet.agent.send_signal(signal.SIGTERM)
    assert fleet.agent.wait(timeout=30) == 0  # SIGTERM stops it cleanly
    assert "Traceback" not in fleet.agent_log()


def test_a_process_with_a_hostile_name_leaves_the_node_fresh(fleet: Fleet) -> None:
    """Any local user can write a tab or a non-breaking space into its own comm:
    the agent escapes it; every heartbeat is accepted; the page and /metrics show it."""
    code = ("open('/proc/self/comm', 'wb').write('bz\\t\\xa0x'.encode())\nprint('ready', flush=True)\n"
            "while True:\n    pass\n")  # fmt: skip
    busy = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, process_group=0)
    try:
        assert busy.stdout is not None and busy.stdout.readline() == b"ready\n"
        fleet.start_control_plane()
        fleet.start_agent()

        def shows_it(nodes: list[dict[str, Any]]) -> bool:
            return fresh_with_seq(nodes, above=2) and any(
                s.get("command") == "bz\\t\\xa0x" for s in nodes[0]["heartbeat"]["shards"])

        [node] = fleet.wait_for(shows_it)
        assert node["heartbeats"] == node["heartbeat"]["seq"]  # not one refused
        [shard] = [s for s in node["heartbeat"]["shards"] if s.get("command") == "bz\\t\\xa0x"]
        base = f"http://127.0.0.1:{fleet.pages_port}"
        with urllib.request.urlopen(f"{base}/node/n1", timeout=5) as r:
            assert "bz\\t\\xa0x" in r.read().decode()
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            assert f'shard="{shard["id"]}"' in r.read().decode()
        assert "left out" not in fleet.agent_log()
    finally:
        busy.kill()
        busy.wait()
