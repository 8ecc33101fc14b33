"""Incidents: every sample of the nodes named, from a few minutes before a
moment to a minute after, fetched from their rings (controlplane/samples/hindsight.py)
and kept on disk, for the question asked after the fact.

An incident is started by an Alertmanager webhook (`POST /api/alertmanager`,
the nodes from the alerts' `node` label), by the control plane when an
engine's starvation verdict turns on, or by an operator (`POST
/api/incidents`). Each node's samples are fetched as a span; once every
span is done (or given up, its rest named missing), the incident is written
to its directory:

    ID.json        what it is: reason, nodes, span, what is missing (written first, and again when done)
    ID.K.json      the samples of its K-th node, in the raw block's shapes (docs/wire-format.md)

each file written whole (a temporary file, flushed, renamed; mode 0600) in
a directory of mode 0700 the control plane owns. A file's name is never a
node's (a 240-character name was too long for one and cost every node's
samples), and each node is written on its own: one node's failure costs
that node alone.

Bounded under abuse (tests/test_incidents.py, "bounded and fair"):
- the directory: at most `per_node_bytes` of one node's samples and
  `max_bytes` in all, each incident's own file counted; at most
  `MAX_INCIDENTS`; the oldest nodes' files go first, an incident whose
  every file went goes with them, and one that holds no samples goes
  `EMPTY_KEPT_S` after it is done;
- starts: each source has its own budget (`START_BUDGETS`), so neither a
  node's heartbeats nor anyone else spends the Alertmanager's or an
  operator's; a node's starvation verdicts start at most one incident each
  `STARVED_AGAIN_S`, however its engines are named;
- exports: `MAX_EXPORTS` at once; JSON streamed from the files as they
  are, CSV a node's samples at a time.

An incident that was being captured when the control plane stopped is said
to be so, its samples missing.
"""

from __future__ import annotations

import asyncio
import collections
import csv
import io
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from controlplane.keys import REGISTRY
from controlplane.listen.bodies import request_body
from controlplane.listen.page_access import may_change_fleet
from controlplane.samples.hindsight import Fetch, HindsightFetches, Refused
from controlplane.state.registry import NodeRegistry
from controlplane.state.registry_state import write

log = logging.getLogger(__name__)

BEFORE_S = 300.0  # an incident's samples start this long before its moment (--incident-before) ...
AFTER_S = 60.0  # ... and end this long after it (--incident-after); an alert seen again within both starts none
MAX_NODES = 32  # nodes in one incident: an alert storm naming the fleet captures the first
PER_NODE_BYTES = 64 * 2**20  # one node's samples in all its incidents
MAX_BYTES = 512 * 2**20  # the directory (--incidents-mib)
MAX_BODY = 1 << 20  # a webhook's body: Alertmanager's for a few hundred alerts
# Each source's incidents: (at once, then one each so many seconds). A flood of valid webhooks costs
# its own 429s; the fleet's starvation verdicts share one budget, and each node one a STARVED_AGAIN_S.
START_BUDGETS = {"alertmanager": (10, 6.0), "operator": (10, 6.0), "starvation": (10, 60.0)}
STATES = ("capturing", "done", "interrupted", "failed")
STARVED_AGAIN_S = 600.0  # a node starved again within this starts none: a flapping verdict is one incident
MAX_INCIDENTS = 1000  # kept at once, the oldest dropped first
EMPTY_KEPT_S = 3600.0  # an incident that holds no samples (every node missing) is said for an hour, then goes
MAX_EXPORTS = 2  # exports read at once (a CSV parses a node's samples whole: about 12 bytes a byte of file)
EXPORT_CHUNK = 1 << 20  # bytes read from a file, or rows' text gathered, before each write to the client
CHECK_S = 1.0  # how often a capture looks at its spans
ID = re.compile(r"[0-9]{8}T[0-9]{6}-[0-9a-f]{6}")


