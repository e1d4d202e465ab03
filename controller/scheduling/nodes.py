"""A cluster's nodes as data: each node's GPUs as the API states them (pure).

At the bottom of the package, beside :mod:`controller.probes.memory`: the kubernetes runtime
(:mod:`controller.runtime.kubernetes.nodes`) reads nodes and pods into
:class:`NodeGpus`, answered through :class:`ClusterProbe` (its memory probe); the
manager's admission turns them into placement devices with :mod:`controller.scheduling.cluster`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["ClusterProbe", "NodeGpus"]


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """One node's GPUs as the API says them (the runtime's reading)."""

    name: str
    resource: str  # the extended resource it offers (nvidia.com/gpu, amd.com/gpu)
    allocatable: int  # GPUs (replicas, when time-sliced) pods may request
    physical: int  # GPUs (GFD's nvidia.com/gpu.count, else the allocatable)
    per_gpu: int | None  # bytes per GPU (GFD's nvidia.com/gpu.memory); None: not stated
    # GPUs the pods of this controller's slots request there, per slot (from the pods)
    pods: Mapping[str, int] = field(default_factory=dict)
    others: int = 0  # GPUs requested by every other pod bound to the node
    unusable: str | None = None  # why no slot goes there: NotReady, cordoned, a taint

    @property
    def sliced(self) -> bool:
        return self.allocatable > self.physical


@runtime_checkable
class ClusterProbe(Protocol):
    """A memory probe that knows a cluster's nodes (the kubernetes runtime's)."""

    def cluster(self) -> Sequence[NodeGpus]:
        """Every node with GPUs, by name (a snapshot of the runtime's cache)."""
        ...
