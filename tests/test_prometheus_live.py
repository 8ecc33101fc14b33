"""A real Prometheus (Debian's) scrapes a control plane fed by a real agent:
the node's CPU, its engine's cores, and a stale node's series, read back
through Prometheus' HTTP API. Everything on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent_fleet import web_config_file
from tests.conftest import free_port
from tests.workloads import BURN_ONE_CORE, start_group

pytestmark = pytest.mark.live


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[Any]] = []
        self.agent_port, self.pages_port, self.prom_port = free_port(), free_port(), free_port()

    def start(self, args: list[str], **kw: Any) -> subprocess.Popen[Any]:
        p = subprocess.Popen(args, **kw)
        self.procs.append(p)
        return p

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prom_port}{path}", timeout=5) as r:
            return json.load(r)

    def wait_for(self, promql: str, check: Callable[[list[dict[str, Any]]], bool], timeout: float = 60) -> Any:
        """Poll Prometheus until the query's result satisfies check (it scrapes once a second)."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if check(result):
                return result
            time.sleep(0.5)
        raise AssertionError(f"{promql}: last result {result}")

    def wait_ready(self, timeout: float = 60) -> None:
        """Prometheus answers /-/ready once its storage is open."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.prom_port}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus missing: make setup installs Debian's prometheus")
    s = Stack(tmp_path)
    yield s
    s.stop()


def value(result: list[dict[str, Any]]) -> float:
    [series] = result
    return float(series["value"][1])


def test_prometheus_scrapes_the_fleet(stack: Stack, tmp_path: Path) -> None:
    py = [sys.executable, "-m", "nodesampler"]
    secret = tmp_path / "secret"
    secret.write_text("prometheus-test-secret\n")
    cp = stack.start([*py, "controlplane", "--listen", f"127.0.0.1:{stack.agent_port}", "--pages-listen",
                      f"127.0.0.1:{stack.pages_port}", "--secret-file", str(secret), "--stale-after", "3"],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    assert cp.stdout is not None and b"control plane" in cp.stdout.readline()

    burner = start_group(BURN_ONE_CORE)
    stack.procs.append(burner)
    config = tmp_path / "agent.toml"
    config.write_text(f'[[shard]]\nid = "burn"\nmodel = "spin"\nreplica = "r1"\nselect = "pgid:{burner.pid}"\n')
    token = tmp_path / "token"
    token.write_bytes(subprocess.run([*py, "token", "n1", "--secret-file", str(secret)], capture_output=True,
                                     check=True).stdout)  # fmt: skip
    agent = stack.start([*py, "agent", "--control-plane", f"http://127.0.0.1:{stack.agent_port}", "--token-file",
                         str(token), "--node", "n1", "--interval", "1", "--backend", "proc", "--config", str(config)],
                        stderr=subprocess.DEVNULL)  # fmt: skip

    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: nodesampler\n    static_configs: [{{targets: ['127.0.0.1:{stack.pages_port}']}}]\n"
    )
    stack.start(["prometheus", f"--config.file={prom_config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{stack.prom_port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    stack.wait_ready()

    cpu = stack.wait_for('llmgw_node_cpu_utilization_percent{node="n1"}', lambda r: len(r) == 1)
    assert 0 <= value(cpu) <= 100
    # The engine burns one core: its shard says so, labelled as configured.
    cores = stack.wait_for('llmgw_shard_cpu_cores{node="n1",shard="burn"}', lambda r: len(r) == 1 and value(r) > 0.8)
    assert cores[0]["metric"]["model"] == "spin" and cores[0]["metric"]["replica"] == "r1"
    assert value(stack.query('llmgw_node_up{node="n1"}')) == 1.0

    agent.kill()  # the node falls silent: stale after 3 s
    agent.wait()
    stack.wait_for('llmgw_node_up{node="n1"}', lambda r: len(r) == 1 and value(r) == 0.0)
    # Its measurements are gone from the scrape, so from Prometheus' present: no flat zero.
    stack.wait_for('llmgw_node_cpu_utilization_percent{node="n1"}', lambda r: r == [])
    assert stack.query('llmgw_shard_cpu_cores{node="n1"}') == []
    assert len(stack.query('llmgw_node_info{node="n1"}')) == 1


def test_prometheus_scrapes_through_basic_auth_and_tls(stack: Stack, tmp_path: Path) -> None:
    """The web config file operators give Prometheus, given to the control
    plane: Prometheus' own `basic_auth` and `tls_config` scrape it; a job with
    a wrong password and one without a user are refused (`up` 0)."""
    py = [sys.executable, "-m", "nodesampler"]
    secret = tmp_path / "secret"
    secret.write_text("prometheus-test-secret\n")
    config = web_config_file(tmp_path, {"prometheus": "scrape-secret"}, cost=10)  # htpasswd's cost
    cp = stack.start([*py, "controlplane", "--listen", f"127.0.0.1:{stack.agent_port}", "--pages-listen",
                      f"127.0.0.1:{stack.pages_port}", "--secret-file", str(secret), "--web-config-file", str(config)],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    assert cp.stdout is not None and b"pages on https://" in cp.stdout.readline()
    token = tmp_path / "token"
    token.write_bytes(subprocess.run([*py, "token", "n1", "--secret-file", str(secret)], capture_output=True,
                                     check=True).stdout)  # fmt: skip
    stack.start([*py, "agent", "--control-plane", f"https://127.0.0.1:{stack.agent_port}", "--token-file", str(token),
                 "--ca-file", str(tmp_path / "ca.crt"), "--node", "n1", "--interval", "1", "--backend", "proc"],
                stderr=subprocess.DEVNULL)  # fmt: skip
    (tmp_path / "password").write_text("scrape-secret\n")
    (tmp_path / "wrong").write_text("guessed\n")
    target = f"static_configs: [{{targets: ['127.0.0.1:{stack.pages_port}']}}]"
    tls = f"scheme: https\n    tls_config: {{ca_file: {tmp_path / 'ca.crt'}}}\n    {target}\n"
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: nodesampler\n    basic_auth: {{username: prometheus, password_file: {tmp_path / 'password'}}}\n"
        f"    {tls}"
        f"  - job_name: wrong-password\n    basic_auth: {{username: prometheus, password_file: {tmp_path / 'wrong'}}}\n"
        f"    {tls}"
        f"  - job_name: no-user\n    {tls}"
    )
    stack.start(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{stack.prom_port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    stack.wait_ready()
    stack.wait_for('llmgw_node_up{node="n1",job="nodesampler"}', lambda r: len(r) == 1 and value(r) == 1.0)
    for job in ("wrong-password", "no-user"):
        stack.wait_for(f'up{{job="{job}"}}', lambda r: len(r) == 1 and value(r) == 0.0)
    assert value(stack.query('up{job="nodesampler"}')) == 1.0
    targets = stack.get("/api/v1/targets")["data"]["activeTargets"]
    errors = {t["labels"]["job"]: t["lastError"] for t in targets}
    assert "401" in errors["wrong-password"] and "401" in errors["no-user"] and errors["nodesampler"] == "", errors