@dataclass
class Incident:
    id: str
    reason: str
    source: str  # alertmanager, starvation, operator
    nodes: list[str]
    t_from: float
    t_to: float
    created: float
    state: str = "capturing"  # done; interrupted: the control plane stopped while capturing
    missing: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per node
    dropped: list[str] = field(default_factory=list)  # nodes whose samples went for the budget
    bytes: dict[str, int] = field(default_factory=dict)  # per node, on disk
    meta_bytes: int = 0  # its own file's size, not said: counted in the budget
    done_at: float | None = None  # when it stopped capturing (not said: its file's time)

    def part_name(self, node: str) -> str:
        """The file of a node's samples: its place in `nodes`, never its name."""
        return f"{self.id}.{self.nodes.index(node)}.json"

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "reason": self.reason, "source": self.source, "nodes": self.nodes,
                "from": round(self.t_from, 6), "to": round(self.t_to, 6), "created": round(self.created, 3),
                "state": self.state, "missing": self.missing, "dropped": self.dropped, "bytes": self.bytes}  # fmt: skip

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Incident:
        return cls(id=str(body["id"]), reason=str(body["reason"]), source=str(body["source"]),
                   nodes=[str(n) for n in body["nodes"]], t_from=float(body["from"]), t_to=float(body["to"]),
                   created=float(body["created"]), state=str(body["state"]), missing=dict(body.get("missing", {})),
                   dropped=[str(n) for n in body.get("dropped", [])], bytes=dict(body.get("bytes", {})))  # fmt: skip


def is_own(st: os.stat_result) -> bool:
    """A directory no other user may write: this process's, writable by
    nobody else, or by a group this process is in. The kubelet makes a claim
    group-writable and setgid for the pod's fsGroup at every mount (mode
    2770, `fsGroupChangePolicy: Always`): that group is the pod's own."""
    if st.st_uid != os.geteuid() or st.st_mode & 0o002:
        return False
    return not st.st_mode & 0o020 or st.st_gid == os.getegid() or st.st_gid in os.getgroups()


