"""Device memory probes: NVML, AMD sysfs, /proc/meminfo or psutil.

Called by the slot manager before every load. Probes sit behind :class:`MemoryProbe`
(one seam; tests use :class:`FakeMemoryProbe`, a fake ``pynvml`` module or fixture sysfs
trees). Each GPU is its own device: :meth:`MemoryProbe.gpus` lists them (index, UUID,
name, total, free) and ``sample("gpu:N")`` answers for one; ``sample("gpu")`` is the sum
over them (what a dashboard's "all GPUs" line shows). The figures are
:class:`~controller.scheduling.fit.DeviceMemory`; what they admit (the budgets, the GPU
inventory, the admission check) is the pure :mod:`controller.scheduling.fit`'s.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, Final, Protocol

import psutil

from controller.model.devices import gpu_key, key_index
from controller.scheduling.fit import DeviceMemory, sum_gpus

INIT_RETRY_S: Final = 30.0  # a failed nvmlInit is tried again after this long

__all__ = [
    "AmdSysfsProbe",
    "FakeMemoryProbe",
    "MemoryProbe",
    "NvmlProbe",
    "PsutilProbe",
    "SystemMemoryProbe",
    "read_meminfo",
]


class MemoryProbe(Protocol):
    def sample(self, device: str) -> DeviceMemory | None:
        """Total and free memory of ``device`` now, or None when it cannot be probed."""
        ...

    def gpus(self) -> tuple[DeviceMemory, ...]:
        """Every GPU the probe sees now, in index order (empty: none, or no GPU probe);
        one that cannot be read is listed with its ``error``."""
        ...


def _one_gpu(gpus: tuple[DeviceMemory, ...], device: str) -> DeviceMemory | None:
    """``sample(device)`` of a GPU probe: ``gpu`` the sum, ``gpu:N`` that GPU."""
    if device == "gpu":
        return sum_gpus(gpus)
    index = key_index(device)
    if index is None:
        return None
    return next((g for g in gpus if g.index == index and g.error is None), None)


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

    def gpus(self) -> tuple[DeviceMemory, ...]:
        return ()


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
    """NVIDIA GPUs through NVML (``nvidia-ml-py``), one :class:`DeviceMemory` per handle.

    A GPU whose handle or memory cannot be read (``NVMLError_GpuIsLost``, a card that fell
    off the bus) is listed with its ``error`` (and no figures), so the placement never
    picks it and a slot pinned to it is refused with the reason.
    """

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._nvml = module
        self._ready = False
        self.error: str | None = None
        self._names: dict[int, tuple[str | None, str | None]] = {}  # index -> (uuid, name)
        self._retry_at = 0.0  # monotonic: when a failed nvmlInit is tried again
        self._last: tuple[DeviceMemory, ...] = ()  # the GPUs of the last good reading
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError:
                self.error = "nvidia-ml-py is not installed"

    def _init(self) -> bool:
        """NVML initialised; a failed init (no driver yet, a driver being reloaded) is
        tried again every ``INIT_RETRY_S``, not at every sample."""
        if self._ready:
            return True
        if self._nvml is None or time.monotonic() < self._retry_at:
            return False
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001  (NVMLError_* subclasses Exception only)
            self.error = f"NVML unavailable: {exc}"
            self._retry_at = time.monotonic() + INIT_RETRY_S
            return False
        self._ready, self.error = True, None
        return True

    def sample(self, device: str) -> DeviceMemory | None:
        if not device.startswith("gpu"):
            return None
        return _one_gpu(self.gpus(), device)

    def gpus(self) -> tuple[DeviceMemory, ...]:
        if not self._init():
            return ()
        nvml = self._nvml
        assert nvml is not None
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:  # noqa: BLE001  (the GPUs seen before, each lost now)
            self.error = f"NVML device count failed: {exc}"
            return tuple(
                replace(g, total_bytes=0, free_bytes=0, error=self.error) for g in self._last
            )
        out: list[DeviceMemory] = []
        for index in range(count):
            key = gpu_key(index)
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # noqa: BLE001  (a lost GPU: the others still count)
                error = f"NVML: {exc}"
                uuid = self._names.get(index, (None, None))[0]  # known from before it was lost
                out.append(
                    DeviceMemory(key, 0, 0, "nvml", index, uuid, vendor="nvidia", error=error)
                )
                continue
            uuid, name = self._identity(index, handle)
            total, free = int(info.total), int(info.free)
            out.append(DeviceMemory(key, total, free, "nvml", index, uuid, name, "nvidia"))
        self._last = tuple(out)
        return self._last

    def process_bytes(self, pids: set[int], indices: tuple[int, ...] = ()) -> int | None:
        """The device memory the processes ``pids`` hold (NVML's per-process
        ``usedGpuMemory`` over the GPUs, ``indices`` only when given); None when NVML
        cannot tell (no binding, no driver, a driver that hides per-process figures)."""
        if not self._init():
            return None
        nvml = self._nvml
        assert nvml is not None
        total, told = 0, False
        try:
            count = int(nvml.nvmlDeviceGetCount())
            for index in indices or tuple(range(count)):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(proc, "usedGpuMemory", None)
                    if int(proc.pid) in pids and used is not None:
                        total += int(used)
                        told = True
        except Exception as exc:  # noqa: BLE001  (NVMLError_*: no per-process figure now)
            self.error = f"NVML per-process memory failed: {exc}"
            return None
        return total if told else 0

    def _identity(self, index: int, handle: Any) -> tuple[str | None, str | None]:
        """(UUID, name) of a GPU, read once per index."""
        known = self._names.get(index)
        if known is None:
            known = (self._ask("nvmlDeviceGetUUID", handle), self._ask("nvmlDeviceGetName", handle))
            self._names[index] = known
        return known

    def _ask(self, call: str, handle: Any) -> str | None:
        try:
            return _text(getattr(self._nvml, call)(handle))
        except Exception:  # noqa: BLE001  (an identity NVML cannot give: placed by index)
            return None


def _text(value: object) -> str | None:
    """pynvml answers ``str`` (nvidia-ml-py >= 11.5) or ``bytes`` (older bindings)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value) if value is not None else None


