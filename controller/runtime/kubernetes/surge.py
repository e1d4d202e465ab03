"""The kubernetes runtime's surge capability: a slot's second instance, switched to by its
Service.

Beside :mod:`controller.runtime.kubernetes.runtime`, over the same API access
(:mod:`controller.runtime.kubernetes.api`; the protocol: :mod:`controller.runtime.surging`).
A slot has two instance names (:mod:`controller.runtime.kubernetes.spec`): instance ``0``
is the Deployment ``slotctl-<slot>``, instance ``1`` ``slotctl1-<slot>``; the slot's
Service names the one that serves. A surge:

    start_instance   the Service made to select the serving instance by its label (one
                     written before instances selected by slot alone; a slot whose pods
                     predate the label cannot surge: :meth:`KubernetesSurge.cannot_surge_slot`),
                     then the other instance's Deployment applied with the new launch, marked
                     ``slotctl.surge: "true"``; until its pod runs (the manager then
                     probes it at its pod IP while the old pod serves on)
    promote          the Service switched to it (selector + annotation: one write), then
                     the mark cleared (``"false"``: its body applied again, the drift
                     intent now); until the caches show both; then the InferencePool's
                     label (``slotctl.pool``) moved from the old pod to the new one
    stop_retiring    the old instance scaled to 0, its pod gone, its Deployment deleted
    stop_instance    (a failed or abandoned surge) the marked instance removed the same way

Which Deployment is the slot's own is read from the cluster every time (the Service, the
mark), so each step is idempotent and an operator killed between two finds where it
stopped: :meth:`KubernetesSurge.settle` converges from the objects alone (a marked
instance the Service does not name is deleted; one it names is promoted and the other
deleted; an unmarked second instance is a retiring one, deleted), even without the
manager's ``rollout.json`` (a state dir lost with its node). Only Deployments with this
owner's labels for the slot are touched; a name held by anyone else fails the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import httpx2
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from controller.model.errors import SlotSpawnFailed, SlotTerminateTimeout
from controller.runtime.base import LaunchSpec, Observed, RunStatus
from controller.runtime.kubernetes.api import KubernetesApi
from controller.runtime.kubernetes.poolspec import POOL_LABEL
from controller.runtime.kubernetes.spec import (
    INSTANCE_LABEL,
    SURGE_ANNOTATION,
    instance_name,
    labelled,
    observe,
    other,
    ours,
    surging,
    switched_service,
    terminating,
)

__all__ = ["Instances", "KubernetesSurge"]

log = logging.getLogger("slotctl.runtime")


class Instances(Protocol):
    """What the surge asks of the runtime beside its API access."""

    def deployment_for(
        self, launch: LaunchSpec, instance: str = "0", surge: bool = False
    ) -> dict[str, Any]: ...

    async def wait_running(self, launch: LaunchSpec, instance: str) -> Observed: ...

    async def scale_instance(self, slot: str, instance: str, replicas: int) -> None: ...

    async def pods_gone(self, slot: str, instance: str, timeout: float) -> bool: ...


class KubernetesSurge:
    """A slot's second instance on the kubernetes runtime (see the module docstring)."""

    def __init__(self, api: KubernetesApi, instances: Instances) -> None:
        self.api = api
        self.instances = instances
        self._bodies: dict[str, dict[str, Any]] = {}  # slot -> the surge's applied body
        # slot -> the instance a promotion made the serving one (the caches may lag)
        self._promoted: dict[str, str] = {}

    # ------------------------------------------------------------------ the protocol

    async def start_instance(self, launch: LaunchSpec) -> Observed:
        async with self.api.lock(launch.slot):
            return await self.api.call("start", launch.slot, lambda: self._start(launch))

    def cannot_surge_slot(self, slot: str) -> str | None:
        """Why ``slot`` cannot surge now (None: it can), from the caches: a slot adopted
        from before instances were labelled has a Service selecting by slot alone and
        pods without ``slotctl.instance``. A second pod would match that Service while it
        warms, and no selector can name the old pod alone (labelling its Deployment's
        template restarts it; labelling the pod leaves any replacement unselected), so
        such a slot is recreated once; its new objects are labelled and it surges after."""
        cache = self.api.cache
        service = cache.service(slot)
        selector = (service.spec.selector if service and service.spec else None) or {}
        if service is None or INSTANCE_LABEL in selector:
            return None
        serving = cache.serving(slot)
        pods = cache.slot_pods(slot, serving)
        if labelled(cache.instance(slot, serving)) and all(_instance_labelled(p) for p in pods):
            return None  # the Service is made to select the serving instance first
        return (
            "its Service and pod predate instance labels (slotctl.instance): a second pod "
            "would be selected by the Service while it warms; recreated once, it surges after"
        )

    async def inspect_instance(self, slot: str) -> Observed:
        async def look() -> Observed:
            found = self._surge(slot)
            if found is None:
                return Observed(slot=slot, status=RunStatus.MISSING)
            instance, deployment = found
            cache = self.api.cache
            return observe(
                slot,
                deployment,
                cache.slot_pods(slot, instance),
                owner=self.api.owner,
                namespace=self.api.namespace,
                lost=cache.lost(self.api.node_lost_s),
            )

        return await self.api.call("inspect", slot, look)

    async def stop_instance(self, slot: str, timeout: float) -> None:
        async def stop() -> None:
            await self._revert(slot)
            instance = other(self.api.cache.serving(slot))
            found = await self.api.confirmed(Deployment, slot, instance)  # a start's stray too
            if found is not None and ours(found, slot, self.api.owner) and surging(found):
                await self._remove(slot, instance, timeout)
            self._bodies.pop(slot, None)

        async with self.api.lock(slot):
            await self.api.call("stop", slot, stop)

    async def promote(self, slot: str) -> None:
        async with self.api.lock(slot):
            await self.api.call("promote", slot, lambda: self._promote(slot))

    async def stop_retiring(self, slot: str, timeout: float) -> bool:
        async def stop() -> bool:
            serving = self._promoted.pop(slot, None) or self.api.cache.serving(slot)
            instance = other(serving)
            found = self.api.cache.instance(slot, instance)
            if found is None or not ours(found, slot, self.api.owner) or surging(found):
                return False  # none, not ours, or a surge not promoted (not retiring)
            await self._remove(slot, instance, timeout)
            return True

        async with self.api.lock(slot):
            return await self.api.call("stop", slot, stop)

    async def settle(self, slot: str) -> str | None:
        """Converge ``slot``'s instances from the cluster's objects alone (after a
        restart): one Deployment of the slot remains, the serving one. Returns what was
        done (None: nothing to do)."""

        async def converge() -> str | None:
            cache, owner = self.api.cache, self.api.owner
            serving = cache.serving(slot)
            current = cache.instance(slot, serving)
            second = cache.instance(slot, other(serving))
            said = None
            if current is not None and ours(current, slot, owner) and surging(current):
                await self._promote(slot)  # switched, not marked yet: finished
                said = "the switch to the new instance finished"
            if second is None or not ours(second, slot, owner):
                return said
            if surging(second):
                await self._remove(slot, other(serving), self.api.termination_grace_s)
                return "the new instance of an interrupted surge deleted; the old one serves"
            await self._remove(slot, other(serving), self.api.termination_grace_s)
            return (said + "; " if said else "") + "the retired instance deleted"

        async with self.api.lock(slot):
            return await self.api.call("settle", slot, converge)

    # ------------------------------------------------------------------ the steps

    def _surge(self, slot: str) -> tuple[str, Deployment] | None:
        """The slot's marked instance the Service does not serve yet (and its Deployment)."""
        instance = other(self.api.cache.serving(slot))
        found = self.api.cache.instance(slot, instance)
        if found is None or not ours(found, slot, self.api.owner) or not surging(found):
            return None
        return instance, found

    async def _revert(self, slot: str) -> None:
        """A promotion the manager did not finish (it failed after the Service's switch,
        before the mark was cleared): the Service back on the other instance, which the
        manager still serves from (a restart settles the other way: :meth:`settle`)."""
        cache, owner = self.api.cache, self.api.owner
        serving = cache.serving(slot)
        current, back = cache.instance(slot, serving), cache.instance(slot, other(serving))
        if current is None or not surging(current) or not ours(current, slot, owner):
            return
        if back is None or not ours(back, slot, owner) or surging(back):
            return
        await self.api.apply(switched_service(back, self.api.namespace))
        await self._until(slot, lambda: cache.serving(slot) == other(serving), "the switch back")
        log.warning("slot %s: an unfinished switch to instance %s undone", slot, serving)

    async def _start(self, launch: LaunchSpec) -> Observed:
        slot = launch.slot
        await self._revert(slot)
        self._promoted.pop(slot, None)
        instance = other(self.api.cache.serving(slot))
        name = instance_name(slot, instance)
        existing = await self.api.confirmed(Deployment, slot, instance)
        if not ours(existing, slot, self.api.owner):
            raise SlotSpawnFailed(
                f"cannot surge slot {slot!r}: the name {name} in {self.api.namespace} is held "
                "by a Deployment slotctl does not manage: remove or rename it",
                slot=slot,
            )
        if existing is not None and not surging(existing):
            # an older rollout's retiring instance, never removed: it goes first
            await self._remove(slot, instance, self.api.termination_grace_s)
        await self._select_serving(slot)
        body = self.instances.deployment_for(launch, instance, surge=True)
        self._bodies[slot] = copy.deepcopy(body)
        await self.api.apply(body)
        return await self.instances.wait_running(launch, instance)

    async def _select_serving(self, slot: str) -> None:
        """Before a second pod starts, the Service selects the serving instance by its
        label (one written before instances selects by slot alone: it would pick up the
        new pod while it warms, on a port the Service does not target). Refused when the
        old pods lack the label (:meth:`cannot_surge_slot`: the manager recreates)."""
        why = self.cannot_surge_slot(slot)
        if why is not None:
            raise SlotSpawnFailed(f"cannot surge slot {slot!r}: {why}", slot=slot)
        cache = self.api.cache
        service = cache.service(slot)
        selector = (service.spec.selector if service and service.spec else None) or {}
        serving = cache.serving(slot)
        current = cache.instance(slot, serving)
        if service is None or current is None or selector.get(INSTANCE_LABEL) == serving:
            return
        await self.api.apply(switched_service(current, self.api.namespace))

        def shown() -> bool:
            found = cache.service(slot)
            spec = found.spec if found is not None else None
            return ((spec.selector if spec else None) or {}).get(INSTANCE_LABEL) == serving

        await self._until(slot, shown, "the Service's selection of the serving instance")
        log.info("slot %s: its Service selects instance %s by label now", slot, serving)

    async def _promote(self, slot: str) -> None:
        cache = self.api.cache
        serving = cache.serving(slot)
        current = cache.instance(slot, serving)
        if current is not None and surging(current) and ours(current, slot, self.api.owner):
            new, deployment = serving, current  # switched already; the mark is left
        else:
            found = self._surge(slot)
            if found is None:
                return  # promoted already (or nothing to promote)
            new, deployment = found
            await self.api.apply(switched_service(deployment, self.api.namespace))
        body = self._bodies.pop(slot, None)
        if body is not None and body["metadata"]["name"] == instance_name(slot, new):
            body["metadata"]["annotations"][SURGE_ANNOTATION] = "false"
            self.api.drift.intend(slot, body)  # the serving Deployment's intent now
            await self.api.apply(body)
        else:  # after a restart: the body is not known here; the mark is cleared alone
            await self.api.client().patch(
                Deployment,
                instance_name(slot, new),
                {"metadata": {"annotations": {SURGE_ANNOTATION: "false"}}},
                namespace=self.api.namespace,
                patch_type=PatchType.MERGE,
            )
        self._promoted[slot] = new
        await self._until(slot, lambda: self._shown(slot, new), "the switch")
        await self._move_pool(slot, new)

    async def _move_pool(self, slot: str, new: str) -> None:
        """The slot's InferencePool follows the Service: the new instance's pods get the
        ``slotctl.pool`` label the old one's carry, then the old ones lose it, so a gateway
        sends the retiring pod no new request while it drains (the pools' pass,
        :mod:`~controller.runtime.kubernetes.pools`, labels serving pods only and would
        leave it there until it is scaled to 0). Nothing when no pool selects the slot."""
        cache = self.api.cache
        old = [p for p in cache.slot_pods(slot, other(new)) if _pool_of(p)]
        if not old:
            return
        pool = _pool_of(old[0])
        for pod in cache.slot_pods(slot, new):
            if not terminating(pod) and _pool_of(pod) != pool:
                await self._label_pool(pod, pool)
        for pod in old:
            await self._label_pool(pod, None)
        log.info("slot %s: pool %s moved to instance %s", slot, pool, new)

    async def _label_pool(self, pod: Pod, pool: str | None) -> None:
        name = pod.metadata.name if pod.metadata else None
        if not name:
            return
        with _gone_already():
            await self.api.client().patch(
                Pod,
                name,
                {"metadata": {"labels": {POOL_LABEL: pool}}},
                namespace=self.api.namespace,
                patch_type=PatchType.MERGE,
            )

    def _shown(self, slot: str, new: str) -> bool:
        cache = self.api.cache
        return cache.serving(slot) == new and not surging(cache.instance(slot, new))

    async def _until(self, slot: str, seen: Callable[[], bool], what: str) -> None:
        """Until the caches show ``seen()`` (the runtime's own write), woken by their
        events; a watch that lags longer than ``sync_timeout_s`` is logged (the write
        was made: what follows reads :attr:`_promoted`, not the cache)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.api.sync_timeout_s
        while not seen():
            left = deadline - loop.time()
            if left <= 0:
                log.warning(
                    "slot %s: %s was written but the watch did not show it within %gs",
                    slot,
                    what,
                    self.api.sync_timeout_s,
                )
                return
            await self.api.cache.changed(slot, min(left, 1.0))

    async def _remove(self, slot: str, instance: str, timeout: float) -> None:
        """One instance scaled to 0, its pods gone, its Deployment deleted."""
        name = instance_name(slot, instance)
        with _gone_already():
            await self.instances.scale_instance(slot, instance, 0)
        wait = max(timeout, self.api.termination_grace_s) + self.api.stop_grace_s
        gone = await self.instances.pods_gone(slot, instance, wait)
        with _gone_already():
            await self.api.client().delete(Deployment, name, namespace=self.api.namespace)
        if not gone:
            raise SlotTerminateTimeout(
                f"slot {slot!r}: the pod of {name} is still there {wait:g}s after it was "
                "scaled to 0 (its Deployment is deleted: garbage collection takes it)",
                slot=slot,
            )
        log.info("slot %s: instance %s (%s) removed", slot, instance, name)


def _instance_labelled(pod: Pod) -> bool:
    return INSTANCE_LABEL in ((pod.metadata.labels if pod.metadata else None) or {})


def _pool_of(pod: Pod) -> str | None:
    labels = (pod.metadata.labels if pod.metadata else None) or {}
    return labels.get(POOL_LABEL) or None


@contextlib.contextmanager
def _gone_already() -> Iterator[None]:
    """A 404 is the object gone already (another error is raised)."""
    try:
        yield
    except httpx2.HTTPStatusError as exc:
        if exc.response.status_code != 404:
            raise
