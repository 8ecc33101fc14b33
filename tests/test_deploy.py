"""The deployment files say what the agent needs: each parsed, the fields that matter checked."""

from __future__ import annotations

import base64
import configparser
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import yaml

from tests.podman_pods import COMBINATIONS, COMPONENT_NAMES, find, manifests, sample_secrets, secret_data

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_kustomization_applies_every_manifest_once() -> None:
    k = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files
    kinds = {(d["kind"], d["metadata"]["name"]) for d in manifests()}
    assert kinds >= {("Namespace", "nodesampler"), ("ServiceAccount", "nodesampler-agent"),
                     ("DaemonSet", "nodesampler-agent"), ("ServiceAccount", "nodesampler-controlplane"),
                     ("ClusterRoleBinding", "nodesampler-controlplane-issuer-discovery"),
                     ("StatefulSet", "nodesampler-controlplane"), ("Service", "nodesampler-controlplane"),
                     ("PodDisruptionBudget", "nodesampler-controlplane"),
                     ("Service", "nodesampler-pages"), ("NetworkPolicy", "nodesampler-controlplane"),
                     ("NetworkPolicy", "nodesampler-agent"),
                     # Generated from what `nodesampler kube-secrets` writes: nothing to prepare in the cluster.
                     ("Secret", "nodesampler-controlplane-tls"), ("Secret", "nodesampler-controlplane-web"),
                     ("Secret", "nodesampler-controlplane-peers"),
                     ("Secret", "nodesampler-prometheus-auth")}  # fmt: skip
    # No object of a CRD: `kubectl apply -k` works on a cluster without the Prometheus Operator.
    assert {d["apiVersion"].split("/")[0] for d in manifests()} <= {"v1", "apps", "policy", "networking.k8s.io",
                                                                    "rbac.authorization.k8s.io"}  # fmt: skip
    for d in manifests():
        if d["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == "nodesampler", d["metadata"]["name"]


def test_every_secret_a_manifest_names_is_generated() -> None:
    """The Secrets the pods mount and the ServiceMonitor reads, each key they
    name, are the kustomization's own: none must exist in the cluster first."""
    docs = manifests(components=["servicemonitor"])
    secrets = {d["metadata"]["name"]: set(d["data"]) for d in docs if d["kind"] == "Secret"}
    named: set[tuple[str, str | None]] = set()
    for kind in ("DaemonSet", "StatefulSet"):
        [workload] = [d for d in docs if d["kind"] == kind]
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                items = volume["secret"].get("items") or [{"key": None}]
                named |= {(volume["secret"]["secretName"], item["key"]) for item in items}
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    endpoint = monitor["spec"]["endpoints"][0]
    for ref in (endpoint["tlsConfig"]["ca"]["secret"], *endpoint["basicAuth"].values()):
        named.add((ref["name"], ref["key"]))
    assert {name for name, _ in named} == set(secrets)
    for name, key in named:
        assert key is None or key in secrets[name], (name, key)
    assert secrets["nodesampler-controlplane-tls"] == {"tls.crt", "tls.key", "ca.crt"}
    assert secrets["nodesampler-controlplane-peers"] == {"secret"}  # --peer-secret-file=/etc/nodesampler/peers/secret


def test_daemonset() -> None:
    pod = find("DaemonSet", "nodesampler-agent")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["serviceAccountName"] == "nodesampler-agent"
    [agent] = pod["containers"]
    assert agent["command"] == ["nodesampler", "agent"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["/sys"]["readOnly"] is True and volumes[mounts["/sys"]["name"]]["hostPath"]["path"] == "/sys"
    # The programs compile against the headers the image ships: none of the host's are mounted.
    assert not {"/lib/modules", "/usr/src"} & set(mounts)
    assert volumes[mounts["/host"]["name"]]["hostPath"]["path"] == "/" and mounts["/host"]["readOnly"] is True
    args = dict(a.removeprefix("--").split("=", 1) for a in agent["args"])
    assert args["host-root"] == "/host" and args["node"] == "$(NODE_NAME)"
    # Every replica of the control plane, each by its own name (the StatefulSet's, through its headless Service).
    assert _each("control-plane", agent["args"]) == replica_urls()
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The token is the pod's own, projected for our audience: no per-node Secret.
    token = next(m for m in agent["volumeMounts"] if args["token-file"].startswith(m["mountPath"] + "/"))
    sources = {s["serviceAccountToken"]["path"]: s["serviceAccountToken"]
               for s in volumes[token["name"]]["projected"]["sources"] if "serviceAccountToken" in s}  # fmt: skip
    assert sources[args["token-file"].rsplit("/", 1)[1]]["audience"] == "nodesampler"
    # The kubelet's token is the API server's audience (the kubelet checks it there), on this node's kubelet.
    assert "audience" not in sources[args["kubelet-token-file"].rsplit("/", 1)[1]]
    assert args["kubelet-url"] == "https://$(NODE_IP):10250"
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    ca = next(m for m in agent["volumeMounts"] if args["ca-file"].startswith(m["mountPath"] + "/"))
    assert volumes[ca["name"]]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the key
    config = next(m for m in agent["volumeMounts"] if args["config"].startswith(m["mountPath"] + "/"))
    assert volumes[config["name"]]["configMap"]["optional"] is True
    # The kubelet's certificate is verified against the cluster's CA, projected from kube-root-ca.crt.
    assert "kubelet-insecure-skip-tls-verify" not in args
    ca_source = next(m for m in agent["volumeMounts"] if args["kubelet-ca-file"].startswith(m["mountPath"] + "/"))
    [root_ca] = [s["configMap"] for s in volumes[ca_source["name"]]["projected"]["sources"] if "configMap" in s]
    assert root_ca == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "cluster-ca.crt"}]}


