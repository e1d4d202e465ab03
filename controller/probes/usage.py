"""What one server's processes hold now: the learning half of footprints (issue 36).

:class:`ProcessUsage` measures a server by the pid its runtime reports: the resident set
(RSS) of its process tree in host memory (psutil), and on a GPU NVML's per-process used
memory of the same processes (:meth:`~controller.probes.memory.NvmlProbe.process_bytes`;
tests pass a fake ``pynvml`` module to the probe). A CPU slot's device memory *is* its
RSS. The slot manager keeps the peak per model and launch config
(:meth:`controller.slots.table.SlotTable.observed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from controller.probes.memory import NvmlProbe

__all__ = ["ProcessUsage", "Usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    device_bytes: int  # on the slot's device (a GPU's per-process figure; a CPU slot's RSS)
    host_bytes: int  # the process tree's RSS
    source: str  # nvml | rss


def _peak(pid: int) -> int:
    """A process's peak resident set (Linux ``VmHWM``; 0 where it cannot be read): the
    peak while serving is kept even between two samples."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"VmHWM:"):
                    fields = line.split()
                    return int(fields[1]) * 1024 if len(fields) > 1 else 0
    except (OSError, ValueError):
        return 0
    return 0


class ProcessUsage:
    """Measures a server's process tree (see the module)."""

    def __init__(self, nvml: NvmlProbe | None = None) -> None:
        self.nvml = nvml

    @staticmethod
    def tree(pid: int) -> dict[int, int]:
        """pid -> the peak RSS of ``pid`` and of each descendant (its current RSS where
        no peak can be read; those gone meanwhile left out)."""
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return {}
        out: dict[int, int] = {}
        for proc in procs:
            try:
                out[proc.pid] = max(int(proc.memory_info().rss), _peak(proc.pid))
            except psutil.Error:
                continue
        return out

    def measure(self, pid: int, device_kind: str, gpus: tuple[int, ...] = ()) -> Usage | None:
        """The server ``pid``'s use now; None when it is gone, or (a GPU slot) when NVML
        cannot tell its per-process figure."""
        rss = self.tree(pid)
        if not rss:
            return None
        host = sum(rss.values())
        if device_kind != "gpu":
            return Usage(host, host, "rss")
        if self.nvml is None:
            return None
        device = self.nvml.process_bytes(set(rss), gpus)
        if device is None:
            return None
        return Usage(device, host, "nvml")
