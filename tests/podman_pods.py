"""The shipped manifests' pods, run for real with podman.

podman 4.3's `kube play` knows no DaemonSet, so this maps a pod spec taken
from the YAML onto `podman run`, field by field, as the kubelet would: the
command and its args (with `$(VAR)` expanded from the env), the env (the
downward API's `spec.nodeName` from the node the test plays), privileged /
hostPID / user / read-only root / capabilities, memory and CPU limits, and
every volume: host paths as they are, Secrets, ConfigMaps and projected
service-account tokens as files the test writes the way the kubelet does
(a timestamped directory behind a `..data` symlink swapped atomically on
update). Networking is the host's: the cluster's Service names are added
to the containers' /etc/hosts as 127.0.0.1.

A field this mapping does not know fails the test: a manifest that grows
one must grow the mapping too, never be run half-understood.
"""

from __future__ import annotations

import atexit
import base64
import functools
import itertools
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KUBERNETES = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
POD_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# This host's hard nofile limit is 20,000: a container may not ask for more.
ULIMITS = ["--ulimit", "nofile=16384:16384", "--ulimit", "nproc=16384:16384"]

# `affinity` is the scheduler's: one test host runs every pod it plays.
KNOWN_POD = {"serviceAccountName", "automountServiceAccountToken", "hostPID", "priorityClassName",
             "terminationGracePeriodSeconds", "tolerations", "containers", "volumes", "securityContext",
             "affinity"}  # fmt: skip
KNOWN_CONTAINER = {"name", "image", "command", "args", "env", "securityContext", "resources", "volumeMounts",
                   "ports", "readinessProbe", "livenessProbe", "startupProbe"}  # fmt: skip
KNOWN_SECURITY = {"privileged", "runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem",
                  "allowPrivilegeEscalation", "capabilities", "seccompProfile", "fsGroup"}  # fmt: skip
SECCOMP = Path(__file__).resolve().parent.parent / "deploy" / "seccomp"
# containerd's RuntimeDefault, which the shipped manifests are written for:
# containers-common's profile (podman's own default) with the two rules
# containerd adds, bpf() with CAP_BPF and perf_event_open() with CAP_PERFMON.
# The shipped Localhost profile is exactly that, so it stands for both.
RUNTIME_DEFAULT = SECCOMP / "nodesampler-agent.json"


COMPONENTS = KUBERNETES.parent / "components"
COMPONENT_NAMES = sorted(p.name for p in COMPONENTS.iterdir())
# Every set of components an operator may list together, the empty one included.
COMBINATIONS = [list(c) for n in range(len(COMPONENT_NAMES) + 1) for c in itertools.combinations(COMPONENT_NAMES, n)]
# What `nodesampler kube-secrets deploy/kubernetes/secrets` writes (git ignores
# it): the shipped kustomization's secretGenerator reads it.
SHIPPED_SECRETS = KUBERNETES / "secrets"
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "generatorOptions",
                        "secretGenerator"}  # fmt: skip


@functools.cache
def sample_secrets() -> Path:
    """The files `nodesampler kube-secrets` writes, made once a test run: they
    stand for a checkout's deploy/kubernetes/secrets where it has none."""
    from nodesampler.cli.kube_secrets import write

    directory = Path(tempfile.mkdtemp(prefix="nodesampler-kube-secrets-"))
    atexit.register(shutil.rmtree, directory, True)
    write(directory / "secrets")
    return directory / "secrets"


