"""Heartbeats for tests of what reads them (the registry, the families,
the history, the pages): a few parts given, the rest the least the wire
takes, made as the control plane holds them."""

from __future__ import annotations

from typing import Any

import msgspec

import wire
from controlplane.state.registry import MAX_SHARDS_PER_NODE, Received, received
from controlplane.state.starvation import StarvationRules
from wire.schema import CoreStats, Heartbeat, PercentStats, Registration, Shard, WindowSummary


def _whole_stats(value: Any) -> Any:
    """A test may give a summary's mean alone: its p95 and max are then the mean."""
    if isinstance(value, dict):
        value = {k: _whole_stats(v) for k, v in value.items()}
        if "mean" in value and set(value) <= {"mean", "p95", "max"}:
            value = {"p95": value["mean"], "max": value["mean"], **value}
        return value
    if isinstance(value, list):
        return [_whole_stats(v) for v in value]
    return value


def heartbeat(parts: dict[str, Any] | None = None, **more: Any) -> Heartbeat:
    body = {"node": "n1", "seq": 1, "backend": "proc", "window": {"start": 0.0, "end": 5.0, "samples": 50},
            "machine": {}, **(parts or {}), **more}  # fmt: skip
    return msgspec.convert(_whole_stats(body), Heartbeat)


def held(parts: dict[str, Any] | None = None, rules: StarvationRules | None = None, **more: Any) -> Received:
    """As the registry would hold it: the busiest shards kept, each judged."""
    return received(heartbeat(parts, **more), MAX_SHARDS_PER_NODE, rules or StarvationRules())


def registration(node: str = "n1", **more: Any) -> Registration:
    return msgspec.convert({"node": node, **more}, Registration)


def cores_of(shard: Shard) -> CoreStats:
    """A shard's measured cores (a test that expects them fails here if they were not measured)."""
    assert shard.cpu_cores is not None, f"{shard.id}: cores not measured"
    return shard.cpu_cores


def cpu_of(summary: Heartbeat) -> PercentStats:
    """The machine's measured CPU, likewise."""
    assert summary.machine.cpu_percent is not None, "machine CPU not measured"
    return summary.machine.cpu_percent


def window_summary(parts: dict[str, Any] | None = None, **more: Any) -> WindowSummary:
    """A summary as the agent makes it (`wire.made`: text fit, bounds left to the control plane)."""
    body = {"node": "n1", "seq": 1, "backend": "proc", "window": {"start": 1.0, "end": 2.0, "samples": 1},
            "machine": {}, **(parts or {}), **more}  # fmt: skip
    return wire.made(WindowSummary, _whole_stats(body))
