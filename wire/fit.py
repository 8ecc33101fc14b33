"""What the agent sends, made fit for the wire: text from the machine
(process names, mount points, GPU names) made printable by escaping, lists
trimmed to their limits, most important first, with a count of what was
left out."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TypeVar

from wire.checks import Json
from wire.limits import MAX_DISKS, MAX_GPUS, MAX_K8S_NAME, MAX_NAME, MAX_PGIDS, MAX_SHARDS, MAX_TEXT


def printable(text: str | None, limit: int = MAX_TEXT) -> str | None:
    """Machine text as it may cross the wire: every character that is not
    printable escaped as Python writes it (a tab as `\\t`, a non-breaking
    space as `\\xa0`), never dropped, so two names that differ still differ;
    cut to `limit` characters with an ellipsis. None for nothing to say."""
    if not text:
        return None
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


T = TypeVar("T")


def keep_busiest(shards: Sequence[T], most: int, cores: Callable[[T], float | None]) -> tuple[Sequence[T], int]:
    """The `most` busiest shards by their mean cores (one not measured
    counts as idle), and how many were left out: the one rule both the
    agent (the wire's limit) and the control plane (`--max-shards`) trim by.
    Fewer than `most` are kept as they came, in their order."""
    if len(shards) <= most:
        return shards, 0
    return sorted(shards, key=lambda s: -(cores(s) or 0.0))[:most], len(shards) - most


def _fit_text(src: Json, keys: tuple[str, ...], limit: int) -> None:
    for key in keys:
        if isinstance(src.get(key), str):
            if (text := printable(src[key], limit)) is None:
                del src[key]
            else:
                src[key] = text


def _fit_disks(disks: list[Json]) -> tuple[list[Json], int]:
    for d in disks:
        d["mount"] = printable(d.get("mount")) or "?"
    if len(disks) <= MAX_DISKS:
        return disks, 0
    kept = sorted(disks, key=lambda d: -d.get("bytes", 0))[:MAX_DISKS]  # the largest
    return kept, len(disks) - MAX_DISKS


def _fit_gpus(gpus: list[Json]) -> list[Json]:
    for g in gpus[:MAX_GPUS]:
        _fit_text(g, ("name",), MAX_NAME)
        _fit_text(g, ("uuid", "pci_bus_id", "driver_version"), MAX_TEXT)
    return gpus[:MAX_GPUS]


def fit_registration(body: Json) -> Json:
    """A registration made fit for the wire, in place."""
    _fit_text(body, ("hostname", "kernel", "agent_version", "backend_reason"), MAX_TEXT)
    if isinstance(body.get("disks"), list):
        body["disks"], _ = _fit_disks(body["disks"])
    if isinstance(body.get("gpus"), list):
        body["gpus"] = _fit_gpus(body["gpus"])
    return body


def fit_heartbeat(summary: Json) -> Json:
    """A window's summary made fit for the wire, in place: text escaped and
    cut, lists trimmed (the busiest shards, the largest disks), and what was
    left out counted (`shards_left_out`, `machine.disks_left_out`)."""
    _fit_text(summary, ("backend_reason", "gpu_error"), MAX_TEXT)
    machine = summary.get("machine")
    if isinstance(machine, dict) and isinstance(machine.get("disks"), list):
        machine["disks"], left_out = _fit_disks(machine["disks"])
        if left_out:
            machine["disks_left_out"] = left_out
    shards = summary.get("shards")
    if isinstance(shards, list):
        shards, left_out = keep_busiest(shards, MAX_SHARDS, lambda s: (s.get("cpu_cores") or {}).get("mean"))
        if left_out:
            summary["shards"], summary["shards_left_out"] = shards, left_out
        seen: set[str] = set()
        for s in shards:
            sid = base = printable(s.get("id"), MAX_NAME) or "?"
            n = 0
            while sid in seen:  # cut names may meet: keep each shard, and its id unique
                n += 1
                sid = base[: MAX_NAME - len(f"~{n}")] + f"~{n}"
            seen.add(sid)
            s["id"] = sid
            _fit_text(s, ("model", "replica"), MAX_NAME)
            _fit_text(s, ("namespace", "pod", "container"), MAX_K8S_NAME)
            _fit_text(s, ("selector", "command", "metrics_error"), MAX_TEXT)
            if isinstance(s.get("pgids"), list) and len(s["pgids"]) > MAX_PGIDS:
                s["pgids"] = s["pgids"][:MAX_PGIDS]
    if isinstance(summary.get("gpus"), list):
        summary["gpus"] = _fit_gpus(summary["gpus"])
    return summary


def dumps(body: Json) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
