"""What a card's SMs do, and what holds its clocks back, at GPM's own rate.

NVML's utilisation is the share of time at least one kernel ran: a card
decoding one small batch reads 100% while most of its SMs idle. GPU
Performance Monitoring (GPM, Hopper and later) says what the SMs do: the
share of SMs busy, warps resident against the maximum, tensor pipes
active, DRAM bandwidth, PCIe and NVLink bytes. Each figure is computed by
NVML from two samples (`nvmlGpmSampleGet`, then `nvmlGpmMetricsGet` over
the pair), which must lie at least 100 ms apart (NVML's reference, the
note of `nvmlGpmMetricsGet`; NVIDIA calls faster than 10 Hz unsupported):
so GPM keeps its own clock, `MIN_INTERVAL_S` at the finest, whatever the
sampler's `--hz`, and a window's figures are the mean, p95 and max of the
intervals that ended in it, each weighed by its length (wire/raw.py's
`window_stats`), with their mean length beside them. The intervals of the
percent figures go to a live viewer and to hindsight one by one (`POINTS`).

The clock-event reasons (`nvmlDeviceGetCurrentClocksEventReasons`, a bit
mask of why the clocks are below their maximum now) are read at the same
ticks on every card, GPM or not: each reason's share of the window is the
time it was set (each tick's mask standing for the interval it ends).

Everything here runs on the NVML thread (sampler/gpu/nvml.py): the ticks
and the window's reading alike, so nothing is shared with another thread.
A card, driver or metric without support is absent, said once with the
reason, never 0; a read that fails costs that figure that interval.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wire.raw import window_stats

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.1  # two GPM samples at least 100 ms apart (NVML's nvmlGpmMetricsGet)
MiB = 1 << 20

# The wire's name (its stem) -> NVML's metric, and its unit on the wire.
# NVML gives percents, and bytes as MiB a second.
METRICS: dict[str, tuple[str, str]] = {
    "sm_activity": ("NVML_GPM_METRIC_SM_UTIL", "percent"),  # SMs busy, of all
    "sm_occupancy": ("NVML_GPM_METRIC_SM_OCCUPANCY", "percent"),  # warps resident, of the most possible
    "tensor_activity": ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "percent"),  # any tensor pipe
    "tensor_hmma_activity": ("NVML_GPM_METRIC_HMMA_TENSOR_UTIL", "percent"),  # half-precision matrix pipes
    "dram_bandwidth": ("NVML_GPM_METRIC_DRAM_BW_UTIL", "percent"),  # of the theoretical maximum
    "pcie_tx": ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", "bytes_per_second"),
    "pcie_rx": ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", "bytes_per_second"),
    "nvlink_tx": ("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", "bytes_per_second"),
    "nvlink_rx": ("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", "bytes_per_second"),
}

# The wire's name -> NVML's bit: what holds a card's clocks back.
CLOCK_EVENTS: dict[str, str] = {
    "sw_power_cap": "nvmlClocksEventReasonSwPowerCap",
    "hw_slowdown": "nvmlClocksEventReasonHwSlowdown",
    "sw_thermal_slowdown": "nvmlClocksEventReasonSwThermalSlowdown",
    "hw_thermal_slowdown": "nvmlClocksEventReasonHwThermalSlowdown",
    "power_brake": "nvmlClocksEventReasonHwPowerBrakeSlowdown",
    "sync_boost": "nvmlClocksEventReasonSyncBoost",
}


# The metrics whose intervals a live viewer and hindsight see one by one
# (wire/raw.py's GPU points), as NVML's utilisation samples are seen.
POINTS = ("sm_activity", "sm_occupancy", "tensor_activity", "dram_bandwidth")


def fields(stem: str) -> tuple[str, str, str]:
    """The wire's mean, p95 and max fields of a GPM metric."""
    unit = METRICS[stem][1]
    return f"{stem}_{unit}", f"{stem}_p95_{unit}", f"{stem}_max_{unit}"


def clock_event_field(name: str) -> str:
    return f"clock_event_{name}_ratio"


