"""A fleet of nodes with an hour of history, for the fleet's picture
(controlplane/history/heatmap.py): its tests, the browser's, and bench/heatmap.py.

Node i's CPU peaks at `idle_cpu(i)` every window; a third of the nodes
carry an H100, a third an A100, the rest no card. A burst is one node's
window at 100%.
"""

from __future__ import annotations

import json
import time
from typing import Any

import wire
from controlplane.history.backends import EmbeddedHistory
from controlplane.state.registry import NodeRegistry, Received
from tests.heartbeats import held

MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", None)


def node_name(i: int) -> str:
    return f"node-{i:05d}"


def idle_cpu(i: int) -> float:
    return float(10 + i % 40)


def model_of(i: int) -> str | None:
    return MODELS[i % 3]


def cpu_at(i: int, k: int, burst_at: int | None, varied: bool) -> float:
    """Node i's CPU peak in its heartbeat k back from the last."""
    return 100.0 if k == burst_at else idle_cpu(i) + ((k * 7 + i * 13) % 20 if varied else 0)


def _body(node: str, cpu_max: float, model: str | None) -> dict[str, Any]:
    gpus = [{"index": 0, "uuid": f"GPU-{node}", "name": model, "utilization_percent": cpu_max / 2}] if model else []
    return {"node": node, "seq": 1, "backend": "bpf", "window": {"start": 0.0, "end": 5.0, "samples": 50},
            "machine": {"cpus": 8, "cpu_percent": {"mean": cpu_max / 2, "p95": cpu_max, "max": cpu_max}},
            "gpus": gpus, "shards": []}  # fmt: skip


def fleet_with_history(nodes: int, heartbeats: int, bursts: dict[str, int] | None = None, interval: float = 5.0,
                       now: float | None = None, gpus: bool = True,
                       varied: bool = False) -> tuple[NodeRegistry, EmbeddedHistory, float]:  # fmt: skip
    """`nodes` nodes, each with `heartbeats` heartbeats `interval` apart up to
    `now` (the last at `now`), registered and fresh; `bursts`: node -> which
    heartbeat, counted back from the last (0), was at 100% CPU. Returns the
    registry, the history and `now`. `gpus=False`: no node has a card;
    `varied`: each window's figure 0-19 points above the node's idle one (a
    picture as a busy fleet's compresses, not as an idle one's)."""
    now = time.time() if now is None else now
    bursts = bursts or {}
    registry = NodeRegistry(stale_after=60, clock=time.monotonic)
    history = EmbeddedHistory(interval=interval, clock=time.time)
    made: dict[tuple[float, str | None], Received] = {}  # one held heartbeat a distinct figure

    def received(cpu_max: float, model: str | None) -> Received:
        if (cpu_max, model) not in made:
            made[cpu_max, model] = held(_body("n", cpu_max, model))
        return made[cpu_max, model]

    for i in range(nodes):
        node, model = node_name(i), model_of(i) if gpus else None
        registry.register(wire.decode_registration(json.dumps({"node": node, "hostname": f"{node}.sim"}).encode()))
        registry.heartbeat(wire.decode_heartbeat(json.dumps(_body(node, idle_cpu(i), model)).encode()).heartbeat)
        burst_at = bursts.get(node)
        for k in range(heartbeats - 1, -1, -1):
            cpu = cpu_at(i, k, burst_at, varied)
            history.record(node, received(cpu, model), at=now - k * interval)
    return registry, history, now


def openmetrics(nodes: int, heartbeats: int, bursts: dict[str, int], interval: float, now: float,
                varied: bool = False, gpus: bool = True) -> str:  # fmt: skip
    """The same fleet's figures as the control plane exports them
    (`llmgw_node_up`, the CPU's window max, each card's utilisation), each
    heartbeat a sample at its time: what Prometheus would have scraped,
    for `promtool tsdb create-blocks-from openmetrics`."""
    out = []
    for family in ("llmgw_node_up", "llmgw_node_cpu_utilization_max_percent", "llmgw_gpu_utilization_percent"):
        out.append(f"# TYPE {family} gauge")
        for i in range(nodes):
            labels, scale = f'node="{node_name(i)}"', 1.0
            if family == "llmgw_gpu_utilization_percent":
                if not gpus or model_of(i) is None:
                    continue
                labels, scale = labels + f',gpu="0",gpu_model="{model_of(i)}"', 0.5  # as _body's card
            for k in range(heartbeats - 1, -1, -1):
                value = 1.0 if family == "llmgw_node_up" else cpu_at(i, k, bursts.get(node_name(i)), varied) * scale
                out.append(f"{family}{{{labels}}} {value} {now - k * interval:.3f}")
    out.append("# EOF")
    return "\n".join(out) + "\n"
