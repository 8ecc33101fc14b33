"""GPUs through a fake NVML that follows pynvml's signatures, return types and errors."""

from __future__ import annotations

import inspect
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pynvml
import pytest

from sampler.backend import BackendChoice
from sampler.gpu.nvml import GpuReader, GpuReading
from sampler.shards.pods import Pod
from sampler.shards.proc_shards import ProcShardSampler
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler
from sampler.window.summary_text import render
from tests.fakenvml import OLD_DRIVER, FakeCard, FakeNvml, GiB, h200_node
from tests.fakeproc import FakeClock, FakeProc

MEASURED = ("utilization_percent", "utilization_p95_percent", "utilization_max_percent", "memory_used_bytes",
            "memory_total_bytes", "memory_bandwidth_percent", "sm_clock_hz", "ecc_uncorrected",
            "temperature_celsius", "power_watts", "energy_joules")  # fmt: skip


@pytest.fixture
def readers() -> Iterator[list[GpuReader]]:
    made: list[GpuReader] = []
    yield made
    for r in made:
        r.close()


def open_reader(nvml: FakeNvml, readers: list[GpuReader]) -> GpuReader:
    r = GpuReader(nvml)
    readers.append(r)
    assert r.wait_ready(10)
    return r


def read(r: GpuReader, members: dict[str, set[int]] | None = None) -> GpuReading:
    r.request(members or {})
    assert r.wait(10)
    reading = r.take()
    assert reading is not None
    return reading


def read_gpus(r: GpuReader, members: dict[str, set[int]] | None = None) -> list[dict[str, Any]]:
    """A reading's GPUs, which must have been measured."""
    gpus = read(r, members).gpus
    assert gpus is not None
    return gpus


def test_fake_follows_pynvml_signatures() -> None:
    for name, fn in inspect.getmembers(FakeNvml, inspect.isfunction):
        if name.startswith("nvml"):
            real = inspect.signature(getattr(pynvml, name))
            fake = inspect.signature(fn)
            assert list(fake.parameters)[1:] == list(real.parameters), name


def test_eight_h200s_every_field_of_every_card(readers: list[GpuReader]) -> None:
    nvml = h200_node()
    for card in nvml.cards:
        card.samples = [(1_000_000 + i * 166_000, v) for i, v in enumerate([90, 95, 100, 98, 97])]
    nvml.cards[2].processes = [(100, 30 * GiB), (101, 10 * GiB), (999, 5 * GiB)]
    nvml.cards[5].processes = [(200, 60 * GiB), (101, 2 * GiB)]
    r = open_reader(nvml, readers)

    inventory = r.inventory()
    assert inventory is not None and len(inventory) == 8
    assert inventory[3] == {"index": 3, "uuid": nvml.cards[3].uuid, "name": "NVIDIA H200",
                            "memory_total_bytes": 141 * GiB, "pci_bus_id": "00000000:1B:00.0",
                            "driver_version": "550.54.15"}  # fmt: skip

    reading = read(r, {"llama": {100, 101}, "mistral": {200}, "idle": {300}})
    assert reading.gpus is not None and len(reading.gpus) == 8
    for gpu in reading.gpus:
        assert set(MEASURED) <= set(gpu)
    g = reading.gpus[0]
    assert g["utilization_percent"] == 96.0 and g["utilization_max_percent"] == 100.0
    assert 98 <= g["utilization_p95_percent"] <= 100
    assert g["sm_clock_hz"] == 1_980_000_000 and g["power_watts"] == 512.3 and g["energy_joules"] == 123456.7
    assert g["memory_used_bytes"] == 80 * GiB and g["memory_bandwidth_percent"] == 41.0
    # Per engine: its processes on every card; an engine with none uses 0 (measured).
    assert reading.shard_memory == {"llama": 42 * GiB, "mistral": 60 * GiB, "idle": 0}


def test_samples_are_taken_once(readers: list[GpuReader]) -> None:
    nvml = h200_node(1)
    nvml.cards[0].samples = [(10, 50), (20, 60)]
    r = open_reader(nvml, readers)
    assert read_gpus(r)[0]["utilization_max_percent"] == 60.0
    nvml.cards[0].samples += [(30, 10)]
    second = read_gpus(r)[0]
    assert second["utilization_max_percent"] == 10.0  # only the new sample
    # No new sample: no p95 or max, and the instant rate stands in for the mean.
    third = read_gpus(r)[0]
    assert "utilization_max_percent" not in third and "utilization_p95_percent" not in third
    assert third["utilization_percent"] == 97.0


