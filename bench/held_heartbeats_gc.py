"""What a fleet's held heartbeats cost Python's collector: the objects it
tracks for each node (the registry's last heartbeat and verdicts, the
embedded history's ring), and a full collection's time with NODES nodes
held, beside one of the same process with none (the reference, measured
in the same run: our machines' speed varies several-fold).

A full collection stops the event loop: at 20,000 nodes it took 0.82 s
when heartbeats were held as dicts, every heartbeat arriving meanwhile
waiting (bench/heartbeat_throughput.py --fresh's p99). Each node is an
8-GPU, 4-engine node, heard from twice. The full collections the collector
ran while the nodes came are printed too: a tuple is untracked only when
the collector finds its contents untracked, one level of nesting a look, so
nested tuples made at a fleet's first heartbeats cost those collections
more than the held ones cost later.

    PYTHONPATH=. .venv/bin/python bench/held_heartbeats_gc.py [--nodes 20000]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from heartbeat_throughput import gpu_node_heartbeat  # noqa: E402

import wire  # noqa: E402
from controlplane.history.backends import EmbeddedHistory  # noqa: E402
from controlplane.state.registry import NodeRegistry  # noqa: E402
from tests.test_controlplane_api import registration  # noqa: E402


def full_collection_s(runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=20_000)
    args = parser.parse_args()
    gc.collect()
    reference = full_collection_s()
    before = len(gc.get_objects())
    registry, history = NodeRegistry(stale_after=3600), EmbeddedHistory()
    # The full collections the collector itself ran while the nodes came, as a server's would.
    arriving: list[float] = []
    started = 0.0

    def timed(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if info["generation"] == 2:
            if phase == "start":
                started = time.perf_counter()
            else:
                arriving.append(time.perf_counter() - started)

    gc.callbacks.append(timed)
    for i in range(args.nodes):
        node = f"node-{i:05d}"
        registry.register(wire.decode_registration(json.dumps(registration(node)).encode()))
        for seq in (1, 2):
            body = dict(gpu_node_heartbeat(node), seq=seq)
            state = registry.heartbeat(wire.decode_heartbeat(json.dumps(body).encode()).heartbeat)
            assert state.received is not None
            history.record(node, state.received, at=1000.0 + 5 * seq)
    gc.callbacks.remove(timed)
    gc.collect()
    per_node = (len(gc.get_objects()) - before) / args.nodes
    held = full_collection_s()
    print(f"{args.nodes} nodes held: {per_node:.1f} tracked objects a node; a full collection "
          f"{1000 * held:.0f} ms against {1000 * reference:.1f} ms with none held ({held / reference:.0f}x)")
    print(f"while they came: {len(arriving)} full collections, the longest {1000 * max(arriving, default=0):.0f} ms, "
          f"{1000 * sum(arriving):.0f} ms in all")


if __name__ == "__main__":
    main()
