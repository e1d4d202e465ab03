"""A fake ``pynvml`` (nvidia-ml-py's module) for machines without an NVIDIA GPU.

Put ``tests/fakes/nvml`` first on ``PYTHONPATH`` and name a JSON file in
``SLOTCTL_TEST_FAKE_NVML``; every call reads it again, so a test changes the host while a
controller runs (a GPU's memory taken by another process, a card lost)::

    {"gpus": [{"uuid": "GPU-…", "name": "…", "total": bytes, "used": bytes, "lost": false}]}

Only what the memory probe calls is here, with NVML's semantics: ``nvmlInit`` fails
without the file (no driver), a lost GPU's handle raises ``NVMLError``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    """NVML's base error (nvidia-ml-py subclasses it per return code)."""


def _host() -> list[dict[str, Any]]:
    path = os.environ.get("SLOTCTL_TEST_FAKE_NVML", "")
    try:
        with open(path, encoding="utf-8") as handle:
            gpus: list[dict[str, Any]] = json.load(handle)["gpus"]
    except (OSError, ValueError, KeyError) as exc:
        raise NVMLError(f"Driver Not Loaded ({exc})") from None
    return gpus


def nvmlInit() -> None:
    _host()


def nvmlShutdown() -> None:
    """Nothing to release."""


def nvmlDeviceGetCount() -> int:
    return len(_host())


def _gpu(handle: int) -> dict[str, Any]:
    gpu = _host()[handle]
    if gpu.get("lost"):
        raise NVMLError("GPU is lost")
    return gpu


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    _gpu(index)
    return index


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    gpu = _gpu(handle)
    total, used = int(gpu["total"]), int(gpu.get("used", 0))
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_gpu(handle)["uuid"])


def nvmlDeviceGetName(handle: int) -> str:
    return str(_gpu(handle).get("name", "NVIDIA Fake GPU"))


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[SimpleNamespace]:
    """The compute processes on a GPU: ``"processes": [{"pid": N, "used": bytes}]`` of its
    entry (NVML's ``usedGpuMemory``; None when the driver cannot tell, as under MIG)."""
    return [
        SimpleNamespace(pid=int(p["pid"]), usedGpuMemory=p.get("used"))
        for p in _gpu(handle).get("processes", [])
    ]
