"""A stand-in for the `pynvml` module, for machines without a GPU.

It follows the real module: the same function names and signatures (a test
compares them with pynvml's own), the same return types (pynvml's ctypes
structures and friendly objects), and pynvml's own error classes, raised the
way pynvml raises them (`NVMLError(code)` becomes the matching subclass).
Everything else (constants, error classes) is pynvml's, looked up on it.

GPM (GPU Performance Monitoring) follows NVML's reference
(docs.nvidia.com/deploy/nvml-api, "GPM Functions"): sample buffers from
`nvmlGpmSampleAlloc` (pynvml's `c_nvmlGpmSample_t`, a pointer to an opaque
struct), filled by `nvmlGpmSampleGet` with the card's counters at that
moment; `nvmlGpmMetricsGet` computes each asked metric over the interval
between two samples (a counter's advance over the time between them, so a
metric is the time-weighted mean of its rate over the interval), each with
its own `nvmlReturn`, after checking the struct's version
(`NVML_GPM_METRICS_GET_VERSION`). The reference asks for samples at least
100 ms apart and does not say what NVML does otherwise: the fake refuses
such a pair (`NVML_ERROR_INVALID_ARGUMENT`) and counts it. A card's
support is `nvmlGpmQueryDeviceSupport`'s `isSupportedDevice`; the clock
events are `nvmlDeviceGetCurrentClocksEventReasons`' bit mask
(`nvmlClocksEventReason*`).

MIG (the reference's "Multi Instance GPU Management"): a card in MIG mode
(`nvmlDeviceGetMigMode`'s current mode `NVML_DEVICE_MIG_ENABLE`) has
`nvmlDeviceGetMaxMigDeviceCount` slots (7 on A100 and H100), each empty
(`nvmlDeviceGetMigDeviceHandleByIndex`: NOT_FOUND) or a MIG device handle
(the fake's: the `FakeInstance` itself) that names its GPU and compute
instance ids and answers for its own memory and processes; utilisation is
not supported on it (as NVML says of MIG devices). The card's own handle
gives the processes of every instance only to a privileged caller (the
reference's note on `nvmlDeviceGetComputeRunningProcesses` in MIG mode): the
fake's agent is not, and gets NO_PERMISSION. GPM samples of an instance come
through the card's handle and its GPU instance id (`nvmlGpmMigSampleGet`);
an id the card does not have is INVALID_ARGUMENT.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

GiB = 1024**3


@dataclass(kw_only=True)
class GpmCounters:
    """A card's or a MIG instance's GPM counters."""

    # GPM metric id -> its rate now (percent, or MiB a second), and its counter (rate x seconds) so far
    gpm_rates: dict[int, float] = field(default_factory=dict)
    gpm_counters: dict[int, float] = field(default_factory=dict)
    gpm_counted_to: float | None = None
    gpm_refused: dict[int, int] = field(default_factory=dict)  # metric id -> the nvmlReturn it gets

    def set_gpm_rates(self, now: float, rates: dict[int, float]) -> None:
        """From `now` on, the metrics advance at `rates` (the counters brought up to now first)."""
        self.count_gpm(now)
        self.gpm_rates = dict(rates)

    def count_gpm(self, now: float) -> None:
        if self.gpm_counted_to is not None:
            for metric, rate in self.gpm_rates.items():
                self.gpm_counters[metric] = self.gpm_counters.get(metric, 0.0) + rate * (now - self.gpm_counted_to)
        self.gpm_counted_to = now


@dataclass
class FakeInstance(GpmCounters):
    """A MIG device: a GPU instance (with one compute instance) of a card."""

    gpu_instance_id: int
    compute_instance_id: int = 0
    memory_total: int = 16 * GiB
    memory_used: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes or None)
    fails: dict[str, int] = field(default_factory=dict)
    gone: bool = False  # destroyed since its handle was given: the handle names nothing
    card: FakeCard | None = None  # set by its card

    @property
    def uuid(self) -> str:
        assert self.card is not None
        return f"MIG-{self.card.index:04d}{self.gpu_instance_id:04d}-fake-0000-0000-000000000000"


@dataclass
class FakeCard(GpmCounters):
    index: int
    name: str = "NVIDIA H200"
    memory_total: int = 141 * GiB
    memory_used: int = 80 * GiB
    utilization: int = 97
    memory_bandwidth: int = 41
    sm_clock_mhz: int = 1980
    ecc_uncorrected: int = 0
    temperature: int = 61
    power_mw: int = 512300
    energy_mj: int = 123456700
    samples: list[tuple[int, int]] = field(default_factory=list)  # (timestamp us, percent)
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes or None)
    # per-process utilisation samples: (timestamp us, pid, SM percent, memory percent)
    process_samples: list[tuple[int, int, int, int]] = field(default_factory=list)
    # function name -> NVML error code it raises (an old driver, a card without the feature)
    fails: dict[str, int] = field(default_factory=dict)
    lost: bool = False
    back_after_reinit: bool = True
    hang: threading.Event | None = None  # set: calls return; clear: nvmlDeviceGetTemperature blocks
    calls: int = 0
    gpm: bool = True  # nvmlGpmQueryDeviceSupport's isSupportedDevice (Hopper and later)
    clock_events: int = 0  # nvmlDeviceGetCurrentClocksEventReasons' mask now
    pcie_replays: int = 0  # nvmlDeviceGetPcieReplayCounter: cumulative
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    # MIG mode's slots, each an instance or empty (None); None: MIG disabled
    mig: list[FakeInstance | None] | None = None

    def __post_init__(self) -> None:
        for instance in self.mig or ():
            if instance is not None:
                instance.card = self

    @property
    def uuid(self) -> str:
        return f"GPU-{self.index:08d}-fake-0000-0000-000000000000"


@dataclass
class _GpmSample:
    card: GpmCounters | None = None  # a card or an instance; None: allocated, never filled
    at: float = 0.0
    counters: dict[int, float] = field(default_factory=dict)
    freed: bool = False


class FakeNvml:
    def __init__(self, cards: list[FakeCard], library: bool = True, driver: str = "550.54.15",
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.cards = cards
        self.library = library
        self.driver = driver
        self.initialised = False
        self.inits = 0
        self.clock = clock  # GPM samples' time, as the driver stamps them
        self._gpm_buffers: dict[int, tuple[Any, _GpmSample]] = {}  # address -> (the struct, kept alive; its sample)
        self.gpm_pairs_too_close = 0
        self.gpm_unfreed_at_shutdown = 0
        # XID events: what the driver has raised and not yet been read, (card, event type, XID code);
        # each set's registered cards and types.
        self.events: list[tuple[FakeCard, int, int]] = []
        self._event_sets: list[dict[int, int]] = []  # set -> id(card) -> its registered types

    def __getattr__(self, name: str) -> Any:
        return getattr(pynvml, name)  # constants, error classes, structures

    # --- helpers -----------------------------------------------------------------

    def _card(self, handle: Any, fn: str) -> FakeCard:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        card: FakeCard = handle
        card.calls += 1
        if card.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fn in card.fails:
            raise pynvml.NVMLError(card.fails[fn])
        return card

    def _instance(self, handle: FakeInstance, fn: str) -> FakeInstance:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        assert handle.card is not None
        if handle.card.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if handle.gone:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if fn in handle.fails:
            raise pynvml.NVMLError(handle.fails[fn])
        return handle

    # --- the module's functions ----------------------------------------------------------

    def nvmlInit(self) -> None:
        if not self.library:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialised = True
        self.inits += 1
        for card in self.cards:
            if card.lost and card.back_after_reinit and self.inits > 1:
                card.lost = False

    def nvmlShutdown(self) -> None:
        self.initialised = False
        # NVML's reference says nothing of sample buffers across a shutdown: the fake takes them as
        # gone with it, counts those not freed first, and refuses them afterwards.
        self.gpm_unfreed_at_shutdown += sum(not sample.freed for _, sample in self._gpm_buffers.values())
        self._gpm_buffers.clear()

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.cards[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, FakeInstance):
            return self._instance(handle, "nvmlDeviceGetUUID").uuid
        return self._card(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._card(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        card = self._card(handle, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = f"00000000:{0x18 + card.index:02X}:00.0".encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        c: FakeCard | FakeInstance
        if isinstance(handle, FakeInstance):
            c = self._instance(handle, "nvmlDeviceGetMemoryInfo")
        else:
            c = self._card(handle, "nvmlDeviceGetMemoryInfo")
        return pynvml.c_nvmlMemory_t(total=c.memory_total, free=c.memory_total - c.memory_used, used=c.memory_used)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        c = self._card(handle, "nvmlDeviceGetUtilizationRates")
        return pynvml.c_nvmlUtilization_t(gpu=c.utilization, memory=c.memory_bandwidth)

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        assert type == pynvml.NVML_CLOCK_SM
        return self._card(handle, "nvmlDeviceGetClockInfo").sm_clock_mhz

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        assert (errorType, counterType) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return self._card(handle, "nvmlDeviceGetTotalEccErrors").ecc_uncorrected

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        card = self._card(handle, "nvmlDeviceGetTemperature")
        if card.hang is not None:
            card.hang.wait()  # a wedged driver
        return card.temperature

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._card(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self._card(handle, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetSamples(self, device: Any, sampling_type: int, timeStamp: int) -> tuple[int, list[Any]]:
        card = self._card(device, "nvmlDeviceGetSamples")
        assert sampling_type == pynvml.NVML_GPU_UTILIZATION_SAMPLES
        fresh = [(t, v) for t, v in card.samples if t > timeStamp]
        if not fresh:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        out = []
        for t, v in fresh:
            s = pynvml.c_nvmlSample_t()
            s.timeStamp = t
            s.sampleValue.uiVal = v
            out.append(s)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, out

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        card = self._card(handle, "nvmlDeviceGetProcessUtilization")
        fresh = [s for s in card.process_samples if s[0] > timeStamp]
        if not fresh:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return [pynvml.c_nvmlProcessUtilizationSample_t(pid=pid, timeStamp=t, smUtil=sm, memUtil=mem, encUtil=0,
                                                        decUtil=0) for t, pid, sm, mem in fresh]  # fmt: skip

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        c: FakeCard | FakeInstance
        if isinstance(handle, FakeInstance):
            c = self._instance(handle, "nvmlDeviceGetComputeRunningProcesses")
        else:
            c = self._card(handle, "nvmlDeviceGetComputeRunningProcesses")
            if c.mig is not None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)  # every instance's: the privileged alone
        return [pynvml.nvmlFriendlyObject({"pid": pid, "usedGpuMemory": mem}) for pid, mem in c.processes]

    # --- MIG -------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        card = self._card(device, "nvmlDeviceGetMigMode")
        enabled = pynvml.NVML_DEVICE_MIG_ENABLE if card.mig is not None else pynvml.NVML_DEVICE_MIG_DISABLE
        return [enabled, enabled]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        card = self._card(device, "nvmlDeviceGetMaxMigDeviceCount")
        return 7 if card.mig is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        card = self._card(device, "nvmlDeviceGetMigDeviceHandleByIndex")
        if card.mig is None or not 0 <= index < 7:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        instance = card.mig[index] if index < len(card.mig) else None
        if instance is None or instance.gone:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return instance

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        if not isinstance(device, FakeInstance):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a card's own handle has none
        return self._instance(device, "nvmlDeviceGetGpuInstanceId").gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        if not isinstance(device, FakeInstance):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._instance(device, "nvmlDeviceGetComputeInstanceId").compute_instance_id


    # --- GPM and clock events ------------------------------------------------------------

    def _gpm_sample(self, pointer: Any) -> _GpmSample:
        address = ctypes.cast(pointer, ctypes.c_void_p).value
        if address is None or address not in self._gpm_buffers or self._gpm_buffers[address][1].freed:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpm_buffers[address][1]

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        card = self._card(device, "nvmlGpmQueryDeviceSupport")
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(card.gpm)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        struct = pynvml.struct_c_nvmlGpmSample_t()
        pointer = pynvml.c_nvmlGpmSample_t(struct)
        self._gpm_buffers[ctypes.addressof(struct)] = (struct, _GpmSample())
        return pointer

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        if not self.initialised:  # as every NVML call but nvmlInit: after nvmlShutdown, nothing is freed
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self._gpm_sample(gpmSample).freed = True

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        card = self._card(device, "nvmlGpmSampleGet")
        if not card.gpm:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._take_gpm(card, gpmSample)

    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        card = self._card(device, "nvmlGpmMigSampleGet")
        if not card.gpm:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        instance = next((i for i in card.mig or () if i is not None and not i.gone
                         and i.gpu_instance_id == gpuInstanceId), None)  # fmt: skip
        if instance is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._take_gpm(instance, gpmSample)

    def _take_gpm(self, counted: GpmCounters, gpmSample: Any) -> Any:
        sample = self._gpm_sample(gpmSample)
        now = self.clock()
        counted.count_gpm(now)
        sample.card, sample.at, sample.counters = counted, now, dict(counted.gpm_counters)
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first, second = self._gpm_sample(metricsGet.sample1), self._gpm_sample(metricsGet.sample2)
        if first.card is None or first.card is not second.card or not second.at > first.at:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if second.at - first.at < 0.1 - 1e-6:  # a microsecond for the clocks' float sums
            self.gpm_pairs_too_close += 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        card = first.card
        seconds = second.at - first.at
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            if metric.metricId in card.gpm_refused:
                metric.nvmlReturn, metric.value = card.gpm_refused[metric.metricId], 0.0
                continue
            advanced = second.counters.get(metric.metricId, 0.0) - first.counters.get(metric.metricId, 0.0)
            metric.nvmlReturn, metric.value = pynvml.NVML_SUCCESS, advanced / seconds
        return metricsGet

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._card(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_events

    # --- what breaks a card ----------------------------------------------------------------

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._card(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replays

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        return self._card(device, "nvmlDeviceGetRemappedRows").remapped_rows

    def nvmlEventSetCreate(self) -> Any:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self._event_sets.append({})
        return len(self._event_sets) - 1  # pynvml's is an opaque handle: the fake's, its number

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        card = self._card(handle, "nvmlDeviceRegisterEvents")
        self._event_sets[eventSet][id(card)] = self._event_sets[eventSet].get(id(card), 0) | eventTypes

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._event_sets[eventSet] = {}

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """The oldest event of a registered card and type; NVML_ERROR_TIMEOUT
        at once when there is none (the fake never waits: the reader asks with 0)."""
        assert timeoutms == 0, "the reader must never wait on NVML's event set"
        registered = self._event_sets[eventSet]
        for i, (card, kind, code) in enumerate(self.events):
            if registered.get(id(card), 0) & kind:
                del self.events[i]
                return pynvml.nvmlFriendlyObject({"device": card, "eventType": kind, "eventData": code,
                                                  "gpuInstanceId": 0, "computeInstanceId": 0})  # fmt: skip
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)


def h200_node(cards: int = 8) -> FakeNvml:
    return FakeNvml([FakeCard(i) for i in range(cards)])


OLD_DRIVER = {
    "nvmlDeviceGetUtilizationRates": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "nvmlDeviceGetSamples": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    "nvmlDeviceGetTotalEnergyConsumption": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "nvmlDeviceGetProcessUtilization": pynvml.NVML_ERROR_NOT_SUPPORTED,
}
