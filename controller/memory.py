"""Device memory: probes (NVML, AMD sysfs, /proc/meminfo or psutil, configured budgets) and
admission.

Called by the slot manager before every load. Probes sit behind :class:`MemoryProbe`
(one seam; tests use :class:`FakeMemoryProbe` or fixture sysfs trees). Admission itself
is a pure function of numbers (:func:`check_admission`), SPEC §6::

    admitted(device) + needed <= budget - margin     (what slotctl promised)
    needed                    <= probed_free - margin (what the device has right now)

An absent probe degrades to the configured ``memory_budget_gb`` (free = budget -
admitted); with neither, a load on that device is refused: never a silent CPU fallback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import psutil

from controller.units import GIB  # re-exported: one definition

__all__ = [
    "GIB",
    "Admission",
    "AmdSysfsProbe",
    "DeviceMemory",
    "FakeMemoryProbe",
    "MemoryProbe",
    "NvmlProbe",
    "PsutilProbe",
    "SystemMemoryProbe",
    "check_admission",
    "read_meminfo",
]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    device: str
    total_bytes: int
    free_bytes: int
    source: str  # nvml | amd-sysfs | meminfo | psutil | budget | fake


class MemoryProbe(Protocol):
    def sample(self, device: str) -> DeviceMemory | None:
        """Total and free memory of ``device`` now, or None when it cannot be probed."""
        ...


class PsutilProbe:
    """System RAM (device ``cpu``; also ``npu``, which shares system memory).

    On Linux the two figures are read from ``/proc/meminfo`` directly (``MemTotal`` and
    ``MemAvailable``: what ``psutil.virtual_memory()`` reports as ``total`` and
    ``available``, without parsing the file's ~50 other lines into a named tuple: a third
    of its cost, and admission samples twice a load); elsewhere, or on a kernel without
    ``MemAvailable`` (before 3.14: psutil then estimates it), psutil answers.
    """

    def __init__(self, meminfo: Path = Path("/proc/meminfo")) -> None:
        self.meminfo = os.fspath(meminfo)

    def sample(self, device: str) -> DeviceMemory | None:
        figures = read_meminfo(self.meminfo)
        if figures is not None:
            return DeviceMemory(device, figures[0], figures[1], "meminfo")
        vm = psutil.virtual_memory()
        return DeviceMemory(device, int(vm.total), int(vm.available), "psutil")


def read_meminfo(path: str = "/proc/meminfo") -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes from a meminfo file, or None when it cannot be
    read or lacks either figure."""
    try:
        with open(path, "rb") as handle:  # a str path: no Path built per sample
            data = handle.read()
    except OSError:
        return None
    figures = []
    for key in (b"MemTotal:", b"MemAvailable:"):
        start = data.find(key)
        if start < 0 or (start > 0 and data[start - 1] != 0x0A):  # a line's start only
            return None
        end = data.find(b"\n", start)
        fields = data[start + len(key) : end if end >= 0 else len(data)].split()
        if not fields or not fields[0].isdigit():
            return None
        unit = fields[1].lower() if len(fields) > 1 else b""
        figures.append(int(fields[0]) * (1024 if unit == b"kb" else 1))
    return figures[0], figures[1]


class NvmlProbe:
    """NVIDIA GPUs through NVML (``nvidia-ml-py``), summed over visible GPUs."""

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._nvml = module
        self._ready = False
        self.error: str | None = None
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError:
                self.error = "nvidia-ml-py is not installed"

    def _init(self) -> bool:
        if self._ready:
            return True
        if self._nvml is None:
            return False
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001  (NVMLError_* subclasses Exception only)
            self.error = f"NVML unavailable: {exc}"
            self._nvml = None
            return False
        self._ready = True
        return True

    def sample(self, device: str) -> DeviceMemory | None:
        if device != "gpu" or not self._init():
            return None
        nvml = self._nvml
        assert nvml is not None
        total = free = 0
        count = int(nvml.nvmlDeviceGetCount())
        for index in range(count):
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
            total += int(info.total)
            free += int(info.free)
        if count == 0:
            return None
        return DeviceMemory(device, total, free, "nvml")


class AmdSysfsProbe:
    """AMD GPUs/APUs via amdgpu sysfs: VRAM plus GTT (APUs load models into GTT)."""

    def __init__(self, root: Path = Path("/sys/class/drm")) -> None:
        self.root = root

    @staticmethod
    def _read(path: Path) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().strip())
        return None

    def sample(self, device: str) -> DeviceMemory | None:
        if device != "gpu" or not self.root.is_dir():
            return None
        total = used = 0
        found = False
        for card in sorted(self.root.glob("card[0-9]*")):
            dev = card / "device"
            for kind in ("vram", "gtt"):
                t = self._read(dev / f"mem_info_{kind}_total")
                u = self._read(dev / f"mem_info_{kind}_used")
                if t is not None and u is not None:
                    total += t
                    used += u
                    found = True
        if not found:
            return None
        return DeviceMemory(device, total, max(0, total - used), "amd-sysfs")


class SystemMemoryProbe:
    """The default: NVML, then AMD sysfs for ``gpu``; psutil for ``cpu`` and ``npu``."""

    def __init__(
        self,
        nvml: NvmlProbe | None = None,
        amd: AmdSysfsProbe | None = None,
        ram: PsutilProbe | None = None,
    ) -> None:
        self.nvml = nvml or NvmlProbe()
        self.amd = amd or AmdSysfsProbe()
        self.ram = ram or PsutilProbe()

    def sample(self, device: str) -> DeviceMemory | None:
        if device == "gpu":
            return self.nvml.sample(device) or self.amd.sample(device)
        return self.ram.sample(device)


class FakeMemoryProbe:
    """For tests: fixed totals; free = total - used_by(device) - external[device]."""

    def __init__(
        self,
        totals: Mapping[str, int],
        used_by: Callable[[str], int] | None = None,
    ) -> None:
        self.totals = dict(totals)
        self.external: dict[str, int] = {}
        self.used_by = used_by or (lambda device: 0)

    def sample(self, device: str) -> DeviceMemory | None:
        if device not in self.totals:
            return None
        total = self.totals[device]
        free = total - self.used_by(device) - self.external.get(device, 0)
        return DeviceMemory(device, total, max(0, free), "fake")


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
        return self.shortfall == 0


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