class Incidents:
    def __init__(self, directory: Path, fetches: HindsightFetches, registry: NodeRegistry,
                 max_bytes: int = MAX_BYTES, per_node_bytes: int = PER_NODE_BYTES, before_s: float = BEFORE_S,
                 after_s: float = AFTER_S, wall: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.directory, self.fetches, self.registry = directory, fetches, registry
        self.before_s, self.after_s = before_s, after_s
        self.max_bytes, self.per_node_bytes = max_bytes, min(per_node_bytes, max_bytes)
        self.wall = wall
        self._by_id: dict[str, Incident] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._starts = {source: (float(burst), wall()) for source, (burst, _) in START_BUDGETS.items()}
        self._alerts_seen: dict[str, float] = {}  # fingerprint -> when
        self._starved_at: dict[str, float] = {}  # node -> when its engines last started one
        self._exports = asyncio.Semaphore(MAX_EXPORTS)
        # Counted for /metrics (controlplane/samples/surface_metrics.py), fixed label sets.
        self.started = dict.fromkeys(START_BUDGETS, 0)
        self.refused = dict.fromkeys(START_BUDGETS, 0)

    # --- on disk -----------------------------------------------------------------

    def load(self) -> int:
        """The incidents the directory holds; one captured when the control
        plane stopped is said interrupted. A file that is not one is left alone."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        owned = self.directory.stat()
        if not is_own(owned):
            raise OSError(f"{self.directory} is not the control plane's own (owned by uid {owned.st_uid}, group "
                          f"{owned.st_gid}, mode {owned.st_mode & 0o7777:o}): incidents are kept in a directory no "
                          "other user may write (group-writable only by a group of this process's, as a pod's "
                          "fsGroup makes it)")  # fmt: skip
        for path in sorted(self.directory.glob("*.json")):
            if not ID.fullmatch(path.stem):
                continue
            try:
                body = path.read_bytes()
                incident = Incident.from_json(json.loads(body))
                incident.meta_bytes = len(body)
                incident.done_at = path.stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                log.warning("incident file %s cannot be read (%s): left alone", path, e)
                continue
            if incident.state == "capturing":
                incident.state = "interrupted"
                for node in incident.nodes:
                    incident.missing.setdefault(node, []).append(
                        {"from": incident.t_from, "to": incident.t_to,
                         "why": "the control plane stopped while capturing"})  # fmt: skip
                self._write_meta(incident)
            self._by_id[incident.id] = incident
        self._keep_within_budget()
        return len(self._by_id)

    def _part(self, incident: Incident, node: str) -> Path:
        return self.directory / incident.part_name(node)

    def _write_meta(self, incident: Incident) -> None:
        body = json.dumps(incident.as_json()).encode()
        write(self.directory / f"{incident.id}.json", body)
        incident.meta_bytes = len(body)

    def bytes_on_disk(self) -> int:
        return sum(i.meta_bytes + sum(i.bytes.values()) for i in self._by_id.values())

    def kept(self) -> dict[tuple[str, str], int]:
        """Incidents kept, by (source, state): every pair, 0 where none."""
        counts = dict.fromkeys(((source, state) for source in START_BUDGETS for state in STATES), 0)
        for incident in self._by_id.values():
            key = (incident.source, incident.state)
            if key in counts:
                counts[key] += 1
        return counts

    # --- started ---------------------------------------------------------------

    def _may_start(self, source: str) -> bool:
        now = self.wall()
        burst, every = START_BUDGETS[source]
        tokens, then = self._starts[source]
        tokens = min(float(burst), tokens + (now - then) / every)
        self._starts[source] = (tokens - 1, now) if tokens >= 1 else (tokens, now)
        return tokens >= 1

    def start(self, reason: str, source: str, nodes: Iterable[str], at: float | None = None) -> Incident:
        """An incident of the nodes around `at` (now when None): their spans
        asked for at once, written when all are done. Refused (429) when
        `source` starts incidents faster than its budget (`START_BUDGETS`)."""
        if not self._may_start(source):
            self.refused[source] += 1
            raise Refused(f"incidents from {source} are started more often than once each "
                          f"{START_BUDGETS[source][1]:.0f} s")  # fmt: skip
        self.started[source] += 1
        now = self.wall()
        at = now if at is None else min(at, now)
        named = list(dict.fromkeys(nodes))[:MAX_NODES]
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
        incident = Incident(f"{stamp}-{secrets.token_hex(3)}", reason[:500], source, named, at - self.before_s,
                            at + self.after_s, now)  # fmt: skip
        spans: dict[str, Fetch] = {}
        for node in named:
            state = self.registry.get(node)
            held = state.hindsight_held_seconds() if state is not None else None
            try:
                spans[node] = self.fetches.ask(node, incident.t_from, incident.t_to, f"incident {incident.id}", held,
                                               for_incident=True, ahead_s=self.after_s)  # fmt: skip
            except Refused as e:
                incident.missing[node] = [{"from": incident.t_from, "to": incident.t_to, "why": str(e)}]
        self._by_id[incident.id] = incident
        self._write_meta(incident)
        log.info("incident %s: %s (%s), %d nodes", incident.id, incident.reason, source, len(named))
        task = asyncio.get_running_loop().create_task(self._capture(incident, spans))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return incident

    async def _capture(self, incident: Incident, spans: dict[str, Fetch]) -> None:
        try:
            while any(f.finished_at is None for f in spans.values()):
                await asyncio.sleep(CHECK_S)
                self.fetches.sweep()
            await asyncio.to_thread(self._write_parts, incident, spans)
        except Exception:
            log.exception("incident %s could not be written", incident.id)
            incident.state = "failed"
        incident.state = "done" if incident.state == "capturing" else incident.state
        incident.done_at = self.wall()
        try:
            self._write_meta(incident)
            self._keep_within_budget()
        except OSError as e:
            log.error("incident %s: %s", incident.id, e)

    def _write_parts(self, incident: Incident, spans: dict[str, Fetch]) -> None:
        for node, fetch in spans.items():
            if fetch.missing:
                incident.missing[node] = fetch.missing
            try:
                body = json.dumps(fetch.samples(), separators=(",", ":")).encode()
                if len(body) > self.per_node_bytes:
                    raise ValueError(f"its samples ({len(body) >> 20} MiB) are more than a node may keep")
                write(self._part(incident, node), body)
            except (OSError, ValueError) as e:  # this node's samples alone
                log.warning("incident %s: %s's samples not kept: %s", incident.id, node[:253], e)
                incident.missing.setdefault(node, []).append(
                    {"from": incident.t_from, "to": incident.t_to, "why": f"not written: {str(e)[:200]}"})  # fmt: skip
                continue
            incident.bytes[node] = len(body)

    def _keep_within_budget(self) -> None:
        """The oldest nodes' samples dropped until each node and the whole
        (each incident's own file counted) are within budget; incidents past
        `MAX_INCIDENTS`, and those that hold no samples `EMPTY_KEPT_S` after
        they are done, go whole."""
        now = self.wall()
        finished = sorted((i for i in self._by_id.values() if i.state != "capturing"), key=lambda i: i.created)
        over = len(self._by_id) - MAX_INCIDENTS
        for incident in finished:
            if over > 0 or (not incident.bytes and now - (incident.done_at or incident.created) > EMPTY_KEPT_S):
                self._drop(incident)
                over -= 1
        parts = [(i.created, i, node, size) for i in self._by_id.values() for node, size in i.bytes.items()]
        parts.sort(key=lambda p: p[0])
        per_node: collections.Counter[str] = collections.Counter()
        total = sum(i.meta_bytes for i in self._by_id.values())
        for _, _, node, size in parts:
            per_node[node] += size
            total += size
        for _, incident, node, size in parts:
            if per_node[node] <= self.per_node_bytes and total <= self.max_bytes:
                continue
            self._part(incident, node).unlink(missing_ok=True)
            del incident.bytes[node]
            incident.dropped.append(node)
            per_node[node] -= size
            total -= size
            if not incident.bytes and incident.state != "capturing":  # nothing of it left: it goes
                total -= incident.meta_bytes
                self._drop(incident)
                log.info("incident %s dropped: the incidents' budget is spent", incident.id)
            else:
                self._write_meta(incident)
        for incident in sorted(self._by_id.values(), key=lambda i: i.created):  # their own files, the oldest first
            if total <= self.max_bytes:
                break
            if incident.state != "capturing":
                total -= incident.meta_bytes + sum(incident.bytes.values())
                self._drop(incident)

    def _drop(self, incident: Incident) -> None:
        for node in list(incident.bytes):
            self._part(incident, node).unlink(missing_ok=True)
        (self.directory / f"{incident.id}.json").unlink(missing_ok=True)
        self._by_id.pop(incident.id, None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- what starts one ---------------------------------------------------------

    def alerts(self, body: Any) -> dict[str, Any]:
        """Alertmanager's webhook (version 4): one incident for the firing
        alerts' nodes not already captured, around the earliest start. What
        was done, for the answer."""
        if not isinstance(body, dict) or str(body.get("version")) != "4" or not isinstance(body.get("alerts"), list):
            raise ValueError("not an Alertmanager webhook body of version 4")
        for i, alert in enumerate(body["alerts"][:1000]):  # checked whole first: a refused body changes nothing
            if isinstance(alert, dict) and "startsAt" in alert and _rfc3339(alert["startsAt"]) is None:
                raise ValueError(f"alerts[{i}].startsAt: not an RFC 3339 time (as Alertmanager writes it, "
                                 f"2026-01-02T15:04:05.999Z): {str(alert['startsAt'])[:40]!r}")  # fmt: skip
        now = self.wall()
        for fingerprint, seen in list(self._alerts_seen.items()):
            if now - seen > self.before_s + self.after_s:
                del self._alerts_seen[fingerprint]
        nodes: dict[str, None] = {}
        names: dict[str, None] = {}
        unknown: list[str] = []
        starts = []
        for alert in body["alerts"][:1000]:
            if not isinstance(alert, dict) or alert.get("status") != "firing":
                continue
            labels: dict[str, Any] = alert["labels"] if isinstance(alert.get("labels"), dict) else {}
            node = labels.get("node")
            if not isinstance(node, str):
                continue
            fingerprint = str(alert.get("fingerprint") or json.dumps(labels, sort_keys=True))[:200]
            if fingerprint in self._alerts_seen:
                continue
            if self.registry.get(node) is None:
                unknown.append(node[:253])
                continue
            self._alerts_seen[fingerprint] = now
            nodes[node] = None
            names[str(labels.get("alertname", "alert"))[:100]] = None
            starts.append(_rfc3339(alert.get("startsAt")))
        if len(self._alerts_seen) > 10_000:
            self._alerts_seen.clear()
        if not nodes:
            return {"started": None, "unknown_nodes": unknown[:20]}
        known = [s for s in starts if s is not None]
        at = max(min(known), now - self.before_s) if known else now  # a long-firing alert: its last minutes
        incident = self.start(f"alert {', '.join(names)}", "alertmanager", nodes, at)
        return {"started": incident.id, "nodes": incident.nodes, "unknown_nodes": unknown[:20]}

    def verdicts_changed(self, node: str, before: dict[str, bool], after: dict[str, bool], at: float) -> None:
        """A heartbeat's engines judged starved now that were not before: one
        incident for them (none for an engine that started one lately)."""
        now = self.wall()
        turned = [sid for sid, starved in after.items() if starved and not before.get(sid, False)]
        if not turned or now - self._starved_at.get(node, -STARVED_AGAIN_S) < STARVED_AGAIN_S:
            return
        self._starved_at[node] = now
        if len(self._starved_at) > 100_000:
            self._starved_at.clear()
        try:
            self.start(f"starved: {', '.join(turned)[:300]} on {node}", "starvation", [node], at)
        except Refused as e:
            log.warning("no incident for %s starved on %s: %s", ", ".join(turned)[:300], node, e)

    # --- read ----------------------------------------------------------------------

    def listed(self, node: str | None = None) -> list[dict[str, Any]]:
        """Newest first; those of `node` alone when given."""
        chosen = [i for i in self._by_id.values() if node is None or node in i.nodes]
        return [i.as_json() for i in sorted(chosen, key=lambda i: -i.created)]

    def get(self, incident_id: str) -> Incident | None:
        return self._by_id.get(incident_id)

    def parts(self, incident: Incident) -> Iterator[tuple[str, bytes]]:
        """Each node's samples as stored (JSON), read from disk a node at a time."""
        for node, path in self.part_paths(incident):
            try:
                yield node, path.read_bytes()
            except OSError as e:
                log.warning("incident %s: %s's samples: %s", incident.id, node[:253], e)

    def part_paths(self, incident: Incident) -> list[tuple[str, Path]]:
        return [(node, self._part(incident, node)) for node in incident.nodes if node in incident.bytes]


def _rfc3339(value: Any) -> float | None:
    """Alertmanager's startsAt (RFC 3339, nanoseconds and a zone) as unix seconds."""
    if not isinstance(value, str):
        return None
    text = re.sub(r"(\.\d{6})\d+", r"\1", value.strip()).replace("Z", "+00:00")
    try:
        when = datetime.fromisoformat(text)
        return when.timestamp() if when.tzinfo is not None and len(text) <= 40 else None  # a zone, as RFC 3339 says
    except (ValueError, OverflowError):
        return None


def csv_rows(node: str, samples: dict[str, Any]) -> Iterator[list[str]]:
    """A node's samples as CSV rows: node, series, begin, end (unix seconds), value (empty: not measured)."""
    t0 = samples["from"]
    series: list[tuple[str, dict[str, Any]]] = []
    if "machine" in samples:
        series.append(("machine_cpu_percent", samples["machine"]["cpu_percent"]))
    series += [(f"shard_cpu_cores:{s['id']}", s["cpu_cores"]) for s in samples["shards"]]
    for name, s in series:
        t = t0 + s["start"]
        for us, v in zip(s["us"], s["v"], strict=True):
            yield [node, name, f"{t:.6f}", f"{t + us / 1e6:.6f}", "" if v is None else repr(v)]
            t += us / 1e6
    for g in samples["gpus"]:
        p = g["utilization_percent"]
        for t, v in zip(p["t"], p["v"], strict=True):
            yield [node, f"gpu_utilization_percent:{g['index']}", "", f"{t0 + t:.6f}", repr(v)]


def to_csv(parts: Iterable[tuple[str, bytes]]) -> bytes:
    """The export's CSV whole (for scripts and tests; the route streams it)."""
    return b"node,series,begin,end,value\n" + b"".join(
        piece for node, body in parts for piece in _csv_chunks(node, json.loads(body)))


# --- the pages' routes -----------------------------------------------------------------

INCIDENTS = web.AppKey("incidents", Incidents)


# A body read already (controlplane/fleet/forward.py splits an incident's nodes by the replica
# that holds each, and this replica's share is what it starts).
BODY_READ = web.RequestKey("body_read", bytes)


async def _json_body(request: web.Request) -> Any:
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text="a JSON body, please\n")
    data = request[BODY_READ] if BODY_READ in request else await request_body(request, MAX_BODY)
    if len(data) > MAX_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=len(data))
    try:
        return json.loads(data)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"not JSON: {str(e)[:100]}\n") from None