class AmdSysfsProbe:
    """AMD GPUs/APUs via amdgpu sysfs, one per card: VRAM plus GTT (APUs load models into
    GTT). A card's index is its position among the amdgpu cards in card-number order (the
    order ROCm enumerates them in on a usual host; ``HIP_VISIBLE_DEVICES`` takes it)."""

    def __init__(self, root: Path = Path("/sys/class/drm")) -> None:
        self.root = root

    @staticmethod
    def _read(path: Path) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().strip())
        return None

    def sample(self, device: str) -> DeviceMemory | None:
        if not device.startswith("gpu"):
            return None
        return _one_gpu(self.gpus(), device)

    def gpus(self) -> tuple[DeviceMemory, ...]:
        if not self.root.is_dir():
            return ()
        cards = [c for c in self.root.glob("card[0-9]*") if c.name[4:].isdigit()]
        out: list[DeviceMemory] = []
        for card in sorted(cards, key=lambda c: int(c.name[4:])):
            dev = card / "device"
            if not self._is_amd(dev):
                continue
            index, key = len(out), gpu_key(len(out))
            figures = self._card(dev)
            if figures is None:  # an AMD card whose memory cannot be read now: lost
                error = f"amdgpu sysfs: cannot read {dev}/mem_info_*"
                out.append(DeviceMemory(key, 0, 0, "amd-sysfs", index, vendor="amd", error=error))
                continue
            total, free = figures
            out.append(DeviceMemory(key, total, free, "amd-sysfs", index, None, None, "amd"))
        return tuple(out)

    @staticmethod
    def _is_amd(dev: Path) -> bool:
        """An amdgpu card: AMD's PCI vendor id, or (a fixture tree, an odd driver) its
        memory files. A card keeps its index while its files cannot be read (it is lost,
        not renumbered); one that leaves sysfs renumbers those after it, as ROCm does."""
        with contextlib.suppress(OSError):
            return (dev / "vendor").read_text().strip().lower() == "0x1002"
        return (dev / "mem_info_vram_total").exists() or (dev / "mem_info_gtt_total").exists()

    def _card(self, dev: Path) -> tuple[int, int] | None:
        total = used = 0
        found = False
        for kind in ("vram", "gtt"):
            t = self._read(dev / f"mem_info_{kind}_total")
            u = self._read(dev / f"mem_info_{kind}_used")
            if t is not None and u is not None:
                total += t
                used += u
                found = True
        return (total, max(0, total - used)) if found else None


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
        if device.startswith("gpu"):
            return _one_gpu(self.gpus(), device)
        return self.ram.sample(device)

    def gpus(self) -> tuple[DeviceMemory, ...]:
        return self.nvml.gpus() or self.amd.gpus()

    def why_not(self, device: str) -> str:
        """Why no figure answers for ``device`` and what to do (the refusal says it)."""
        if not device.startswith("gpu"):
            return "system memory could not be read (/proc/meminfo, psutil)"
        self.gpus()  # the probes' errors as of now
        nvml = self.nvml.error or "NVML sees no GPU"
        hint = (
            "install it (pip install nvidia-ml-py; slotctl depends on it, so reinstall slotctl)"
            if "not installed" in nvml
            else "check the NVIDIA driver (nvidia-smi)"
        )
        amd = (
            f"no amdgpu card under {self.amd.root}"
            if not self.amd.root.is_dir() or not self.amd.gpus()
            else "amdgpu sysfs unreadable"
        )
        return (
            f'{nvml}: {hint}; {amd}. On a host without a GPU use device = "cpu", or set '
            f"memory_budget_gb.{device.split(':', 1)[0]} to admit against a budget"
        )


