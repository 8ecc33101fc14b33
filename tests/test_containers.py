"""The product as deployed: the image built here, the control plane's and the
agent's pods run with podman exactly as deploy/kubernetes says (see
podman_pods.py), two agents as two nodes, each with its own projected
service-account token signed by a test issuer whose keys the control plane
fetches as it would from the API server.

Root, podman and a kernel backend that loads are needed;
NODESAMPLER_REQUIRE_CONTAINERS=1 (CI) fails instead of skipping without them.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodesampler import __version__
from nodesampler.cli.kube_secrets import USERS
from nodesampler.cli.kube_secrets import write as write_kube_secrets
from sampler.sources.machine import MachineGaugeReader
from tests import podman_pods as pods
from tests.agent_fleet import basic
from tests.certs import TestCA, kubelet_serving_name
from tests.fakekubelet import FakeKubelet, pod_doc
from tests.issuer import TestIssuer
from tests.workloads import QUARTER_WORKERS, group_cpu_at, group_members, start_group

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = os.environ.get("NODESAMPLER_REQUIRE_CONTAINERS") == "1"
# The StatefulSet's replicas by name: this host plays the first; the others are
# named where nothing answers (IPv6 loopback: the replica listens on IPv4), so
# agents whose order puts one of them first move on to it, as when one is down.
REPLICA_SERVICE = "nodesampler-controlplane.nodesampler.svc"
CP_HOST = f"nodesampler-controlplane-0.{REPLICA_SERVICE}"
ABSENT_REPLICAS = [f"nodesampler-controlplane-{i}.{REPLICA_SERVICE}" for i in (1, 2)]
API_HOST = "kubernetes.default.svc"
ENGINE_TAG = "nodesampler-test-engine"
WAIT_S = 120.0
ARTIFACTS = ROOT / "test-artifacts"


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"NODESAMPLER_REQUIRE_CONTAINERS=1 and {reason}")
    pytest.skip(reason)


def until(what: str, check: Callable[[], Any], timeout: float = WAIT_S, every: float = 0.5) -> Any:
    """Poll `check` until it returns something true. Polling is the only way
    to await another process's state here: the containers offer no event."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