def _may_start_incidents(request: web.Request, route: str) -> None:
    if not may_change_fleet(request):
        raise web.HTTPForbidden(text=f"{route} needs a user of --web-config-file's basic_auth_users "
                                     "(Alertmanager: its http_config.basic_auth), or the control plane's "
                                     "--admin-socket\n")  # fmt: skip


class Holders(Protocol):
    """The replicas a node may be held by instead of this one (controlplane/fleet/peers.py)."""

    def holder(self, node: str) -> str | None: ...

    def forward_alerts(self, peer: str, body: dict[str, Any]) -> Awaitable[dict[str, Any]]: ...


HOLDERS = web.AppKey("holders", Holders)


async def alertmanager(request: web.Request) -> web.Response:
    """POST /api/alertmanager: Alertmanager's webhook (a receiver's
    `webhook_configs` url, with `http_config.basic_auth` as a web-config
    user): what an operator's start needs, since anyone who may post it
    spends the incidents' budget. With peers, the alerts of nodes another
    replica holds are that replica's to capture: sent on to it, its answer
    under `forwarded`."""
    _may_start_incidents(request, "the Alertmanager webhook")
    body = await _json_body(request)
    forwarded: dict[str, Any] = {}
    if (holders := request.app.get(HOLDERS)) is not None and isinstance(body, dict) and isinstance(
            body.get("alerts"), list):  # fmt: skip
        here: list[Any] = []
        elsewhere: dict[str, list[Any]] = {}
        for alert in body["alerts"][:1000]:
            labels = alert.get("labels") if isinstance(alert, dict) else None
            node = labels.get("node") if isinstance(labels, dict) else None
            peer = holders.holder(node) if isinstance(node, str) else None
            (elsewhere.setdefault(peer, []) if peer is not None else here).append(alert)
        body = {**body, "alerts": here}
        answers = await asyncio.gather(*(holders.forward_alerts(peer, {**body, "alerts": alerts})
                                         for peer, alerts in elsewhere.items()))  # fmt: skip
        forwarded = dict(zip(elsewhere, answers, strict=True))
    try:
        done = request.app[INCIDENTS].alerts(body)
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from None
    except Refused as e:
        if not forwarded:
            raise e.answer() from None
        done = {"started": None, "refused": str(e)}
    return web.json_response({**done, "forwarded": forwarded} if forwarded else done)