class FakeMemoryProbe:
    """For tests: fixed totals; free = total - used_by(device) - external[device].

    GPUs are ``gpu:N`` keys; a plain ``gpu`` total is a host with one GPU (``gpu:0``, whose
    ``external`` may be given as ``gpu`` too), as the tests of a one-GPU box write it.
    """

    def __init__(
        self,
        totals: Mapping[str, int],
        used_by: Callable[[str], int] | None = None,
    ) -> None:
        self.totals = dict(totals)
        self.external: dict[str, int] = {}
        self.used_by = used_by or (lambda device: 0)

    def _gpu_totals(self) -> dict[int, int]:
        indexed = {key_index(k): v for k, v in self.totals.items() if key_index(k) is not None}
        if not indexed and "gpu" in self.totals:
            return {0: self.totals["gpu"]}
        return {i: v for i, v in sorted(indexed.items()) if i is not None}

    def _one(self, device: str, total: int, index: int | None = None) -> DeviceMemory:
        external = self.external.get(device, 0)
        if index is not None and "gpu" in self.totals and len(self._gpu_totals()) == 1:
            external = external or self.external.get("gpu", 0)
        free = total - self.used_by(device) - external
        vendor = "nvidia" if index is not None else None
        return DeviceMemory(device, total, max(0, free), "fake", index, None, None, vendor)

    def gpus(self) -> tuple[DeviceMemory, ...]:
        return tuple(self._one(gpu_key(i), t, i) for i, t in self._gpu_totals().items())

    def sample(self, device: str) -> DeviceMemory | None:
        if device == "gpu" and "gpu" in self.totals and len(self._gpu_totals()) == 1:
            return replace(self.gpus()[0], device="gpu", index=None, vendor=None)
        if device == "gpu":
            return sum_gpus(self.gpus())
        if key_index(device) is not None:
            return next((g for g in self.gpus() if g.device == device), None)
        if device not in self.totals:
            return None
        return self._one(device, self.totals[device])