def test_the_agent_holds_only_the_privileges_its_features_use() -> None:
    pod = find("DaemonSet", "nodesampler-agent")["spec"]["template"]["spec"]
    [agent] = pod["containers"]
    sc = agent["securityContext"]
    assert "privileged" not in sc and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "PERFMON", "SYS_RESOURCE"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "tolerations" not in pod  # an operator opts into tainted nodes (docs/deployment.md)
    assert not {"hostNetwork", "hostIPC"} & set(pod)
    # Every host path read-only, and only / and /sys.
    volumes = {v["name"]: v for v in pod["volumes"]}
    host = {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"] for m in agent["volumeMounts"]
            if "hostPath" in volumes[m["name"]]}  # fmt: skip
    assert host == {"/sys": "/sys", "/host": "/"}
    assert all(m.get("readOnly") for m in agent["volumeMounts"] if m["mountPath"] in host)
    # The probes read the file the agent touches each window, in a volume of its own.
    args = dict(a.removeprefix("--").split("=", 1) for a in agent["args"])
    [run] = [m for m in agent["volumeMounts"] if args["alive-file"].startswith(m["mountPath"] + "/")]
    assert volumes[run["name"]]["emptyDir"]["medium"] == "Memory"
    for kind in ("startupProbe", "livenessProbe"):
        assert args["alive-file"] in " ".join(agent[kind]["exec"]["command"]), kind


def test_the_shipped_seccomp_profile_gates_bpf_on_its_capabilities() -> None:
    profile = json.loads((DEPLOY / "seccomp" / "nodesampler-agent.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    rules = {(name, r["action"], tuple(r.get("includes", {}).get("caps", ())),
              tuple(r.get("excludes", {}).get("caps", ())))
             for r in profile["syscalls"] for name in r["names"]}  # fmt: skip
    for name, cap in (("bpf", "CAP_BPF"), ("perf_event_open", "CAP_PERFMON")):
        allowed = {rule for rule in rules if rule[0] == name and rule[1] == "SCMP_ACT_ALLOW"}
        assert allowed == {(name, "SCMP_ACT_ALLOW", ("CAP_SYS_ADMIN",), ()), (name, "SCMP_ACT_ALLOW", (cap,), ())}
    # Neither is open to a container without its capability, nor is a module load.
    unconditional = {r[0] for r in rules if r[1] == "SCMP_ACT_ALLOW" and not r[2]}
    assert not {"init_module", "bpf", "perf_event_open"} & unconditional