class IssuerServer:
    """The API server's `/openid/v1/jwks`, over TLS as `kubernetes.default.svc`,
    answering only a bearer token (the control plane's own)."""

    def __init__(self, issuer: TestIssuer, ca: TestCA, work: Path, token: str) -> None:
        cert, key = work / "api.crt", work / "api.key"
        ca.issue(cert, key, [API_HOST])
        self.seen: list[str] = []
        jwks = json.dumps(issuer.jwks()).encode()
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                seen.append(self.headers.get("Authorization", ""))
                ok = self.path == "/openid/v1/jwks" and self.headers.get("Authorization") == f"Bearer {token}"
                body = jwks if ok else b'{"kind":"Status","code":401}'
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/jwk-set+json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 443), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class CpuTruth:
    """The kernel's account of a process group's CPU seconds, recorded with
    wall-clock stamps at 20 Hz, read back at any window's edges."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.points: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        members = group_members(self.pgid)
        while not self._stop.wait(0.05):
            self.points.append(group_cpu_at(self.pgid, members, clock=time.time))

    def at(self, t: float) -> float | None:
        for (t0, s0), (t1, s1) in zip(self.points, self.points[1:], strict=False):
            if t0 <= t <= t1:
                return s0 + (s1 - s0) * (t - t0) / (t1 - t0)
        return None

    def cores(self, start: float, end: float) -> float | None:
        a, b = self.at(start), self.at(end)
        return None if a is None or b is None else (b - a) / (end - start)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


PAGES_HOST = "nodesampler-pages.nodesampler.svc"


class Cluster:
    """The control plane and two agents' pods, and what the test knows of them."""

    def __init__(self, work: Path, image: str) -> None:
        self.work, self.image = work, image
        self.issuer = TestIssuer(kid="cluster-key-1")
        self.cluster_ca = TestCA("test cluster CA")
        # The Secrets as the shipped kustomization makes them, from what `nodesampler kube-secrets` writes.
        secrets = work / "secrets"
        write_kube_secrets(secrets)
        generated = pods.manifests(secrets=secrets)
        self.tls = pods.secret_data(generated, "nodesampler-controlplane-tls")
        self.web = pods.secret_data(generated, "nodesampler-controlplane-web")
        self.peers = pods.secret_data(generated, "nodesampler-controlplane-peers")
        self.passwords = {user: (secrets / f"{user}.password").read_text() for user in USERS}
        self.context = ssl.create_default_context(cadata=self.tls["ca.crt"].decode())
        self.cp_token = self.issuer.token(None, account="nodesampler-controlplane")
        self.api = IssuerServer(self.issuer, self.cluster_ca, work, self.cp_token)
        self.names: list[str] = []
        self.played: dict[str, pods.PlayedPod] = {}
        self.pages = "https://127.0.0.1:8080"

    def get_text(self, path: str, user: str | None = "operator") -> str:
        """A page, as a user of the web config (its operator unless another is named)."""
        headers = basic(user, self.passwords[user]) if user else {}
        request = urllib.request.Request(f"{self.pages}{path}", headers=headers)
        with urllib.request.urlopen(request, timeout=10, context=self.context) as r:
            return str(r.read().decode())

    def get_json(self, path: str, user: str | None = "operator") -> Any:
        return json.loads(self.get_text(path, user))

    def hosts(self) -> dict[str, str]:
        return {CP_HOST: "127.0.0.1", API_HOST: "127.0.0.1", **{name: "::1" for name in ABSENT_REPLICAS}}

    def start_controlplane(self) -> None:
        """The StatefulSet's first replica, on its claim (kept by the test: played again, it finds its state)."""
        sts = pods.find("StatefulSet", "nodesampler-controlplane")
        [claim] = sts["spec"]["volumeClaimTemplates"]
        played = pods.PlayedPod(node="node-cp", secrets={"nodesampler-controlplane-tls": self.tls,
                                                         "nodesampler-controlplane-web": self.web,
                                                         "nodesampler-controlplane-peers": self.peers},
                                sa_tokens={"": self.cp_token}, hosts=self.hosts(),
                                cluster_ca=self.cluster_ca.cert.public_bytes(_pem()),
                                claims={claim["metadata"]["name"]: self.work / "claim-state-0"})  # fmt: skip
        self._run(sts["spec"]["template"]["spec"], played, "nodesampler-test-cp")
        until("the control plane's /health", self._healthy)

    def _healthy(self) -> bool:
        try:
            return bool(self.get_json("/health", user=None)["status"] == "ok")  # as the kubelet's probe: no user
        except OSError:
            return False

    def start_agent(self, node: str, token: str, config: bytes | None = None, ca: bytes | None = None) -> str:
        ds = pods.find("DaemonSet", "nodesampler-agent")
        tls = dict(self.tls) if ca is None else {**self.tls, "ca.crt": ca}
        played = pods.PlayedPod(node=node, secrets={"nodesampler-controlplane-tls": tls},
                                config_maps={} if config is None else {"nodesampler-agent": {"agent.toml": config}},
                                sa_tokens={"nodesampler": token, "": f"api-token-of-{node}"},
                                cluster_ca=self.cluster_ca.cert.public_bytes(_pem()), hosts=self.hosts())  # fmt: skip
        name = f"nodesampler-test-agent-{node}"
        self._run(ds["spec"]["template"]["spec"], played, name)
        return name

    def _run(self, pod: dict[str, Any], played: pods.PlayedPod, name: str) -> None:
        argv = pods.podman_run(pod, played, name, self.work, self.image)
        (self.work / f"{name}.argv").write_text(" ".join(argv))
        pods.start(argv)
        self.names.append(name)
        self.played[name] = played

    def node(self, name: str) -> dict[str, Any] | None:
        for n in self.get_json("/api/nodes")["nodes"]:
            if n["node"] == name:
                return dict(n)
        return None

    def heartbeat(self, name: str, after_seq: int = 0) -> dict[str, Any] | None:
        n = self.node(name)
        hb = n and n["state"] == "fresh" and n["heartbeat"]
        return hb if hb and hb["seq"] > after_seq else None

    def close(self) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        for name in self.names:
            (ARTIFACTS / f"{name}.log").write_text(pods.logs(name))
            pods.remove(name)
        self.api.close()


