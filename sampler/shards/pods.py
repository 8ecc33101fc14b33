"""Pods as the kubelet reports them, and the `k8s:` selector that picks them.

`k8s:NAMESPACE/LABEL_SELECTOR[#CONTAINER]`: the pods of NAMESPACE (`*` for
every namespace) whose labels match LABEL_SELECTOR, in Kubernetes' own
syntax (`app=vllm`, `tier in (engine,router)`, `!canary`, requirements
joined by commas; empty: every pod), optionally one container of each.
Set-based `notin` and `!=` match a pod without the label, as in Kubernetes.

A pod document comes from whoever can create pods on the node: every field
is checked, and a pod that does not parse is left out, never half-read.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sampler.shards import container_ids

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = rf"(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}"
_VALUE = rf"(?:{_NAME})?"
LABEL_KEY = re.compile(_KEY)
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_EXISTS = re.compile(rf"(!?)\s*({_KEY})")
_EQUALS = re.compile(rf"({_KEY})\s*(==|=|!=)\s*({_VALUE})")
_IN = re.compile(rf"({_KEY})\s+(in|notin)\s*\(\s*({_VALUE}(?:\s*,\s*{_VALUE})*)\s*\)")

Labels = dict[str, str]
_PORT_FIELD = re.compile(r"\{(port|annotation):([^{}]+)\}")
# An engine's endpoint in a pod: its IP, and a port fixed, named or annotated.
METRICS_URL = re.compile(rf"https?://\{{pod_ip\}}:(?:[0-9]{{1,5}}|\{{port:{_NAME}\}}|\{{annotation:{_KEY}\}})(?:/[!-z|~]*)?")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "exists", "!exists", "in", "notin"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Labels) -> bool:
        value = labels.get(self.key)
        if self.op == "exists":
            return value is not None
        if self.op == "!exists":
            return value is None
        if self.op == "in":
            return value in self.values
        return value not in self.values


def parse_label_selector(text: str) -> tuple[Requirement, ...]:
    """Kubernetes' label selector syntax; ValueError naming the bad part."""
    if not text.isprintable():
        raise ValueError(f"label selector {text!r}: control characters")
    if not text.strip():
        return ()
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"label selector {text!r}: unbalanced parentheses")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    out = []
    for part in (p.strip() for p in parts):
        if m := _IN.fullmatch(part):
            values = frozenset(v.strip() for v in m.group(3).split(","))
            out.append(Requirement(m.group(1), m.group(2), values))
        elif m := _EQUALS.fullmatch(part):
            out.append(Requirement(m.group(1), "notin" if m.group(2) == "!=" else "in", frozenset({m.group(3)})))
        elif m := _EXISTS.fullmatch(part):
            out.append(Requirement(m.group(2), "!exists" if m.group(1) else "exists"))
        else:
            raise ValueError(f"label selector {text!r}: cannot read {part!r}")
    return tuple(out)


@dataclass(frozen=True)
class PodSelector:
    namespace: str | None  # None: every namespace
    labels: tuple[Requirement, ...]
    container: str | None = None

    @classmethod
    def parse(cls, text: str) -> PodSelector:
        """The part after `k8s:`."""
        namespace, sep, rest = text.partition("/")
        if not sep:
            raise ValueError(f"pod selector {text!r}: expected NAMESPACE/LABEL_SELECTOR[#CONTAINER]")
        if namespace != "*" and not _DNS_LABEL.fullmatch(namespace):
            raise ValueError(f"pod selector {text!r}: namespace {namespace!r} is not a namespace name or '*'")
        selector, hashed, container = rest.partition("#")
        if hashed and not _DNS_LABEL.fullmatch(container):
            raise ValueError(f"pod selector {text!r}: container {container!r} is not a container name")
        return cls(None if namespace == "*" else namespace, parse_label_selector(selector), container or None)

    def matches(self, pod: Pod) -> bool:
        return (self.namespace is None or pod.namespace == self.namespace) and all(
            r.matches(pod.labels) for r in self.labels
        )


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    uid: str
    labels: Labels = field(default_factory=dict)
    containers: dict[str, str] = field(default_factory=dict)  # container name -> its running id
    ip: str | None = None  # status.podIP
    # Short annotations (a port, a path) and named container ports: where an
    # engine's metrics endpoint is, for a `metrics_url` template.
    annotations: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def metrics_url(self, template: str) -> str | None:
        """`template` with `{pod_ip}`, `{port:NAME}` (a container port's
        number) and `{annotation:KEY}` (a port number) filled in; None where
        the pod has no such value."""
        if self.ip is None:
            return None
        host = f"[{self.ip}]" if ":" in self.ip else self.ip

        def port(m: re.Match[str]) -> str:
            kind, key = m.group(1), m.group(2)
            value = self.ports.get(key) if kind == "port" else self.annotations.get(key)
            if value is None or not str(value).isdigit() or not 0 < int(value) < 65536:
                raise KeyError(key)
            return str(int(value))

        try:
            return _PORT_FIELD.sub(port, template.replace("{pod_ip}", host))
        except KeyError:
            return None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _text(value: Any, limit: int = 253) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limit or not value.isprintable():
        raise ValueError(f"{value!r:.80} is not printable text of 1-{limit} characters")
    return value


