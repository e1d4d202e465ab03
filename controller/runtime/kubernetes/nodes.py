"""The nodes of a cluster as the kubernetes runtime's admission sees them: each node's
GPUs (:class:`controller.scheduling.nodes.NodeGpus`: allocatable, GPU feature discovery's labels,
what every pod bound there requests, whether a slot may go there at all), answered as a
:class:`controller.probes.memory.MemoryProbe` and a
:class:`controller.scheduling.nodes.ClusterProbe`.

Sits under :mod:`controller.runtime.kubernetes.runtime`, which feeds it from its node and pod
caches (:mod:`controller.runtime.kubernetes.watch`): :class:`NodeMemory` reads them when
asked, after a change only. :func:`node_gpus`, :func:`unusable` and :func:`pod_gpus` are
pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from lightkube.resources.core_v1 import Node, Pod

from controller.scheduling.fit import DeviceMemory
from controller.scheduling.nodes import NodeGpus

GPU_RESOURCES: Final = ("nvidia.com/gpu", "amd.com/gpu")
# MiB per GPU, as NVIDIA's GPU feature discovery labels a node.
GPU_MEMORY_LABEL: Final = "nvidia.com/gpu.memory"
GPU_COUNT_LABEL: Final = "nvidia.com/gpu.count"
MANAGED: Final = "slotctl.managed"
SLOT: Final = "slotctl.slot"
# Taints a slot's pod tolerates (kubernetes_spec adds the tolerations): a GPU node's own
# resource taint, and a lost node's (the node's readiness decides there).
_TOLERATED: Final = frozenset(
    {*GPU_RESOURCES, "node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
)
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


def _name(obj: Node | Pod) -> str:
    return str(obj.metadata.name) if obj.metadata and obj.metadata.name else ""


def unusable(node: Node) -> str | None:
    """Why no slot may go to ``node`` (pure): not Ready, cordoned, or a ``NoSchedule`` /
    ``NoExecute`` taint a slot's pod does not tolerate; None: it may."""
    status = node.status
    ready = next(
        (c for c in (status.conditions if status else None) or [] if c.type == "Ready"), None
    )
    if ready is None or ready.status != "True":
        why = f" ({ready.reason})" if ready is not None and ready.reason else ""
        return f"NotReady{why}"
    if node.spec and node.spec.unschedulable:
        return "cordoned (spec.unschedulable)"
    for taint in (node.spec.taints if node.spec else None) or []:
        if taint.effect in ("NoSchedule", "NoExecute") and taint.key not in _TOLERATED:
            value = f"={taint.value}" if taint.value else ""
            return f"tainted {taint.key}{value}:{taint.effect} (not tolerated)"
    return None


def pod_gpus(pod: Pod, resource: str) -> int:
    """GPUs of ``resource`` a pod requests (what the scheduler counts): its containers'
    requests (or limits) summed, or its largest init container's if more."""
    spec = pod.spec
    if spec is None:
        return 0

    def asked(containers: Iterable[object]) -> list[int]:
        out = []
        for c in containers:
            res = getattr(c, "resources", None)
            wanted = (
                (getattr(res, "requests", None) or getattr(res, "limits", None) or {})
                if res
                else {}
            )
            out.append(parse_quantity(str(wanted.get(resource, "0"))) or 0)
        return out

    return max(sum(asked(spec.containers or [])), max(asked(spec.initContainers or []), default=0))


def _node_of(pod: Pod | None) -> str | None:
    return (pod.spec.nodeName or None) if pod is not None and pod.spec else None


def _pod_key(pod: Pod) -> str:
    meta = pod.metadata
    return f"{meta.namespace}/{meta.name}" if meta is not None else ""


def _finished(pod: Pod) -> bool:
    return bool(pod.status and pod.status.phase in ("Succeeded", "Failed"))


def node_gpus(
    node: Node, pods: Iterable[Pod], ours: Callable[[Pod], str | None]
) -> NodeGpus | None:
    """``node``'s GPUs with what ``pods`` (those bound to it, unfinished) request there;
    ``ours(pod)`` names the slot of a pod of this controller's. None: it offers no GPU."""
    allocatable = dict((node.status.allocatable if node.status else None) or {})
    labels = dict((node.metadata.labels if node.metadata else None) or {})
    offered = [(r, parse_quantity(allocatable.get(r, "0")) or 0) for r in GPU_RESOURCES]
    resource, count = max(offered, key=lambda rc: rc[1])
    if count <= 0:
        return None
    physical = parse_quantity(labels.get(GPU_COUNT_LABEL, "")) or count
    mib = parse_quantity(labels.get(GPU_MEMORY_LABEL, ""))
    slots: dict[str, int] = {}
    others = 0
    for pod in pods:
        gpus = pod_gpus(pod, resource)
        if not gpus or _finished(pod):
            continue
        slot = ours(pod)
        if slot is None:
            others += gpus
        else:
            slots[slot] = slots.get(slot, 0) + gpus
    return NodeGpus(
        name=_name(node),
        resource=resource,
        allocatable=count,
        physical=physical,
        per_gpu=mib * 2**20 if mib else None,
        pods=slots,
        others=others,
        unusable=unusable(node),
    )


