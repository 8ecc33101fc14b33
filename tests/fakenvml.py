"""A stand-in for the `pynvml` module, for machines without a GPU.

It follows the real module: the same function names and signatures (a test
compares them with pynvml's own), the same return types (pynvml's ctypes
structures and friendly objects), and pynvml's own error classes, raised the
way pynvml raises them (`NVMLError(code)` becomes the matching subclass).
Everything else (constants, error classes) is pynvml's, looked up on it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pynvml

GiB = 1024**3


@dataclass
class FakeCard:
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

    @property
    def uuid(self) -> str:
        return f"GPU-{self.index:08d}-fake-0000-0000-000000000000"


class FakeNvml:
    def __init__(self, cards: list[FakeCard], library: bool = True, driver: str = "550.54.15") -> None:
        self.cards = cards
        self.library = library
        self.driver = driver
        self.initialised = False
        self.inits = 0

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

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.cards[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._card(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._card(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        card = self._card(handle, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = f"00000000:{0x18 + card.index:02X}:00.0".encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
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
        card = self._card(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [pynvml.nvmlFriendlyObject({"pid": pid, "usedGpuMemory": mem}) for pid, mem in card.processes]


def h200_node(cards: int = 8) -> FakeNvml:
    return FakeNvml([FakeCard(i) for i in range(cards)])


OLD_DRIVER = {
    "nvmlDeviceGetUtilizationRates": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "nvmlDeviceGetSamples": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    "nvmlDeviceGetTotalEnergyConsumption": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "nvmlDeviceGetProcessUtilization": pynvml.NVML_ERROR_NOT_SUPPORTED,
}