def _ip(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"podIP {value!r:.80} is not an IP address") from None


def parse_pod(item: Any) -> Pod | None:
    """One pod of a PodList; None for a pod that has ended (Succeeded or
    Failed: no process of it can run). ValueError for one that does not read."""
    if not isinstance(item, dict):
        raise ValueError("a pod must be an object")
    meta, status = item.get("metadata"), item.get("status")
    status = {} if status is None else status
    if not isinstance(meta, dict) or not isinstance(status, dict):
        raise ValueError("a pod's metadata and status must be objects")
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    labels = meta.get("labels")
    labels = {} if labels is None else labels
    if not isinstance(labels, dict):
        raise ValueError("a pod's labels must be an object")
    containers = {}
    for kind in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        statuses = status.get(kind)
        statuses = [] if statuses is None else statuses
        if not isinstance(statuses, list):
            raise ValueError(f"a pod's {kind} must be a list")
        for cs in statuses:
            if not isinstance(cs, dict):
                raise ValueError(f"a pod's {kind} must hold objects")
            cid = cs.get("containerID")
            bare = container_ids.from_status(cid) if isinstance(cid, str) else None
            if bare is not None:  # none yet: not started
                containers[_text(cs.get("name"), 63)] = bare
    annotations = meta.get("annotations")
    # Kept only where short and printable: a port or a path, never a
    # last-applied-configuration (which costs nothing to skip, and fails no pod).
    annotations = {k: v for k, v in (annotations if isinstance(annotations, dict) else {}).items()
                   if isinstance(k, str) and isinstance(v, str) and len(k) <= 317 and 0 < len(v) <= 253
                   and (k + v).isprintable()}  # fmt: skip
    return Pod(
        _text(meta.get("namespace"), 63),
        _text(meta.get("name")),
        _text(meta.get("uid"), 64),
        {_text(k, 317): _text(v, 63) if v != "" else "" for k, v in labels.items()},
        containers,
        _ip(status.get("podIP")),
        annotations,
        _ports(item.get("spec")),
    )


def _ports(spec: Any) -> dict[str, int]:
    """The pod's named container ports (`spec.containers[].ports[]`); the first of a name wins."""
    out: dict[str, int] = {}
    containers = spec.get("containers") if isinstance(spec, dict) else None
    for c in containers if isinstance(containers, list) else []:
        ports = c.get("ports") if isinstance(c, dict) else None
        for p in ports if isinstance(ports, list) else []:
            if isinstance(p, dict) and isinstance(p.get("name"), str) and type(p.get("containerPort")) is int:
                out.setdefault(p["name"], p["containerPort"])
    return out


def parse_pod_list(data: bytes, skipped: Callable[[str], None]) -> list[Pod]:
    """The kubelet's `/pods` answer (a PodList). ValueError when it is not
    one; a pod that does not read is left out, its reason given to `skipped`."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValueError("not a PodList: no 'items' list")
    pods = []
    for i, item in enumerate(doc["items"]):
        try:
            pod = parse_pod(item)
        except ValueError as e:
            skipped(f"pod {i}: {e}")
            continue
        if pod is not None:
            pods.append(pod)
    return pods
