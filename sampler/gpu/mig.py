"""A card split into MIG instances: finding them, and what each holds.

With MIG (Multi-Instance GPU, A100 and later) a card is cut into GPU
instances, each with its own SMs and memory, and the processes run on one
of them; a card-wide figure then says nothing of one tenant's slice. NVML
names each instance by a MIG device handle (`nvmlDeviceGetMigDeviceHandleByIndex`,
slots 0 to `nvmlDeviceGetMaxMigDeviceCount`, an empty slot NOT_FOUND), whose
GPU instance id (`nvmlDeviceGetGpuInstanceId`) names it under its card; its
memory and its processes are read through that handle (NVML's reference:
in MIG mode the card's own handle gives the processes of all instances only
to a privileged caller, and per-instance figures come from the MIG
handles). Its GPM samples come through the card's handle and the instance
id (`nvmlGpmMigSampleGet`, sampler/gpu/gpm.py).

Instances are found when NVML is (re-)initialised and again at most every
`RESCAN_S` (an operator re-partitions a drained card; a read that fails
because an instance went brings the scan forward), not at every reading:
up to 7 handles a card, four calls each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from wire.limits import MAX_GPU_INSTANCES

log = logging.getLogger(__name__)

RESCAN_S = 60.0


@dataclass(frozen=True)
class Instance:
    gpu_instance_id: int
    compute_instance_id: int | None
    handle: Any  # its MIG device handle
    uuid: str | None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def instances_of(nv: Any, card: Any) -> list[Instance] | None:
    """The card's MIG instances; None where the card is not in MIG mode (or
    the card or driver cannot say: a card without MIG is the common case,
    not a problem). An instance that cannot be named is left out."""
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(card)
    except nv.NVMLError:
        return None  # NOT_SUPPORTED on a card without MIG, FUNCTION_NOT_FOUND on an old driver
    if current != nv.NVML_DEVICE_MIG_ENABLE:
        return None
    try:
        slots = min(int(nv.nvmlDeviceGetMaxMigDeviceCount(card)), MAX_GPU_INSTANCES)
    except nv.NVMLError as e:
        log.info("a MIG card's instances could not be counted: %s", e)
        return []
    found: list[Instance] = []
    for slot in range(slots):
        try:
            handle = nv.nvmlDeviceGetMigDeviceHandleByIndex(card, slot)
            gpu_instance = int(nv.nvmlDeviceGetGpuInstanceId(handle))
        except nv.NVMLError_NotFound:
            continue  # an empty slot
        except nv.NVMLError as e:
            log.debug("MIG slot %d left out: %s", slot, e)
            continue
        try:
            compute_instance: int | None = int(nv.nvmlDeviceGetComputeInstanceId(handle))
        except nv.NVMLError:
            compute_instance = None
        try:
            uuid: str | None = _text(nv.nvmlDeviceGetUUID(handle))
        except nv.NVMLError:
            uuid = None
        found.append(Instance(gpu_instance, compute_instance, handle, uuid))
    return found
