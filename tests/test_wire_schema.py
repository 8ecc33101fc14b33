"""The heartbeat's schema, declared once (wire/schema.py), and its two
readers: msgspec's decoder (the fast path) and the explainer that names a
refused body's problem (wire/explain.py). They must agree on every body:
what one accepts the other accepts identically, and a body the decoder
refuses is one the explainer refuses or trims."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import msgspec.structs
import pytest

import wire
from sampler.gpu import gpm
from tests.test_controlplane_api import heartbeat, registration
from wire.heartbeat import explained
from wire.schema import Heartbeat, Registration

ODD_VALUES: list[Any] = [None, -1, 0, 1, 0.5, 1e20, 2**70, "x", "", "a\x00b", "a\tb", "\u00a0", "x" * 600, True, False,
                         [], {}, [1], {"a": 1}, math.nan, math.inf, 1e11, 5.0, 4096, "bpf", "proc", -100.5]  # fmt: skip


def every_field_heartbeat() -> dict[str, Any]:
    """A heartbeat with every field the schema declares, each in range."""
    body = heartbeat()
    body.update(backend_reason="why", gpu_error="nvml: gone", shards_left_out=3, hindsight_held_seconds=900.5)
    body["machine"].update(cpu_steal_percent={"mean": 1, "p95": 2, "max": 3}, disks_left_out=1,
                           pressure={"cpu": {"some": 0.1, "full": 0.0}, "io": {"some": 0.2}})  # fmt: skip
    body["shards"][0].update(
        namespace="ns", pod="p", container="c", selector="cmd:x", command="python", metrics_error="e",
        runqueue_wait_seconds={"p50": 0.1, "p99": 0.2, "mean": 0.1, "total": 1, "cumulative": 5},
        cpu_quota_cores=2, cpu_throttled_ratio=0.5, cpu_throttled_seconds=1, cpu_throttled_seconds_total=10,
        threads=4, cpu_affinity_cores=8, threads_per_quota_core=2.0, gpu_utilization_percent=50,
        gpu_utilization_max_percent=60, gpu_memory_bandwidth_percent=10, gpu_memory_bandwidth_max_percent=20,
        requests_waiting=1, requests_running=2, kv_cache_usage_ratio=0.5, gpu_indices=[0],
        gpu_sm_activity_percent=40, gpu_tensor_activity_percent=20)  # fmt: skip
    body["gpus"][0].update(pci_bus_id="0000:01:00.0", driver_version="550.54", lost=False, utilization_p95_percent=99,
                           utilization_max_percent=100, memory_bandwidth_percent=41, sm_clock_hz=1.98e9)  # fmt: skip
    # GPM and the clock events (sampler/gpu/gpm.py names them).
    body["gpus"][0].update({f: 50.0 for stem in gpm.METRICS for f in gpm.fields(stem)}, gpm_interval_seconds=0.1)
    body["gpus"][0].update({gpm.clock_event_field(r): 0.25 for r in gpm.CLOCK_EVENTS})
    body["gpus"][0].update(xid_errors=1, xid_errors_total=3, xid_last=79, pcie_replays=2, pcie_replays_total=9,
                           remapped_rows_correctable=1, remapped_rows_uncorrectable=0, row_remap_pending=False,
                           row_remap_failed=False)  # fmt: skip
    # A MIG instance: its ids, memory and GPM figures.
    body["gpus"][0]["mig_instances"] = [{"gpu_instance_id": 1, "compute_instance_id": 0, "uuid": "MIG-1",
                                         "memory_used_bytes": 1 << 30, "memory_total_bytes": 20 << 30,
                                         "gpm_interval_seconds": 0.1,
                                         **{f: 25.0 for stem in gpm.METRICS for f in gpm.fields(stem)}}]  # fmt: skip
    return body


def paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*path, i))


def mutated(body: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    """The body with one to three of its values replaced by odd ones, or removed."""
    out = copy.deepcopy(body)
    where = [p for p in paths(out) if p]
    for _ in range(rnd.choice((1, 1, 2, 3))):
        path = rnd.choice(where)
        parent: Any = out
        try:
            for key in path[:-1]:
                parent = parent[key]
            if rnd.random() < 0.15 and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = copy.deepcopy(rnd.choice(ODD_VALUES))
        except (KeyError, IndexError, TypeError):
            pass  # the path went through a value replaced before
    return out


def test_the_example_uses_every_field_the_schema_declares() -> None:
    def declared(kind: mi.Type, prefix: str) -> set[str]:
        if isinstance(kind, mi.UnionType):
            kind = next(k for k in kind.types if not isinstance(k, mi.NoneType))
        if isinstance(kind, mi.Metadata):
            kind = kind.type
        if isinstance(kind, (mi.ListType, mi.VarTupleType)):
            return declared(kind.item_type, prefix + "[]")
        if not isinstance(kind, mi.StructType):
            return {prefix}
        return set().union(*(declared(f.type, f"{prefix}.{f.encode_name}".lstrip(".")) for f in kind.fields))

    def present(value: Any, prefix: str) -> set[str]:
        if isinstance(value, list):
            return set().union(*(present(v, prefix + "[]") for v in value))
        if isinstance(value, dict) and not prefix.endswith(("pressure", "raw")):
            return set().union(*(present(v, f"{prefix}.{k}".lstrip(".")) for k, v in value.items()))
        return {prefix}

    body = every_field_heartbeat()
    missing = declared(mi.type_info(Heartbeat), "") - present(body, "") - {"raw", "hindsight"}
    assert {p for p in missing if not p.startswith("machine.pressure.")} == set()


@pytest.mark.parametrize("seed", range(2))
def test_the_decoder_and_the_explainer_agree_on_every_body(seed: int) -> None:
    rnd = random.Random(seed)
    bases = [every_field_heartbeat(), heartbeat()]
    agreed = refused = 0
    for i in range(1500):
        kind: type[Heartbeat] | type[Registration] = Registration if i % 5 == 0 else Heartbeat
        body = mutated(registration() if kind is Registration else rnd.choice(bases), rnd)
        data = json.dumps(body).encode()
        dropped: wire.Dropped = []
        try:
            slow: Any = explained(data, kind, dropped)[0]  # type: ignore[type-var]  # either kind, as the loop picks
        except wire.WireError:
            slow = None
        try:
            fast: Any = msgspec.json.decode(data, type=kind)
        except msgspec.DecodeError:
            assert slow is None or dropped, f"the decoder refused what the explainer takes whole: {body}"
            refused += 1
            continue
        if isinstance(fast, Heartbeat):
            fast = msgspec.structs.replace(fast, raw=None)
        assert slow == fast and not dropped, body
        agreed += 1
    assert agreed > 100 and refused > 500  # both ways were exercised


def test_a_non_finite_number_is_named_where_it_is() -> None:
    body = heartbeat()
    body["shards"].append(dict(body["shards"][0], id="s1", cpu_cores={"mean": math.nan, "p95": 1, "max": 1}))
    dropped: wire.Dropped = []
    hb = wire.parse_heartbeat(json.dumps(body).encode(), dropped)
    assert [s["id"] for s in hb["shards"]] == ["s0"]
    assert dropped == [{"field": "shards[1].cpu_cores.mean", "reason": "must be finite"}]


def test_a_window_may_not_end_before_it_starts() -> None:
    body = heartbeat()
    body["window"]["end"] = body["window"]["start"] - 1
    with pytest.raises(wire.WireError) as e:
        wire.parse_heartbeat(json.dumps(body).encode())
    assert (e.value.field, e.value.reason) == ("window.end", f"must be within {body['window']['start']:g}..1e+11")


def test_every_number_declares_its_unit_and_every_string_its_bounds() -> None:
    def fields(kind: mi.Type, prefix: str) -> Iterator[tuple[str, mi.Type]]:
        if isinstance(kind, mi.UnionType):
            kind = next(k for k in kind.types if not isinstance(k, mi.NoneType))
        inner = kind.type if isinstance(kind, mi.Metadata) else kind
        if isinstance(inner, (mi.ListType, mi.VarTupleType)):
            yield from fields(inner.item_type, prefix + "[]")
        elif isinstance(inner, mi.StructType):
            for f in inner.fields:
                yield from fields(f.type, f"{prefix}.{f.encode_name}".lstrip("."))
        else:
            yield prefix, kind

    for root in (Heartbeat, Registration):
        for path, kind in fields(mi.type_info(root), ""):
            inner = kind.type if isinstance(kind, mi.Metadata) else kind
            if isinstance(inner, (mi.FloatType, mi.IntType)):
                assert isinstance(kind, mi.Metadata) and (kind.extra or {}).get("unit"), path
                assert inner.ge is not None and inner.le is not None, path
            if isinstance(inner, mi.StrType):
                assert inner.pattern or (inner.min_length == 1 and inner.max_length), path


def test_a_body_with_its_blocks_is_decoded_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A raw block and a hindsight piece are read by msgspec as they are, not
    by the slow path (msgspec reads no `Raw` within a union: every live-view
    heartbeat and every piece once went through `explained`); the heartbeat
    held is the schema's own, equal to one made from the same body."""
    import wire.heartbeat as module
    from wire.hindsight import SpanRequest

    def slow(*args: object) -> None:
        raise AssertionError("the slow path read a body that fits the schema")

    monkeypatch.setattr(module, "explained", slow)
    raw = {"window_start": 0.0, "machine": {"cpu_percent": {"start": 0, "us": [100], "v": [1.0]}}}
    piece = {"id": "s1", "from": 10.0, "to": 11.0, "done": True, "windows": [[0, 1]]}
    body = heartbeat() | {"raw": raw, "hindsight": piece, "hindsight_held_seconds": 60.0}
    decoded = wire.decode_heartbeat(json.dumps(body).encode(), [], lambda node: True,
                                    lambda node: SpanRequest("s1", 10.0, 11.0))  # fmt: skip
    assert type(decoded.heartbeat) is Heartbeat and decoded.heartbeat.raw is None
    assert decoded.raw_came and decoded.hindsight_came
    assert decoded.hindsight is not None and decoded.hindsight["done"] is True
    plain = wire.decode_heartbeat(json.dumps(heartbeat() | {"hindsight_held_seconds": 60.0}).encode())
    assert plain.heartbeat == decoded.heartbeat and not plain.raw_came and not plain.hindsight_came
    nulls = wire.decode_heartbeat(json.dumps(heartbeat() | {"raw": None, "hindsight": None}).encode())
    assert not nulls.raw_came and not nulls.hindsight_came
