"""GPUs through NVML (nvidia-ml-py, module `pynvml`).

Every NVML call runs on one worker thread, never on the sampling loop: NVML
takes a driver-wide lock, a call can hang with a wedged driver, and
initialising costs seconds per GPU. The loop asks for a reading shortly
before a window ends (`request`) and takes it at the end if it is ready
(`take`); a reading that is not ready leaves the window without GPU figures
and the loop on time.

Each field is read on its own: a field the driver or card does not support
is absent (never 0) and costs neither the other fields nor the other cards.
Utilisation's p95 and max come from NVML's own buffered samples
(`nvmlDeviceGetSamples`), not from polling NVML at the sampling rate.
Likewise each engine's share of its cards, from the per-process samples
(`nvmlDeviceGetProcessUtilization`), joined to the engine by pid.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from sampler.gpu import gpm, mig
from sampler.gpu.gpm import CardMonitor
from sampler.off_thread import InFlight, Said

log = logging.getLogger(__name__)


@dataclass
class GpuReading:
    gpus: list[dict[str, Any]] | None  # None: not measured (NVML not loaded), `error` says why
    # shard id -> GPU memory of its processes on all cards; None: not measured
    shard_memory: dict[str, int | None]
    seconds: float  # time spent in NVML for this reading
    error: str | None = None
    # shard id -> its GPU utilisation on the cards it runs on (mean, max of SM and memory
    # bandwidth, percent); a shard on no card, or with no per-process samples from a driver, is absent
    shard_utilisation: dict[str, dict[str, float]] = field(default_factory=dict)
    # card index -> NVML's utilisation samples of this reading: times (Unix microseconds) and percents
    utilisation_samples: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # shard id -> the cards (indices) it holds a context on: a compute process of its on each
    shard_cards: dict[str, list[int]] = field(default_factory=dict)
    # card index -> GPM's intervals of this reading (gpm.POINTS): stem -> their ends (Unix microseconds) and values
    gpm_samples: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    # shard id -> the MIG instances (card index, GPU instance id) it runs on: a compute process of its on each
    shard_instances: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


INIT_RETRY_START_S = 1.0
INIT_RETRY_CAP_S = 60.0  # a driver that loads late, or a library mounted in later, is seen within a minute


@dataclass
class _Card:
    index: int
    handle: Any
    uuid: str
    name: str | None
    pci_bus_id: str | None
    memory_total_bytes: int | None
    last_sample_us: int = 0  # newest NVML utilisation sample seen
    last_process_sample_us: int = 0  # likewise, of the per-process samples
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    instances: list[mig.Instance] | None = None  # its MIG instances; None: not in MIG mode
    instances_found_at: float = -math.inf
    xid_watched: bool = False  # registered for XID events
    xid_total: int = 0  # XID events seen since then
    xid_seen: int = 0  # ... as of the last reading
    xid_last: int | None = None
    pcie_replays: int | None = None  # NVML's cumulative count, at the last reading


class _CardLost(Exception):
    pass


MAX_EVENTS_A_READING = 1000  # an XID storm is counted a thousand a reading; the rest wait for the next


def _handle_key(handle: Any) -> int:
    """What identifies a card's handle in an event: pynvml's is a pointer (an
    event carries a new pointer object to the same device); a stand-in's, itself."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
    return address if address is not None else id(handle)


