"""The nodes of a cluster as the kubernetes runtime's admission sees them: each node's
memory budget per device (from its allocatable resources and NVIDIA's GPU feature
discovery labels), answered as a :class:`controller.memory.MemoryProbe` for ``NODE/DEVICE``
keys, and read again in the background (:class:`NodeReading`).

Sits under :mod:`controller.runtime.kubernetes`; :func:`node_budgets` and
:class:`NodeMemory` are pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final

import httpx2
from lightkube.resources.core_v1 import Node

from controller.memory import DeviceMemory

log = logging.getLogger("slotctl.runtime")

GPU_RESOURCES: Final = ("nvidia.com/gpu", "amd.com/gpu")
# MiB per GPU, as NVIDIA's GPU feature discovery labels a node.
GPU_MEMORY_LABEL: Final = "nvidia.com/gpu.memory"
GPU_COUNT_LABEL: Final = "nvidia.com/gpu.count"
_QUANTITY_RE: Final = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")
_SUFFIXES: Final[dict[str, int | float]] = {
    "": 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "m": 1e-3,
}


def parse_quantity(text: str) -> int | None:
    """A Kubernetes quantity (``16Gi``, ``2``, ``500M``) as an integer; None if not one."""
    match = _QUANTITY_RE.match(str(text).strip())
    if match is None or match.group(2) not in _SUFFIXES:
        return None
    return int(float(match.group(1)) * _SUFFIXES[match.group(2)])


def node_budgets(allocatable: Mapping[str, str], labels: Mapping[str, str]) -> dict[str, int]:
    """Device -> bytes a node offers (pure): ``gpu`` = its GPUs (the ``nvidia.com/gpu.count``
    label, else the allocatable ``nvidia.com/gpu`` / ``amd.com/gpu``) x the per-GPU memory
    its ``nvidia.com/gpu.memory`` label states (MiB); ``cpu`` = allocatable memory.
    A device the node says nothing about is absent (the controller settings apply)."""
    budgets: dict[str, int] = {}
    # physical GPUs (GFD's count label: time-slicing advertises more allocatable replicas)
    gpus = parse_quantity(labels.get(GPU_COUNT_LABEL, "")) or max(
        (parse_quantity(allocatable.get(r, "0")) or 0) for r in GPU_RESOURCES
    )
    per_gpu = parse_quantity(labels.get(GPU_MEMORY_LABEL, ""))
    if gpus and per_gpu:
        budgets["gpu"] = gpus * per_gpu * 2**20
    memory = parse_quantity(allocatable.get("memory", ""))
    if memory:
        budgets["cpu"] = memory
    return budgets


class NodeMemory:
    """The admission's memory probe on a cluster (a :class:`controller.memory.MemoryProbe`).

    ``NODE/DEVICE`` keys answer with that node's budget (:func:`node_budgets`); a bare
    device (a slot the scheduler has not placed yet) with the largest node's, so a slot
    that fits on no node is refused before anything is scaled. Nothing measures a remote
    GPU: free = total, and the admitted bytes per key do the accounting. A node or
    device the nodes say nothing about answers None (``memory_budget_gb`` applies).
    """

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, int]] = {}
        self.gpu_resources: dict[str, str] = {}  # node -> the GPU resource it offers

    def update(self, nodes: Sequence[Node]) -> None:
        seen: dict[str, dict[str, int]] = {}
        resources: dict[str, str] = {}
        for node in nodes:
            name = node.metadata.name if node.metadata else None
            if not name:
                continue
            allocatable = dict((node.status.allocatable if node.status else None) or {})
            labels = dict((node.metadata.labels if node.metadata else None) or {})
            seen[name] = node_budgets(allocatable, labels)
            for resource in GPU_RESOURCES:
                if parse_quantity(allocatable.get(resource, "0")):
                    resources[name] = resource
        self.nodes, self.gpu_resources = seen, resources

    def sample(self, device: str) -> DeviceMemory | None:
        node, sep, kind = device.rpartition("/")
        if sep:
            total = self.nodes.get(node, {}).get(kind)
        else:
            totals = [b[kind] for b in self.nodes.values() if kind in b]
            total = max(totals) if totals else None
        if total is None:
            return None
        return DeviceMemory(device=device, total_bytes=total, free_bytes=total, source="node")

    def gpus(self) -> tuple[DeviceMemory, ...]:
        """No host GPUs on a cluster: slots are admitted per ``NODE/DEVICE`` (the device
        plugin picks a node's GPUs for the pod)."""
        return ()


class NodeReading:
    """The nodes' budgets read in the background every ``every_s`` (``read`` is the
    runtime's :meth:`KubernetesRuntime.refresh_nodes`). Supervised: a failed reading is
    logged and the next one comes; whatever happens, the first reading counts as done
    (API calls wait for it, 10 s at most)."""

    def __init__(self, read: Callable[[], Awaitable[None]], every_s: float) -> None:
        self.read, self.every_s = read, every_s
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name="slotctl-k8s-nodes"
            )

    async def first_read(self) -> None:
        if not self._first.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._first.wait(), 10.0)

    async def _loop(self) -> None:
        while True:
            try:
                await self.read()
            except (httpx2.HTTPError, OSError) as exc:
                log.warning("reading the nodes' allocatable resources failed: %s", exc)
            except Exception:  # a bug or a malformed Node: logged, the loop lives on
                log.exception("reading the nodes' allocatable resources failed")
            finally:
                self._first.set()
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
