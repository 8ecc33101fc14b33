"""Pods as the agent finds them: container ids in cgroup paths of every
runtime and driver, Kubernetes' label selector syntax, the kubelet's
PodList (pending, terminating, restarted, hostile), a `k8s:` shard made
concrete per pod, and a kubelet over TLS that answers, fails or hangs."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sampler.agent.config import ConfigError, parse_config
from sampler.shards import container_ids
from sampler.shards.kubelet import KubeletPods
from sampler.shards.pods import PodSelector, parse_label_selector, parse_pod_list
from sampler.shards.selectors import Selector, ShardSpec, pod_watches
from tests.certs import TestCA, kubelet_serving_name
from tests.fakekubelet import FakeKubelet, pod_doc

A = "a" * 64
B = "0123456789abcdef" * 4
UID = "6f0e7d2c-4b1a-4c8e-9d3f-2a1b0c9d8e7f"
UID_ = UID.replace("-", "_")

# Real shapes of /proc/<pid>/cgroup paths, per runtime, cgroup driver and version.
CGROUP_PATHS = {
    "containerd, systemd, v2": f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
                               f"cri-containerd-{A}.scope",
    "containerd, systemd, v1": f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
                               f"cri-containerd-{A}.scope",
    "containerd, cgroupfs, v1": f"/kubepods/burstable/pod{UID}/{A}",
    "containerd, cgroupfs, v2, guaranteed": f"/kubepods/pod{UID}/{A}",
    "CRI-O, systemd, v2": f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{A}.scope",
    "CRI-O, cgroupfs, v1": f"/kubepods/burstable/pod{UID}/crio-{A}",
    "Docker, systemd, v1": f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
                           f"docker-{A}.scope",
    "Docker, cgroupfs, v1": f"/kubepods/burstable/pod{UID}/{A}",
    "private cgroup namespace, v2": f"/../../kubepods-burstable-pod{UID_}.slice/cri-containerd-{A}.scope",
    "a container's own sub-cgroup": f"/kubepods/burstable/pod{UID}/{A}/workers/w1",
    "a sub-cgroup named like another container": f"/kubepods/burstable/pod{UID}/{A}/{B}",
    "k3s, containerd, cgroupfs": f"/kubepods/besteffort/pod{UID}/{A}",
}  # fmt: skip
NOT_CONTAINERS = {
    "CRI-O's conmon": f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
                      f"crio-conmon-{A}.scope",
    "the pod's slice": f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
    "a system service": "/system.slice/containerd.service",
    "the root": "/",
    "in its own private namespace": "/",
    "a short hex name": "/kubepods/burstable/pod1/abcdef",
    "upper-case hex": f"/kubepods/burstable/pod{UID}/{A.upper()}",
}  # fmt: skip


@pytest.mark.parametrize("shape", list(CGROUP_PATHS))
def test_each_runtime_and_driver_names_the_container(shape: str) -> None:
    assert container_ids.from_cgroup_path(CGROUP_PATHS[shape]) == A


@pytest.mark.parametrize("shape", list(NOT_CONTAINERS))
def test_paths_that_name_no_container(shape: str) -> None:
    assert container_ids.from_cgroup_path(NOT_CONTAINERS[shape]) is None


def test_v1_hierarchies_of_one_process() -> None:
    lines = ["12:pids:/kubepods/burstable/pod1/" + A, "3:cpu,cpuacct:/kubepods/burstable/pod1/" + A, "1:name=systemd:/"]
    assert container_ids.from_cgroup_paths([line.split(":", 2)[2] for line in lines]) == A
    assert container_ids.from_cgroup_paths(["/", "/user.slice"]) is None


@pytest.mark.parametrize("status, bare", [
    (f"containerd://{A}", A), (f"cri-o://{A}", A), (f"docker://{A}", A),
    (f"rkt://{A}", None), ("containerd://abc", None), (f"containerd://{A}/../x", None), ("", None),
])  # fmt: skip
def test_kubelet_container_ids(status: str, bare: str | None) -> None:
    assert container_ids.from_status(status) == bare


LABELS = {"app": "vllm", "tier": "engine", "app.kubernetes.io/name": "vllm", "canary": "true"}


@pytest.mark.parametrize("selector, matches", [
    ("", True), ("app=vllm", True), ("app==vllm", True), ("app!=vllm", False), ("app=sglang", False),
    ("tier in (engine,router)", True), ("tier in (router)", False), ("tier notin (router, batch)", True),
    ("canary", True), ("!canary", False), ("missing", False), ("!missing", True), ("missing!=x", True),
    ("missing notin (x)", True), ("app=vllm,tier=engine", True), ("app=vllm, tier=router", False),
    ("app.kubernetes.io/name=vllm", True), ("tier in ( engine , router ),app=vllm", True),
])  # fmt: skip
def test_label_selectors_as_kubernetes_reads_them(selector: str, matches: bool) -> None:
    reqs = parse_label_selector(selector)
    assert all(r.matches(LABELS) for r in reqs) is matches


@pytest.mark.parametrize("selector", [
    "app=", "=vllm", "app=vllm,", ",app=vllm", "app in vllm", "tier in (engine", "tier in engine)",
    "app=vl lm", "app>1", "a" * 64 + "=x", "app=" + "v" * 64, "app=vllm\n", "tier in ((x))", "-app=x",
])  # fmt: skip
def test_bad_label_selectors_are_refused(selector: str) -> None:
    # "app=" is the one exception Kubernetes reads (an empty value); ours too.
    if selector == "app=":
        assert parse_label_selector(selector)[0].values == frozenset({""})
        return
    with pytest.raises(ValueError, match="label selector"):
        parse_label_selector(selector)


@pytest.mark.parametrize("text, error", [
    ("default", "NAMESPACE/"), ("Default/app=x", "namespace"), ("ns_1/app=x", "namespace"),
    ("default/app=x#Engine", "container"), ("default/app=x#", "container"), ("default/app=(", "label selector"),
])  # fmt: skip
def test_bad_pod_selectors_are_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        PodSelector.parse(text)


def podlist(*pods: dict[str, Any]) -> bytes:
    return json.dumps({"kind": "PodList", "items": list(pods)}).encode()


def test_pod_list_pending_terminating_restarted_and_ended() -> None:
    skipped: list[str] = []
    pods = parse_pod_list(podlist(
        pod_doc("llm", "engine-0", {"vllm": A}, {"app": "vllm"}),
        pod_doc("llm", "engine-1", {"vllm": ""}, {"app": "vllm"}, phase="Pending", ip=None),
        pod_doc("llm", "engine-2", {"vllm": B}, {"app": "vllm"}, deletionTimestamp="2026-11-30T10:00:00Z"),
        pod_doc("llm", "job-0", {"main": A[::-1]}, phase="Succeeded"),
        pod_doc("llm", "engine-3", {"vllm": B[::-1]}, runtime="cri-o"),
    ), skipped.append)  # fmt: skip
    assert [p.name for p in pods] == ["engine-0", "engine-1", "engine-2", "engine-3"] and not skipped
    assert pods[0].containers == {"vllm": A} and pods[0].ip == "10.244.1.7"
    assert pods[1].containers == {} and pods[1].ip is None  # not started: no container yet
    assert pods[2].containers == {"vllm": B}  # terminating: its processes still run until they exit
    assert pods[3].containers == {"vllm": B[::-1]}


@pytest.mark.parametrize("hostile", [
    {"metadata": "x"}, 7, {"metadata": {"name": "p", "namespace": "n", "uid": "u", "labels": []}},
    {"metadata": {"name": "p\x1b[2J", "namespace": "n", "uid": "u"}},
    {"metadata": {"name": "p" * 300, "namespace": "n", "uid": "u"}},
    {"metadata": {"name": "p", "namespace": "n", "uid": "u"}, "status": {"podIP": "10.0.0.1; rm"}},
    {"metadata": {"name": "p", "namespace": "n", "uid": "u"}, "status": {"containerStatuses": "all"}},
    {"metadata": {"name": "p", "namespace": "n", "uid": "u", "labels": {"a": 3}}},
])  # fmt: skip
def test_a_pod_that_does_not_read_is_left_out_alone(hostile: object) -> None:
    skipped: list[str] = []
    pods = parse_pod_list(podlist(hostile, pod_doc("llm", "engine-0", {"vllm": A})), skipped.append)  # type: ignore[arg-type]
    assert [p.name for p in pods] == ["engine-0"] and len(skipped) == 1


@pytest.mark.parametrize("body", [b"", b"<html>", b'{"items": 3}', b"[]", b"\xff"])
def test_a_kubelet_answer_that_is_no_pod_list_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_pod_list(body, lambda why: None)


def k8s_watch(text: str, **kwargs: object) -> ShardSpec:
    return ShardSpec("k8s:0", Selector.parse(text), **kwargs)  # type: ignore[arg-type]


def test_a_pod_selector_is_one_shard_per_pod() -> None:
    pods = parse_pod_list(podlist(
        pod_doc("llm", "engine-0", {"vllm": A, "sidecar": B}, {"app": "vllm", "model": "llama-3-8b", "replica": "r0"}),
        pod_doc("llm", "engine-1", {"vllm": A[::-1]}, {"app": "vllm"}),
        pod_doc("other", "engine-9", {"vllm": B[::-1]}, {"app": "vllm"}),
        pod_doc("llm", "router-0", {"router": "c" * 64}, {"app": "router"}),
    ), lambda why: None)  # fmt: skip
    made = pod_watches(k8s_watch("k8s:llm/app=vllm", model_label="model", replica_label="replica",
                                 metrics_url="http://{pod_ip}:8000/metrics"), pods)  # fmt: skip
    assert [w.id for w in made] == ["llm/engine-0", "llm/engine-1"]
    assert made[0].selector == Selector("containers", ",".join(sorted([A, B])))
    assert (made[0].model, made[0].replica, made[0].namespace, made[0].pod) == ("llama-3-8b", "r0", "llm", "engine-0")
    assert made[1].model is None and made[0].metrics_url == "http://10.244.1.7:8000/metrics"
    # The endpoint's port: fixed, a container port's name, or an annotation.
    named = pod_doc("llm", "engine-5", {"vllm": "d" * 64}, {"app": "vllm"}, ip="fd00::5",
                    annotations={"prometheus.io/port": "9400", "kubectl.kubernetes.io/last-applied-configuration":
                                 "{\n" + "x" * 100_000 + "}"})  # fmt: skip
    named["spec"]["containers"][0]["ports"] = [{"name": "metrics", "containerPort": 8080}, {"containerPort": 1}]
    [five] = parse_pod_list(podlist(named), lambda why: None)
    assert five.metrics_url("http://{pod_ip}:{port:metrics}/metrics") == "http://[fd00::5]:8080/metrics"
    assert five.metrics_url("http://{pod_ip}:{annotation:prometheus.io/port}/m") == "http://[fd00::5]:9400/m"
    assert five.metrics_url("http://{pod_ip}:{port:http}/metrics") is None  # no such port: no queue figures
    assert five.metrics_url("http://{pod_ip}:{annotation:kubectl.kubernetes.io/last-applied-configuration}/") is None
    assert pods[1].metrics_url("http://{pod_ip}:{annotation:prometheus.io/port}/metrics") is None
    one = pod_watches(k8s_watch("k8s:*/app=vllm#vllm"), pods)
    assert [(w.id, w.container, w.selector.value) for w in one] == [
        ("llm/engine-0/vllm", "vllm", A), ("llm/engine-1/vllm", "vllm", A[::-1]),
        ("other/engine-9/vllm", "vllm", B[::-1]),
    ]
    assert pod_watches(k8s_watch("k8s:llm/app=vllm#sidecar"), pods)[0].selector.value == B


def test_the_config_takes_pod_selectors() -> None:
    [w] = parse_config(b'[[shard]]\nselect = "k8s:llm/app.kubernetes.io/name=vllm,tier in (engine)#vllm"\n'
                       b'model_label = "model"\nreplica_label = "app.kubernetes.io/instance"\n'
                       b'metrics_url = "http://{pod_ip}:{port:metrics}/metrics"\n')  # fmt: skip
    assert w.selector.kind == "k8s" and w.model_label == "model" and w.replica_label == "app.kubernetes.io/instance"
    for bad, why in [
        (b'[[shard]]\nid = "x"\nselect = "k8s:llm/app=vllm"\n', "drop 'id'"),
        (b'[[shard]]\nselect = "k8s:llm/app=vllm"\nmodel_label = "bad label!"\n', "model_label"),
        (b'[[shard]]\nid = "x"\nselect = "pgid:1"\nmodel_label = "model"\n', "model_label"),
        (b'[[shard]]\nselect = "k8s:llm/app=vllm"\nmetrics_url = "http://10.0.0.1:8000/metrics"\n', "pod_ip"),
        (b'[[shard]]\nselect = "k8s:llm/app=vllm"\nmetrics_url = "http://{pod_ip}:{env:HOME}/metrics"\n', "pod_ip"),
        (b'[[shard]]\nselect = "k8s:llm/app=vllm"\nmetrics_url = "http://{pod_ip}:{port:a b}/m"\n', "metrics_url"),
        (b'[[shard]]\nid = "x"\nselect = "pgid:1"\nmetrics_url = "http://{pod_ip}:8000/metrics"\n', "pod_ip"),
        (b'[[shard]]\nselect = "k8s:llm/app in (vllm"\n', "label selector"),
    ]:
        with pytest.raises(ConfigError, match=why.replace("(", r"\(")):
            parse_config(bad)


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    k = FakeKubelet(tmp_path)
    yield k
    k.stop()


def test_the_kubelet_over_tls_with_the_token(kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture) -> None:
    kubelet.pods = [pod_doc("llm", "engine-0", {"vllm": A}, {"app": "vllm"})]
    pods = KubeletPods(kubelet.url, kubelet.token_file, kubelet.ca_file, poll_s=3600, refresh_s=0)
    try:
        n = pods.wait_for_poll(0, 10)
        assert [p.key for p in pods.pods() or []] == ["llm/engine-0"] and pods.error is None
        # A kubelet that fails, hangs or answers nonsense: the last good answer stays, said once a reason.
        for mode, said in (("error", "HTTP 500"), ("garbage", "not a PodList"), ("slow", "not whole within 0.5 s")):
            kubelet.mode = mode
            pods.deadline_s = 0.5
            with caplog.at_level(logging.WARNING, logger="sampler.shards.kubelet"):
                pods.refresh()
                n = pods.wait_for_poll(n, 10)
            assert [p.key for p in pods.pods() or []] == ["llm/engine-0"]
            assert said in (pods.error or ""), pods.error
        assert sum("the last answer is kept" in r.getMessage() for r in caplog.records) == 3
        kubelet.mode = "ok"
        kubelet.pods.append(pod_doc("llm", "engine-1", {"vllm": B}, {"app": "vllm"}))
        pods.refresh()
        pods.wait_for_poll(n, 10)
        assert [p.key for p in pods.pods() or []] == ["llm/engine-0", "llm/engine-1"] and kubelet.refused == 0
    finally:
        pods.close()


def test_a_kubelet_with_an_untrusted_certificate_or_a_wrong_token_gives_no_pods(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    kubelet.pods = [pod_doc("llm", "engine-0", {"vllm": A})]
    other = TestCA("another CA").write_ca(tmp_path / "other.crt")  # it did not sign the kubelet's certificate
    untrusted = KubeletPods(kubelet.url, kubelet.token_file, other)
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    refused = KubeletPods(kubelet.url, wrong, kubelet.ca_file)
    try:
        untrusted.wait_for_poll(0, 10)
        refused.wait_for_poll(0, 10)
        assert untrusted.pods() is None and "CERTIFICATE_VERIFY_FAILED" in (untrusted.error or "")
        assert refused.pods() is None and "HTTP 401" in (refused.error or "")
    finally:
        untrusted.close()
        refused.close()


def test_the_token_goes_only_to_this_nodes_kubelet(tmp_path: Path) -> None:
    """A kubelet-serving certificate (the cluster's signer: system:nodes) must
    name this node: another node's kubelet at a reused address gets no token."""
    kubelet = FakeKubelet(tmp_path, subject=kubelet_serving_name("node-7"))
    kubelet.pods = [pod_doc("llm", "engine-0", {"vllm": A})]
    ours = KubeletPods(kubelet.url, kubelet.token_file, kubelet.ca_file, node="node-7")
    other = KubeletPods(kubelet.url, kubelet.token_file, kubelet.ca_file, node="node-8")
    try:
        ours.wait_for_poll(0, 10)
        assert [p.key for p in ours.pods() or []] == ["llm/engine-0"] and kubelet.requests == 1
        other.wait_for_poll(0, 10)
        assert other.pods() is None and kubelet.requests == 1  # refused before the request: no token sent
        assert other.error is not None and "'system:node:node-7''s, not system:node:node-8's" in other.error
    finally:
        ours.close()
        other.close()
        kubelet.stop()


def test_a_self_signed_kubelet_is_read_only_by_the_loud_opt_out(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    kubelet.pods = [pod_doc("llm", "engine-0", {"vllm": A})]
    verified = KubeletPods(kubelet.url, kubelet.token_file, node="n1")  # the system's trust store: not the kubelet's CA
    with caplog.at_level(logging.WARNING, logger="sampler.shards.kubelet"):
        unverified = KubeletPods(kubelet.url, kubelet.token_file, node="n1", verify=False)
        try:
            verified.wait_for_poll(0, 10)
            unverified.wait_for_poll(0, 10)
            assert verified.pods() is None and "CERTIFICATE_VERIFY_FAILED" in (verified.error or "")
            assert [p.key for p in unverified.pods() or []] == ["llm/engine-0"]
        finally:
            verified.close()
            unverified.close()
    [said] = [r.getMessage() for r in caplog.records if "NOT verified" in r.getMessage()]
    assert "--kubelet-insecure-skip-tls-verify" in said and "token goes to whatever answers" in said


def test_an_unknown_container_asks_the_kubelet_once_not_at_every_walk(kubelet: FakeKubelet) -> None:
    now = [0.0]
    pods = KubeletPods(kubelet.url, kubelet.token_file, kubelet.ca_file, poll_s=3600, refresh_s=2, clock=lambda: now[0])
    try:
        n = pods.wait_for_poll(0, 10)  # the first poll, at start
        now[0] = 10.0
        pods.note_unknown({A})  # a pod's sandbox: named by no container status
        n = pods.wait_for_poll(n, 10)
        for t in range(11, 60):  # walks after: the kubelet was asked since it was met
            now[0] = float(t)
            pods.note_unknown({A})
        assert pods.wait_for_poll(n, 0.2) == n and kubelet.requests == 2
        now[0] = 75.0  # a minute on: asked about once more
        pods.note_unknown({A})
        pods.wait_for_poll(n, 10)
        assert kubelet.requests == 3
    finally:
        pods.close()
