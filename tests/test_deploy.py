"""The deployment files say what the agent needs: each parsed, the fields that matter checked."""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from tests.podman_pods import find, manifests

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_kustomization_applies_every_manifest_once() -> None:
    k = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files - {"tls-secret.example.yaml"}  # the keys are the operator's
    kinds = {(d["kind"], d["metadata"]["name"]) for d in manifests()}
    assert kinds >= {("Namespace", "nodesampler"), ("ServiceAccount", "nodesampler-agent"),
                     ("DaemonSet", "nodesampler-agent"), ("ServiceAccount", "nodesampler-controlplane"),
                     ("ClusterRoleBinding", "nodesampler-controlplane-issuer-discovery"),
                     ("Deployment", "nodesampler-controlplane"), ("Service", "nodesampler-controlplane"),
                     ("Service", "nodesampler-pages"), ("NetworkPolicy", "nodesampler-controlplane"),
                     ("ServiceMonitor", "nodesampler")}  # fmt: skip
    for d in manifests():
        if d["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == "nodesampler", d["metadata"]["name"]


def test_daemonset() -> None:
    pod = find("DaemonSet", "nodesampler-agent")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["serviceAccountName"] == "nodesampler-agent"
    [agent] = pod["containers"]
    assert agent["securityContext"]["privileged"] is True
    assert agent["command"] == ["nodesampler", "agent"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["/sys"]["readOnly"] is True and volumes[mounts["/sys"]["name"]]["hostPath"]["path"] == "/sys"
    # The programs compile against the headers the image ships: none of the host's are mounted.
    assert not {"/lib/modules", "/usr/src"} & set(mounts)
    assert volumes[mounts["/host"]["name"]]["hostPath"]["path"] == "/" and mounts["/host"]["readOnly"] is True
    args = dict(a.removeprefix("--").split("=", 1) for a in agent["args"])
    assert args["host-root"] == "/host" and args["node"] == "$(NODE_NAME)"
    assert args["control-plane"].startswith("https://nodesampler-controlplane.nodesampler.svc:")
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The token is the pod's own, projected for our audience: no per-node Secret.
    token = next(m for m in agent["volumeMounts"] if args["token-file"].startswith(m["mountPath"] + "/"))
    sources = {s["serviceAccountToken"]["path"]: s["serviceAccountToken"]
               for s in volumes[token["name"]]["projected"]["sources"]}  # fmt: skip
    assert sources[args["token-file"].rsplit("/", 1)[1]]["audience"] == "nodesampler"
    # The kubelet's token is the API server's audience (the kubelet checks it there), on this node's kubelet.
    assert "audience" not in sources[args["kubelet-token-file"].rsplit("/", 1)[1]]
    assert args["kubelet-url"] == "https://$(NODE_IP):10250"
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    ca = next(m for m in agent["volumeMounts"] if args["ca-file"].startswith(m["mountPath"] + "/"))
    assert volumes[ca["name"]]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the key
    config = next(m for m in agent["volumeMounts"] if args["config"].startswith(m["mountPath"] + "/"))
    assert volumes[config["name"]]["configMap"]["optional"] is True


def test_the_agent_may_read_its_kubelets_pods_and_nothing_else() -> None:
    role = find("ClusterRole", "nodesampler-agent")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes/proxy"], "verbs": ["get"]}]
    binding = find("ClusterRoleBinding", "nodesampler-agent")
    assert binding["roleRef"]["name"] == "nodesampler-agent"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "nodesampler-agent", "namespace": "nodesampler"}]


def test_controlplane_verifies_the_agents_account() -> None:
    pod = find("Deployment", "nodesampler-controlplane")["spec"]["template"]["spec"]
    [cp] = pod["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in cp["args"])
    namespace, name = args["k8s-service-account"].split("/")
    agent_sa = find("ServiceAccount", "nodesampler-agent")["metadata"]
    assert (namespace, name) == (agent_sa["namespace"], agent_sa["name"])
    assert args["k8s-audience"] == "nodesampler" and "tls-cert" in args and "secret-file" not in args
    # The known nodes are kept on a volume the pod's user can write (the root file system is read-only).
    [state] = [m for m in cp["volumeMounts"] if args["state-file"].startswith(m["mountPath"] + "/")]
    assert not state.get("readOnly") and "emptyDir" in {v["name"]: v for v in pod["volumes"]}[state["name"]]
    binding = find("ClusterRoleBinding", "nodesampler-controlplane-issuer-discovery")
    assert binding["roleRef"]["name"] == "system:service-account-issuer-discovery"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": "nodesampler"}]  # fmt: skip
    policy = find("NetworkPolicy", "nodesampler-controlplane")["spec"]
    agent_port = int(args["listen"].rsplit(":", 1)[1])
    [agents_rule] = [r for r in policy["ingress"] if r["ports"][0]["port"] == agent_port]
    assert agents_rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nodesampler-agent"}}}]


def test_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.startswith("#") and "\nFROM ${BASE}" in text and "ARG BASE=debian:" in text
    assert "python3-bpfcc" in text and "--system-site-packages" in text and "--no-index" in text
    pins = [line for line in (DEPLOY / "image-requirements.txt").read_text().splitlines()
            if line and not line.startswith("#")]  # fmt: skip
    assert pins and all("==" in p for p in pins)
    assert {"numpy", "aiohttp", "PyJWT", "cryptography"} <= {p.split("==")[0] for p in pins}


def test_systemd_unit() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "nodesampler-agent.service")
    service = unit["Service"]
    assert " agent " in service["ExecStart"] and "--token-file=" in service["ExecStart"]
    assert service["Restart"] == "always" and service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_the_wheel_carries_the_kernel_programs(tmp_path: Path) -> None:
    root = DEPLOY.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(root)], check=True, capture_output=True)  # fmt: skip
    [wheel] = tmp_path.glob("nodesampler-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "bpf/sched_groups.bpf.c" in names and "sampler/bpf_sched.py" in names