def test_the_components_change_only_what_they_say() -> None:
    base = {(d["kind"], d["metadata"]["name"]): d for d in manifests()}

    def changed(component: str) -> dict[tuple[str, str], Any]:
        docs = {(d["kind"], d["metadata"]["name"]): d for d in manifests(components=[component])}
        assert docs.keys() >= base.keys()
        return {k: d for k, d in docs.items() if d != base.get(k)}

    assert COMPONENT_NAMES == ["before-1.36", "privileged", "seccomp-localhost", "servicemonitor"]
    ds = ("DaemonSet", "nodesampler-agent")
    privileged = changed("privileged")
    assert privileged.keys() == {ds}
    assert privileged[ds]["spec"]["template"]["spec"]["containers"][0]["securityContext"] == {
        "privileged": True, "readOnlyRootFilesystem": True}  # fmt: skip
    old = changed("before-1.36")
    assert old.keys() == {("ClusterRole", "nodesampler-agent")}
    assert [r["resources"] for r in old[("ClusterRole", "nodesampler-agent")]["rules"]] == [["nodes/pods"],
                                                                                            ["nodes/proxy"]]
    localhost = changed("seccomp-localhost")
    assert localhost.keys() == {ds}
    profile = localhost[ds]["spec"]["template"]["spec"]["securityContext"]["seccompProfile"]
    assert profile["type"] == "Localhost" and (DEPLOY / "seccomp" / profile["localhostProfile"]).is_file()
    assert changed("servicemonitor").keys() == {("ServiceMonitor", "nodesampler")}
    # Together, each does what it does alone: a CRI-O cluster before 1.36 takes both of its components.
    role = ("ClusterRole", "nodesampler-agent")
    both = {(d["kind"], d["metadata"]["name"]): d for d in manifests(components=["before-1.36", "seccomp-localhost"])}
    assert both[ds] == localhost[ds] and both[role] == old[role]


def _canonical(docs: list[dict[str, Any]]) -> list[str]:
    """Objects as sorted JSON, a Secret's data decoded (kustomize folds its base64 into lines)."""
    out = []
    for d in docs:
        if d["kind"] == "Secret":
            d = {**d, "data": {k: base64.b64decode(v).decode() for k, v in d["data"].items()}}
        out.append(json.dumps(d, sort_keys=True))
    return sorted(out)


def operators_kustomization(tmp_path: Path, components: list[str]) -> Path:
    """A copy of deploy/ with what `nodesampler kube-secrets` writes, and a
    kustomization of the operator's that lists the base and `components`."""
    deploy = tmp_path / "deploy"
    if not deploy.exists():
        shutil.copytree(DEPLOY, deploy, ignore=shutil.ignore_patterns("secrets"))
        shutil.copytree(sample_secrets(), deploy / "kubernetes" / "secrets")
    mine = tmp_path / ("mine-" + "+".join(components))
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../deploy/kubernetes"], "components": [f"../deploy/components/{c}" for c in components]}))
    return mine


def kubectl_kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    """`kubectl kustomize` (make setup-test installs kubectl)."""
    assert shutil.which("kubectl"), "no kubectl: make setup-test installs it (deploy/host-setup.sh)"
    return subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True)


def test_the_tests_kustomize_renders_every_combination_as_kubectl_does(tmp_path: Path) -> None:
    secrets = tmp_path / "deploy/kubernetes/secrets"
    for components in COMBINATIONS:
        mine = operators_kustomization(tmp_path, components)
        r = kubectl_kustomize(mine)
        assert r.returncode == 0, (components, r.stderr)
        rendered = _canonical([d for d in yaml.safe_load_all(r.stdout) if d])
        assert rendered == _canonical(manifests(mine)) == _canonical(manifests(components=components, secrets=secrets))
    # The shipped base as it is applied: `kubectl apply -k deploy/kubernetes` once kube-secrets has run.
    r = kubectl_kustomize(tmp_path / "deploy/kubernetes")
    assert r.returncode == 0 and _canonical([d for d in yaml.safe_load_all(r.stdout) if d]) == _canonical(
        manifests(secrets=secrets))  # fmt: skip