def manifests(directory: Path = KUBERNETES, components: Iterable[str] = (),
              secrets: Path | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Every object `kubectl apply -k DIRECTORY` would apply, with the named
    `components` of deploy/components listed as a kustomization of the
    operator's would list them: the kustomize subset the shipped files use
    (resources, files or directories; components; JSON patches by kind and
    name; secretGenerator with fixed names). The generated Secrets read
    their files from `secrets` where given, else from beside the
    kustomization, else (the shipped one, in a checkout that made none)
    from `sample_secrets()`. tests/test_deploy.py checks it against
    `kubectl kustomize` of every combination."""
    docs = _render(directory, secrets)
    for name in components:
        _component(COMPONENTS / name, docs, secrets)
    return docs


def _render(directory: Path, secrets: Path | None) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"kustomization fields not mapped: {unknown}"
    assert kustomization["kind"] == "Kustomization"
    docs = _resources(directory, kustomization, secrets)
    for path in kustomization.get("components", []):
        _component((directory / path).resolve(), docs, secrets)
    _patch(docs, kustomization)
    return docs


def _component(directory: Path, docs: list[dict[str, Any]], secrets: Path | None) -> None:
    component = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert component["kind"] == "Component" and not set(component) - KUSTOMIZATION_FIELDS, directory
    docs.extend(_resources(directory, component, secrets))
    _patch(docs, component)


def _resources(directory: Path, kustomization: dict[str, Any], secrets: Path | None) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in kustomization.get("resources", []):
        path = (directory / name).resolve()
        if path.is_dir():
            docs.extend(_render(path, secrets))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    if kustomization.get("secretGenerator"):
        # Hashed names would need every reference rewritten, the ServiceMonitor's too.
        assert kustomization["generatorOptions"] == {"disableNameSuffixHash": True}
    for generator in kustomization.get("secretGenerator", []):
        assert not set(generator) - {"name", "namespace", "type", "files", "literals"}, generator
        data: dict[str, bytes] = {}
        for literal in generator.get("literals", []):
            key, _, value = literal.partition("=")
            data[key] = value.encode()
        for entry in generator.get("files", []):
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = _secret_file(directory, path, secrets)
        docs.append({"apiVersion": "v1", "kind": "Secret",
                     "metadata": {"name": generator["name"], "namespace": generator["namespace"]},
                     "type": generator.get("type", "Opaque"),
                     "data": {k: base64.b64encode(v).decode() for k, v in data.items()}})  # fmt: skip
    return docs


def _secret_file(directory: Path, path: str, secrets: Path | None) -> bytes:
    assert path.startswith("secrets/"), f"a generated Secret's file outside secrets/: {path}"
    if secrets is not None:
        return (secrets / path.removeprefix("secrets/")).read_bytes()
    if (directory / path).exists() or directory != KUBERNETES:
        return (directory / path).read_bytes()
    return (sample_secrets() / path.removeprefix("secrets/")).read_bytes()


def secret_data(docs: list[dict[str, Any]], name: str) -> dict[str, bytes]:
    """A rendered Secret's keys, as the kubelet writes them into a volume."""
    [doc] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name]
    return {k: base64.b64decode(v) for k, v in doc["data"].items()}


def _patch(docs: list[dict[str, Any]], kustomization: dict[str, Any]) -> None:
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        [doc] = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        for op in yaml.safe_load(patch["patch"]):
            _json_patch(doc, op)