def test_old_driver_leaves_its_missing_fields_absent(
    readers: list[GpuReader], caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml([FakeCard(0, fails=dict(OLD_DRIVER)), FakeCard(1)])
    nvml.cards[1].samples = [(5, 40)]
    r = open_reader(nvml, readers)
    with caplog.at_level(logging.INFO, logger="sampler.gpu.nvml"):
        old, new = read_gpus(r)
        read(r)
    for key in ("utilization_percent", "utilization_p95_percent", "utilization_max_percent",
                "memory_bandwidth_percent", "energy_joules"):  # fmt: skip
        assert key not in old
    for key in ("memory_used_bytes", "sm_clock_hz", "temperature_celsius", "power_watts", "ecc_uncorrected"):
        assert key in old
    assert set(MEASURED) <= set(new)  # the other card lost nothing
    # Each missing field is said once, not at every reading.
    missing = [rec for rec in caplog.records if "not measured" in rec.message or "not available" in rec.message]
    assert len(missing) == 3


def test_lost_gpu_is_absent_the_rest_go_on_and_it_comes_back(readers: list[GpuReader]) -> None:
    nvml = h200_node(4)
    r = open_reader(nvml, readers)
    assert all("temperature_celsius" in g for g in read_gpus(r))
    nvml.cards[2].lost = True
    gpus = read_gpus(r)
    assert gpus[2] == {"index": 2, "uuid": nvml.cards[2].uuid, "lost": True}
    assert all("temperature_celsius" in g for i, g in enumerate(gpus) if i != 2)
    # The next reading re-initialises NVML, and the card answers again.
    gpus = read_gpus(r)
    assert nvml.inits == 2
    assert "lost" not in gpus[2] and gpus[2]["temperature_celsius"] == 61


def test_no_nvml_is_not_measured_not_no_gpus(readers: list[GpuReader], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sampler.gpu.nvml"):
        r = open_reader(FakeNvml([], library=False), readers)
        for _ in range(3):
            reading = read(r, {"s0": {1}})
            assert reading.gpus is None and reading.error is not None and "not loaded" in reading.error
            assert reading.shard_memory == {"s0": None}  # not measured, not 0
    assert r.inventory() is None
    said = [rec.message for rec in caplog.records if "NVML not loaded" in rec.message]
    assert len(said) == 1 and "Library Not Found" in said[0]


def test_a_library_that_appears_later_is_found_within_a_minute(
    readers: list[GpuReader], caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml([FakeCard(0), FakeCard(1)], library=False)
    attempts = 0
    init = nvml.nvmlInit

    def counted() -> None:
        nonlocal attempts
        attempts += 1
        init()

    nvml.nvmlInit = counted  # type: ignore[method-assign]
    clock = FakeClock()
    r = GpuReader(nvml, clock=clock)
    readers.append(r)
    assert r.wait_ready(10)
    seen: list[list[dict[str, Any]] | None] = []
    for _ in range(40):  # 40 windows of 5 s: the retries back off 1, 2, 4 ... 60 s apart
        clock.advance(5.0)
        seen.append(read(r).gpus)
    assert all(g is None for g in seen)  # never "no GPUs": not measured
    assert 5 <= attempts <= 10  # backed off, not every window
    nvml.library = True  # the driver's library is mounted in
    clock.advance(60.0)
    reading = read(r)
    assert reading.gpus is not None and len(reading.gpus) == 2
    inventory = r.inventory()
    assert inventory is not None and len(inventory) == 2
    assert any("NVML loaded" in rec.message for rec in caplog.records)


def test_process_memory_not_available_is_not_zero(readers: list[GpuReader]) -> None:
    nvml = h200_node(1)
    nvml.cards[0].fails["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    r = open_reader(nvml, readers)
    assert read(r, {"s0": {1}}).shard_memory == {"s0": None}


class GpuTime:
    """Fake time for a window: each sleep also lets a running NVML reading
    finish, as the half second before the window's end would, unless the
    test is holding NVML wedged."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.wedged = clock, False
        self.gpus: GpuReader | None = None

    def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        if self.gpus is not None and not self.wedged:
            assert self.gpus.wait(10)


def window_sampler(tmp_path: Path, nvml: FakeNvml, readers: list[GpuReader]) -> tuple[WindowSampler, GpuTime]:
    proc = FakeProc(tmp_path / "proc")
    proc.add(100, rss=10)
    clock = FakeClock()
    time = GpuTime(clock)
    gpus = time.gpus = open_reader(nvml, readers)
    specs = [ShardSpec("llama", Selector.parse("pgid:100"))]
    ws = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root, clock), specs,
                       hz=10, node="n1", clock=clock, wall_clock=clock, sleep=time.sleep, gpus=gpus)  # fmt: skip
    return ws, time


def test_summary_carries_gpus_and_engine_gpu_memory(tmp_path: Path, readers: list[GpuReader]) -> None:
    nvml = h200_node(2)
    nvml.cards[1].processes = [(100, 7 * GiB)]
    ws, _ = window_sampler(tmp_path, nvml, readers)
    summary = ws.run_window(1.0)
    assert summary.gpus is not None and [g.index for g in summary.gpus] == [0, 1]
    assert summary.shards[0].gpu_memory_bytes == 7 * GiB
    text = render(summary)
    assert "GPU 1  NVIDIA H200" in text and "7.0 GiB" in text


def test_hung_nvml_call_never_holds_up_the_cpu_windows(tmp_path: Path, readers: list[GpuReader]) -> None:
    nvml = h200_node(2)
    wedge = threading.Event()
    ws, time = window_sampler(tmp_path, nvml, readers)
    nvml.cards[0].hang = wedge  # from now on, card 0's temperature never returns
    time.wedged = True
    try:
        for _ in range(3):
            summary = ws.run_window(1.0)  # returns: the loop never waits on NVML
            assert summary.window.samples == 10
            assert summary.gpus is None  # not measured, not an empty list
            assert summary.shards[0].gpu_memory_bytes is None
        gpu_lines = [line for line in render(summary).splitlines() if line.startswith("GPU ")]
        assert gpu_lines == ["GPU      — (NVML did not answer before the window ended)"]
    finally:
        wedge.set()
    nvml.cards[0].hang = None
    time.wedged = False
    summary = ws.run_window(1.0)
    assert summary.gpus is not None and summary.gpus[0].temperature_celsius == 61


def test_a_call_hung_in_the_driver_does_not_hold_the_process_at_exit(tmp_path: Path) -> None:
    """SIGTERM must end the agent even while NVML never returns: the NVML
    thread is a daemon (a ThreadPoolExecutor's would be joined at exit)."""
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from sampler.gpu.nvml import GpuReader\n"
        "from tests.fakenvml import h200_node\n"
        "nvml = h200_node(1)\n"
        "r = GpuReader(nvml)\n"
        "assert r.wait_ready(10)\n"
        "nvml.cards[0].hang = threading.Event()  # never set: the driver is wedged\n"
        "r.request({})\n"
        "assert not r.wait(1.0)\n"
        "r.close()\n"
        "print('closed', flush=True)\n"
    )
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "closed\n", r.stderr


# --- each engine's share of its GPUs (per-process samples) ----------------------------------------


def test_engine_gpu_utilisation_from_per_process_samples(readers: list[GpuReader]) -> None:
    nvml = h200_node(3)
    # Card 0: two of llama's processes and one of another engine, sampled at three instants.
    nvml.cards[0].processes = [(100, 10 * GiB), (101, 10 * GiB), (200, 5 * GiB)]
    nvml.cards[0].process_samples = [(10, 100, 30, 5), (10, 101, 20, 5), (10, 200, 40, 50),
                                     (20, 100, 60, 10), (20, 101, 60, 10),  # 120: at most 100
                                     (30, 200, 90, 60)]  # llama idle at 30: not listed, so 0  # fmt: skip
    # Card 1: llama holds a context but never had activity: 0 measured, not absent.
    nvml.cards[1].processes = [(100, 10 * GiB)]
    # Card 2: nobody watched.
    nvml.cards[2].process_samples = [(10, 999, 100, 100)]
    r = open_reader(nvml, readers)
    reading = read(r, {"llama": {100, 101}, "mistral": {200}, "cpu-only": {300}})
    llama, mistral = reading.shard_utilisation["llama"], reading.shard_utilisation["mistral"]
    # llama: card 0 at 50, 100, 0 (mean 50), card 1 at 0: the mean of its cards' means.
    assert llama["gpu_utilization_percent"] == 25.0 and llama["gpu_utilization_max_percent"] == 100.0
    assert llama["gpu_memory_bandwidth_percent"] == pytest.approx((10 + 20 + 0) / 3 / 2, abs=0.01)
    assert llama["gpu_memory_bandwidth_max_percent"] == 20.0
    assert mistral["gpu_utilization_percent"] == pytest.approx(130 / 3, abs=0.01)
    assert mistral["gpu_utilization_max_percent"] == 90.0
    assert "cpu-only" not in reading.shard_utilisation  # on no card: absent, not 0
    # The next reading sees only newer samples.
    nvml.cards[0].process_samples.append((40, 100, 80, 30))
    again = read(r, {"llama": {100, 101}, "mistral": {200}}).shard_utilisation
    assert again["llama"]["gpu_utilization_max_percent"] == 80.0
    assert again["mistral"]["gpu_utilization_percent"] == 0.0  # on the card, no activity since


def test_engine_gpu_utilisation_absent_where_the_driver_lacks_it(readers: list[GpuReader]) -> None:
    nvml = FakeNvml([FakeCard(0, fails=dict(OLD_DRIVER), processes=[(100, GiB)])])
    r = open_reader(nvml, readers)
    reading = read(r, {"llama": {100}})
    assert reading.shard_memory == {"llama": GiB} and reading.shard_utilisation == {}


def test_summary_carries_the_engine_gpu_utilisation(tmp_path: Path, readers: list[GpuReader]) -> None:
    import wire

    nvml = h200_node(1)
    nvml.cards[0].processes = [(100, 7 * GiB)]
    nvml.cards[0].process_samples = [(10, 100, 8, 3), (20, 100, 12, 5)]
    ws, _ = window_sampler(tmp_path, nvml, readers)
    made = ws.run_window(1.0).shards[0]
    assert made.gpu_utilization_percent == 10.0 and made.gpu_utilization_max_percent == 12.0
    assert made.gpu_memory_bandwidth_percent == 4.0 and made.gpu_memory_bandwidth_max_percent == 5.0
    shard = msgspec.to_builtins(made)
    body = {"node": "n1", "seq": 1, "backend": "proc", "window": {"start": 1.0, "end": 2.0, "samples": 1},
            "machine": {}, "shards": [shard]}  # fmt: skip
    assert wire.parse_heartbeat(json_bytes(body))["shards"][0]["gpu_utilization_percent"] == 10.0
    for bad in (-1, 101, "x"):
        with pytest.raises(wire.WireError, match="gpu_utilization_max_percent"):
            wire.parse_heartbeat(json_bytes({**body, "shards": [{**shard, "gpu_utilization_max_percent": bad}]}))


def json_bytes(body: dict[str, Any]) -> bytes:
    import json

    return json.dumps(body).encode()


class _Pods:
    """The kubelet's answer, as KubeletPods gives it to the sampler."""

    deadline_s = 1.0

    def __init__(self, pods: list[Pod]) -> None:
        self._pods = pods

    def pods(self) -> list[Pod]:
        return self._pods

    def note_unknown(self, ids: set[str]) -> None:
        pass

    def wait_for_poll(self, after: int, timeout: float) -> int:
        return after + 1


def test_gpu_memory_and_share_by_pod(tmp_path: Path, readers: list[GpuReader]) -> None:
    """NVML's per-process figures joined through pid -> container -> pod."""
    a, b = "a" * 64, "b" * 64
    proc = FakeProc(tmp_path / "proc")
    for pid, cid in ((100, a), (101, a), (200, b)):  # engine-0: two processes; engine-1: one
        proc.add(pid, rss=10, cgroup=f"/kubepods/burstable/pod-{cid[0]}/{cid}")
    proc.add(300, rss=10)  # not in a pod
    nvml = h200_node(2)
    nvml.cards[0].processes = [(100, 7 * GiB), (200, 3 * GiB), (300, 1 * GiB)]
    nvml.cards[1].processes = [(101, 5 * GiB)]
    clock = FakeClock()
    time = GpuTime(clock)
    gpus = time.gpus = open_reader(nvml, readers)
    pods = _Pods([Pod("llm", "engine-0", "u0", {"app": "vllm"}, {"vllm": a}),
                  Pod("llm", "engine-1", "u1", {"app": "vllm"}, {"vllm": b})])  # fmt: skip
    specs = [ShardSpec("k8s:0", Selector.parse("k8s:llm/app=vllm"))]
    ws = WindowSampler(proc.root, BackendChoice("proc", None), ProcShardSampler(proc.root, clock), specs,
                       hz=10, node="n1", clock=clock, wall_clock=clock, sleep=time.sleep, gpus=gpus,
                       kubelet=pods)  # type: ignore[arg-type]  # fmt: skip
    shards = {s.id: s for s in ws.run_window(1.0).shards}
    assert shards["llm/engine-0"].gpu_memory_bytes == 12 * GiB  # both its processes, on both cards
    assert shards["llm/engine-1"].gpu_memory_bytes == 3 * GiB
    assert (shards["llm/engine-0"].namespace, shards["llm/engine-0"].pod) == ("llm", "engine-0")


def test_raw_samples_carry_nvmls_own_samples_and_the_windows(tmp_path: Path, readers: list[GpuReader]) -> None:
    """While a live viewer asks: each card's NVML samples of this reading, at
    their times from the window's start, whose mean is the card's
    utilisation; the machine's and the shard's samples, one per slot."""
    nvml = h200_node(2)
    ws, _ = window_sampler(tmp_path, nvml, readers)
    ws.run_window(1.0)  # the clock is at 101 s: NVML's samples below are this next window's
    nvml.cards[0].samples = [(101_100_000, 90), (101_267_000, 100), (101_433_000, 95)]
    nvml.cards[1].samples = [(101_200_000, 10)]
    ws.raw_wanted = True
    summary = ws.run_window(1.0)
    assert summary.raw is not None and summary.gpus is not None
    raw = json.loads(bytes(summary.raw))
    start = summary.window.start
    assert start == 101.0
    assert raw["gpus"] == [{"index": 0, "utilization_percent": {"t": [0.1, 0.267, 0.433], "v": [90.0, 100.0, 95.0]}},
                           {"index": 1, "utilization_percent": {"t": [0.2], "v": [10.0]}}]  # fmt: skip
    assert summary.gpus[0].utilization_percent == 95.0 == sum(raw["gpus"][0]["utilization_percent"]["v"]) / 3
    machine = raw["machine"]["cpu_percent"]
    [shard] = raw["shards"]
    assert shard["id"] == "llama" and len(shard["cpu_cores"]["us"]) == len(machine["us"]) == 10
    assert sum(machine["us"]) == 1_000_000 and machine["start"] == 0.0  # the slots cover the window exactly
    ws.raw_wanted = False
    assert ws.run_window(1.0).raw is None  # nobody watches: nothing extra


def test_xid_errors_are_counted_on_their_cards_without_waiting(readers: list[GpuReader]) -> None:
    """XID errors come through NVML's event set, drained at each reading
    with a timeout of 0 (the fake refuses any other): each card's count this
    window, since the agent watched, and its last code; a card that cannot
    be watched has none of them (not 0)."""
    nvml = h200_node(3)
    nvml.cards[2].fails["nvmlDeviceRegisterEvents"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    r = open_reader(nvml, readers)
    xid = pynvml.nvmlEventTypeXidCriticalError
    nvml.events += [(nvml.cards[1], xid, 79), (nvml.cards[1], pynvml.nvmlEventTypeSingleBitEccError, 0),
                    (nvml.cards[1], xid, 48), (nvml.cards[2], xid, 13)]  # fmt: skip
    first = read_gpus(r)
    assert (first[0]["xid_errors"], first[0]["xid_errors_total"]) == (0, 0) and "xid_last" not in first[0]
    assert (first[1]["xid_errors"], first[1]["xid_errors_total"], first[1]["xid_last"]) == (2, 2, 48)
    assert not {"xid_errors", "xid_errors_total", "xid_last"} & set(first[2])
    second = read_gpus(r)
    assert (second[1]["xid_errors"], second[1]["xid_errors_total"], second[1]["xid_last"]) == (0, 2, 48)


def test_an_xid_storm_costs_a_bounded_drain_a_reading(readers: list[GpuReader]) -> None:
    nvml = h200_node(1)
    r = open_reader(nvml, readers)
    nvml.events += [(nvml.cards[0], pynvml.nvmlEventTypeXidCriticalError, 31)] * 2500
    counts = [read_gpus(r)[0]["xid_errors"] for _ in range(4)]
    assert counts == [1000, 1000, 500, 0]


def test_pcie_replays_and_remapped_rows(readers: list[GpuReader]) -> None:
    nvml = h200_node(2)
    nvml.cards[0].pcie_replays = 5
    nvml.cards[0].remapped_rows = (2, 1, 1, 0)
    nvml.cards[1].fails.update(nvmlDeviceGetPcieReplayCounter=pynvml.NVML_ERROR_NOT_SUPPORTED,
                               nvmlDeviceGetRemappedRows=pynvml.NVML_ERROR_NOT_SUPPORTED)  # fmt: skip
    r = open_reader(nvml, readers)
    first = read_gpus(r)
    assert first[0]["pcie_replays_total"] == 5 and "pcie_replays" not in first[0]  # no reading before to count from
    assert (first[0]["remapped_rows_correctable"], first[0]["remapped_rows_uncorrectable"],
            first[0]["row_remap_pending"], first[0]["row_remap_failed"]) == (2, 1, True, False)  # fmt: skip
    assert not {"pcie_replays", "pcie_replays_total", "remapped_rows_correctable", "row_remap_pending"} & set(first[1])
    nvml.cards[0].pcie_replays = 8
    assert read_gpus(r)[0]["pcie_replays"] == 3  # this window's