async def start_incident(request: web.Request) -> web.Response:
    """POST /api/incidents, `{"nodes": [...], "reason": "...", "at": T}`
    (`at` optional: now; else a finite wall time within the nodes' rings'
    reach): an operator's, like forgetting a node
    (controlplane/listen/page_access.py)."""
    _may_start_incidents(request, "starting an incident")
    body = await _json_body(request)
    registry = request.app[REGISTRY]
    incidents = request.app[INCIDENTS]
    try:
        if not isinstance(body, dict):
            raise ValueError("a JSON object: {\"nodes\": [...], \"reason\": \"...\", \"at\": T}")
        nodes = body["nodes"]
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise ValueError("nodes: a list of node names")
        unknown = [n[:253] for n in nodes if registry.get(n) is None]
        if unknown:
            raise ValueError(f"no such nodes: {', '.join(unknown[:10])}")
        at = None if body.get("at") is None else float(body["at"])
        if at is not None:
            now = incidents.wall()
            held = [h for n in nodes if (state := registry.get(n)) is not None
                    and (h := state.hindsight_held_seconds()) is not None]  # fmt: skip
            reach = max(held, default=0.0) + incidents.before_s
            if not math.isfinite(at) or not now - reach <= at <= now:
                raise ValueError(f"at: a wall time within the last {reach:.0f} s (what the nodes' rings hold, and "
                                 "the incident's minutes before)")  # fmt: skip
        reason = str(body.get("reason") or "started by an operator")
        if not reason.isprintable():
            raise ValueError("reason: printable text")
    except (KeyError, TypeError, ValueError) as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from None
    try:
        incident = incidents.start(reason, "operator", nodes, at)
    except Refused as e:
        raise e.answer() from None
    return web.json_response(incident.as_json(), status=202)