def test_without_kube_secrets_kubectl_names_the_missing_file(tmp_path: Path) -> None:
    shutil.copytree(DEPLOY, tmp_path / "deploy", ignore=shutil.ignore_patterns("secrets"))
    r = kubectl_kustomize(tmp_path / "deploy/kubernetes")
    assert r.returncode != 0 and "secrets/tls.crt" in r.stderr, r.stderr


def test_the_agent_may_read_its_kubelets_pods_and_nothing_else() -> None:
    role = find("ClusterRole", "nodesampler-agent")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes/pods"], "verbs": ["get"]}]
    binding = find("ClusterRoleBinding", "nodesampler-agent")
    assert binding["roleRef"]["name"] == "nodesampler-agent"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "nodesampler-agent", "namespace": "nodesampler"}]


def _each(flag: str, args: list[str]) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{flag}=")]


def replica_urls(listener: str = "listen") -> list[str]:
    """A listener of each replica (the agents'; "pages-listen": the pages'), as the
    StatefulSet names its pods and its headless Service their DNS."""
    sts = find("StatefulSet", "nodesampler-controlplane")
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    [cp] = sts["spec"]["template"]["spec"]["containers"]
    port = dict(a.removeprefix("--").split("=", 1) for a in cp["args"])[listener].rsplit(":", 1)[1]
    return [f"https://{name}-{i}.{service}.nodesampler.svc:{port}" for i in range(sts["spec"]["replicas"])]


