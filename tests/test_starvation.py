"""The starved / host-bound verdict: each rule, each threshold at its edge,
absent where nothing was measured, and the control plane's flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import msgspec.structs
import pytest

import wire
from controlplane.state.registry import NodeRegistry
from controlplane.state.starvation import StarvationRules, Verdict, judge, judge_shards
from tests.heartbeats import heartbeat
from wire.schema import Gpu, Shard

RULES = StarvationRules(throttled_ratio=0.25, wait_ratio=0.5, min_wait=0.05, gpu_utilization=0.5)


def shard(**fields: Any) -> Shard:
    return msgspec.convert({"id": "s0", **fields}, Shard)


def busy(cores: float, wait: float) -> dict[str, Any]:
    """An engine using `cores` on average, its threads waiting `wait` seconds in all."""
    return {"cpu_cores": {"mean": cores, "p95": cores, "max": cores}, "runqueue_wait_seconds": {"total": wait}}


def test_the_throttled_rule_at_its_edge() -> None:
    assert judge(shard(cpu_throttled_ratio=0.25, cpu_quota_cores=6.0), 5.0, RULES).cpu_starved is False
    over = judge(shard(cpu_throttled_ratio=0.26, cpu_quota_cores=6.0, threads=172), 5.0, RULES)
    assert over.cpu_starved is True
    assert over.why == "throttled in 26% of CFS periods (quota 6 cores, 172 threads)"
    # The threshold is the flag's, not a constant.
    assert judge(shard(cpu_throttled_ratio=0.26), 5.0, StarvationRules(throttled_ratio=0.3)).cpu_starved is False


def test_the_run_queue_rule_at_its_edges() -> None:
    # 1 core for 5 s is 5 s on CPU: 2.5 s waiting is exactly 0.5 s per second on CPU.
    assert judge(shard(**busy(1.0, 2.5)), 5.0, RULES).cpu_starved is False
    over = judge(shard(**busy(1.0, 2.51)), 5.0, RULES)
    assert over.cpu_starved is True
    assert over.why == "waited 0.50 s for a CPU per second on one (0.50 threads waiting on average)"
    # Waiting long against a tiny on-CPU time, but for less than min_wait a second: not starved ...
    assert judge(shard(**busy(0.001, 0.249)), 5.0, RULES).cpu_starved is False
    # ... and at min_wait it is.
    assert judge(shard(**busy(0.001, 0.25)), 5.0, RULES).cpu_starved is True
    # Never on a CPU, and waiting: starved (it barely ran).
    never = judge(shard(**busy(0.0, 1.0)), 5.0, RULES)
    assert never.cpu_starved is True and "barely ran" in never.why
    # An idle engine: judged, not starved.
    assert judge(shard(**busy(0.0, 0.0)), 5.0, RULES).cpu_starved is False
    strict = StarvationRules(wait_ratio=0.1, min_wait=0.0)
    assert judge(shard(**busy(1.0, 0.6)), 5.0, strict).cpu_starved is True


def test_host_bound_only_when_both_sides_hold() -> None:
    starved = {"cpu_throttled_ratio": 0.9, "cpu_quota_cores": 0.5}
    healthy = {"cpu_throttled_ratio": 0.0, "cpu_quota_cores": 0.5}
    both = judge(shard(**starved, gpu_utilization_percent=49.9), 5.0, RULES)
    assert (both.cpu_starved, both.host_bound) == (True, True) and "its GPUs busy 50% of the time" in both.why
    at_edge = judge(shard(**starved, gpu_utilization_percent=50.0), 5.0, RULES)
    assert (at_edge.cpu_starved, at_edge.host_bound) == (True, False)
    idle_gpu_fed_cpu = judge(shard(**healthy, gpu_utilization_percent=3.0), 5.0, RULES)
    assert (idle_gpu_fed_cpu.cpu_starved, idle_gpu_fed_cpu.host_bound) == (False, False)
    assert judge(shard(**starved, gpu_utilization_percent=60.0), 5.0,
                 StarvationRules(gpu_utilization=0.7)).host_bound is True  # fmt: skip
    # No GPU figures (a CPU engine, or a driver without per-process samples): not judged.
    assert judge(shard(**starved), 5.0, RULES).host_bound is None
    # Busy GPUs settle it alone, even when the CPU side is unknown.
    assert judge(shard(gpu_utilization_percent=95.0), 5.0, RULES).host_bound is False
    assert judge(shard(gpu_utilization_percent=5.0), 5.0, RULES).host_bound is None


def test_absent_where_nothing_was_measured() -> None:
    # No quota (no throttled share) and no run-queue figures: no verdict, not "healthy".
    nothing = judge(shard(cpu_cores={"mean": 2.0, "p95": 2.0, "max": 2.0}), 5.0, RULES)
    assert nothing.cpu_starved is None and nothing.as_json() == {}
    # A window of no length (a node's clock stepped back) cannot weigh a wait.
    assert judge(shard(**busy(1.0, 4.0)), 0.0, RULES).cpu_starved is None
    assert judge(shard(**busy(1.0, 4.0)), None, RULES).cpu_starved is None


def test_rules_refuse_values_outside_their_range() -> None:
    for bad in ({"throttled_ratio": 1.5}, {"gpu_utilization": -0.1}, {"wait_ratio": float("nan")},
                {"min_wait": -1.0}):  # fmt: skip
        with pytest.raises(ValueError):
            StarvationRules(**bad)


def test_the_registry_judges_each_heartbeat_as_it_arrives() -> None:
    registry = NodeRegistry(starvation=StarvationRules(throttled_ratio=0.5))
    registry.register(wire.decode_registration(json.dumps({"node": "n1"}).encode()))
    body = {"node": "n1", "seq": 1, "backend": "bpf", "window": {"start": 10.0, "end": 15.0, "samples": 50},
            "machine": {}, "shards": [{"id": "a", "cpu_throttled_ratio": 0.6, "cpu_quota_cores": 2.0,
                                       "gpu_utilization_percent": 10.0},
                                      {"id": "b", "cpu_throttled_ratio": 0.4, "cpu_quota_cores": 2.0},
                                      {"id": "c", "starved": {"cpu_starved": 1}}]}  # fmt: skip
    sent = wire.decode_heartbeat(json.dumps(body).encode()).heartbeat
    state = registry.heartbeat(sent)
    assert state.received is not None and state.received.heartbeat is sent  # held as it came
    a, b, c = state.received.verdicts
    assert a is not None and a.cpu_starved is True and a.host_bound is True
    assert b == Verdict(False, None, "")
    assert c is None  # a node cannot pass its own verdict off as the control plane's
    a_json, b_json, c_json = state.received.as_json()["shards"]  # as /api/nodes shows them
    assert a_json["starved"]["cpu_starved"] == 1 and a_json["starved"]["host_bound"] == 1
    assert b_json["starved"] == {"cpu_starved": 0} and "starved" not in c_json


def test_judge_shards_leaves_a_shard_without_figures_unjudged() -> None:
    hb = heartbeat(shards=[{"id": "x"}])
    assert judge_shards(hb, tuple(hb.shards), RULES) == (None,)


@pytest.mark.parametrize("flag, value", [("--starved-throttled-ratio", "1.5"), ("--starved-throttled-ratio", "x"),
                                         ("--starved-wait-ratio", "-1"), ("--starved-min-wait", "nan"),
                                         ("--host-bound-gpu-utilization", "2")])  # fmt: skip
def test_controlplane_refuses_a_threshold_out_of_range(flag: str, value: str) -> None:
    r = subprocess.run([sys.executable, "-m", "nodesampler", "controlplane", "--listen", "127.0.0.1:0",
                        "--pages-listen", "127.0.0.1:0", "--secret-file", "/nonexistent", flag, value],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and flag in r.stderr, r.stderr


@pytest.mark.parametrize("gpu_percent, throttled, host_bound", [(8, 0.9, 1), (95, 0.9, 0), (8, 0.0, 0)])
def test_host_bound_through_the_fake_nvml(tmp_path: Path, gpu_percent: int, throttled: float,
                                          host_bound: int) -> None:  # fmt: skip
    """The GPU side as the agent measures it (NVML's per-process samples, through
    the window and the wire); the CPU side as its cgroup would say."""
    from sampler.gpu.nvml import GpuReader
    from tests.fakenvml import GiB, h200_node
    from tests.test_nvml import window_sampler

    nvml = h200_node(1)
    nvml.cards[0].processes = [(100, 7 * GiB)]
    nvml.cards[0].process_samples = [(10, 100, gpu_percent, 3), (20, 100, gpu_percent, 3)]
    readers: list[GpuReader] = []
    try:
        ws, _ = window_sampler(tmp_path, nvml, readers)
        summary = ws.run_window(1.0)
    finally:
        for r in readers:
            r.close()
    shard = msgspec.structs.replace(summary.shards[0], cpu_quota_cores=2.0, cpu_throttled_ratio=throttled)
    hb = wire.decode_heartbeat(wire.encode(msgspec.structs.replace(summary, shards=(shard,)))).heartbeat
    [verdict] = judge_shards(hb, tuple(hb.shards), RULES)
    assert hb.shards[0].gpu_utilization_percent == gpu_percent
    assert verdict is not None and verdict.host_bound is bool(host_bound)


def test_the_queue_settles_an_idle_gpu_and_names_the_clearest_case() -> None:
    starved_idle_gpu = {"cpu_throttled_ratio": 0.9, "cpu_quota_cores": 0.5, "gpu_utilization_percent": 5.0}
    queued = judge(shard(**starved_idle_gpu, requests_waiting=37.0, requests_running=8.0), 5.0, RULES)
    assert queued.host_bound is True and queued.why.endswith("its GPUs busy 5% of the time with 37 requests waiting")
    # Nothing to do at all: the GPU idles for want of work, not waiting on the host.
    no_work = judge(shard(**starved_idle_gpu, requests_waiting=0.0, requests_running=0.0), 5.0, RULES)
    assert (no_work.cpu_starved, no_work.host_bound) == (True, False)
    # Running but none queued: still host-bound, with no queue to name.
    running = judge(shard(**starved_idle_gpu, requests_waiting=0.0, requests_running=2.0), 5.0, RULES)
    assert running.host_bound is True and "waiting" not in running.why.split(";")[-1]
    # No queue figures (no metrics endpoint): judged as before.
    assert judge(shard(**starved_idle_gpu), 5.0, RULES).host_bound is True


def card(index: int, **shares: float) -> Gpu:
    """A card whose clock-event reasons held it back `shares` of the window (all others measured at 0)."""
    fields = {f"clock_event_{r}_ratio": 0.0 for r in ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown",
                                                       "hw_thermal_slowdown", "power_brake", "sync_boost")}  # fmt: skip
    fields.update({f"clock_event_{r}_ratio": v for r, v in shares.items()})
    return msgspec.convert({"index": index, **fields}, Gpu)


def test_an_engine_queued_behind_a_card_held_back_is_named_with_its_card_and_cause() -> None:
    cards = {0: card(0), 3: card(3, sw_power_cap=0.8, hw_thermal_slowdown=0.1)}
    held = judge(shard(gpu_indices=[0, 3], requests_waiting=12), 5.0, RULES, cards)
    assert held.card_held_back is True
    assert held.why == "GPU 3 held back by its power cap 80% of the window with 12 requests waiting"
    assert held.as_json() == {"card_held_back": 1, "why": held.why}
    # Nothing waiting: slowed, but holding nothing back.
    assert judge(shard(gpu_indices=[3], requests_waiting=0), 5.0, RULES, cards).card_held_back is False
    # No queue figures: whether it held the engine back is not known.
    assert judge(shard(gpu_indices=[3]), 5.0, RULES, cards).card_held_back is None
    # Held back exactly the threshold's share: not more than it.
    edge = {1: card(1, hw_slowdown=0.5)}
    assert judge(shard(gpu_indices=[1], requests_waiting=3), 5.0, RULES, edge).card_held_back is False
    assert judge(shard(gpu_indices=[1], requests_waiting=3), 5.0, StarvationRules(card_held_back=0.4),
                 edge).card_held_back is True  # fmt: skip
    # Sync boost follows the neighbours' clocks: not power or heat.
    boost = {2: card(2, sync_boost=1.0)}
    assert judge(shard(gpu_indices=[2], requests_waiting=3), 5.0, RULES, boost).card_held_back is False


def test_an_engine_whose_cards_do_not_say_is_not_judged_held_back() -> None:
    silent = {0: msgspec.convert({"index": 0, "utilization_percent": 90.0}, Gpu)}  # no clock events: an old driver
    assert judge(shard(gpu_indices=[0], requests_waiting=5), 5.0, RULES, silent).card_held_back is None
    assert judge(shard(requests_waiting=5), 5.0, RULES, {0: card(0, sw_power_cap=1.0)}).card_held_back is None
    # A card the heartbeat does not carry (lost, or left out) says nothing either.
    assert judge(shard(gpu_indices=[7], requests_waiting=5), 5.0, RULES, {}).card_held_back is None


def test_the_heartbeat_s_cards_are_what_judge_shards_reads() -> None:
    hb = heartbeat(shards=[{"id": "s0", "gpu_indices": [1], "requests_waiting": 4}],
                   gpus=[{"index": 1, "uuid": "GPU-1", "clock_event_hw_thermal_slowdown_ratio": 0.9}])
    [verdict] = judge_shards(hb, hb.shards, RULES)
    assert verdict is not None and verdict.card_held_back is True and verdict.cpu_starved is None
    assert verdict.why == "GPU 1 held back by a hardware thermal slowdown 90% of the window with 4 requests waiting"