def node_budgets(allocatable: Mapping[str, str], labels: Mapping[str, str]) -> dict[str, int]:
    """Device -> bytes a node offers in all (pure): ``gpu`` = its GPUs x the per-GPU memory
    its ``nvidia.com/gpu.memory`` label states (MiB); ``cpu`` = allocatable memory."""
    budgets: dict[str, int] = {}
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


def _budgets(node: Node) -> dict[str, int]:
    allocatable = dict((node.status.allocatable if node.status else None) or {})
    labels = dict((node.metadata.labels if node.metadata else None) or {})
    return node_budgets(allocatable, labels)


class NodeMemory:
    """The admission's probes on a cluster (a :class:`controller.probes.memory.MemoryProbe` and a
    :class:`controller.scheduling.nodes.ClusterProbe`), over the runtime's caches of nodes and pods.

    :meth:`cluster` answers every GPU node (:func:`node_gpus`); ``NODE/cpu`` keys answer
    with the node's allocatable memory, ``NODE/gpu:N`` with its per-GPU memory (when a
    label states it). Nothing measures a remote GPU: free = total, and the admitted bytes
    per key do the accounting.

    Kept per node from the watches' events (issue 39): :meth:`pod_changed` files a pod
    under the node it is bound to and marks that node (and the one it left) changed,
    :meth:`node_changed` marks its node; :meth:`cluster` reads again only the nodes
    marked since, from the pods bound to each (not every pod of the cluster per load, as
    it did while a burst of 1,000 pods kept every node changed). :meth:`stale` marks
    everything changed (read again in full when asked next).
    """

    def __init__(
        self,
        nodes: Mapping[str, Node] | None = None,
        pods: Mapping[str, Pod] | None = None,
        ours: Callable[[Pod], str | None] = lambda pod: None,
    ) -> None:
        self._nodes = nodes if nodes is not None else {}
        self._pods = pods if pods is not None else {}
        self._ours = ours
        self._cluster: tuple[NodeGpus, ...] | None = None
        self._bound: dict[str, dict[str, Pod]] | None = None  # node -> pod key -> pod
        self._per_node: dict[str, NodeGpus] = {}  # the GPU nodes, as last read
        self._changed: set[str] = set()  # nodes to read again
        self.gpu_resources: dict[str, str] = {}  # node -> the GPU resource it offers

    def bind(
        self, nodes: Mapping[str, Node], pods: Mapping[str, Pod], ours: Callable[[Pod], str | None]
    ) -> None:
        """Read these caches (the runtime's, kept in place by their watches)."""
        self._nodes, self._pods, self._ours = nodes, pods, ours
        self.stale()

    def stale(self) -> None:
        """Everything changed: read every node and pod again when asked next."""
        self._cluster = None
        self._bound = None

    def pod_changed(self, old: Pod | None, new: Pod | None) -> None:
        """A pod's watch event: only the nodes it was and is bound to are read again."""
        bound = self._bound
        if bound is None:
            return  # read in full when asked next
        for pod, add in ((old, False), (new, True)):
            node = _node_of(pod)
            if pod is None or node is None:
                continue
            on = bound.setdefault(node, {})
            if add:
                on[_pod_key(pod)] = pod
            else:
                on.pop(_pod_key(pod), None)
            self._changed.add(node)

    def node_changed(self, name: str) -> None:
        """A node's watch event: that node is read again."""
        self._changed.add(name)

    def pods_on(self, name: str) -> list[Pod]:
        """The pods bound to node ``name`` (unfinished or not)."""
        self.cluster()
        return list((self._bound or {}).get(name, {}).values())

    def cluster(self) -> tuple[NodeGpus, ...]:
        if self._bound is None:
            bound: dict[str, dict[str, Pod]] = {}
            for key, pod in self._pods.items():
                node = _node_of(pod)
                if node:
                    bound.setdefault(node, {})[key] = pod
            self._bound = bound
            self._per_node = {}
            self._changed = set(self._nodes)
            self._cluster = None
        if self._changed or self._cluster is None:
            for name in self._changed:
                item = self._nodes.get(name)
                gpus = (
                    node_gpus(item, self._bound.get(name, {}).values(), self._ours)
                    if item is not None
                    else None
                )
                if gpus is None:
                    self._per_node.pop(name, None)
                else:
                    self._per_node[name] = gpus
            self._changed = set()
            found = tuple(self._per_node[k] for k in sorted(self._per_node))
            self._cluster = found
            self.gpu_resources = {n.name: n.resource for n in found}
        return self._cluster

    def sample(self, device: str) -> DeviceMemory | None:
        node_name, sep, kind = device.rpartition("/")
        if kind.startswith("gpu:"):
            self.cluster()
            found = self._per_node.get(node_name)
            total = found.per_gpu if found is not None else None
        elif sep:
            node = self._nodes.get(node_name)
            total = _budgets(node).get(kind) if node is not None else None
        else:  # not placed yet (a cpu slot the scheduler places): the largest node's
            totals = [b[kind] for b in map(_budgets, self._nodes.values()) if kind in b]
            total = max(totals) if totals else None
        if total is None:
            return None
        return DeviceMemory(device=device, total_bytes=total, free_bytes=total, source="node")

    def gpus(self) -> tuple[DeviceMemory, ...]:
        """No host GPUs on a cluster: slots are placed on the nodes' (:meth:`cluster`)."""
        return ()