@dataclass
class _CardState:
    index: int
    handle: Any  # the card's (an instance's GPM samples come through its card and its id)
    gpu_instance: int | None = None  # a MIG instance's GPU instance id; None: the whole card
    gpm: bool | None = None  # None: not asked yet
    buffers: list[Any] = field(default_factory=list)  # two GPM sample buffers, the newest first after a tick
    ask: Any = None  # the metrics asked of a pair: made once (23 KB, its ids set through pynvml's Python setters)
    last_at: float | None = None  # when buffers[0] was taken
    # (when it ended, monotonic; its seconds; stem -> value)
    intervals: list[tuple[float, float, dict[str, float]]] = field(default_factory=list)
    clock_events: bool = True  # False: the card or driver does not say
    clock_at: float | None = None
    held: dict[str, float] = field(default_factory=dict)  # reason -> seconds set, this window
    clock_seconds: float = 0.0  # seconds the ticks covered, this window

    @property
    def name(self) -> str:
        return f"GPU {self.index}" if self.gpu_instance is None else f"GPU {self.index} instance {self.gpu_instance}"


class CardMonitor:
    """GPM and clock events of a node's cards, and GPM of their MIG instances,
    ticked on the NVML thread."""

    def __init__(self, nvml: Any, clock: Callable[[], float], said: Callable[[str], bool],
                 wall: Callable[[], float] = time.time) -> None:  # fmt: skip
        self._nv = nvml
        self._clock = clock
        self._wall = wall
        self._first = said  # True the first time a problem is seen: it is logged once
        self._cards: dict[tuple[int, int | None], _CardState] = {}  # (index, GPU instance id or None)
        self._ids = {stem: int(getattr(nvml, name)) for stem, (name, _) in METRICS.items()}
        self._bits = {reason: int(getattr(nvml, name)) for reason, name in CLOCK_EVENTS.items()}

    def follow(self, cards: list[tuple[int, Any]], instances: Iterable[tuple[int, int, Any]] = ()) -> None:
        """The cards (index, handle) found at NVML's (re-)initialisation, and
        their MIG instances (card index, GPU instance id, the card's handle);
        old buffers are freed. The clock events are the card's alone."""
        self.close()
        self._cards = {(index, None): _CardState(index, handle) for index, handle in cards}
        for index, gpu_instance, handle in instances:
            self._cards[index, gpu_instance] = _CardState(index, handle, gpu_instance, clock_events=False)

    def follow_instances(self, index: int, handle: Any, gpu_instances: list[int]) -> None:
        """A card's MIG instances found anew: those gone freed, new ones
        followed; those kept keep their pair of samples."""
        for key in [k for k in self._cards if k[0] == index and k[1] is not None and k[1] not in gpu_instances]:
            self._free(self._cards.pop(key))
        for gpu_instance in gpu_instances:
            if (index, gpu_instance) not in self._cards:
                self._cards[index, gpu_instance] = _CardState(index, handle, gpu_instance, clock_events=False)

    def _free(self, card: _CardState) -> None:
        for buffer in card.buffers:
            with contextlib.suppress(self._nv.NVMLError):
                self._nv.nvmlGpmSampleFree(buffer)
        card.buffers = []

    def close(self) -> None:
        for card in self._cards.values():
            self._free(card)
        self._cards = {}

    # --- a tick -----------------------------------------------------------------------

    def tick(self) -> None:
        now = self._clock()
        for card in self._cards.values():
            self._tick_clock_events(card, now)
            if card.gpm is None:
                card.gpm = self._supports_gpm(card)
            if card.gpm:
                self._tick_gpm(card)

    def _supports_gpm(self, card: _CardState) -> bool:
        nv = self._nv
        try:
            supported = bool(nv.nvmlGpmQueryDeviceSupport(card.handle).isSupportedDevice)
            if supported:
                card.buffers = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
                card.ask = nv.c_nvmlGpmMetricsGet_t()
                card.ask.version = nv.NVML_GPM_METRICS_GET_VERSION
                card.ask.numMetrics = len(self._ids)
                for i, metric in enumerate(self._ids.values()):
                    card.ask.metrics[i].metricId = metric
        except nv.NVMLError as e:
            if self._first(f"gpm {card.name}"):
                log.info("%s: SM activity, occupancy, tensor and bandwidth not measured: GPM not available "
                         "(%s)", card.name, e)  # fmt: skip
            return False
        if not supported and self._first(f"gpm {card.name}"):
            log.info("%s: SM activity, occupancy, tensor and bandwidth not measured: the card has no GPM "
                     "(Hopper and later have it)", card.name)  # fmt: skip
        return supported

    def _tick_gpm(self, card: _CardState) -> None:
        """A GPM sample of the card, paired with its last. The pair's times are
        the clock read after each call (NVML stamps a sample within its call):
        a sample is taken only when the clock before the call is
        MIN_INTERVAL_S past the last one's after, so the two NVML pairs are
        that far apart whatever the calls before it in the tick took (a tick
        read the clock once for every card: a MIG card's later instances,
        sampled late in a slow tick and early in the next, were paired 80 ms
        apart, which NVML refuses)."""
        nv = self._nv
        if card.last_at is not None and self._clock() - card.last_at < MIN_INTERVAL_S - 1e-6:  # float sums
            return
        newest, older = card.buffers[1], card.buffers[0]  # the older of the two is written over
        try:
            if card.gpu_instance is None:
                nv.nvmlGpmSampleGet(card.handle, newest)
            else:
                nv.nvmlGpmMigSampleGet(card.handle, card.gpu_instance, newest)
            now = self._clock()
        except nv.NVMLError as e:
            if self._first(f"gpm sample {card.name} {e}"):
                log.info("%s: a GPM sample failed (%s): that interval is left out", card.name, e)
            card.last_at = None  # the next sample starts a new pair
            return
        card.buffers = [newest, older]
        if card.last_at is None:
            card.last_at = now
            return
        seconds, card.last_at = now - card.last_at, now
        ask = card.ask
        ask.sample1, ask.sample2 = older, newest
        try:
            nv.nvmlGpmMetricsGet(ask)
        except nv.NVMLError as e:
            if self._first(f"gpm metrics {card.name} {e}"):
                log.info("%s: GPM metrics failed (%s): that interval is left out", card.name, e)
            return
        values = {}
        for i, stem in enumerate(self._ids):
            got = ask.metrics[i]
            if got.nvmlReturn != nv.NVML_SUCCESS:
                if self._first(f"gpm {card.name} {stem} {got.nvmlReturn}"):
                    log.info("%s: %s not measured: NVML returned %s", card.name, stem,
                             nv.NVMLError(got.nvmlReturn))  # fmt: skip
                continue
            value = float(got.value)
            if not np.isfinite(value) or value < 0:
                continue
            values[stem] = value * MiB if METRICS[stem][1] == "bytes_per_second" else min(value, 100.0)
        card.intervals.append((now, seconds, values))

    def _tick_clock_events(self, card: _CardState, now: float) -> None:
        if not card.clock_events:
            return
        nv = self._nv
        try:
            mask = int(nv.nvmlDeviceGetCurrentClocksEventReasons(card.handle))
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound, nv.NVMLError_NoPermission) as e:
            card.clock_events = False
            log.info("GPU %d: what holds its clocks back not measured: %s", card.index, e)
            return
        except nv.NVMLError:
            card.clock_at = None  # this interval unknown: the next tick starts again
            return
        if card.clock_at is not None:
            seconds = now - card.clock_at
            card.clock_seconds += seconds
            for reason, bit in self._bits.items():
                if mask & bit:
                    card.held[reason] = card.held.get(reason, 0.0) + seconds
        card.clock_at = now

    # --- a window ---------------------------------------------------------------------

    def take(self, index: int, gpu_instance: int | None = None) -> dict[str, Any]:
        """The card's (or its MIG instance's) fields for the window since the
        last take: absent where not measured (no GPM, no interval ended, the
        metric refused)."""
        return self.take_with_points(index, gpu_instance)[0]

    def take_with_points(self, index: int, gpu_instance: int | None = None
                         ) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:  # fmt: skip
        """take()'s fields, and the intervals of each of POINTS themselves:
        stem -> (each one's end, Unix microseconds; its value)."""
        card = self._cards.get((index, gpu_instance))
        if card is None:
            return {}, {}
        out: dict[str, Any] = {}
        points: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        intervals, card.intervals = card.intervals, []
        if intervals:
            to_wall = self._wall() - self._clock()
            lengths = np.array([s for _, s, _ in intervals])
            out["gpm_interval_seconds"] = round(float(lengths.mean()), 3)
            for stem in METRICS:
                kept = [(at, s, v[stem]) for at, s, v in intervals if stem in v]
                if not kept:
                    continue
                ends, weights, values = (np.array(column) for column in zip(*kept, strict=True))
                # The one definition of a window's mean, p95 and max (wire/raw.py): the
                # live view's and hindsight's lines over these intervals are the same.
                stats = window_stats(values, weights)
                assert stats is not None  # every value is finite, every interval has a length
                for name, figure in zip(fields(stem), ("mean", "p95", "max"), strict=True):
                    out[name] = round(stats[figure], 2)
                if stem in POINTS:
                    points[stem] = ((ends + to_wall) * 1e6, values)
        if card.clock_events and card.clock_seconds > 0:
            for reason in CLOCK_EVENTS:
                out[clock_event_field(reason)] = round(min(1.0, card.held.get(reason, 0.0) / card.clock_seconds), 4)
        card.held, card.clock_seconds = {}, 0.0
        return out, points