async def list_incidents(request: web.Request) -> web.Response:
    """GET /api/incidents (`?node=NODE`: its alone)."""
    return web.json_response({"incidents": request.app[INCIDENTS].listed(request.query.get("node"))})


async def read_incident(request: web.Request) -> web.StreamResponse:
    """GET /api/incidents/ID: what it is and every node's samples (JSON);
    `?format=csv`: the samples a row each. Both streamed, `MAX_EXPORTS` at
    once (429 beyond): the JSON from the files as they are, a megabyte at a
    time; the CSV a node's samples at a time."""
    incidents = request.app[INCIDENTS]
    incident = incidents.get(request.match_info["id"])
    if incident is None:
        raise web.HTTPNotFound(text="no such incident\n")
    form = request.query.get("format", "json")
    if form not in ("json", "csv"):
        raise web.HTTPBadRequest(text="format: json or csv\n")
    if request.method == "HEAD":  # whether it is here (a peer asks, controlplane/fleet/forward.py): no export
        return web.Response(content_type="text/csv" if form == "csv" else "application/json")
    if incidents._exports.locked():
        raise web.HTTPTooManyRequests(text=f"{MAX_EXPORTS} incidents are being read already; try again\n",
                                      headers={"Retry-After": "5"})  # fmt: skip
    async with incidents._exports:
        paths = incidents.part_paths(incident)
        response = web.StreamResponse()
        if form == "csv":
            response.content_type = "text/csv"
            response.headers["Content-Disposition"] = f'attachment; filename="incident-{incident.id}.csv"'
            await response.prepare(request)
            await response.write(b"node,series,begin,end,value\n")
            for node, path in paths:
                try:
                    chunks = _csv_chunks(node, await asyncio.to_thread(_read_json, path))
                    # Made on a thread a piece at a time, each written before the next is made.
                    while (piece := await asyncio.to_thread(next, chunks, None)) is not None:
                        await response.write(piece)
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("incident %s: %s's samples: %s", incident.id, node[:253], e)
        else:
            response.content_type = "application/json"
            await response.prepare(request)
            # The stored samples as they are: the answer is put together, not parsed and written again.
            await response.write(json.dumps(incident.as_json())[:-1].encode() + b',"samples":{')
            first = True
            for node, path in paths:
                try:
                    f = await asyncio.to_thread(open, path, "rb")
                except OSError as e:
                    log.warning("incident %s: %s's samples: %s", incident.id, node[:253], e)
                    continue
                with f:
                    await response.write((b"" if first else b",") + json.dumps(node).encode() + b":")
                    first = False
                    while chunk := await asyncio.to_thread(f.read, EXPORT_CHUNK):
                        await response.write(chunk)
            await response.write(b"}}")
        await response.write_eof()
        return response


