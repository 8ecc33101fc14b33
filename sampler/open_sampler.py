"""A window sampler as the commands ask for it (`sample`, `up`, `agent`):
the backend opened, the rate checked against what it can measure, the GPUs'
reader made. The CLI gives the options and says the errors."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sampler.backend import open_backend
from sampler.gpu import gpm
from sampler.gpu.nvml import GpuReader
from sampler.shards.kubelet import KubeletPods
from sampler.shards.selectors import Selector, ShardSpec
from sampler.window.sampler import WindowSampler

log = logging.getLogger(__name__)


class OptionError(ValueError):
    """An option that cannot work as given: the flag, and why."""


@dataclass(frozen=True)
class SamplerOptions:
    backend: str  # auto, bpf or proc (sampler/backend.py)
    hz: float
    proc: Path
    groups: list[tuple[str, str]] = field(default_factory=list)  # --group NAME=SELECTOR; none: the busiest groups
    kernel_headers: Path | str | None = None
    gpu_grace: float = 0.0
    sleep: Callable[[float], None] = time.sleep
    node: str | None = None
    host_root: Path | None = None
    kubelet: KubeletPods | None = None
    bpf_stats: bool = False


def open_sampler(options: SamplerOptions) -> WindowSampler:
    """The sampler, or OptionError, or BackendUnavailable (the backend asked
    for does not load here, and why)."""
    o = options
    if not o.proc.is_dir():
        raise OptionError(f"--proc-root {o.proc}: not a directory")
    if o.host_root is not None and not o.host_root.is_dir():
        raise OptionError(f"--host-root {o.host_root}: not a directory")
    names = [n for n, _ in o.groups]
    if len(set(names)) != len(names):
        raise OptionError("--group: each NAME may be given once")
    specs = [ShardSpec(name, Selector.parse(sel)) for name, sel in o.groups] or None
    choice, shard_sampler = open_backend(o.backend, o.proc, o.kernel_headers, bpf_stats=o.bpf_stats)
    hz, finest = o.hz, shard_sampler.finest_hz
    if finest is not None and hz > finest:
        why = (f"the {choice.name} backend's counters move in ticks of up to 10 ms: above {finest:g} samples "
               "a second, a tick early or late is more than a tenth of a busy thread's time")  # fmt: skip
        if o.backend == choice.name:
            shard_sampler.close()
            raise OptionError(f"--hz {hz:g}: {why}")
        log.warning("--hz %g capped at %g: %s", hz, finest, why)
        hz = finest
    # GPM and the clock events at the sampler's rate, but never faster than GPM's 10 Hz (sampler/gpu/gpm.py).
    gpus = GpuReader(gpm_every_s=max(gpm.MIN_INTERVAL_S, 1.0 / hz))
    return WindowSampler(o.proc, choice, shard_sampler, specs, hz=hz, node=o.node, gpus=gpus,
                         gpu_grace=o.gpu_grace, sleep=o.sleep, host_root=o.host_root, kubelet=o.kubelet)  # fmt: skip