def _pem() -> Any:
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.PEM


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0:
        _unavailable("the container tests need root")
    if shutil.which("podman") is None:
        _unavailable("podman is not installed (make test installs it)")
    r = subprocess.run(["bash", str(ROOT / "deploy" / "build-image.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def _cgroup_dir() -> Path:
    """Where the engine's own cgroup goes: the v2 tree, or v1's cpu hierarchy."""
    root = Path("/sys/fs/cgroup")
    return root / ENGINE_TAG if (root / "cgroup.controllers").exists() else root / "cpu" / ENGINE_TAG


@pytest.fixture(scope="module")
def engine() -> Iterator[subprocess.Popen[str]]:
    """The engine: a group of three workers at a quarter core each, in a cgroup of its own."""
    p = start_group(QUARTER_WORKERS, ENGINE_TAG)
    cg = _cgroup_dir()
    cg.mkdir(exist_ok=True)
    for pid in subprocess.run(["pgrep", "-g", str(p.pid)], capture_output=True, text=True).stdout.split():
        (cg / "cgroup.procs").write_text(pid)
    yield p
    os.killpg(p.pid, 9)
    p.wait()
    until("the engine's cgroup to empty", lambda: not (cg / "cgroup.procs").read_text().strip(), timeout=10)
    cg.rmdir()


@pytest.fixture(scope="module")
def cluster(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"), image)
    try:
        c.start_controlplane()
        yield c
    finally:
        c.close()


ENGINE_CONFIG = f"""
[[shard]]
id = "engine"
model = "test-model"
replica = "r1"
select = "cmdline:{ENGINE_TAG}"

[[shard]]              # the same engine by its cgroup: the host's path, seen from the container
id = "engine-cg"
select = "cgroup:/{ENGINE_TAG}"
""".encode()


def test_the_manifests_image_is_this_version(image: str) -> None:
    assert image == f"nodesampler:{__version__}"


def test_the_image_is_one_name_for_both_platforms_and_runs_on_arm64(image: str) -> None:
    """The manifest list names an amd64 and an arm64 image (a node pulls its
    own), and the arm64 one runs the agent, here under qemu-user: its Python,
    bcc's bindings, every wheel (numpy, google-re2, msgspec), and a window
    sampled from /proc (emulation has no BPF to load)."""
    listed = json.loads(subprocess.run(["podman", "manifest", "inspect", image], capture_output=True, text=True,
                                       check=True).stdout)  # fmt: skip
    assert sorted(m["platform"]["architecture"] for m in listed["manifests"]) == ["amd64", "arm64"]
    r = subprocess.run(["podman", "run", "--rm", "--runtime", "runc", *pods.ULIMITS, "--platform", "linux/arm64",
                        "--entrypoint", "sh", f"{image}-arm64", "-c",
                        "uname -m && /opt/nodesampler/.venv/bin/python -c 'import bcc, numpy, re2, msgspec' "
                        "&& nodesampler sample --backend proc --hz 10 --duration 1 --json"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    machine, summary = r.stdout.split("\n", 1)
    assert machine == "aarch64"
    window = json.loads(summary)
    assert window["backend"] == "proc" and window["window"]["samples"] >= 9


def test_two_nodes_each_speaking_for_itself(cluster: Cluster, engine: subprocess.Popen[str]) -> None:
    container_caps = pods.find("DaemonSet", "nodesampler-agent")["spec"]["template"]["spec"]["containers"][0][
        "securityContext"]["capabilities"]  # fmt: skip
    t0 = time.time()
    # node-a's first token expires within the test; the "kubelet" rotates it.
    short = cluster.issuer.token("node-a", ttl=15, now=t0)
    a = cluster.start_agent("node-a", short)
    b = cluster.start_agent("node-b", cluster.issuer.token("node-b"), config=ENGINE_CONFIG)
    truth = CpuTruth(engine.pid)
    try:
        hb_a = until("node-a's first heartbeat", lambda: cluster.heartbeat("node-a"))
        until("node-b's first heartbeat", lambda: cluster.heartbeat("node-b"))
        cluster.played[a].volumes["token"].update({"token": cluster.issuer.token("node-a").encode()})

        metrics = cluster.get_text("/metrics")
        for node in ("node-a", "node-b"):
            assert f'llmgw_node_up{{node="{node}"}} 1\n' in metrics
        # The control plane fetched the issuer's keys with its own token.
        assert cluster.api.seen and set(cluster.api.seen) == {f"Bearer {cluster.cp_token}"}

        # Each agent saw the host, through the container: its name, its disks, the kernel backend,
        # with no more capabilities than the manifest adds (drop ALL; BPF, PERFMON, SYS_RESOURCE).
        reg = cluster.node("node-a")["registration"]  # type: ignore[index]
        assert reg["hostname"] == socket.gethostname()
        assert reg["backend"] == "bpf", reg.get("backend_reason")
        # (This machine's root has no CAP_SYS_RESOURCE to give: a container gets what the host's bounding set allows.)
        added = {f"cap_{c.lower()}" for c in container_caps["add"]}
        assert container_caps["drop"] == ["ALL"] and added == {"cap_bpf", "cap_perfmon", "cap_sys_resource"}
        assert _effective_capabilities(a) == added & _capabilities("self", "CapBnd")
        # Its switch program typed (tp_btf), the tracepoint found in the host's BTF through /sys.
        agent_log = pods.logs(a)
        assert "kernel backend compiled against" in agent_log and "attached as a raw tracepoint" not in agent_log
        host_disks = MachineGaugeReader(Path("/proc")).read_disks()
        assert host_disks is not None
        assert {d["mount"]: d["bytes"] for d in hb_a["machine"]["disks"]} == {d["mount"]: d["bytes"]
                                                                             for d in host_disks}  # fmt: skip

        # Without a ConfigMap node-a reports the busiest groups; node-b its shard.
        assert all(s["id"].startswith(("comm:", "pgid:")) for s in hb_a["shards"])
        hb_b = until("a node-b window with the engine's truth on both edges", lambda: _judged(cluster, truth))
        shards = {s["id"]: s for s in hb_b["shards"]}
        assert shards.keys() == {"engine", "engine-cg"} and shards["engine"]["model"] == "test-model"
        w = hb_b["window"]
        cores = truth.cores(w["start"], w["end"])
        assert cores is not None
        for shard in shards.values():
            assert abs(shard["cpu_cores"]["mean"] - cores) <= 0.05 + 0.02 * cores, (shard, cores)
            assert shard["cpu_cores"]["max"] >= shard["cpu_cores"]["mean"]

        # A ConfigMap edit is picked up.
        cluster.played[b].volumes["config"].update({"agent.toml": ENGINE_CONFIG.replace(b'"engine"', b'"edited"')})
        until("node-b's edited shard", lambda: (hb := cluster.heartbeat("node-b")) and
              [s["id"] for s in hb["shards"]] == ["edited", "engine-cg"])  # fmt: skip

        # node-a's first token has expired (with the leeway): its heartbeats go on with the rotated one.
        until("a node-a heartbeat after its first token expired",
              lambda: (hb := cluster.heartbeat("node-a")) and hb["window"]["end"] > t0 + 15 + 30 + 1)  # fmt: skip
        assert "changed: using the new token" in pods.logs(a)
        refused = re.findall(r'nodesampler_requests_rejected_total\{kind="heartbeat",reason="(\w+)"\} (\S+)',
                             cluster.get_text("/metrics"))  # fmt: skip
        assert all(float(n) == 0 for _, n in refused), refused

        # The control plane keeps the known nodes on its replica's claim (written every 30 s).
        state = cluster.work / "claim-state-0" / "registry.json"
        until("the control plane's state file to hold both nodes", lambda: state.exists() and {"node-a", "node-b"}
              <= {n["registration"]["node"] for n in json.loads(state.read_text())["nodes"]}, timeout=90)  # fmt: skip
    finally:
        truth.stop()


CAPABILITIES = {21: "cap_sys_admin", 19: "cap_sys_ptrace", 24: "cap_sys_resource", 38: "cap_perfmon", 39: "cap_bpf",
                0: "cap_chown", 1: "cap_dac_override", 2: "cap_dac_read_search", 12: "cap_net_admin", 13: "cap_net_raw"}


def _agent_pid(name: str) -> int:
    r = subprocess.run(["podman", "inspect", "-f", "{{.State.Pid}}", name], capture_output=True, text=True)
    return int(r.stdout.strip())


def _capabilities(pid: int | str, which: str = "CapEff") -> set[str]:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(re.search(rf"^{which}:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
    return {CAPABILITIES.get(bit, f"cap_{bit}") for bit in range(64) if mask >> bit & 1}


def _effective_capabilities(name: str) -> set[str]:
    """The agent process's effective capabilities, read from the host."""
    return _capabilities(_agent_pid(name))


def _probe(name: str, probe: dict[str, Any]) -> int:
    """The exit status of an exec probe, run in the container as the kubelet runs it."""
    return subprocess.run(["podman", "exec", name, *probe["exec"]["command"]], capture_output=True).returncode


def test_the_liveness_probe_fails_when_sampling_stops(cluster: Cluster) -> None:
    container = pods.find("DaemonSet", "nodesampler-agent")["spec"]["template"]["spec"]["containers"][0]
    name = cluster.start_agent("node-live", cluster.issuer.token("node-live"))
    alive = cluster.work / name / "run" / "alive"  # the emptyDir, as the host sees it
    until("the agent's first window", alive.exists)
    for kind in ("startupProbe", "livenessProbe"):
        assert _probe(name, container[kind]) == 0, kind
    pid = _agent_pid(name)
    os.kill(pid, signal.SIGSTOP)  # a sampler that no longer runs (a GIL held for minutes looks the same)
    try:
        past = time.time() - 120
        os.utime(alive, (past, past))
        assert _probe(name, container["livenessProbe"]) != 0
    finally:
        os.kill(pid, signal.SIGCONT)
    until("the probe passing again once the agent runs", lambda: _probe(name, container["livenessProbe"]) == 0)


POD_UID = "5e1f0c7a-2b7d-4c1e-9f3a-0d6b8e4a1c22"
POD_CONTAINER = "ab" * 32


def test_a_pod_found_through_this_nodes_kubelet(cluster: Cluster, tmp_path: Path) -> None:
    """A `k8s:` shard in the unprivileged pod: the kubelet (on NODE_IP:10250,
    its serving certificate the cluster CA's for this node) names the pod and
    its container; the agent finds the container's processes by their cgroup,
    the host's path, seen from its own cgroup namespace."""
    cg = _cgroup_dir().parent / "kubepods" / "burstable" / f"pod{POD_UID}" / POD_CONTAINER
    kubelet = FakeKubelet(tmp_path, kubelet_serving_name("node-k"), cluster.cluster_ca, port=10250,
                          token="api-token-of-node-k")  # fmt: skip
    kubelet.pods = [pod_doc("inference", "llama-0", {"vllm": POD_CONTAINER}, {"app": "vllm"}, uid=POD_UID)]
    pod = start_group(QUARTER_WORKERS, "nodesampler-test-pod")
    try:
        cg.mkdir(parents=True)
        for pid in group_members(pod.pid):
            (cg / "cgroup.procs").write_text(str(pid))
        config = b'[[shard]]\nselect = "k8s:inference/app=vllm#vllm"\n'
        name = cluster.start_agent("node-k", cluster.issuer.token("node-k"), config=config)
        truth = CpuTruth(pod.pid)

        def judged() -> dict[str, Any] | None:
            hb = cluster.heartbeat("node-k")
            if not hb or truth.cores(hb["window"]["start"], hb["window"]["end"]) is None:
                return None
            return next((s | {"window": hb["window"]} for s in hb["shards"] if s["id"] == "inference/llama-0/vllm"),
                        None)  # fmt: skip

        shard = until("node-k's pod shard, the truth on both edges of its window", judged)
        truth.stop()
        assert shard["namespace"] == "inference" and shard["pod"] == "llama-0" and shard["container"] == "vllm"
        cores = truth.cores(shard["window"]["start"], shard["window"]["end"])
        assert cores is not None and abs(shard["cpu_cores"]["mean"] - cores) <= 0.05 + 0.02 * cores, (shard, cores)
        assert kubelet.refused == 0 and "NOT verified" not in pods.logs(name)
    finally:
        kubelet.stop()
        os.killpg(pod.pid, 9)
        pod.wait()
        until("the pod's cgroup to empty", lambda: not (cg / "cgroup.procs").read_text().strip(), timeout=10)
        for d in (cg, cg.parent, cg.parent.parent, cg.parent.parent.parent):
            d.rmdir()


def _judged(cluster: Cluster, truth: CpuTruth) -> dict[str, Any] | None:
    hb = cluster.heartbeat("node-b")
    if not hb or len(hb["shards"]) < 2 or hb["window"]["samples"] < 10:
        return None
    w = hb["window"]
    return hb if truth.cores(w["start"], w["end"]) is not None else None


def _post(path: str, body: dict[str, Any], token: str, cluster: Cluster) -> int:
    """POST to the agent port over TLS, verifying the Service's name (which
    resolves to loopback only inside the containers)."""
    context = ssl.create_default_context(cadata=cluster.tls["ca.crt"].decode())
    conn = http.client.HTTPSConnection(CP_HOST, 8081, context=context, timeout=10)
    conn.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", 8081), timeout=10),
                                    server_hostname=CP_HOST)  # fmt: skip
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Authorization": f"Bearer {token}",
                                                                  "Content-Type": "application/json"})  # fmt: skip
        return conn.getresponse().status
    finally:
        conn.close()


def test_tokens_that_are_not_this_nodes_are_refused(cluster: Cluster) -> None:
    body = {"node": "node-b", "hostname": "x", "kernel": "6.1", "agent_version": __version__, "backend": "proc"}
    i = cluster.issuer
    assert _post("/v1/register", body, i.token("node-a"), cluster) == 403  # node A's token, node B's body
    assert _post("/v1/register", body, i.token("node-b", ttl=-600), cluster) == 401  # expired
    assert _post("/v1/register", body, i.token("node-b", audience="kubernetes"), cluster) == 401
    assert _post("/v1/register", body, i.token("node-b", account="default"), cluster) == 401
    assert _post("/v1/register", body, TestIssuer(kid="stranger").token("node-b"), cluster) == 401
    assert _post("/v1/register", body, i.token(None), cluster) == 403  # before Kubernetes 1.30
    assert "names no node" in pods.logs("nodesampler-test-cp")


def test_a_wrong_ca_is_refused_and_said_once(cluster: Cluster) -> None:
    other = TestCA("not the control plane's CA").cert.public_bytes(_pem())
    name = cluster.start_agent("node-c", cluster.issuer.token("node-c"), ca=other)
    line = until("the agent's TLS complaint",
                 lambda: [x for x in pods.logs(name).splitlines() if "certificate" in x])  # fmt: skip
    assert len(line) == 1 and "not trusted" in line[0], line
    assert cluster.node("node-c") is None


def test_the_pages_need_a_user_and_the_pods_operator_forgets_through_the_socket(cluster: Cluster) -> None:
    """As deployed: the pages listener over TLS with the web config Secret's
    users, and `kubectl exec ... nodesampler forget` (here `podman exec`) as
    the pod's own user through the admin socket on its memory volume."""
    with pytest.raises(urllib.error.HTTPError) as refused:
        cluster.get_text("/api/nodes", user=None)
    assert refused.value.code == 401
    assert "nodes" in cluster.get_json("/api/nodes", user="prometheus")
    r = subprocess.run(["podman", "exec", "nodesampler-test-cp", "nodesampler", "forget", "no-such-node"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 1 and "404" in r.stderr, r.stderr


def test_a_replica_rolled_finds_its_nodes_on_its_claim_and_they_come_back(cluster: Cluster) -> None:
    """The StatefulSet rolled: the replica's pod made again on its claim (with
    the kubelet's ownership change for the pod's fsGroup, as at every mount)
    knows every node it held (its state file is there, not on the pod) and
    its incidents, and each node is fresh again once its agent's next
    heartbeat comes."""
    before = {n["node"] for n in cluster.get_json("/api/nodes?here=1")["nodes"] if n["state"] == "fresh"}
    assert before, "the earlier tests' agents heartbeat here"
    # An operator's incident, kept in the claim's incidents directory (made 0700 by the control plane).
    request = urllib.request.Request(f"{cluster.pages}/api/incidents", method="POST", data=json.dumps(
        {"nodes": sorted(before)[:1], "reason": "before the roll"}).encode(), headers={
        **basic("operator", cluster.passwords["operator"]), "Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10, context=cluster.context) as r:
        incident = json.loads(r.read())["id"]
    argv = (cluster.work / "nodesampler-test-cp.argv").read_text().split(" ")
    subprocess.run(["podman", "stop", "-t", "30", "nodesampler-test-cp"], capture_output=True, check=True)
    # The claim mounted again: the kubelet gives it, and all it holds, to the pod's fsGroup once more.
    sts = pods.find("StatefulSet", "nodesampler-controlplane")
    fs_group = sts["spec"]["template"]["spec"]["securityContext"]["fsGroup"]
    pods.kubelet_ownership(cluster.work / "claim-state-0", fs_group)
    pods.start(argv)  # a new pod: its emptyDirs as they were left here, its claim the same
    until("the control plane's /health", cluster._healthy)
    known = {n["node"] for n in cluster.get_json("/api/nodes?here=1")["nodes"]}
    assert before <= known, "known from the claim's state file, before any agent spoke again"
    # The kubelet gave the claim to the pod's fsGroup again at the mount (2770 and setgid on each
    # directory, the incidents' too): the control plane took it as its own, its incidents with it.
    incidents_dir = cluster.work / "claim-state-0" / "registry.json.incidents"
    assert incidents_dir.stat().st_mode & 0o7777 == 0o2770
    assert incident in [i["id"] for i in cluster.get_json("/api/incidents")["incidents"]]
    until("every node fresh again", lambda: before <= {n["node"] for n in cluster.get_json("/api/nodes?here=1")["nodes"]
                                                         if n["state"] == "fresh"})  # fmt: skip
    [known_before] = re.findall(r"registry state \S+: (\d+) nodes known from before", pods.logs("nodesampler-test-cp"))
    assert int(known_before) >= len(before)