def _json_patch(doc: Any, op: dict[str, Any]) -> None:
    """One RFC 6902 operation: add, replace or remove."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    for part in parents:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    if op["op"] == "remove":
        del doc[int(last) if isinstance(doc, list) else last]
    elif op["op"] == "add" and isinstance(doc, list):
        doc.insert(len(doc) if last == "-" else int(last), op["value"])
    elif op["op"] in ("add", "replace"):
        if op["op"] == "replace":
            assert (int(last) < len(doc)) if isinstance(doc, list) else last in doc, f"nothing to replace at {op}"
        doc[int(last) if isinstance(doc, list) else last] = op["value"]
    else:
        raise AssertionError(f"patch op {op['op']} not mapped")


def find(kind: str, name: str) -> dict[str, Any]:
    """The shipped object, the ServiceMonitor's component included (it adds that object alone)."""
    [doc] = [d for d in manifests(components=["servicemonitor"]) if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def quantity_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([KMG]i?)?", q)
    assert m, f"quantity {q!r}"
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


def quantity_cpus(q: str) -> float:
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


class KubeletFiles:
    """A Secret / ConfigMap / projected volume's files, written as the kubelet's
    atomic writer does: `..TIMESTAMP/` holds them, `..data` points at it, and
    each file is a symlink through `..data`. `update` swaps `..data` at once."""

    def __init__(self, root: Path, files: dict[str, bytes], mode: int = 0o644) -> None:
        self.root, self.mode = root, mode
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        self.update(files)

    def update(self, files: dict[str, bytes]) -> None:
        stamp = self.root / f"..{time.time_ns()}"
        stamp.mkdir()
        stamp.chmod(0o755)
        for name, data in files.items():
            (stamp / name).write_bytes(data)
            (stamp / name).chmod(self.mode)
        tmp = self.root / "..data_tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(stamp.name)
        old = (self.root / "..data").resolve() if (self.root / "..data").is_symlink() else None
        os.replace(tmp, self.root / "..data")
        for entry in self.root.iterdir():
            if not entry.name.startswith("..") and entry.name not in files:
                entry.unlink()  # a key that went away
        for name in files:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")
        if old is not None and old != stamp:
            shutil.rmtree(old)


@dataclass
class PlayedPod:
    """What the test gives a pod that the cluster would: its node, the
    Secrets' and ConfigMaps' data, service-account tokens by audience."""

    node: str
    secrets: dict[str, dict[str, bytes]] = field(default_factory=dict)
    config_maps: dict[str, dict[str, bytes]] = field(default_factory=dict)
    sa_tokens: dict[str, str] = field(default_factory=dict)  # audience -> token ("" audience: the API server's)
    cluster_ca: bytes = b""
    host_ip: str = "127.0.0.1"  # the node's address (status.hostIP)
    hosts: dict[str, str] = field(default_factory=dict)  # Service DNS name -> address
    # A StatefulSet's claims (volumeClaimTemplates' names) -> the directory bound to this pod's: it
    # outlives the pod, as a PersistentVolume does, so a pod played again finds what it left.
    claims: dict[str, Path] = field(default_factory=dict)
    volumes: dict[str, KubeletFiles] = field(default_factory=dict)  # filled by podman_run

    def file_volume(self, spec: dict[str, Any], where: Path) -> KubeletFiles | None:
        """The files of a Secret, ConfigMap or projected volume; None for a missing optional one."""
        if "secret" in spec:
            src = spec["secret"]
            data = self.secrets.get(src["secretName"])
            if data is None:
                assert src.get("optional"), f"Secret {src['secretName']} is not given and not optional"
                return None
            return KubeletFiles(where, _items(data, src.get("items")))
        if "configMap" in spec:
            src = spec["configMap"]
            data = self.config_maps.get(src["name"])
            if data is None:
                assert src.get("optional"), f"ConfigMap {src['name']} is not given and not optional"
                return KubeletFiles(where, {})  # the kubelet mounts an empty directory
            return KubeletFiles(where, _items(data, src.get("items")))
        if "projected" in spec:
            files: dict[str, bytes] = {}
            for source in spec["projected"]["sources"]:
                [(kind, src)] = source.items()
                if kind == "configMap":
                    assert src["name"] == "kube-root-ca.crt", f"projected ConfigMap {src['name']} not mapped"
                    files.update(_items({"ca.crt": self.cluster_ca}, src.get("items")))
                    continue
                assert kind == "serviceAccountToken", f"projected source {kind} not mapped"
                assert 600 <= src["expirationSeconds"] <= 86400  # what the API server grants
                files[src["path"]] = self.sa_tokens[src.get("audience", "")].encode()
            return KubeletFiles(where, files, mode=0o600)
        raise AssertionError(f"volume {spec['name']}: kind not mapped: {sorted(spec)}")


def _items(data: dict[str, bytes], items: list[dict[str, str]] | None) -> dict[str, bytes]:
    if items is None:
        return dict(data)
    return {i["path"]: data[i["key"]] for i in items}


def _expand(text: str, env: dict[str, str]) -> str:
    # The kubelet expands $(VAR) from the container's env; $$(VAR) escapes.
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)



def kubelet_ownership(root: Path, gid: int) -> None:
    """What the kubelet does to a volume at every mount for the pod's fsGroup
    (`fsGroupChangePolicy: Always`, the default; pkg/volume/volume_linux.go):
    each file and directory given to the group, files made group-readable
    and -writable, directories group-writable and setgid (2770 at least)."""
    for path in (root, *root.rglob("*")):
        if path.is_symlink():
            continue
        st = path.lstat()
        os.chown(path, -1, gid)
        mode = stat.S_IMODE(st.st_mode) | (0o2770 if path.is_dir() else 0o660)
        path.chmod(mode)