def _csv_chunks(node: str, samples: dict[str, Any]) -> Iterator[bytes]:
    """A node's samples as CSV text, in pieces of about `EXPORT_CHUNK`."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    for row in csv_rows(node, samples):
        writer.writerow(row)
        if text.tell() >= EXPORT_CHUNK:
            yield text.getvalue().encode()
            text.seek(0)
            text.truncate()
    yield text.getvalue().encode()


def _read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def add_routes(app: web.Application, incidents: Incidents) -> None:
    app[INCIDENTS] = incidents
    app.router.add_post("/api/alertmanager", alertmanager)
    app.router.add_post("/api/incidents", start_incident)
    app.router.add_get("/api/incidents", list_incidents)
    app.router.add_get("/api/incidents/{id}", read_incident)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        yield
        await incidents.close()

    app.cleanup_ctx.append(lifecycle)


INCIDENTS_OFF = ("no incidents are kept by this control plane: start it with --incidents-dir DIR (or --state-file "
                 "PATH, which keeps them beside it)\n")  # fmt: skip


async def incidents_off(request: web.Request) -> web.Response:
    """503: Alertmanager retries, and its log and the operator's client say which flag turns incidents on."""
    return web.Response(status=503, text=INCIDENTS_OFF)


def add_routes_when_off(app: web.Application) -> None:
    """Without a directory for incidents: each route says why, not a bare 404."""
    app.router.add_post("/api/alertmanager", incidents_off)
    app.router.add_route("*", "/api/incidents", incidents_off)
    app.router.add_get("/api/incidents/{id}", incidents_off)

