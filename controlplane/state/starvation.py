"""One answer per engine to "is my GPU waiting on the host?", judged from
each heartbeat as it arrives (docs/metrics.md has the formula).

An engine is `cpu_starved` in a window when either rule fires:
- throttled: its cgroup was throttled in more than `throttled_ratio` of the
  window's CFS periods (kube-prometheus' CPUThrottlingHigh fires at 25%);
- run queue: its threads waited for a CPU more than `wait_ratio` seconds per
  second they ran, and at least `min_wait` seconds per second of the window
  (an engine that wakes twice a window may wait longer than it runs, for a
  few microseconds: that is not starvation).

It is `host_bound` when, in the same window, it was `cpu_starved` and its
GPUs' utilisation (the mean over its cards of NVML's per-process samples)
was under `gpu_utilization`, unless its own metrics say it had no request
at all (none waiting, none running): a GPU idle for want of work is not
waiting on the host. Requests waiting make it the clearest case, and the
reason says how many.

It is `card_held_back` when one of the cards it holds a context on had its
clocks held below their maximum by power or heat (its power cap, a hardware
or thermal slowdown, the power brake: NVML's clock-event reasons) for more
than `card_held_back` of the window while the engine had requests waiting:
its queue grows because its card is slowed, whatever its host does.

Absent is not zero. `cpu_starved` is stated when at least one rule could be
judged (a quota with a throttled share, or a run-queue wait); `host_bound`
only for an engine with GPU figures, and only when `cpu_starved` is known or
the GPUs were busy enough to settle it alone; `card_held_back` only for an
engine whose cards say what held their clocks, and whose own metrics say
how many requests wait (or whose cards were never held back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from wire.schema import Gpu, Heartbeat, Shard

Json = dict[str, Any]


@dataclass(frozen=True)
class StarvationRules:
    throttled_ratio: float = 0.25  # share of CFS periods throttled
    wait_ratio: float = 0.5  # run-queue seconds per on-CPU second
    min_wait: float = 0.05  # run-queue seconds per second of the window
    gpu_utilization: float = 0.5  # 0..1, the engine's GPUs' mean
    card_held_back: float = 0.5  # 0..1, the share of the window a card's clocks were held back

    def __post_init__(self) -> None:
        for name in ("throttled_ratio", "gpu_utilization", "card_held_back"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"{name} must be within 0..1, not {value}")
        for name in ("wait_ratio", "min_wait"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number from 0 up, not {value}")


class Verdict(msgspec.Struct, frozen=True, gc=False):
    """gc=False: a fleet's verdicts, held with their heartbeats, cost a full collection nothing."""

    cpu_starved: bool | None
    host_bound: bool | None
    why: str  # one line for a person; "" for a healthy engine
    card_held_back: bool | None = None

    def as_json(self) -> Json:
        out: Json = {}
        if self.cpu_starved is not None:
            out["cpu_starved"] = int(self.cpu_starved)
        if self.host_bound is not None:
            out["host_bound"] = int(self.host_bound)
        if self.card_held_back is not None:
            out["card_held_back"] = int(self.card_held_back)
        if self.why:
            out["why"] = self.why
        return out


# What holds a card's clocks back by power or heat (not sync boost, which follows its
# neighbours', nor the application clocks someone set): wire/schema.py's Gpu fields.
HELD_BACK_BY = {"sw_power_cap": "its power cap", "hw_slowdown": "a hardware slowdown",
                "sw_thermal_slowdown": "a thermal slowdown", "hw_thermal_slowdown": "a hardware thermal slowdown",
                "power_brake": "the power brake"}  # fmt: skip


def _held_back(shard: Shard, cards: dict[int, Gpu], rules: StarvationRules, reasons: list[str]) -> bool | None:
    """Whether one of the engine's cards was held back over the rule's share
    of the window while it had requests waiting; None where that cannot be told."""
    worst: tuple[float, int, str] | None = None  # (share, card, reason)
    for index in shard.gpu_indices or ():
        card = cards.get(index)
        if card is None:
            continue
        for reason in HELD_BACK_BY:
            share = getattr(card, f"clock_event_{reason}_ratio")
            if share is not None and (worst is None or share > worst[0]):
                worst = (share, index, reason)
    if worst is None:
        return None  # no card of its says what held its clocks
    share, index, reason = worst
    if share <= rules.card_held_back:
        return False
    waiting = shard.requests_waiting
    if waiting is None:
        return None  # held back, but whether its queue had work is not known
    if waiting == 0:
        return False
    reasons.append(f"GPU {index} held back by {HELD_BACK_BY[reason]} {100 * share:.0f}% of the window "
                   f"with {waiting:g} requests waiting")  # fmt: skip
    return True


def judge(shard: Shard, window_seconds: float | None, rules: StarvationRules,
          cards: dict[int, Gpu] | None = None) -> Verdict:  # fmt: skip
    """`cards`: the node's GPUs in the same heartbeat, by index."""
    judged, reasons = False, []
    throttled = shard.cpu_throttled_ratio
    if throttled is not None:
        judged = True
        if throttled > rules.throttled_ratio:
            sizing = ""
            if shard.threads is not None and shard.cpu_quota_cores:
                sizing = f", {shard.threads} threads"
            reasons.append(f"throttled in {100 * throttled:.0f}% of CFS periods "
                           f"(quota {shard.cpu_quota_cores or 0:g} cores{sizing})")  # fmt: skip
    wait = None if shard.runqueue_wait_seconds is None else shard.runqueue_wait_seconds.total
    cores = None if shard.cpu_cores is None else shard.cpu_cores.mean
    if wait is not None and cores is not None and window_seconds is not None and window_seconds > 0:
        judged = True
        on_cpu = cores * window_seconds
        per_second_on_cpu = wait / on_cpu if on_cpu > 0 else (math.inf if wait > 0 else 0.0)
        if per_second_on_cpu > rules.wait_ratio and wait / window_seconds >= rules.min_wait:
            threads = f"{wait / window_seconds:.2f} threads waiting on average"
            if math.isinf(per_second_on_cpu):
                reasons.append(f"waited for a CPU and barely ran ({threads})")
            else:
                reasons.append(f"waited {per_second_on_cpu:.2f} s for a CPU per second on one ({threads})")
    starved = bool(reasons) if judged else None

    gpu = shard.gpu_utilization_percent
    waiting, running = shard.requests_waiting, shard.requests_running
    no_work = waiting == 0 and running == 0  # its own metrics read, and nothing to do
    host_bound: bool | None = None
    if gpu is not None:
        busy = gpu / 100 >= rules.gpu_utilization
        if busy or starved is False or no_work:
            host_bound = False
        elif starved:
            host_bound = True
            queued = f" with {waiting:g} requests waiting" if waiting else ""
            reasons.append(f"its GPUs busy {gpu:.0f}% of the time{queued}")
    held_back = _held_back(shard, cards or {}, rules, reasons)
    return Verdict(starved, host_bound, "; ".join(reasons), held_back)


def judge_shards(hb: Heartbeat, shards: tuple[Shard, ...], rules: StarvationRules) -> tuple[Verdict | None, ...]:
    """A verdict for each of the heartbeat's `shards`; None where nothing could be judged."""
    seconds = hb.window.end - hb.window.start
    cards = {g.index: g for g in hb.gpus or () if not g.lost}
    verdicts = (judge(shard, seconds, rules, cards) for shard in shards)
    return tuple(v if (v.cpu_starved, v.host_bound, v.card_held_back) != (None, None, None) else None
                 for v in verdicts)  # fmt: skip
