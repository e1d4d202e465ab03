"""The kubernetes runtime: each slot's server is a Deployment ``slotctl-<slot>`` + a Service.

Sits beside :mod:`controller.runtime.docker` under the ``Runtime`` seam (``slotctl operator
--runtime kubernetes``, the default inside a pod); the slot manager is its only caller.
It talks to the API server through lightkube's typed async client (design record 0005):

* **objects** (their bodies: :mod:`~controller.runtime.kubernetes_spec`): one Deployment
  per slot (``replicas`` 1 while loaded, 0 once unloaded, strategy ``Recreate``) and one
  Service; an object with a slot's name but without slotctl's labels is reported
  (``Observed(managed=False)``) and never patched, scaled or deleted; a labelled
  Deployment that runs the same config is adopted;
* **readiness**: :meth:`start` returns once the pod runs and has an IP; the manager
  probes ``http://<pod IP>:<port>`` like any other server (:attr:`Observed.endpoint`);
* **memory**: :attr:`KubernetesRuntime.memory`, the admission's probe for ``NODE/DEVICE``
  keys (:mod:`~controller.runtime.kubernetes_nodes`).

``stop`` scales a running slot to 0 and waits for its pod to go — a terminating pod
(``deletionTimestamp`` set, its server still running within its grace period) counts as
still there; the kubelet sends SIGTERM and, after the pod's grace period, SIGKILL. Still
there after the stop's timeout + that grace: :class:`~controller.errors.SlotTerminateTimeout`
(nothing is force-deleted). A stop of a slot already at 0 with no pod left deletes the
Deployment and the Service (a slot nobody declares any more: the reconciler's orphan
sweep). A start that fails after it scaled the Deployment to 1 (the Service refused, a
crash-looping or unpullable container, an API error, a cancellation) scales it back to 0
before it raises. Slot names too long for a Service name are refused (``check_launch``).

**Ownership**: every Deployment and Service carries ``slotctl.owner`` (the operator's
identity: ``SLOTCTL_K8S_OWNER``, the chart sets the Helm release name; default
``slotctl``) in its metadata labels, not in its selector; only objects with this
runtime's owner are listed, adopted, scaled or deleted, so two releases in one namespace
leave each other's slots alone. API failures become typed errors:
:class:`~controller.errors.SlotSpawnFailed` from ``start``,
:class:`~controller.errors.DockerEngineError` (``runtime.engine_error``: the API said no)
or :class:`~controller.errors.DockerUnavailable` (``runtime.unavailable``: no API server)
from the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import httpx2
from lightkube import AsyncClient, ConfigError
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Node, Pod, Service
from lightkube.types import PatchType

from controller.errors import (
    DockerEngineError,
    DockerUnavailable,
    SlotctlError,
    SlotSpawnFailed,
    SlotTerminateTimeout,
)
from controller.runtime.base import (
    HASH_LABEL,
    MANAGED_LABEL,
    SLOT_LABEL,
    LaunchSpec,
    Observed,
    ProgressCallback,
    RunStatus,
    RuntimeKind,
)
from controller.runtime.kubernetes_nodes import GPU_RESOURCES, NodeMemory, NodeReading
from controller.runtime.kubernetes_spec import (
    CONTAINER,
    DEFAULT_OWNER,
    FIELD_MANAGER,
    OWNER_LABEL,
    api_reason,
    check_gpu_resource,
    check_launch,
    check_owner,
    deployment_body,
    object_name,
    observe,
    ours,
    owned,
    service_body,
    start_verdict,
    terminating,
    unschedulable,
    without_nulls,
)

__all__ = ["KubernetesRuntime"]

log = logging.getLogger("slotctl.runtime")

T = TypeVar("T")


class KubernetesRuntime:
    """Runtime for servers run as pods of per-slot Deployments (see module docstring)."""

    kind = RuntimeKind.KUBERNETES

    def __init__(
        self,
        client: AsyncClient | None = None,
        *,
        namespace: str | None = None,
        gpu_resource: str | None = None,
        owner: str | None = None,
        start_timeout_s: float = 900.0,
        unschedulable_s: float = 120.0,
        stop_grace_s: float = 10.0,
        termination_grace_s: float = 30.0,
        poll_s: float = 0.2,
        node_refresh_s: float = 15.0,
    ) -> None:
        """``client``: a lightkube ``AsyncClient`` (default: the in-cluster service account,
        else ``KUBECONFIG`` / ``~/.kube/config``, created on first use). ``namespace``: where
        the Deployments live (default ``SLOTCTL_K8S_NAMESPACE``, else the client's).
        ``gpu_resource``: the extended resource of a gpu slot whose node does not say
        (default ``SLOTCTL_K8S_GPU_RESOURCE`` or ``nvidia.com/gpu``). ``owner``: the
        ``slotctl.owner`` label value of this operator's objects (default
        ``SLOTCTL_K8S_OWNER``, else ``slotctl``). ``start_timeout_s``:
        how long a pod may take to run (image pull included); ``unschedulable_s``: how
        long it may stay unschedulable; ``termination_grace_s``: the pods' grace period
        between SIGTERM and SIGKILL; ``node_refresh_s``: how often node budgets are read.
        """
        self._api = client
        self._owns_client = client is None
        self._namespace = namespace or os.environ.get("SLOTCTL_K8S_NAMESPACE") or None
        self.gpu_resource = check_gpu_resource(
            gpu_resource or os.environ.get("SLOTCTL_K8S_GPU_RESOURCE") or GPU_RESOURCES[0]
        )
        self.owner = check_owner(owner or os.environ.get("SLOTCTL_K8S_OWNER") or DEFAULT_OWNER)
        self.start_timeout_s = start_timeout_s
        self.unschedulable_s = unschedulable_s
        self.stop_grace_s = stop_grace_s
        self.termination_grace_s = termination_grace_s
        self.poll_s = poll_s
        self.node_refresh_s = node_refresh_s
        self.memory = NodeMemory()
        self._locks: dict[str, asyncio.Lock] = {}
        self._nodes = NodeReading(self.refresh_nodes, node_refresh_s)

    # ------------------------------------------------------------------ API access

    @property
    def namespace(self) -> str:
        if self._namespace is None:
            self._namespace = str(self._client().namespace or "default")
        return self._namespace

    def _client(self) -> AsyncClient:
        if self._api is None:
            try:
                self._api = AsyncClient(field_manager=FIELD_MANAGER)
            except ConfigError as exc:
                raise DockerUnavailable(
                    f"no Kubernetes API configured (in-cluster service account, KUBECONFIG "
                    f"or ~/.kube/config): {exc}"
                ) from exc
        self._nodes.start()
        return self._api

    async def _call(self, op: str, slot: str | None, fn: Callable[[], Awaitable[T]]) -> T:
        """One API call; failures become typed errors (SlotSpawnFailed when starting)."""
        where = f" slot {slot!r}" if slot else ""
        try:
            await self._nodes_read()
            return await fn()
        except SlotctlError:
            raise
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError among them
            cls: type[SlotctlError] = SlotSpawnFailed if op == "start" else DockerEngineError
            raise cls(f"cannot {op}{where}: Kubernetes API: {api_reason(exc)}", slot=slot) from exc
        except (httpx2.HTTPError, OSError) as exc:
            cls = SlotSpawnFailed if op == "start" else DockerUnavailable
            raise cls(f"cannot {op}{where}: the Kubernetes API is unreachable ({exc})") from exc

    async def _get_deployment(self, slot: str) -> Deployment | None:
        try:
            return await self._client().get(Deployment, object_name(slot), namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError among them
            if exc.response.status_code == 404:
                return None
            raise

    async def _get_service(self, slot: str) -> Service | None:
        try:
            return await self._client().get(Service, object_name(slot), namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError among them
            if exc.response.status_code == 404:
                return None
            raise

    async def _pods(self, slot: str | None = None) -> list[Pod]:
        """Our pods (of ``slot``), terminating ones included (their server may still run:
        they count until they are gone); labels checked here as well (a server that
        filters by label selector, or one that does not)."""
        selector: dict[str, Any] = {MANAGED_LABEL: "true", **({SLOT_LABEL: slot} if slot else {})}
        pods = []
        async for pod in self._client().list(Pod, namespace=self.namespace, labels=selector):
            labels = (pod.metadata.labels if pod.metadata else None) or {}
            if labels.get(MANAGED_LABEL) != "true" or (slot and labels.get(SLOT_LABEL) != slot):
                continue
            pods.append(pod)
        return pods

    async def refresh_nodes(self) -> None:
        """Read every node's allocatable resources into :attr:`memory`."""
        nodes = [node async for node in self._client().list(Node)]
        self.memory.update(nodes)

    async def warm_up(self) -> None:
        """Read the nodes once before the first admission (the composition root's
        ``recover`` calls it); an unreachable API is logged and read again later."""
        try:
            await self._nodes_read()
        except SlotctlError as exc:
            log.warning("kubernetes runtime: %s", exc.message)

    async def _nodes_read(self) -> None:
        """The first reading of the nodes is done (admission needs their budgets)."""
        self._client()
        await self._nodes.first_read()

    async def close(self) -> None:
        await self._nodes.stop()
        if self._owns_client and self._api is not None:
            api, self._api = self._api, None
            await api.close()

    def _lock(self, slot: str) -> asyncio.Lock:
        return self._locks.setdefault(slot, asyncio.Lock())

    # ------------------------------------------------------------------ observing

    def _observe(self, slot: str, deployment: Deployment, pods: Sequence[Pod]) -> Observed:
        return observe(slot, deployment, pods, owner=self.owner, namespace=self.namespace)

    async def inspect(self, slot: str) -> Observed:
        async def look() -> Observed:
            deployment = await self._get_deployment(slot)
            if deployment is None:
                return Observed(slot=slot, status=RunStatus.MISSING)
            return self._observe(slot, deployment, await self._pods(slot))

        return await self._call("inspect", slot, look)

    async def list_managed(self) -> list[Observed]:
        async def look() -> list[Observed]:
            pods: dict[str, list[Pod]] = {}
            for pod in await self._pods():
                slot = ((pod.metadata.labels if pod.metadata else None) or {}).get(SLOT_LABEL, "")
                pods.setdefault(slot, []).append(pod)
            found = []
            selector: dict[str, Any] = {MANAGED_LABEL: "true", OWNER_LABEL: self.owner}
            async for dep in self._client().list(
                Deployment, namespace=self.namespace, labels=selector
            ):
                labels = (dep.metadata.labels if dep.metadata else None) or {}
                slot = labels.get(SLOT_LABEL, "")
                name = dep.metadata.name if dep.metadata else None
                if slot and name == object_name(slot) and owned(labels, slot, self.owner):
                    found.append(self._observe(slot, dep, pods.get(slot, [])))
            return sorted(found, key=lambda o: o.slot)

        return await self._call("list", None, look)

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        async def read() -> list[str]:
            pods = sorted(await self._pods(slot), key=terminating)  # the live one first
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
            return await self._call("read logs of", slot, read)
        except SlotctlError as exc:  # a pod not started yet has no log: nothing to show
            log.debug("logs of slot %s: %s", slot, exc.message)
            return []

    # ------------------------------------------------------------------ starting

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        return False  # the kubelet pulls the image while the pod starts

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        return None

    async def start(self, launch: LaunchSpec) -> Observed:
        check_launch(launch)
        async with self._lock(launch.slot):
            return await self._call("start", launch.slot, lambda: self._start(launch))

    async def _start(self, launch: LaunchSpec) -> Observed:
        slot, name = launch.slot, object_name(launch.slot)
        deployment = await self._get_deployment(slot)
        service = await self._get_service(slot)
        foreign = next((o for o in (deployment, service) if not ours(o, slot, self.owner)), None)
        if foreign is not None:
            raise SlotSpawnFailed(
                f"cannot start slot {slot!r}: an unmanaged {type(foreign).__name__} holds the "
                f"name {name} in {self.namespace}; slotctl never touches objects without "
                "its labels: remove or rename it",
                slot=slot,
            )
        exists = deployment is not None
        try:
            if deployment is not None:
                current = self._observe(slot, deployment, await self._pods(slot))
                if current.running and current.config_hash == launch.config_hash():
                    await self._ensure_service(launch, service)
                    return current  # adopted: the same config already runs
            body = deployment_body(
                launch,
                self.namespace,
                gpu_resource=self._gpu_resource(launch.node),
                termination_grace_s=math.ceil(self.termination_grace_s),
                owner=self.owner,
            )
            api = self._client()
            if deployment is None:
                await api.create(cast(Deployment, Deployment.from_dict(without_nulls(body))))
                exists = True
            else:
                await api.patch(
                    Deployment, name, body, namespace=self.namespace, patch_type=PatchType.MERGE
                )
            await self._ensure_service(launch, service)
            return await self._wait_running(launch)
        except BaseException:  # an API error, a refused start, a cancellation: re-raised
            if exists:
                await self._scale_down_after_failure(slot)
            raise

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
        if node is not None and node in self.memory.gpu_resources:
            return self.memory.gpu_resources[node]
        return self.gpu_resource

    async def _ensure_service(self, launch: LaunchSpec, service: Service | None) -> None:
        body = service_body(launch, self.namespace, self.owner)
        api = self._client()
        if service is None:
            await api.create(cast(Service, Service.from_dict(body)))
            return
        ports = [
            (p.port, p.targetPort) for p in (service.spec.ports if service.spec else None) or []
        ]
        if ports != [(launch.port, launch.port)]:
            await api.patch(
                Service,
                object_name(launch.slot),
                body,
                namespace=self.namespace,
                patch_type=PatchType.MERGE,
            )

    async def _wait_running(self, launch: LaunchSpec) -> Observed:
        """Until the pod of this config runs with an IP; the scheduler's or the kubelet's
        verdict when it cannot (unschedulable for too long, failed, a container in
        CrashLoopBackOff or unable to pull its image, timed out). The caller scales the
        Deployment back to 0 when this raises."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        unschedulable_since: float | None = None
        wanted = launch.config_hash()
        while True:
            deployment = await self._get_deployment(launch.slot)
            if deployment is None:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: its Deployment was deleted meanwhile",
                    slot=launch.slot,
                )
            pods = [
                p
                for p in await self._pods(launch.slot)
                if not terminating(p)
                and ((p.metadata.annotations if p.metadata else None) or {}).get(HASH_LABEL)
                == wanted
            ]
            observed = self._observe(launch.slot, deployment, pods)
            if observed.running and observed.endpoint:
                return observed
            now = loop.time()
            reason = next((r for r in map(unschedulable, pods) if r), None)
            if reason is None:
                unschedulable_since = None
            elif unschedulable_since is None:
                unschedulable_since = now
            elif now - unschedulable_since >= self.unschedulable_s:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: its pod stayed unschedulable for "
                    f"{self.unschedulable_s:g}s: {reason}",
                    slot=launch.slot,
                )
            verdict = start_verdict(pods)
            if verdict is not None:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: {verdict[0]}",
                    slot=launch.slot,
                    exit_code=verdict[1],
                )
            if now - began >= self.start_timeout_s:
                raise SlotSpawnFailed(
                    f"cannot start slot {launch.slot!r}: no running pod within "
                    f"{self.start_timeout_s:g}s ({observed.message})",
                    slot=launch.slot,
                )
            await asyncio.sleep(self.poll_s)

    async def _scale(self, slot: str, replicas: int) -> None:
        await self._client().patch(
            Deployment,
            object_name(slot),
            {"spec": {"replicas": replicas}},
            namespace=self.namespace,
            patch_type=PatchType.MERGE,
        )

    # ------------------------------------------------------------------ stopping

    async def stop(self, slot: str, timeout: float) -> Observed:
        async with self._lock(slot):
            return await self._call("stop", slot, lambda: self._stop(slot, timeout))

    async def _stop(self, slot: str, timeout: float) -> Observed:
        deployment = await self._get_deployment(slot)
        if deployment is None:
            await self._delete_service(slot)
            return Observed(slot=slot, status=RunStatus.MISSING)
        pods = await self._pods(slot)
        observed = self._observe(slot, deployment, pods)
        if not observed.managed:
            return observed  # reported, never touched
        replicas = (deployment.spec.replicas if deployment.spec else None) or 0
        if not replicas and not pods:
            # Already unloaded: a stop now is the cleanup of a slot nobody declares.
            api = self._client()
            with contextlib.suppress(httpx2.HTTPStatusError):
                await api.delete(Deployment, object_name(slot), namespace=self.namespace)
            await self._delete_service(slot)
            return Observed(slot=slot, status=RunStatus.EXITED, message="Deployment removed")
        if replicas:
            await self._scale(slot, 0)
        # The kubelet sends SIGTERM, then SIGKILL after the pod's grace period.
        wait = max(timeout, self.termination_grace_s) + self.stop_grace_s
        if not await self._pods_gone(slot, wait):
            raise SlotTerminateTimeout(
                f"slot {slot!r}: the pod of {object_name(slot)} is still there {wait:g}s "
                "after the Deployment was scaled to 0",
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

    async def _pods_gone(self, slot: str, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while await self._pods(slot):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self.poll_s)
        return True

    async def _delete_service(self, slot: str) -> None:
        service = await self._get_service(slot)
        labels = service.metadata.labels if service is not None and service.metadata else None
        if service is not None and owned(labels, slot, self.owner):
            with contextlib.suppress(httpx2.HTTPStatusError):
                await self._client().delete(Service, object_name(slot), namespace=self.namespace)
