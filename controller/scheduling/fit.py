"""Device memory as numbers: each device's figures, the GPUs to place on, and admission.

Pure (no probe, no I/O): the probes (:mod:`controller.probes.memory`: NVML, AMD sysfs,
/proc/meminfo or psutil) produce :class:`DeviceMemory` figures; the placement
(:mod:`controller.scheduling.placement`) and the load decision read them through this
module. :func:`gpu_inventory` merges what the probe sees with the configured budgets
(``gpu`` = each GPU, ``"gpu:1"`` = one of them). Admission itself is a pure function of
numbers (:func:`check_admission`), SPEC §6::

    admitted(device) + needed <= budget - margin     (what slotctl promised)
    needed                    <= probed_free - margin (what the device has right now)

An absent probe degrades to the configured ``memory_budget_gb`` (free = budget -
admitted); with neither, a load on that device is refused: never a silent CPU fallback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from controller.model.devices import GpuRef, gpu_key, key_index
from controller.model.sizes import GIB

__all__ = [
    "Admission",
    "DeviceMemory",
    "GpuDevice",
    "budget_gb_for",
    "check_admission",
    "gpu_inventory",
    "sum_gpus",
]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    device: str  # the admission key: gpu:N, cpu, npu (gpu: the sum over the GPUs)
    total_bytes: int
    free_bytes: int
    source: str  # nvml | amd-sysfs | meminfo | psutil | budget | fake
    index: int | None = None  # a GPU's index (NVML's, or the amdgpu card's position)
    uuid: str | None = None  # a GPU's UUID (NVML)
    name: str | None = None  # a GPU's product name
    vendor: str | None = None  # nvidia | amd
    error: str | None = None  # a GPU that cannot be read now (lost): its figures are 0


def sum_gpus(gpus: tuple[DeviceMemory, ...], device: str = "gpu") -> DeviceMemory | None:
    """All GPUs as one figure (the ``gpu`` line), or None when there are none."""
    gpus = tuple(g for g in gpus if g.error is None)
    if not gpus:
        return None
    total = sum(g.total_bytes for g in gpus)
    free = sum(g.free_bytes for g in gpus)
    return DeviceMemory(device, total, free, gpus[0].source)


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU as the placement sees it: its key, identity, probed figures and budget."""

    key: str  # gpu:N
    ref: GpuRef
    sample: DeviceMemory | None  # None: not probed (a budget-only GPU)
    budget: int | None  # bytes (memory_budget_gb), None: the probed total
    name: str | None = None
    error: str | None = None  # the probe cannot read it now (lost)


def budget_gb_for(key: str, budgets: Mapping[str, float]) -> float | None:
    """The configured budget of a device: ``"gpu:1"`` for GPU 1, else its kind's (``gpu``
    = each GPU), else None."""
    if key in budgets:
        return budgets[key]
    kind = key.rsplit("/", 1)[-1].split(":", 1)[0]
    return budgets.get(kind)


def gpu_inventory(
    probed: tuple[DeviceMemory, ...], budgets: Mapping[str, float]
) -> tuple[GpuDevice, ...]:
    """The GPUs to place on: what the probe sees, else the GPUs the budgets name (a ``gpu``
    budget alone is one GPU, ``gpu:0``; ``"gpu:N"`` keys add theirs). Pure."""

    def budget(key: str) -> int | None:
        gb = budget_gb_for(key, budgets)
        return int(gb * GIB) if gb is not None else None

    if probed:
        return tuple(
            GpuDevice(
                g.device,
                GpuRef(g.index if g.index is not None else i, g.uuid, g.vendor),
                g if g.error is None else None,
                budget(g.device),
                g.name,
                g.error,
            )
            for i, g in enumerate(probed)
        )
    indices = {i for k in budgets if (i := key_index(k)) is not None}
    if "gpu" in budgets:
        indices.add(0)
    return tuple(
        GpuDevice(gpu_key(i), GpuRef(i), None, budget(gpu_key(i))) for i in sorted(indices)
    )


@dataclass(frozen=True, slots=True)
class Admission:
    """The numbers behind an admission decision (all bytes)."""

    device: str
    needed: int
    admitted: int
    budget: int
    free: int
    margin: int
    source: str
    # A whole device (a cluster node's GPU without time-slicing: one pod per GPU): the
    # slots that hold it now. The figures above are the load's alone there; it fits only
    # once they are gone (the placement plans to evict them all).
    holders: int = 0

    @property
    def budget_room(self) -> int:
        return self.budget - self.margin - self.admitted

    @property
    def free_room(self) -> int:
        return self.free - self.margin

    @property
    def shortfall(self) -> int:
        """Bytes that must be freed (evicted) before the load fits; 0 when it fits."""
        return max(0, self.needed - self.budget_room, self.needed - self.free_room)

    @property
    def ok(self) -> bool:
        return self.shortfall == 0 and self.holders == 0


def check_admission(
    device: str,
    needed: int,
    admitted: int,
    sample: DeviceMemory | None,
    budget_bytes: int | None,
    margin: int,
) -> Admission:
    """Pure admission check; see the module docstring for the two inequalities."""
    if sample is None:
        budget = budget_bytes or 0
        free = max(0, budget - admitted)
        source = "budget" if budget_bytes is not None else "none"
    else:
        budget = budget_bytes if budget_bytes is not None else sample.total_bytes
        free = sample.free_bytes
        source = sample.source
    return Admission(device, needed, admitted, budget, free, margin, source)