class _NvmlThread:
    """One daemon thread running the submitted calls in order. Not a
    ThreadPoolExecutor: its threads are joined at interpreter exit, so a call
    hung in the driver would hold the agent's exit (SIGTERM) for ever."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]
                                       | None] = queue.SimpleQueue()  # fmt: skip
        threading.Thread(target=self._run, name="nvml", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

    def shutdown(self) -> None:
        """Cancel what has not started and let the thread end after the call in progress (if it ever returns)."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class GpuReader:
    """Owns NVML for the agent's life: initialised once, on its own thread."""

    def __init__(self, nvml: ModuleType | Any | None = None, clock: Callable[[], float] = time.monotonic,
                 gpm_every_s: float | None = None) -> None:  # fmt: skip
        """`gpm_every_s`: how often GPM and the clock events are sampled (at
        least `gpm.MIN_INTERVAL_S`); None: not at all."""
        self._nvml: Any = nvml  # pynvml, or a stand-in with its functions and errors
        self._clock = clock
        self._monitor: CardMonitor | None = None
        self._events: Any = None  # NVML's event set the cards' XID errors come through
        self._tick: concurrent.futures.Future[None] | None = None
        self.ticks = 0  # ticks submitted to the NVML thread
        self.ticks_skipped = 0  # ticks not submitted: the last one still waited (a hung call)
        self._closed = threading.Event()
        self._cards_found = threading.Event()  # NVML loaded with at least one card: something to tick for
        self._pool = _NvmlThread()
        self._cards: list[_Card] = []
        self._driver: str | None = None
        self._needs_init = True
        self._loaded = False
        self._load_error: str | None = None
        self._next_init_at = 0.0
        self._init_delay = INIT_RETRY_START_S
        self._reading = InFlight[GpuReading]()
        self._said = Said()
        self._init_future = self._pool.submit(self._init)
        if gpm_every_s is not None:
            every = max(gpm.MIN_INTERVAL_S, gpm_every_s)
            threading.Thread(target=self._ticks, args=(every,), name="nvml-ticks", daemon=True).start()

    def _ticks(self, every: float) -> None:
        """GPM's own clock: a tick submitted to the NVML thread every `every`
        seconds, none while the last is still waiting (a call hung in the
        driver does not pile ticks up behind it)."""
        while not self._closed.is_set():
            # A node without cards (or without NVML yet) wakes nothing ten times a second.
            if not self._cards_found.wait(timeout=60) or self._closed.wait(every):
                continue
            if self._tick is None or self._tick.done():
                self._tick = self._pool.submit(self._monitor_tick)
                self.ticks += 1
            else:
                self.ticks_skipped += 1

    # --- on the NVML thread -------------------------------------------------------

    def _monitor_tick(self) -> None:
        if self._loaded and self._monitor is not None:
            self._monitor.tick()

    def _errors(self) -> tuple[type[BaseException], ...]:
        return (self._nvml.NVMLError,) if self._nvml is not None else ()

    def _init(self) -> None:
        """Load NVML and find the cards. A failure (no library, a driver not
        loaded yet) is not "no GPUs": it is retried, with backoff capped at a
        minute, and until then each reading says why it has no GPUs."""
        self._needs_init = False
        self._cards = []  # a failed (re-)initialisation leaves no stale handles behind
        if self._nvml is None:
            try:
                import pynvml

                self._nvml = pynvml
            except ImportError:
                self._not_loaded("nvidia-ml-py is not installed")
                return
        nv = self._nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            self._not_loaded(str(e))
            return
        try:
            self._driver = _text(nv.nvmlSystemGetDriverVersion())
        except nv.NVMLError:
            self._driver = None
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nv.nvmlDeviceGetUUID(h))
            except nv.NVMLError as e:
                log.warning("GPU %d left out: %s", index, e)
                continue
            self._cards.append(self._describe(_Card(index, h, uuid, None, None, None)))
        for card in self._cards:
            self._find_instances(card)
        self._watch_xids()
        if self._monitor is None:
            self._monitor = CardMonitor(nv, self._clock, self._said.first)
        self._monitor.follow([(c.index, c.handle) for c in self._cards],
                             [(c.index, i.gpu_instance_id, c.handle) for c in self._cards for i in c.instances or ()])
        if self._cards:
            self._cards_found.set()
        else:
            self._cards_found.clear()
        if self._load_error is not None:
            log.warning("NVML loaded (it was not: %s): %d GPUs", self._load_error, len(self._cards))
        self._loaded, self._load_error, self._init_delay = True, None, INIT_RETRY_START_S

    def _find_instances(self, card: _Card) -> bool:
        """The card's MIG instances, found again (sampler/gpu/mig.py); whether
        they changed."""
        found = mig.instances_of(self._nvml, card.handle)
        card.instances_found_at = self._clock()
        ids = None if found is None else [i.gpu_instance_id for i in found]
        changed = ids != (None if card.instances is None else [i.gpu_instance_id for i in card.instances])
        if changed and found is not None:
            log.info("GPU %d: MIG instances %s", card.index, ", ".join(map(str, ids or ())) or "none")
        card.instances = found
        return changed

    def _watch_xids(self) -> None:
        """XID errors (the driver's own error reports) come as events: an event
        set, each card registered, drained without waiting at each reading."""
        nv = self._nvml
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            self._events = None
            if self._said.first("xid set"):
                log.info("XID errors not watched: %s", e)
            return
        for card in self._cards:
            try:
                nv.nvmlDeviceRegisterEvents(card.handle, nv.nvmlEventTypeXidCriticalError, self._events)
                card.xid_watched = True
            except nv.NVMLError as e:
                if self._said.first(f"xid {card.index}"):
                    log.info("GPU %d: XID errors not watched: %s", card.index, e)

    def _drain_xids(self) -> None:
        """The XID events since the last reading, counted on their cards; never waits."""
        nv = self._nvml
        if self._events is None:
            return
        cards = {_handle_key(c.handle): c for c in self._cards}
        for _ in range(MAX_EVENTS_A_READING):
            try:
                event = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                return  # none waiting
            except nv.NVMLError as e:
                if self._said.first(f"xid wait {e}"):
                    log.info("XID events could not be read: %s", e)
                return
            if not int(event.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            if (card := cards.get(_handle_key(event.device))) is not None:
                card.xid_total += 1
                card.xid_last = int(event.eventData)

    def _not_loaded(self, reason: str) -> None:
        if self._load_error is None:
            log.info("GPUs not measured: NVML not loaded (%s); trying again, at most a minute apart", reason)
        self._loaded, self._load_error = False, reason
        self._cards_found.clear()
        self._next_init_at = self._clock() + self._init_delay
        self._init_delay = min(INIT_RETRY_CAP_S, self._init_delay * 2)

    def _describe(self, card: _Card) -> _Card:
        nv, h = self._nvml, card.handle
        try:
            card.name = self._field(card, "name", lambda: _text(nv.nvmlDeviceGetName(h)))
            card.pci_bus_id = self._field(card, "pci_bus_id", lambda: _text(nv.nvmlDeviceGetPciInfo(h).busId))
            card.memory_total_bytes = self._field(card, "memory", lambda: int(nv.nvmlDeviceGetMemoryInfo(h).total))
        except _CardLost:
            card.lost = True
        return card

    def _reinit(self) -> None:
        if self._nvml is not None and self._loaded:
            if self._monitor is not None:
                self._monitor.close()  # its GPM buffers, freed while NVML still runs
            if self._events is not None:
                with contextlib.suppress(self._nvml.NVMLError):
                    self._nvml.nvmlEventSetFree(self._events)
                self._events = None
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
        self._init()

    def _field(self, card: _Card, name: str, read: Callable[[], Any]) -> Any:
        """One field, or None where the card or driver lacks it."""
        try:
            return read()
        except self._nvml.NVMLError as e:
            return self._failed(card, name, e)

    def _failed(self, card: _Card, name: str, e: Exception) -> None:
        """A field's read that failed: a lost card raised, a feature the card
        or driver lacks said once, anything else left out this reading."""
        nv = self._nvml
        if isinstance(e, nv.NVMLError_GpuIsLost):
            raise _CardLost() from None
        if isinstance(e, (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound, nv.NVMLError_NoPermission)):
            if name not in card.unsupported:
                card.unsupported.add(name)
                log.info("GPU %d: %s not measured: %s", card.index, name, e)
            return None
        log.debug("GPU %d: %s failed: %s", card.index, name, e)
        return None

    def _utilisation_samples(self, card: _Card) -> tuple[np.ndarray, np.ndarray] | None:
        """Utilisation samples NVML buffered since the last reading: their
        times (Unix microseconds) and values (percent)."""
        nv = self._nvml
        try:
            _, samples = nv.nvmlDeviceGetSamples(card.handle, nv.NVML_GPU_UTILIZATION_SAMPLES, card.last_sample_us)
        except nv.NVMLError_NotFound:
            return None  # nothing new since the last reading
        except nv.NVMLError_GpuIsLost:
            raise _CardLost() from None
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound) as e:
            if "samples" not in card.unsupported:
                card.unsupported.add("samples")
                log.info("GPU %d: utilisation samples not available: %s", card.index, e)
            return None
        except nv.NVMLError:
            return None
        fresh = [(s.timeStamp, s.sampleValue.uiVal) for s in samples if s.timeStamp > card.last_sample_us]
        if not fresh:
            return None
        card.last_sample_us = max(t for t, _ in fresh)
        return np.array([t for t, _ in fresh], dtype=np.float64), np.array([v for _, v in fresh], dtype=np.float64)

    def _read_card(self, card: _Card, raw: dict[int, tuple[np.ndarray, np.ndarray]],
                   gpm_raw: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]) -> dict[str, Any]:  # fmt: skip
        nv, h = self._nvml, card.handle
        out: dict[str, Any] = {"index": card.index, "uuid": card.uuid}
        if card.name is not None:
            out["name"] = card.name
        rates = self._field(card, "utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        timed = self._utilisation_samples(card)
        if timed is not None:
            raw[card.index] = timed
            samples = timed[1]
            out["utilization_percent"] = round(float(samples.mean()), 2)
            out["utilization_p95_percent"] = round(float(np.percentile(samples, 95)), 2)
            out["utilization_max_percent"] = float(samples.max())
        elif rates is not None:
            out["utilization_percent"] = float(rates.gpu)
        if rates is not None:
            out["memory_bandwidth_percent"] = float(rates.memory)
        memory = self._field(card, "memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if memory is not None:
            out["memory_used_bytes"] = int(memory.used)
            out["memory_total_bytes"] = int(memory.total)
        fields: Iterable[tuple[str, Callable[[], Any]]] = (
            ("sm_clock_hz", lambda: int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)) * 1_000_000),
            ("ecc_uncorrected", lambda: int(nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))),
            ("temperature_celsius", lambda: int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
            ("power_watts", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),  # mW
            ("energy_joules", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0),  # mJ
        )  # fmt: skip
        for key, read in fields:
            value = self._field(card, key, read)
            if value is not None:
                out[key] = value
        replays = self._field(card, "pcie_replays", lambda: int(nv.nvmlDeviceGetPcieReplayCounter(h)))
        if replays is not None:
            out["pcie_replays_total"] = replays
            if card.pcie_replays is not None and replays >= card.pcie_replays:
                out["pcie_replays"] = replays - card.pcie_replays  # since the last reading: this window's
            card.pcie_replays = replays
        rows = self._field(card, "remapped_rows", lambda: nv.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            correctable, uncorrectable, pending, failed = (int(v) for v in rows)
            out.update(remapped_rows_correctable=correctable, remapped_rows_uncorrectable=uncorrectable,
                       row_remap_pending=bool(pending), row_remap_failed=bool(failed))  # fmt: skip
        if card.xid_watched:
            out["xid_errors"], card.xid_seen = card.xid_total - card.xid_seen, card.xid_total
            out["xid_errors_total"] = card.xid_total
            if card.xid_last is not None:
                out["xid_last"] = card.xid_last
        if self._monitor is not None:
            figures, points = self._monitor.take_with_points(card.index)  # GPM and clock events, at their own rate
            out.update(figures)
            if points:
                gpm_raw[card.index] = points
        if card.instances is not None:
            out["mig_instances"] = [self._read_instance(card, i) for i in card.instances]
        return out

    def _read_instance(self, card: _Card, instance: mig.Instance) -> dict[str, Any]:
        """A MIG instance's row: its ids, its memory, what its SMs did (GPM)."""
        nv = self._nvml
        out: dict[str, Any] = {"gpu_instance_id": instance.gpu_instance_id}
        if instance.compute_instance_id is not None:
            out["compute_instance_id"] = instance.compute_instance_id
        if instance.uuid is not None:
            out["uuid"] = instance.uuid
        memory = self._instance_field(card, instance, "memory", lambda: nv.nvmlDeviceGetMemoryInfo(instance.handle))
        if memory is not None:
            out["memory_used_bytes"] = int(memory.used)
            out["memory_total_bytes"] = int(memory.total)
        if self._monitor is not None:
            out.update(self._monitor.take(card.index, instance.gpu_instance_id))
        return out

    def _instance_field(self, card: _Card, instance: mig.Instance, name: str, read: Callable[[], Any]) -> Any:
        """One field of an instance, as _field; an instance that went (NOT_FOUND,
        INVALID_ARGUMENT: its handle names nothing now) has the card's
        instances found again at the next reading."""
        nv = self._nvml
        try:
            return read()
        except (nv.NVMLError_NotFound, nv.NVMLError_InvalidArgument):
            card.instances_found_at = -math.inf
            return None
        except nv.NVMLError as e:
            return self._failed(card, f"instance {instance.gpu_instance_id} {name}", e)

    def _processes(self, card: _Card) -> list[tuple[int, int | None, int | None]] | None:
        """(pid, GPU memory or None where the driver does not say, the MIG
        instance it runs on or None) of the compute processes on a card;
        None: unknown. A MIG card's are its instances' (its own handle gives
        them all only to a privileged caller): an instance that does not
        say leaves its processes out, not the card's."""
        nv = self._nvml
        if card.instances is None:
            procs = self._field(card, "processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(card.handle))
            if procs is None:
                return None
            return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory), None) for p in procs]
        out: list[tuple[int, int | None, int | None]] = []
        answered = False
        for instance in card.instances:
            procs = self._instance_field(card, instance, "processes",
                                         functools.partial(nv.nvmlDeviceGetComputeRunningProcesses, instance.handle))
            if procs is not None:
                answered = True
                out += [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                         instance.gpu_instance_id) for p in procs]  # fmt: skip
        return out if answered or not card.instances else None

    def _process_samples(self, card: _Card) -> list[tuple[int, int, int, int]] | None:
        """(timestamp us, pid, SM %, memory %) NVML buffered since the last
        reading; [] when none had any activity; None: not available."""
        nv = self._nvml
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(card.handle, card.last_process_sample_us)
        except nv.NVMLError_NotFound:
            return []  # NVML lists only processes with activity: none had any
        except nv.NVMLError_GpuIsLost:
            raise _CardLost() from None
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound, nv.NVMLError_NoPermission) as e:
            if "process_utilization" not in card.unsupported:
                card.unsupported.add("process_utilization")
                log.info("GPU %d: per-process utilisation not available: %s", card.index, e)
            return None
        except nv.NVMLError as e:
            if getattr(e, "value", None) == 0:  # pynvml raises "Success" when the count is 0
                return []
            return None
        fresh = [(int(s.timeStamp), int(s.pid), int(s.smUtil), int(s.memUtil))
                 for s in samples if s.timeStamp > card.last_process_sample_us]  # fmt: skip
        if fresh:
            card.last_process_sample_us = max(t for t, _, _, _ in fresh)
        return fresh

    @staticmethod
    def _card_share(samples: list[tuple[int, int, int, int]], owner: dict[int, str],
                    on_card: set[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:  # fmt: skip
        """Per shard on this card: its SM and memory percent at each instant NVML
        sampled the card (its processes summed, at most 100; 0 at an instant it
        is not listed: NVML lists only processes with activity)."""
        instants = sorted({t for t, _, _, _ in samples})
        at = {t: i for i, t in enumerate(instants)}
        shards = on_card | {owner[pid] for _, pid, _, _ in samples if pid in owner}
        out = {sid: (np.zeros(max(1, len(instants))), np.zeros(max(1, len(instants)))) for sid in shards}
        for t, pid, sm, mem in samples:
            if (sid := owner.get(pid)) is not None:
                out[sid][0][at[t]] += sm
                out[sid][1][at[t]] += mem
        for sm_, mem_ in out.values():
            np.minimum(sm_, 100.0, out=sm_)
            np.minimum(mem_, 100.0, out=mem_)
        return out

    @staticmethod
    def _shard_utilisation(per_card: dict[str, list[tuple[np.ndarray, np.ndarray]]]) -> dict[str, dict[str, float]]:
        """The mean over the shard's cards of each card's mean; the max of any instant on any."""
        out = {}
        for sid, cards in per_card.items():
            out[sid] = {
                "gpu_utilization_percent": round(float(np.mean([sm.mean() for sm, _ in cards])), 2),
                "gpu_utilization_max_percent": float(max(sm.max() for sm, _ in cards)),
                "gpu_memory_bandwidth_percent": round(float(np.mean([mem.mean() for _, mem in cards])), 2),
                "gpu_memory_bandwidth_max_percent": float(max(mem.max() for _, mem in cards)),
            }
        return out

    def _read(self, members: dict[str, set[int]]) -> GpuReading:
        started = self._clock()
        if self._needs_init or (not self._loaded and started >= self._next_init_at):
            self._reinit()
        if not self._loaded:
            return GpuReading(None, dict.fromkeys(members), self._clock() - started,
                              f"NVML not loaded yet: {self._load_error}")  # fmt: skip
        gpus: list[dict[str, Any]] = []
        used: dict[str, int] = dict.fromkeys(members, 0)
        answered = False
        owner = {pid: sid for sid, pids in members.items() for pid in pids}
        shares: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        raw: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        gpm_raw: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        cards_of: dict[str, list[int]] = {}
        instances_of: dict[str, list[tuple[int, int]]] = {}  # a shard not on an instance: an empty list
        self._drain_xids()
        for card in self._cards:
            if started - card.instances_found_at >= mig.RESCAN_S and self._find_instances(card) and self._monitor:
                self._monitor.follow_instances(card.index, card.handle,
                                               [i.gpu_instance_id for i in card.instances or ()])  # fmt: skip
            try:
                gpus.append(self._read_card(card, raw, gpm_raw))
                procs = self._processes(card) if members else None
                samples = self._process_samples(card) if members else None
            except _CardLost:
                if not card.lost:
                    log.warning("GPU %d (%s) is lost; NVML will be re-initialised", card.index, card.uuid)
                card.lost = True
                self._needs_init = True
                gpus.append({"index": card.index, "uuid": card.uuid, "lost": True})
                continue
            if card.lost:
                log.warning("GPU %d (%s) is back", card.index, card.uuid)
                card.lost = False
            on_card: set[str] = set()
            if procs is not None:
                answered = True
                for pid, memory, gpu_instance in procs:
                    if pid in owner:
                        used[owner[pid]] += memory or 0
                        on_card.add(owner[pid])
                        on = instances_of.setdefault(owner[pid], [])
                        if gpu_instance is not None and (card.index, gpu_instance) not in on:
                            on.append((card.index, gpu_instance))
                for sid in on_card:
                    cards_of.setdefault(sid, []).append(card.index)
            if samples is not None:
                for sid, share in self._card_share(samples, owner, on_card).items():
                    shares.setdefault(sid, []).append(share)
        shard_memory: dict[str, int | None] = {sid: (v if answered else None) for sid, v in used.items()}
        return GpuReading(gpus, shard_memory, self._clock() - started, None, self._shard_utilisation(shares), raw,
                          cards_of, gpm_raw, {sid: on for sid, on in instances_of.items() if on})  # fmt: skip

    # --- on the caller's thread ----------------------------------------------------

    def wait_ready(self, timeout: float) -> bool:
        """Wait for NVML to initialise (seconds per GPU). False: still going."""
        try:
            self._init_future.result(timeout=timeout)
            return True
        except concurrent.futures.TimeoutError:
            return False

    def inventory(self) -> list[dict[str, Any]] | None:
        """What registration carries; None until NVML has loaded."""
        if not self._init_future.done() or not self._loaded:
            return None
        return [
            {k: v for k, v in {"index": c.index, "uuid": c.uuid, "name": c.name,
                               "memory_total_bytes": c.memory_total_bytes, "pci_bus_id": c.pci_bus_id,
                               "driver_version": self._driver}.items() if v is not None}  # fmt: skip
            for c in self._cards
        ]

    def request(self, members: dict[str, set[int]]) -> None:
        """Start a reading unless one is still running (a hung call)."""
        if self._reading.running():
            if self._said.changed("stuck", True):
                log.warning("an NVML call has not returned for %.1f s; GPUs left out until it does",
                            self._clock() - self._reading.since)  # fmt: skip
            return
        self._reading.start(self._pool.submit(self._read, members), self._clock())

    def wait(self, timeout: float) -> bool:
        """Wait for the requested reading to finish; False if it has not."""
        return self._reading.wait(timeout)

    def take(self) -> GpuReading | None:
        """The requested reading if it has finished; None otherwise (never waits)."""
        done = self._reading.take()
        if done is None:
            return None
        if self._said.changed("stuck", None):
            log.warning("NVML answers again")
        try:
            return done.result()
        except Exception as e:  # a bug or an NVML error outside any card: this window only
            log.warning("GPU reading failed: %s", e)
            return None

    def close(self) -> None:
        # A hung NVML call cannot be interrupted: do not wait for it (the thread is a daemon).
        self._closed.set()
        self._cards_found.set()  # the ticker, waiting for cards, sees it is closed
        self._pool.shutdown()
