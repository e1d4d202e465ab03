"""What the kubernetes runtime reads: its caches of the cluster, kept by watches.

Sits under :mod:`controller.runtime.kubernetes.runtime` (reads come from here, writes go to the
API). Four :class:`~controller.runtime.kubernetes.watch.Informer`\\ s: the nodes, every
pod of the cluster (a node's GPUs are requested by the pods of every namespace), and the
Deployments and Services of the runtime's namespace; an index of this runtime's pods by
slot; and per slot a wake-up for whoever waits for its objects to change (a start waiting
for its pod, a stop waiting for it to go), plus :attr:`ClusterCache.on_slot` (the
manager's hook: a slot's server changed) and :attr:`ClusterCache.on_deployment` (the
runtime's drift check). A node that is not ready is remembered with the time it was
first seen so (:meth:`ClusterCache.lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Final

from lightkube import AsyncClient
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Node, Pod, Service

from controller.runtime.base import MANAGED_LABEL, SLOT_LABEL
from controller.runtime.kubernetes.nodes import NodeMemory, unusable
from controller.runtime.kubernetes.spec import (
    INSTANCE_LABEL,
    OBJECT_PREFIX,
    SECOND_PREFIX,
    instance_name,
    instance_of,
    other,
    surging,
)
from controller.runtime.kubernetes.watch import Informer, InformerStats

__all__ = ["ClusterCache"]

ALL_NAMESPACES: Final = "*"  # lightkube's ALL_NS


class ClusterCache:
    """See the module docstring."""

    def __init__(
        self, client: Callable[[], AsyncClient], namespace: str, memory: NodeMemory | None = None
    ) -> None:
        self.namespace = namespace
        self.nodes: Informer[Node] = Informer(client, Node, on_event=self._node_event)
        self.pods: Informer[Pod] = Informer(
            client, Pod, namespace=ALL_NAMESPACES, on_event=self._pod_event, name="pods"
        )
        self.deployments: Informer[Deployment] = Informer(
            client, Deployment, namespace=namespace, on_event=self._deployment_event
        )
        self.services: Informer[Service] = Informer(
            client, Service, namespace=namespace, on_event=self._service_event
        )
        self.memory = memory or NodeMemory()
        self.memory.bind(self.nodes.items, self.pods.items, self.slot_of)
        self.by_slot: dict[str, dict[str, Pod]] = {}  # our pods, by slot, by name
        self.not_ready: dict[str, tuple[float, str]] = {}  # node -> (since, why)
        self.on_slot: Callable[[str], None] | None = None
        self.on_deployment: Callable[[str, Deployment | None], None] | None = None
        self._wake: dict[str, asyncio.Event] = {}
        self._started = False

    @property
    def informers(self) -> tuple[Informer[Any], ...]:
        return (self.nodes, self.pods, self.deployments, self.services)

    def stats(self) -> dict[str, InformerStats]:
        return {i.name: i.stats for i in self.informers}

    # ------------------------------------------------------------------ running

    def start(self) -> None:
        if not self._started:
            self._started = True
            for informer in self.informers:
                informer.start()

    async def synced(self, timeout: float) -> bool:
        """Every cache listed once (False: not within ``timeout``)."""
        self.start()
        waits = [asyncio.ensure_future(i.synced.wait()) for i in self.informers]
        try:
            _, pending = await asyncio.wait(waits, timeout=timeout)
        finally:
            for w in waits:
                w.cancel()
        return not pending

    @property
    def ready(self) -> bool:
        return all(i.synced.is_set() for i in self.informers)

    async def stop(self) -> None:
        for informer in self.informers:
            await informer.stop()
        self._started = False

    # ------------------------------------------------------------------ reads

    def slot_of(self, pod: Pod) -> str | None:
        """The slot of one of this runtime's pods (its namespace, slotctl's labels)."""
        meta = pod.metadata
        if meta is None or meta.namespace != self.namespace:
            return None
        labels = meta.labels or {}
        slot = labels.get(SLOT_LABEL)
        return slot if slot and labels.get(MANAGED_LABEL) == "true" else None

    def deployment(self, slot: str) -> Deployment | None:
        """The slot's own Deployment: the instance that serves (:meth:`serving`)."""
        return self.instance(slot, self.serving(slot))

    def instance(self, slot: str, instance: str) -> Deployment | None:
        """The Deployment of one of the slot's two instances (``0``, ``1``)."""
        return self.deployments.items.get(f"{self.namespace}/{instance_name(slot, instance)}")

    def serving(self, slot: str) -> str:
        """The slot's serving instance: the one its Service names, while that one's
        Deployment is there; else instance ``0`` unless only ``1`` is there, and not as a
        surge not promoted yet (a user deleted the Service, say)."""
        service = self.service(slot)
        annotations = (service.metadata.annotations if service and service.metadata else None) or {}
        named = str(annotations.get(INSTANCE_LABEL, ""))
        if named == "0" or named == "1":
            if self.instance(slot, named) is not None:
                return named
            alone = self.instance(slot, other(named))
            return other(named) if _slots(alone, slot) and not surging(alone) else named
        second = self.instance(slot, "1")
        if self.instance(slot, "0") is None and _slots(second, slot) and not surging(second):
            return "1"
        return "0"

    def service(self, slot: str) -> Service | None:
        return self.services.items.get(f"{self.namespace}/{OBJECT_PREFIX}{slot}")

    def slot_pods(self, slot: str, instance: str | None = None) -> list[Pod]:
        """The slot's pods (of one ``instance``: its Deployment's; None: both)."""
        pods = self.by_slot.get(slot, {}).values()
        return [p for p in pods if instance is None or instance_of(p) == instance]

    def serving_pods(self, slot: str) -> list[Pod]:
        return self.slot_pods(slot, self.serving(slot))

    def lost(self, after_s: float) -> dict[str, str]:
        """Nodes not ready for ``after_s`` or longer (or gone): node -> why."""
        now = time.monotonic()
        return {
            node: f"{why} for {now - since:.0f}s"
            for node, (since, why) in self.not_ready.items()
            if now - since >= after_s
        }

    async def changed(self, slot: str, timeout: float) -> None:
        """Until one of ``slot``'s objects (or a node) changes, or ``timeout``."""
        event = self._wake.setdefault(slot, asyncio.Event())
        with contextlib.suppress(TimeoutError):  # (wait_for could lose a cancellation)
            async with asyncio.timeout(timeout):
                await event.wait()

    # ------------------------------------------------------------------ events

    def _wake_slot(self, slot: str) -> None:
        event = self._wake.pop(slot, None)
        if event is not None:
            event.set()
        if self.on_slot is not None:
            self.on_slot(slot)

    def _pod_event(self, kind: str, old: Pod | None, new: Pod | None) -> None:
        pod = new or old
        assert pod is not None
        if _bound(new) or _bound(old):
            self.memory.pod_changed(old, new)
        slot = self.slot_of(pod)
        if slot is None:
            return
        name = str(pod.metadata.name) if pod.metadata else ""
        if new is None:
            self.by_slot.get(slot, {}).pop(name, None)
        else:
            self.by_slot.setdefault(slot, {})[name] = new
        self._wake_slot(slot)

    def _node_event(self, kind: str, old: Node | None, new: Node | None) -> None:
        node = new or old
        assert node is not None
        name = str(node.metadata.name) if node.metadata else ""
        self.memory.node_changed(name)
        why = "deleted" if new is None else unusable(new)
        if why is not None and (why.startswith("NotReady") or why == "deleted"):
            self.not_ready.setdefault(name, (time.monotonic(), why))
        else:
            self.not_ready.pop(name, None)
        # the slots whose pods are bound there (the node's pods, not every slot's)
        for slot in sorted({s for p in self.memory.pods_on(name) if (s := self.slot_of(p))}):
            self._wake_slot(slot)

    def _deployment_event(self, kind: str, old: Deployment | None, new: Deployment | None) -> None:
        obj = new or old
        slot = _slot_of_object(obj)
        if slot is not None:
            self._wake_slot(slot)
            serving = obj is not None and instance_of(obj) == self.serving(slot)
            if self.on_deployment is not None and serving:  # (drift: the serving one's)
                self.on_deployment(slot, new)

    def _service_event(self, kind: str, old: Service | None, new: Service | None) -> None:
        slot = _slot_of_object(new or old)
        if slot is not None:
            event = self._wake.pop(slot, None)
            if event is not None:
                event.set()


def _slots(deployment: Deployment | None, slot: str) -> bool:
    """A Deployment with slotctl's labels for ``slot`` (a stranger's never serves it)."""
    meta = deployment.metadata if deployment is not None else None
    labels = (meta.labels if meta else None) or {}
    return labels.get(MANAGED_LABEL) == "true" and labels.get(SLOT_LABEL) == slot


def _bound(pod: Pod | None) -> bool:
    return bool(pod is not None and pod.spec and pod.spec.nodeName)


def _slot_of_object(obj: Deployment | Service | None) -> str | None:
    """The slot a ``slotctl-<slot>`` (or a second instance's ``slotctl1-<slot>``) object
    is named for (labelled or not)."""
    name = obj.metadata.name if obj is not None and obj.metadata else None
    for prefix in (OBJECT_PREFIX, SECOND_PREFIX):
        if name and name.startswith(prefix):
            return name[len(prefix) :]
    return None
