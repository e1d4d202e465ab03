"""A cluster's GPUs as the placement sees them: every node's GPUs as devices. Pure.

Sits between the kubernetes runtime, which reads the nodes and the pods bound to them
(:class:`controller.scheduling.nodes.NodeGpus`, through
:class:`controller.scheduling.nodes.ClusterProbe`), and the placement
(:func:`controller.scheduling.placement.place`), which chooses among the devices
:func:`cluster_devices` builds; the manager's admission
(:meth:`controller.slots.admission.Admission.device_facts`) joins the two with what the
controller's own slots hold. The controller decides the node; the runtime pins the pod there (a
required node affinity) and the Kubernetes scheduler binds it.

A node's GPUs, as devices ``NODE/gpu:N``::

    GPUs' memory known, time-sliced     each physical GPU shared by memory, and the node
    (allocatable > GPUs)                needs a free replica per GPU the slot spans
    otherwise                           each allocatable GPU whole: one slot at a time
                                        (by memory, or by count when memory is unknown)

A GPU's memory is GPU feature discovery's ``nvidia.com/gpu.memory`` label, else the
controller's ``memory_budget_gb.gpu`` (each GPU), else unknown: then a slot is admitted by
GPU count alone (:func:`by_count` names those nodes so the manager says so once). GPUs
that pods of others request (every pod bound to the node that is not this controller's
slot, whatever its namespace) are never chosen; neither is any GPU of a node that is not
Ready, is cordoned, has a taint the slot's pod does not tolerate, or that the scheduler
recently left this slot's pod Pending on (``avoid``). A slot spanning ``K`` GPUs gets
them on one node (multi-node tensor parallel is out of scope).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from controller.model.devices import GpuRef
from controller.scheduling.nodes import NodeGpus
from controller.scheduling.placement import DeviceFacts

__all__ = ["Held", "by_count", "cluster_devices"]

VENDORS: Final = {"nvidia.com/gpu": "nvidia", "amd.com/gpu": "amd"}


@dataclass(frozen=True, slots=True)
class Held:
    """What the controller's own slots hold (the requester's own share left out)."""

    bytes: Mapping[str, Sequence[int]]  # key -> (admitted, reserved) bytes
    peers: Mapping[str, int]  # key -> bytes its exclusive-group peers hold (unloaded first)
    holders: Mapping[str, int]  # key -> slots admitted there (peers left out)
    units: Mapping[str, Mapping[str, int]]  # node -> slot -> GPUs it is admitted to there
    # the requester: its own pods are its Deployment's (strategy Recreate), which its start
    # replaces or adopts, so they never count against it (a user's `kubectl scale` put
    # back brings one up while the slot is in error, say); a surge's decision counts its
    # old pod through the table's holders and units instead, and a surge's second pod
    # counts there for the other slots (controller.slots.admission)
    own: str | None = None


def by_count(nodes: Sequence[NodeGpus], per_gpu: int | None) -> list[str]:
    """The nodes whose GPUs' memory nobody states: slots go there by GPU count alone."""
    if per_gpu is not None:
        return []
    return [n.name for n in nodes if n.per_gpu is None]


def cluster_devices(
    nodes: Sequence[NodeGpus],
    held: Held,
    *,
    span: int,
    margin: int,
    per_gpu: int | None = None,
    node: str | None = None,
    avoid: Mapping[str, str] | None = None,
) -> list[DeviceFacts]:
    """Every GPU of every node (of ``node`` only, for a slot pinned there) as a device of
    the placement, for a load spanning ``span`` GPUs. ``per_gpu``: the controller's
    ``memory_budget_gb.gpu`` in bytes (a node's label wins); ``avoid``: node -> why the
    load must not go there now."""
    out: list[DeviceFacts] = []
    for n in sorted(nodes, key=lambda n: n.name):
        if node is not None and n.name != node:
            continue
        reason = n.unusable or (avoid or {}).get(n.name)
        memory = n.per_gpu if n.per_gpu is not None else per_gpu
        if n.sliced and memory is not None:
            out.extend(_shared(n, held, span, margin, memory, reason))
        else:
            out.extend(_whole(n, held, margin, memory, reason))
    return out


def _ours(n: NodeGpus, held: Held) -> tuple[int, int]:
    """(GPUs the table admits there, GPUs others request there): the pods of another slot
    of ours that the table does not count there (an old pod still terminating, say) are
    others'; the requester's own are not (see :class:`Held`)."""
    admitted = held.units.get(n.name, {})
    stray = sum(g for slot, g in n.pods.items() if slot not in admitted and slot != held.own)
    return sum(admitted.values()), n.others + stray


def _facts(
    n: NodeGpus,
    index: int,
    held: Held,
    margin: int,
    budget: int | None,
    lost: str | None,
    holders: int | None = None,
) -> DeviceFacts:
    """One GPU of ``n``; ``holders`` set: a whole GPU (one slot at a time)."""
    key = f"{n.name}/gpu:{index}"
    figures = held.bytes.get(key) or (0, 0)
    return DeviceFacts(
        key,
        figures[0],
        None,
        budget,
        margin,
        reserved=figures[1],
        peers=held.peers.get(key, 0),
        gpu=GpuRef(index, vendor=VENDORS.get(n.resource), node=n.name),
        lost=lost,
        group=n.name,
        exclusive=holders is not None,
        holders=holders or 0,
    )


def _shared(
    n: NodeGpus, held: Held, span: int, margin: int, memory: int, reason: str | None
) -> list[DeviceFacts]:
    """A time-sliced node: its physical GPUs shared by memory; a free replica per GPU."""
    ours, others = _ours(n, held)
    free = n.allocatable - ours - others
    if reason is None and free < span:
        reason = (
            f"no free {n.resource} replica ({n.allocatable} allocatable, {ours} for slots, "
            f"{others} for other pods)"
        )
    return [_facts(n, i, held, margin, memory, reason) for i in range(n.physical)]


def _whole(
    n: NodeGpus, held: Held, margin: int, memory: int | None, reason: str | None
) -> list[DeviceFacts]:
    """One slot per GPU: each allocatable GPU whole; other pods' GPUs are taken (the free
    ones with the highest indices, as the controller counts them)."""
    _, others = _ours(n, held)
    holders = [held.holders.get(f"{n.name}/gpu:{i}", 0) for i in range(n.allocatable)]
    free = [i for i in range(n.allocatable) if not holders[i]]
    taken = set(free[max(0, len(free) - others) :]) if others > 0 else set()
    busy = f"requested by other pods ({others} {n.resource})"
    return [
        _facts(n, i, held, margin, memory, reason or (busy if i in taken else None), holders[i])
        for i in range(n.allocatable)
    ]