def test_the_control_plane_is_replicas_that_survive_each_other() -> None:
    """Three replicas, each its own state on its own claim, one a machine, one
    down at a time; each peers with every replica (itself included) with a
    Secret of their own, and the headless Service names each."""
    sts = find("StatefulSet", "nodesampler-controlplane")["spec"]
    pod = sts["template"]["spec"]
    [cp] = pod["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in cp["args"])
    assert sts["replicas"] == 3 and sts["podManagementPolicy"] == "Parallel"
    assert _each("peer", cp["args"]) == replica_urls("pages-listen")
    mounts = {m["mountPath"]: m for m in cp["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[args["peer-secret-file"].rsplit("/", 1)[0]]["name"]]["secret"]["secretName"] == (
        "nodesampler-controlplane-peers")  # fmt: skip
    assert args["peer-ca-file"].startswith("/etc/nodesampler/tls/")  # the CA the agents trust names every replica
    [claim] = sts["volumeClaimTemplates"]
    [state] = [m for m in cp["volumeMounts"] if args["state-file"].startswith(m["mountPath"] + "/")]
    assert state["name"] == claim["metadata"]["name"] and state["name"] not in volumes
    [spread] = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == sts["selector"]["matchLabels"]
    pdb = find("PodDisruptionBudget", "nodesampler-controlplane")["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"] == sts["selector"]
    service = find("Service", sts["serviceName"])["spec"]
    assert service["clusterIP"] == "None" and service["selector"] == sts["selector"]["matchLabels"]
    # The replicas speak to each other on the pages port, which the policy opens (behind TLS and tokens).
    policy = find("NetworkPolicy", "nodesampler-controlplane")["spec"]
    pages_port = int(args["pages-listen"].rsplit(":", 1)[1])
    assert {p.rsplit(":", 1)[1] for p in _each("peer", cp["args"])} == {str(pages_port)}
    assert [r for r in policy["ingress"] if r["ports"][0]["port"] == pages_port] == [
        {"ports": [{"protocol": "TCP", "port": pages_port}]}]  # fmt: skip


def test_controlplane_verifies_the_agents_account() -> None:
    pod = find("StatefulSet", "nodesampler-controlplane")["spec"]["template"]["spec"]
    [cp] = pod["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in cp["args"])
    namespace, name = args["k8s-service-account"].split("/")
    agent_sa = find("ServiceAccount", "nodesampler-agent")["metadata"]
    assert (namespace, name) == (agent_sa["namespace"], agent_sa["name"])
    assert args["k8s-audience"] == "nodesampler" and "web-config-file" in args and "secret-file" not in args
    # The known nodes are kept on a volume the pod's user can write (the root file system is read-only).
    [state] = [m for m in cp["volumeMounts"] if args["state-file"].startswith(m["mountPath"] + "/")]
    assert not state.get("readOnly")
    binding = find("ClusterRoleBinding", "nodesampler-controlplane-issuer-discovery")
    assert binding["roleRef"]["name"] == "system:service-account-issuer-discovery"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": "nodesampler"}]  # fmt: skip
    policy = find("NetworkPolicy", "nodesampler-controlplane")["spec"]
    agent_port = int(args["listen"].rsplit(":", 1)[1])
    [agents_rule] = [r for r in policy["ingress"] if r["ports"][0]["port"] == agent_port]
    assert agents_rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nodesampler-agent"}}}]
    # The agent's own: nothing in; out to the control plane's agent port, kubelets, DNS and engines' metrics.
    agent = find("NetworkPolicy", "nodesampler-agent")["spec"]
    assert agent["policyTypes"] == ["Ingress", "Egress"] and agent["ingress"] == []
    [to_cp] = [r for r in agent["egress"] if r["ports"] == [{"protocol": "TCP", "port": agent_port}]]
    assert to_cp["to"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nodesampler-controlplane"}}}]
    ports = {(p["protocol"], p["port"]) for r in agent["egress"] for p in r["ports"]}
    assert ports == {("TCP", agent_port), ("TCP", 10250), ("UDP", 53), ("TCP", 53), ("TCP", 8000)}


def test_the_pages_are_served_over_tls_to_users_and_scraped_so() -> None:
    """The generated web config is one our parser takes, naming the TLS
    Secret's files where the StatefulSet mounts them; the probes speak HTTPS;
    the ServiceMonitor scrapes with TLS and a user; the admin socket is on a
    volume of the pod's own."""
    from controlplane.listen.web_config import parse

    docs = manifests(components=["servicemonitor"])
    pod = find("StatefulSet", "nodesampler-controlplane")["spec"]["template"]["spec"]
    [cp] = pod["containers"]
    args = [a.removeprefix("--").split("=", 1) for a in cp["args"]]
    flags = dict(args)
    mounts = {m["mountPath"]: m for m in cp["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_dir, config_name = flags["web-config-file"].rsplit("/", 1)
    secret = volumes[mounts[config_dir]["name"]]["secret"]["secretName"]
    config = parse(secret_data(docs, secret)[config_name], Path(config_dir))
    assert config.tls is not None and set(config.users) == {"prometheus", "operator"}
    tls_dir = str(config.tls.cert_file.parent)
    assert volumes[mounts[tls_dir]["name"]]["secret"]["secretName"] == "nodesampler-controlplane-tls"
    assert cp["readinessProbe"]["httpGet"]["scheme"] == cp["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert [v for k, v in args if k == "pages-host"] == ["nodesampler-pages.nodesampler.svc", "localhost"]
    socket_dir = flags["admin-socket"].rsplit("/", 1)[0]
    assert "emptyDir" in volumes[mounts[socket_dir]["name"]] and not mounts[socket_dir].get("readOnly")
    [endpoint] = find("ServiceMonitor", "nodesampler")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["serverName"] == "nodesampler-pages.nodesampler.svc"
    auth = secret_data(docs, endpoint["basicAuth"]["username"]["name"])
    assert set(auth) == {"username", "password"} and auth["username"] == b"prometheus"


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
    # Its memory limit fits the start-up peak docs/deployment.md measured (256M once did not), as the pod's does.
    docs = (DEPLOY.parent / "docs" / "deployment.md").read_text()
    peak = re.search(r"peaks once, at start, at (\d+) MiB", docs)
    assert peak is not None
    assert service["MemoryMax"].endswith("M") and int(service["MemoryMax"][:-1]) >= int(peak.group(1))
    agent = next(d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "agent.yaml").read_text())
                 if d and d["kind"] == "DaemonSet")  # fmt: skip
    [container] = [c for c in agent["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Mi") and int(limit[:-2]) >= int(peak.group(1))


def test_the_wheel_carries_the_kernel_programs(tmp_path: Path) -> None:
    root = DEPLOY.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(root)], check=True, capture_output=True)  # fmt: skip
    [wheel] = tmp_path.glob("nodesampler-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "bpf/sched_groups.bpf.c" in names and "sampler/kernel/sched.py" in names
