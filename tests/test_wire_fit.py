"""What the agent sends fits the wire: the machine's text escaped, never
dropped; lists trimmed to the wire's limits, most important first; and,
for hostile process trees, whatever the window sampler emits is accepted
whole by the control plane's parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wire
from sampler.backend import BackendChoice
from sampler.shards.proc_shards import ProcShardSampler
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from tests.fakeproc import FakeClock, FakeProc
from wire.schema import Shard, WindowSummary


def test_printable_escapes_and_keeps_names_apart() -> None:
    names = ["vllm\tserve", "vllm\xa0serve", "vllm serve", "\x1b[31mred", "a\nb", "a\\nb", "\u200bzero", "ok"]
    out = [wire.printable(n) for n in names]
    assert all(o is not None and o.isprintable() for o in out)
    assert out[0] == "vllm\\tserve" and out[1] == "vllm\\xa0serve" and out[-1] == "ok"
    assert len(set(out)) == len(out) - 1  # "a\nb" escaped reads as the literal "a\\nb": the one meeting
    assert wire.printable("") is None and wire.printable(None) is None
    long = wire.printable("x" * 1000, 128)
    assert long is not None and len(long) == 128 and long.endswith("\u2026")


def _shard(i: int, cores: float) -> Shard:
    return wire.made(Shard, {"id": f"s{i}", "cpu_cores": {"mean": cores, "p95": cores, "max": cores}})


def test_lists_are_trimmed_most_important_first() -> None:
    shards, left_out = wire.fit_shards([(_shard(i, float(i % 7)), i) for i in range(300)])
    assert len(shards) == wire.MAX_SHARDS and left_out == 300 - wire.MAX_SHARDS
    assert all(s.id == f"s{i}" for s, i in shards)  # each with what was kept beside it
    kept = {s.id for s, _ in shards}
    assert all(f"s{i}" in kept for i in range(300) if i % 7 >= 2)  # the busiest are all there
    machine = wire.fit_machine({"disks": [{"mount": f"/m{i}", "bytes": i, "used_bytes": 0} for i in range(200)]})
    assert machine.disks is not None and machine.disks_left_out == 200 - wire.MAX_DISKS
    assert min(d.bytes for d in machine.disks) == 200 - wire.MAX_DISKS  # the largest
    assert wire.fit_shards([(_shard(1, 1.0), None)]) == ([(_shard(1, 1.0), None)], None)  # none left out: absent


def test_ids_cut_to_the_same_text_stay_apart() -> None:
    shards, _ = wire.fit_shards([(wire.made(Shard, {"id": "x" * 200 + str(i)}), i) for i in range(12)])
    ids = [s.id for s, _ in shards]
    assert len(set(ids)) == 12 and all(len(i) <= wire.MAX_NAME for i in ids)
    assert ids[0] == "x" * 127 + "\u2026" and ids[1] == "x" * 126 + "~1"  # the first keeps the cut name


def test_made_fits_text_leaves_bounds_to_the_control_plane_and_refuses_unknown_keys() -> None:
    shard = wire.made(Shard, {"id": "", "command": "a\tb", "model": "", "cpu_cores": {"mean": 1e9, "p95": 1e9,
                                                                                     "max": 1e9}})  # fmt: skip
    assert (shard.id, shard.command, shard.model) == ("?", "a\\tb", None)  # a required name is never empty
    assert shard.cpu_cores is not None and shard.cpu_cores.mean == 1e9  # as measured: the control plane judges it
    dropped: wire.Dropped = []
    summary = wire.made(WindowSummary, {"node": "n1", "seq": 1, "backend": "proc", "machine": {}, "shards": [shard],
                                        "window": {"start": 1.0, "end": 2.0, "samples": 1}})  # fmt: skip
    assert wire.parse_heartbeat(wire.encode(summary), dropped)["shards"] == []
    assert [d["field"] for d in dropped] == ["shards[0].cpu_cores.mean"]
    with pytest.raises(TypeError, match="no field 'cpu_core'"):
        wire.made(Shard, {"id": "a", "cpu_core": 1.0})


HOSTILE = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00/"), min_size=1, max_size=40)


def _mounts(proc: FakeProc, where: Path, names: list[str]) -> None:
    """A mountinfo of one ext4 disk per name (each its own device), written as the kernel escapes it."""
    lines = []
    for i, name in enumerate(names):
        d = where / f"{i}-{name}"
        d.mkdir(parents=True, exist_ok=True)
        escaped = "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in str(d))
        lines.append(f"{30 + i} 1 254:{i} / {escaped} rw - ext4 /dev/vd{i} rw")
    (proc.root / "self").mkdir(exist_ok=True)
    (proc.root / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    (proc.root / "filesystems").write_text("nodev\ttmpfs\n\text4\n")


def _window(proc: FakeProc, specs: list[ShardSpec] | None) -> WindowSummary:
    clock = FakeClock()

    def sleep(seconds: float) -> None:
        clock.advance(seconds)

    sampler = WindowSampler(proc.root, BackendChoice("proc", "a test tree"), ProcShardSampler(proc.root, clock),
                            specs, hz=10, node="n1", clock=clock, sleep=sleep)  # fmt: skip
    sampler.prime(1.0)
    return sampler.run_window(1.0)


def _accepted_whole(summary: WindowSummary) -> dict[str, Any]:
    dropped: wire.Dropped = []
    parsed = wire.parse_heartbeat(wire.encode(summary), dropped)
    assert dropped == [], dropped
    assert [s["id"] for s in parsed["shards"]] == [s.id for s in summary.shards]
    assert len(parsed["machine"].get("disks", [])) == len(summary.machine.disks or ())
    return parsed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(comms=st.lists(HOSTILE, min_size=1, max_size=12), mounts=st.lists(HOSTILE, max_size=6))
def test_hostile_trees_are_accepted_whole(tmp_path_factory: Any, comms: list[str], mounts: list[str]) -> None:
    tmp = tmp_path_factory.mktemp("hostile")
    proc = FakeProc(tmp / "proc")
    for i, comm in enumerate(comms):
        proc.add(100 + i, comm=comm, cmdline=comm + " --served-model " + comm, utime=10 * i)
    _mounts(proc, tmp / "mnt", mounts)
    summary = _window(proc, None)  # the busiest groups, named by their hostile commands
    parsed = _accepted_whole(summary)
    assert all(s.get("command", "x").isprintable() for s in parsed["shards"])
    specs = [ShardSpec(f"w{i}", Selector.parse(f"pid:{100 + i}")) for i in range(len(comms))]
    _accepted_whole(_window(proc, specs))


def test_a_crowded_hostile_machine_is_accepted_whole(tmp_path: Path) -> None:
    """10,000 processes with every control character in their names, 500
    mounts with odd names, 300 watched shards: one body the control plane
    takes whole, trimmed to its limits with what was left out counted."""
    proc = FakeProc(tmp_path / "proc")
    controls = "".join(chr(c) for c in [*range(1, 32), 127, *range(0x80, 0xA1), 0x2028, 0x200B, 0xFEFF])
    for i in range(10_000):
        c = controls[i % len(controls)]
        proc.add(1000 + i, comm=f"e{c}{i % 97}", cmdline=f"engine{c} --id {i}", utime=i % 500)
    names = [f"vol{chr(9 + i % 5)}{'x' * (i % 300)}\u00a0{i}" for i in range(500)]
    _mounts(proc, tmp_path / "mnt", [n[:200] for n in names])
    specs = [ShardSpec(f"shard-{i}", Selector.parse(f"pid:{1000 + i * 7}")) for i in range(300)]
    summary = _window(proc, specs)
    parsed = _accepted_whole(summary)
    assert len(parsed["shards"]) == wire.MAX_SHARDS and parsed["shards_left_out"] == 300 - wire.MAX_SHARDS
    disks = parsed["machine"]["disks"]
    assert len(disks) == wire.MAX_DISKS and parsed["machine"]["disks_left_out"] == 500 - wire.MAX_DISKS
    assert all(d["mount"].isprintable() for d in disks)
    assert len(wire.encode(summary)) <= wire.MAX_BODY_BYTES


def test_a_pods_names_travel_whole_or_cut_never_refused() -> None:
    long_pod = "p" * 300  # longer than any pod's name may be: cut to the wire's limit, the shard kept
    summary = {"node": "n1", "seq": 1, "backend": "bpf", "window": {"start": 1.0, "end": 2.0, "samples": 10},
               "machine": {"cpus": 2},
               "shards": [{"id": "llm/engine-0", "namespace": "llm", "pod": "engine-0", "container": "vllm"},
                          {"id": "llm/x", "namespace": "llm", "pod": long_pod}]}  # fmt: skip
    dropped: list[dict[str, str]] = []
    body = wire.parse_heartbeat(wire.encode(wire.made(WindowSummary, summary)), dropped)
    assert not dropped
    first, second = body["shards"]
    assert (first["namespace"], first["pod"], first["container"]) == ("llm", "engine-0", "vllm")
    assert len(second["pod"]) == wire.MAX_K8S_NAME and "container" not in second
    raw = {**summary, "shards": [{"id": "x", "pod": "a\x1b[2J"}, {"id": "y", "namespace": ""}]}
    body = wire.parse_heartbeat(wire.dumps(raw), dropped)  # unfitted: each bad shard left out alone
    assert body["shards"] == [] and [d["field"] for d in dropped] == ["shards[0].pod", "shards[1].namespace"]


def test_the_keys_the_summary_promises_are_there_as_null_and_no_others() -> None:
    summary = wire.made(WindowSummary, {
        "node": "n1", "seq": 1, "backend": "bpf", "window": {"start": 1.0, "end": 2.0, "samples": 1},
        "machine": {"cpus": 2}, "shards": [{"id": "gone", "pgids": []}],
        "gpus": [{"index": 0}], "bpf": {"programs": {"on_tick": {"runs": 0, "run_time_ns": 0}}},
    })  # fmt: skip
    body = json.loads(wire.encode(summary))
    assert body["backend_reason"] is None and body["machine"]["cpu_percent"] is None
    [shard] = body["shards"]
    assert shard == {"id": "gone", "pgids": [], "cpu_cores": None, "memory_bytes": None}
    assert body["gpus"] == [{"index": 0}]  # a card's figures not read are absent
    assert body["bpf"] == {"dropped_forks": None, "programs": {"on_tick": {"runs": 0, "run_time_ns": 0,
                                                                          "ns_per_run": None}}}  # fmt: skip
    assert json.loads(wire.encode(wire.made(WindowSummary, {**body, "shards": []})))["shards"] == []