def podman_run(pod: dict[str, Any], played: PlayedPod, name: str, work: Path, image: str,
               extra: Iterable[str] = ()) -> list[str]:  # fmt: skip
    """`podman run -d ...` for the pod's one container, as the pod spec says."""
    unknown = set(pod) - KNOWN_POD
    assert not unknown, f"pod spec fields not mapped: {unknown}"
    [c] = pod["containers"]
    unknown = set(c) - KNOWN_CONTAINER
    assert not unknown, f"container fields not mapped: {unknown}"
    assert c["image"] == image, f"the manifest runs {c['image']}, the build made {image}"
    # A private cgroup namespace, as containerd gives every container on a
    # cgroup v2 node (the harder case: the agent must see the host's paths),
    # and a UTS namespace of its own named after the pod, as every pod without
    # hostNetwork has.
    argv = ["podman", "run", "-d", "--name", name, "--runtime", "runc", *ULIMITS, "--network", "host",
            "--cgroupns", "private", "--uts", "private", "--hostname", name]  # fmt: skip
    for host, address in played.hosts.items():
        argv += ["--add-host", f"{host}:{address}"]
    if pod.get("hostPID"):
        argv += ["--pid", "host"]
    pod_sc = pod.get("securityContext", {})
    sc = c.get("securityContext", {})
    unknown = (set(pod_sc) | set(sc)) - KNOWN_SECURITY
    assert not unknown, f"securityContext fields not mapped: {unknown}"
    if sc.get("privileged"):
        argv.append("--privileged")
    seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile"))
    if seccomp is not None and not sc.get("privileged"):
        kind = seccomp["type"]
        assert kind in ("RuntimeDefault", "Localhost"), f"seccomp profile {kind} not mapped"
        profile = RUNTIME_DEFAULT if kind == "RuntimeDefault" else SECCOMP / seccomp["localhostProfile"]
        argv += ["--security-opt", f"seccomp={profile}"]
    user = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if user is not None:
        argv += ["--user", f"{user}:{sc.get('runAsGroup', pod_sc.get('runAsGroup', user))}"]
    if sc.get("readOnlyRootFilesystem"):
        argv += ["--read-only", "--read-only-tmpfs=false"]  # the kubelet mounts no /tmp: only the pod's volumes
    if sc.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    for cap in sc.get("capabilities", {}).get("drop", []):
        argv += ["--cap-drop", cap]
    for cap in sc.get("capabilities", {}).get("add", []):
        argv += ["--cap-add", cap]
    limits = c.get("resources", {}).get("limits", {})
    if "memory" in limits:
        argv += ["--memory", str(quantity_bytes(limits["memory"]))]
    if "cpu" in limits:
        argv += ["--cpus", str(quantity_cpus(limits["cpu"]))]
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            fields = {"spec.nodeName": played.node, "status.hostIP": played.host_ip}
            assert path in fields, f"downward API field {path} not mapped"
            env[e["name"]] = fields[path]
    for k, v in env.items():
        argv += ["--env", f"{k}={v}"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        spec = volumes.get(m["name"]) or {"claim": played.claims[m["name"]]}
        options = ["ro"] if m.get("readOnly") else ["rw"]
        if m.get("mountPropagation") == "HostToContainer":
            options.append("rslave")
        if "claim" in spec:
            # A volume as a provisioner makes it (root's, 755), then given to the pod's fsGroup at
            # this mount and every later one, with what it holds, as the kubelet does.
            source = spec["claim"]
            if not source.exists():
                source.mkdir(parents=True)
                os.chown(source, 0, 0)
                source.chmod(0o755)
            if "fsGroup" in pod_sc:
                kubelet_ownership(source, pod_sc["fsGroup"])
        elif "hostPath" in spec:
            source = Path(spec["hostPath"]["path"])
            assert spec["hostPath"].get("type", "Directory") == "Directory" and source.is_dir(), spec
        elif "emptyDir" in spec:
            source = work / name / m["name"]  # the kubelet's: empty, writable by the pod's user
            source.mkdir(parents=True, exist_ok=True)
            source.chmod(0o777)
        else:
            files = played.file_volume(spec, work / name / m["name"])
            if files is None:
                continue  # a missing optional Secret: no mount
            played.volumes[m["name"]] = files
            source = files.root
        argv += ["--volume", f"{source}:{m['mountPath']}:{','.join(options)}"]
    if pod.get("automountServiceAccountToken", True):
        sa = KubeletFiles(work / name / "serviceaccount", {"token": played.sa_tokens[""].encode(),
                                                           "ca.crt": played.cluster_ca,
                                                           "namespace": b"nodesampler"})  # fmt: skip
        argv += ["--volume", f"{sa.root}:{POD_SA_DIR}:ro"]
    command = [_expand(a, env) for a in c.get("command", [])]
    args = [_expand(a, env) for a in c.get("args", [])]
    if command:
        argv += ["--entrypoint", command[0]]
    argv += [*extra, image, *command[1:], *args]
    return argv


def start(argv: list[str]) -> str:
    subprocess.run(["podman", "rm", "-f", "-t", "0", argv[argv.index("--name") + 1]], capture_output=True)
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(argv)}\n{r.stderr}"
    return r.stdout.strip()


def logs(name: str) -> str:
    r = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
    return r.stdout + r.stderr


def remove(name: str) -> None:
    subprocess.run(["podman", "rm", "-f", "-t", "5", name], capture_output=True)
