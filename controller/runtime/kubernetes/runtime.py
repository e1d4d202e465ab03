"""The kubernetes runtime: each slot's server is a Deployment ``slotctl-<slot>`` + a Service.

Sits beside :mod:`controller.runtime.docker.runtime` under the ``Runtime`` seam (``slotctl operator
--runtime kubernetes``, the default inside a pod); the slot manager is its only caller.
It talks to the API server through lightkube's typed async client (design record 0005):

* **reads** come from caches kept by watches (:mod:`~controller.runtime.kubernetes.cache`:
  nodes, every pod, this namespace's Deployments and Services, list + watch as an
  informer does), so inspecting a slot, waiting for its pod or for it to go costs no
  request; a change reaches whoever waits, and the manager (:meth:`subscribe`), in one
  event. The one read of the API itself: before a start writes an object the cache does
  not have, a ``get`` makes sure nobody else just made one of that name;
* **writes** go to the API: server-side apply (field manager ``slotctl``, forced) of the
  Deployment and Service bodies (:mod:`~controller.runtime.kubernetes.spec`), so a
  field someone else set stays theirs, and a change to one of ours (``kubectl scale``, a
  label edited) is drift: the Deployment's next event puts it back (:meth:`_drift`,
  backing off if something keeps changing it);
* **placement**: the node the controller's placement chose (the launch's GPUs) becomes a
  required node affinity; a pod the scheduler leaves Pending is reported with its
  reason (the ``note`` hook) and, after ``unschedulable_s``, fails the start
  (``SlotSpawnFailed`` with the node, so the next load avoids it);
* **lost nodes**: a pod on a node not ready for ``node_lost_s`` does not run
  (:attr:`Observed.running` is False, so the slot fails and is placed again elsewhere); a
  stop deletes, with grace 0, pods on a node that is not ready (their kubelet cannot);
* **memory**: :attr:`KubernetesRuntime.memory`, the admission's probe of the nodes
  (:mod:`~controller.runtime.kubernetes.nodes`);
* **surge rollouts**: :attr:`KubernetesRuntime.surge`
  (:mod:`~controller.runtime.kubernetes.surge`) runs a changed slot's new server as the
  slot's second instance (``slotctl1-<slot>`` or ``slotctl-<slot>``) and switches the
  Service to it; everything here acts on the *serving* instance
  (:meth:`~controller.runtime.kubernetes.cache.ClusterCache.serving`: the one the
  Service names) and counts only its pods.

``stop`` scales a running slot to 0 and waits for its pod to go — a terminating pod
(``deletionTimestamp`` set) counts as still there; after the stop's timeout + the pod's
grace: :class:`~controller.model.errors.SlotTerminateTimeout`. A stop of a slot already at 0
with no pod left deletes the Deployment and the Service (the orphan sweep). A start that
fails after it wrote the Deployment scales it back to 0 before it raises. Objects with a
slot's name but without slotctl's labels (or of another ``slotctl.owner``) are reported
(``Observed(managed=False)``) and never written. API failures become typed errors:
:class:`~controller.model.errors.SlotSpawnFailed` from ``start``,
:class:`~controller.model.errors.DockerEngineError` (``runtime.engine_error``) or
:class:`~controller.model.errors.DockerUnavailable` (``runtime.unavailable``) from the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Pod, Service
from lightkube.types import PatchType

from controller.model.errors import (
    ModelPullFailed,
    SlotctlError,
    SlotSpawnFailed,
    SlotTerminateTimeout,
)
from controller.runtime.base import (
    HASH_LABEL,
    SLOT_LABEL,
    LaunchSpec,
    Observed,
    ProgressCallback,
    RunStatus,
    RuntimeKind,
)
from controller.runtime.kubernetes.api import KubernetesApi
from controller.runtime.kubernetes.spec import (
    CONTAINER,
    PULL_ENV,
    check_launch,
    deployment_body,
    instance_name,
    instance_of,
    labelled,
    object_name,
    observe,
    ours,
    owned,
    placed_node,
    pull_seen,
    service_body,
    start_verdict,
    terminating,
    unschedulable,
)
from controller.runtime.kubernetes.surge import KubernetesSurge

__all__ = ["KubernetesRuntime"]

log = logging.getLogger("slotctl.runtime")


class KubernetesRuntime(KubernetesApi):
    """Runtime for servers run as pods of per-slot Deployments (see module docstring)."""

    kind = RuntimeKind.KUBERNETES

    def __init__(self, client: AsyncClient | None = None, **options: Any) -> None:
        super().__init__(client, **options)
        # the surge capability (controller.runtime.surging): a second instance of a slot
        self.surge = KubernetesSurge(self, self)

    # ------------------------------------------------------------------ observing

    def _observe(
        self, slot: str, deployment: Deployment, pods: list[Pod] | None = None
    ) -> Observed:
        cache = self.cache
        found = cache.slot_pods(slot) if pods is None else pods
        lost = cache.lost(self.node_lost_s)
        return observe(
            slot, deployment, found, owner=self.owner, namespace=self.namespace, lost=lost
        )

    async def inspect(self, slot: str) -> Observed:
        async def look() -> Observed:
            deployment = self.cache.deployment(slot)
            if deployment is None:
                return Observed(slot=slot, status=RunStatus.MISSING)
            return self._observe(slot, deployment)

        return await self.call("inspect", slot, look)

    async def list_managed(self) -> list[Observed]:
        async def look() -> list[Observed]:
            found = []
            for dep in list(self.cache.deployments.items.values()):
                labels = (dep.metadata.labels if dep.metadata else None) or {}
                slot = labels.get(SLOT_LABEL, "")
                name = dep.metadata.name if dep.metadata else None
                serving = slot and name == instance_name(slot, self.cache.serving(slot))
                if serving and owned(labels, slot, self.owner):
                    found.append(self._observe(slot, dep))
            return sorted(found, key=lambda o: o.slot)

        return await self.call("list", None, look)

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        async def read() -> list[str]:
            pods = sorted(self.cache.serving_pods(slot), key=terminating)  # the live one first
            if not pods or pods[0].metadata is None or not pods[0].metadata.name:
                return []
            lines = []
            stream = self._client().log(
                pods[0].metadata.name,
                namespace=self.namespace,
                container=CONTAINER,
                tail_lines=tail if tail > 0 else None,
                newlines=False,
            )
            async for line in stream:
                lines.append(line)
            return lines

        try:
            return await self.call("read logs of", slot, read)
        except SlotctlError as exc:  # a pod not started yet has no log: nothing to show
            log.debug("logs of slot %s: %s", slot, exc.message)
            return []

    # ------------------------------------------------------------------ starting

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        """A model to pull first (the kubelet pulls the image while the pod starts)."""
        return launch.pull is not None

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        """The pod's model pull: its Deployment applied, then until its ``model-pull`` init
        container is done (the slot shows ``pulling`` meanwhile); its failure is
        ``model.pull_failed`` with the pull's own typed error in its words, and the
        Deployment goes back to 0. Nothing to do without a model to pull."""
        if launch.pull is None:
            return
        check_launch(launch)
        async with self.lock(launch.slot):
            await self.call("pull the model of", launch.slot, lambda: self._pull(launch, progress))

    async def _pull(self, launch: LaunchSpec, progress: ProgressCallback | None) -> None:
        slot = launch.slot
        deployment: Deployment | None = await self.confirmed(Deployment, slot)
        service: Service | None = await self.confirmed(Service, slot)
        foreign = next((o for o in (deployment, service) if not ours(o, slot, self.owner)), None)
        if foreign is not None:
            raise SlotSpawnFailed(
                f"cannot start slot {slot!r}: an unmanaged {type(foreign).__name__} holds the "
                f"name {object_name(slot)} in {self.namespace}: remove or rename it",
                slot=slot,
            )
        instance = self.cache.serving(slot)
        body = self.deployment_for(launch, instance)
        try:
            self.drift.intend(slot, body)
            await self.apply(body)
            await self._wait_pulled(launch, progress, instance)
        except BaseException:  # a failed pull, a cancelled load: no pod left behind
            await self._scale_down_after_failure(slot)
            raise

    async def _wait_pulled(
        self, launch: LaunchSpec, progress: ProgressCallback | None, instance: str
    ) -> None:
        """Until the pod of this config has pulled its model (woken by the caches' events)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        slot, wanted = launch.slot, launch.config_hash()
        said = ""
        pending: tuple[float, str] | None = None
        while True:
            pods = [
                p
                for p in self.cache.slot_pods(slot, instance)
                if not terminating(p)
                and ((p.metadata.annotations if p.metadata else None) or {}).get(HASH_LABEL)
                == wanted
            ]
            seen = [pull_seen(p) for p in pods]
            if any(s.phase == "done" for s in seen):
                return
            failed = next((s for s in seen if s.phase == "failed"), None)
            if failed is not None:
                raise ModelPullFailed(
                    f"slot {slot!r}: its pod could not pull model {launch.model_id}: "
                    f"{failed.words}",
                    source=launch.pull.source if launch.pull else "",
                    reason="init_container",
                    slot=slot,
                    **({"pull_error": failed.code} if failed.code else {}),
                )
            words = seen[0].words if seen else "no pod yet"
            if words != said:
                said = words
                if progress is not None:
                    result = progress(
                        {
                            "slot": slot,
                            "status": words,
                            "phase": seen[0].phase if seen else "waiting",
                        }
                    )
                    if result is not None:
                        await result
            now = loop.time()
            pending = self._pending(launch, pods, pending, now)
            if now - began >= self.start_timeout_s:
                raise ModelPullFailed(
                    f"slot {slot!r}: its pod did not pull model {launch.model_id} within "
                    f"{self.start_timeout_s:g}s ({words})",
                    source=launch.pull.source if launch.pull else "",
                    reason="timeout",
                    slot=slot,
                )
            await self.cache.changed(slot, 5.0)

    async def start(self, launch: LaunchSpec) -> Observed:
        check_launch(launch)
        async with self.lock(launch.slot):
            return await self.call("start", launch.slot, lambda: self._start(launch))

    async def _start(self, launch: LaunchSpec) -> Observed:
        slot, name = launch.slot, object_name(launch.slot)
        deployment: Deployment | None = await self.confirmed(Deployment, slot)
        service: Service | None = await self.confirmed(Service, slot)
        foreign = next((o for o in (deployment, service) if not ours(o, slot, self.owner)), None)
        if foreign is not None:
            raise SlotSpawnFailed(
                f"cannot start slot {slot!r}: an unmanaged {type(foreign).__name__} holds the "
                f"name {name} in {self.namespace}; slotctl never touches objects without "
                "its labels: remove or rename it",
                slot=slot,
            )
        instance = self.cache.serving(slot)
        body = self.deployment_for(launch, instance)
        exists = deployment is not None
        try:
            if deployment is not None:
                current = self._observe(slot, deployment)
                node = placed_node(launch)
                if (
                    current.running
                    and current.config_hash == launch.config_hash()
                    and node in (None, current.node)
                ):
                    await self._ensure_service(launch, service, instance, labelled(deployment))
                    self.drift.intend(slot, body)
                    return current  # adopted: the same config already runs
            self.drift.intend(slot, body)
            await self.apply(body)
            exists = True
            await self._ensure_service(launch, service, instance, True)
            return await self.wait_running(launch, instance)
        except BaseException:  # an API error, a refused start, a cancellation: re-raised
            if exists:
                await self._scale_down_after_failure(slot)
            raise

    def deployment_for(
        self, launch: LaunchSpec, instance: str = "0", surge: bool = False
    ) -> dict[str, Any]:
        return deployment_body(
            launch,
            self.namespace,
            gpu_resource=self._gpu_resource(placed_node(launch) or launch.node),
            termination_grace_s=math.ceil(self.termination_grace_s),
            owner=self.owner,
            cache=self.model_cache,
            pull_env={k: os.environ[k] for k in PULL_ENV if os.environ.get(k)},
            instance=instance,
            surge=surge,
        )

    async def _scale_down_after_failure(self, slot: str) -> None:
        """A failed start leaves no pod running (best effort: the start's error is what
        the caller hears; a failure to scale down is logged)."""
        try:
            await self._scale(slot, 0)
        except (httpx2.HTTPError, OSError) as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status != 404:  # 404: the Deployment is gone, nothing runs
                log.warning("slot %s: scaling back to 0 after a failed start failed: %s", slot, exc)

    def _gpu_resource(self, node: str | None) -> str:
        resources = self.memory.gpu_resources
        if node is not None and node in resources:
            return resources[node]
        return self.gpu_resource

    async def _ensure_service(
        self, launch: LaunchSpec, service: Service | None, instance: str, by_instance: bool
    ) -> None:
        """The Service in front of ``instance`` (applied when it is missing, has another
        port or names another instance)."""
        body = service_body(
            launch, self.namespace, self.owner, instance=instance, by_instance=by_instance
        )
        ports = [
            (p.port, p.targetPort)
            for p in ((service.spec.ports if service.spec else None) or [] if service else [])
        ]
        selector = (service.spec.selector if service and service.spec else None) or {}
        if (
            service is None
            or ports != [(launch.port, launch.port)]
            or selector != body["spec"]["selector"]
        ):
            await self.apply(body)

    async def wait_running(self, launch: LaunchSpec, instance: str) -> Observed:
        """Until the pod of this config (of the slot's ``instance``) runs with an IP; the
        scheduler's or the kubelet's verdict when it cannot (unschedulable for too long,
        failed, a container in CrashLoopBackOff or unable to pull its image, timed out).
        Woken by the caches' events. The caller scales the Deployment back to 0 when
        this raises."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        slot, wanted = launch.slot, launch.config_hash()
        pending: tuple[float, str] | None = None  # since, the scheduler's reason
        seen = False  # the cache may not have the Deployment just applied yet
        while True:
            deployment = self.cache.instance(slot, instance)
            if deployment is None and seen:
                raise SlotSpawnFailed(
                    f"cannot start slot {slot!r}: its Deployment was deleted meanwhile",
                    slot=slot,
                )
            seen = seen or deployment is not None
            if deployment is None:
                if loop.time() - began >= self.start_timeout_s:
                    raise SlotSpawnFailed(
                        f"cannot start slot {slot!r}: its Deployment never showed in the "
                        f"watch within {self.start_timeout_s:g}s",
                        slot=slot,
                    )
                await self.cache.changed(slot, 1.0)
                continue
            pods = [
                p
                for p in self.cache.slot_pods(slot, instance)
                if not terminating(p)
                and ((p.metadata.annotations if p.metadata else None) or {}).get(HASH_LABEL)
                == wanted
            ]
            observed = self._observe(slot, deployment, pods)
            if observed.running and observed.endpoint:
                return observed
            now = loop.time()
            pending = self._pending(launch, pods, pending, now)
            verdict = start_verdict(pods)
            if verdict is not None:
                raise SlotSpawnFailed(
                    f"cannot start slot {slot!r}: {verdict[0]}", slot=slot, exit_code=verdict[1]
                )
            if now - began >= self.start_timeout_s:
                raise SlotSpawnFailed(
                    f"cannot start slot {slot!r}: no running pod within "
                    f"{self.start_timeout_s:g}s ({observed.message})",
                    slot=slot,
                )
            left = self.start_timeout_s - (now - began)
            if pending is not None:
                left = min(left, pending[0] + self.unschedulable_s - now)
            await self.cache.changed(slot, max(0.05, min(left, 5.0)))

    def _pending(
        self, launch: LaunchSpec, pods: list[Pod], pending: tuple[float, str] | None, now: float
    ) -> tuple[float, str] | None:
        """Track a pod the scheduler leaves Pending: said once per reason (``note``), a
        failure once it stayed so for ``unschedulable_s`` (naming the node, to avoid)."""
        reason = next((r for r in map(unschedulable, pods) if r), None)
        if reason is None:
            return None
        if pending is None or pending[1] != reason:
            if self._note is not None:
                self._note(launch.slot, f"pod Pending: {reason}")
            pending = (pending[0] if pending else now, reason)
        if now - pending[0] >= self.unschedulable_s:
            node = placed_node(launch) or launch.node
            raise SlotSpawnFailed(
                f"cannot start slot {launch.slot!r}: its pod stayed unschedulable for "
                f"{self.unschedulable_s:g}s" + (f" on {node}" if node else "") + f": {reason}",
                slot=launch.slot,
                unschedulable=reason,
                **({"node": node} if node else {}),
            )
        return pending

    async def _scale(self, slot: str, replicas: int) -> None:
        """Through the intended body when there is one (server-side apply keeps owning
        the field), else a merge patch of ``spec.replicas``."""
        body = self.drift.rescale(slot, replicas)
        if body is not None:
            await self.apply(body)
            return
        await self.scale_instance(slot, self.cache.serving(slot), replicas)

    async def scale_instance(self, slot: str, instance: str, replicas: int) -> None:
        """A merge patch of one instance's ``spec.replicas``."""
        await self._client().patch(
            Deployment,
            instance_name(slot, instance),
            {"spec": {"replicas": replicas}},
            namespace=self.namespace,
            patch_type=PatchType.MERGE,
        )

    # ------------------------------------------------------------------ stopping

    async def stop(self, slot: str, timeout: float) -> Observed:
        async with self.lock(slot):
            return await self.call("stop", slot, lambda: self._stop(slot, timeout))

    async def _stop(self, slot: str, timeout: float) -> Observed:
        deployment = self.cache.deployment(slot)
        if deployment is None:
            await self._delete_service(slot)
            self.drift.forget(slot)
            return Observed(slot=slot, status=RunStatus.MISSING)
        instance = instance_of(deployment)
        pods = self.cache.slot_pods(slot, instance)
        observed = self._observe(slot, deployment, pods)
        if not observed.managed:
            return observed  # reported, never touched
        replicas = (deployment.spec.replicas if deployment.spec else None) or 0
        if not replicas and not pods:
            # Already unloaded: a stop now is the cleanup of a slot nobody declares.
            self.drift.forget(slot)
            with contextlib.suppress(httpx2.HTTPStatusError):
                await self._client().delete(
                    Deployment, instance_name(slot, instance), namespace=self.namespace
                )
            await self._delete_service(slot)
            return Observed(slot=slot, status=RunStatus.EXITED, message="Deployment removed")
        if replicas:
            await self._scale(slot, 0)
        # The kubelet sends SIGTERM, then SIGKILL after the pod's grace period.
        wait = max(timeout, self.termination_grace_s) + self.stop_grace_s
        if not await self.pods_gone(slot, instance, wait):
            raise SlotTerminateTimeout(
                f"slot {slot!r}: the pod of {instance_name(slot, instance)} is still there "
                f"{wait:g}s after the Deployment was scaled to 0",
                slot=slot,
            )
        return Observed(
            slot=slot,
            status=RunStatus.EXITED,
            ident=observed.ident,
            config_hash=observed.config_hash,
            stack=observed.stack,
            node=observed.node,
            message="scaled to 0",
        )

    async def pods_gone(self, slot: str, instance: str, timeout: float) -> bool:
        """Until the pods of the slot's ``instance`` are gone (woken by the pods'
        events); a pod on a node that is not ready is deleted with grace 0 (no kubelet
        there to stop it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        deleted: set[str] = set()
        while pods := self.cache.slot_pods(slot, instance):
            await self._release_lost(pods, deleted)
            left = deadline - loop.time()
            if left <= 0:
                return False
            await self.cache.changed(slot, min(left, 5.0))
        return True

    async def _release_lost(self, pods: list[Pod], deleted: set[str]) -> None:
        lost = self.cache.lost(0.0)
        for pod in pods:
            name = pod.metadata.name if pod.metadata else None
            node = pod.spec.nodeName if pod.spec else None
            if not name or name in deleted or node not in lost:
                continue
            deleted.add(name)
            log.warning("pod %s: its node %s is %s: deleted with grace 0", name, node, lost[node])
            with contextlib.suppress(httpx2.HTTPStatusError):
                await self._client().delete(Pod, name, namespace=self.namespace, grace_period=0)

    async def _delete_service(self, slot: str) -> None:
        service = self.cache.service(slot)
        labels = service.metadata.labels if service is not None and service.metadata else None
        if service is not None and owned(labels, slot, self.owner):
            with contextlib.suppress(httpx2.HTTPStatusError):
                await self._client().delete(Service, object_name(slot), namespace=self.namespace)
