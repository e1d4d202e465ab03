"""The kubernetes runtime's access to the API server: the client, the namespace, the caches
its reads come from, the typed errors its calls fail with, and its writes (server-side
apply with the field manager ``slotctl``).

The base of :class:`controller.runtime.kubernetes.runtime.KubernetesRuntime` (its settings live
here too: they are the knobs of this access as much as of the runtime). Reads come from
:class:`~controller.runtime.kubernetes.cache.ClusterCache` (listed and watched once, made
on first use); the one read of the API itself is :meth:`KubernetesApi._confirmed`, the
check before a write that an object the cache does not have is not someone else's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx2
from lightkube import AsyncClient, ConfigError
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Service
from lightkube.types import PatchType

from controller.model.errors import (
    DockerEngineError,
    DockerUnavailable,
    SlotctlError,
    SlotSpawnFailed,
)
from controller.runtime.base import own_image
from controller.runtime.kubernetes.cache import ClusterCache
from controller.runtime.kubernetes.drift import Drift
from controller.runtime.kubernetes.nodes import GPU_RESOURCES, NodeMemory
from controller.runtime.kubernetes.spec import (
    DEFAULT_OWNER,
    FIELD_MANAGER,
    ModelCache,
    api_reason,
    check_gpu_resource,
    check_owner,
    instance_name,
    object_name,
    without_nulls,
)

__all__ = ["KubernetesApi"]

log = logging.getLogger("slotctl.runtime")

T = TypeVar("T")


def _env_s(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


class KubernetesApi:
    """See the module docstring."""

    def __init__(
        self,
        client: AsyncClient | None = None,
        *,
        namespace: str | None = None,
        gpu_resource: str | None = None,
        owner: str | None = None,
        start_timeout_s: float = 900.0,
        unschedulable_s: float | None = None,
        stop_grace_s: float = 10.0,
        termination_grace_s: float = 30.0,
        node_lost_s: float | None = None,
        sync_timeout_s: float = 10.0,
        model_cache: ModelCache | None = None,
    ) -> None:
        """``client``: a lightkube ``AsyncClient`` (default: the in-cluster service account,
        else ``KUBECONFIG`` / ``~/.kube/config``, created on first use). ``namespace``: where
        the Deployments live (default ``SLOTCTL_K8S_NAMESPACE``, else the client's).
        ``gpu_resource``: the extended resource of a gpu slot whose node does not say
        (default ``SLOTCTL_K8S_GPU_RESOURCE`` or ``nvidia.com/gpu``). ``owner``: the
        ``slotctl.owner`` label value of this operator's objects (default
        ``SLOTCTL_K8S_OWNER``, else ``slotctl``). ``start_timeout_s``: how long a pod may
        take to run (image pull included); ``unschedulable_s``: how long it may stay
        Pending, unschedulable (``SLOTCTL_K8S_PENDING_S``, default 120);
        ``termination_grace_s``: the pods' grace period between SIGTERM and SIGKILL;
        ``node_lost_s``: how long a node may be not ready before its slots move
        (``SLOTCTL_K8S_NODE_LOST_S``, default 30); ``sync_timeout_s``: how long a call
        waits for the caches' first listing. ``model_cache``: where pods pull model files
        (``SLOTCTL_K8S_MODEL_CACHE``: ``pvc:NAME`` or a node's directory, default
        ``/var/lib/slotctl/models``), with the image that pulls (``SLOTCTL_K8S_IMAGE``,
        the operator's own; default ``slotctl:VERSION``) and a Secret holding a hub token
        (``SLOTCTL_K8S_HF_TOKEN_SECRET``, key ``token``).
        """
        self._api = client
        self._owns_client = client is None
        self._namespace = namespace or os.environ.get("SLOTCTL_K8S_NAMESPACE") or None
        self.gpu_resource = check_gpu_resource(
            gpu_resource or os.environ.get("SLOTCTL_K8S_GPU_RESOURCE") or GPU_RESOURCES[0]
        )
        self.owner = check_owner(owner or os.environ.get("SLOTCTL_K8S_OWNER") or DEFAULT_OWNER)
        self.start_timeout_s = start_timeout_s
        self.unschedulable_s = (
            unschedulable_s if unschedulable_s is not None else _env_s("SLOTCTL_K8S_PENDING_S", 120)
        )
        self.stop_grace_s = stop_grace_s
        self.termination_grace_s = termination_grace_s
        self.node_lost_s = (
            node_lost_s if node_lost_s is not None else _env_s("SLOTCTL_K8S_NODE_LOST_S", 30)
        )
        self.sync_timeout_s = sync_timeout_s
        self.model_cache = model_cache or ModelCache.parse(
            os.environ.get("SLOTCTL_K8S_MODEL_CACHE"),
            own_image(),
            os.environ.get("SLOTCTL_K8S_HF_TOKEN_SECRET") or None,
        )
        self.memory = NodeMemory()
        self._cache: ClusterCache | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._note: Callable[[str, str], None] | None = None
        self._changed: Callable[[str], None] | None = None
        self.drift = Drift(self.apply, self.lock, lambda slot: self.cache.deployment(slot))

    # ------------------------------------------------------------------ API access

    @property
    def namespace(self) -> str:
        if self._namespace is None:
            self._namespace = str(self._client().namespace or "default")
        return self._namespace

    def client(self) -> AsyncClient:
        """The API client (made on first use): for the runtime's other writers (its
        InferencePools)."""
        return self._client()

    def _client(self) -> AsyncClient:
        if self._api is None:
            try:
                self._api = AsyncClient(field_manager=FIELD_MANAGER)
            except ConfigError as exc:
                raise DockerUnavailable(
                    f"no Kubernetes API configured (in-cluster service account, KUBECONFIG "
                    f"or ~/.kube/config): {exc}"
                ) from exc
        return self._api

    @property
    def cache(self) -> ClusterCache:
        """The caches (made, and their watches started, on first use)."""
        if self._cache is None:
            cache = ClusterCache(self._client, self.namespace, self.memory)
            cache.on_slot = self._on_slot
            cache.on_deployment = self.drift.seen
            self._cache = cache
        self._cache.start()
        return self._cache

    def subscribe(self, changed: Callable[[str], None], note: Callable[[str, str], None]) -> None:
        """The manager's hooks: ``changed(slot)`` when a slot's objects change (its server
        may have), ``note(slot, words)`` for what a start waits for (a Pending pod)."""
        self._changed, self._note = changed, note

    def _on_slot(self, slot: str) -> None:
        if self._changed is not None:
            self._changed(slot)

    async def _ready(self) -> ClusterCache:
        cache = self.cache
        if not cache.ready and not await cache.synced(self.sync_timeout_s):
            raise DockerUnavailable(
                f"the Kubernetes API gave no listing within {self.sync_timeout_s:g}s "
                "(nodes, pods, deployments, services)"
            )
        return cache

    async def call(self, op: str, slot: str | None, fn: Callable[[], Awaitable[T]]) -> T:
        """One operation; failures become typed errors (SlotSpawnFailed when starting)."""
        where = f" slot {slot!r}" if slot else ""
        try:
            await self._ready()
            return await fn()
        except SlotctlError as exc:
            if op == "start" and not isinstance(exc, SlotSpawnFailed):
                raise SlotSpawnFailed(f"cannot start{where}: {exc.message}", slot=slot) from exc
            raise
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError among them
            cls: type[SlotctlError] = SlotSpawnFailed if op == "start" else DockerEngineError
            raise cls(f"cannot {op}{where}: Kubernetes API: {api_reason(exc)}", slot=slot) from exc
        except (httpx2.HTTPError, OSError) as exc:
            cls = SlotSpawnFailed if op == "start" else DockerUnavailable
            raise cls(f"cannot {op}{where}: the Kubernetes API is unreachable ({exc})") from exc

    async def warm_up(self) -> None:
        """List the cluster once before the first admission (the composition root's
        ``recover`` calls it); an unreachable API is logged and listed again later."""
        try:
            await self._ready()
        except SlotctlError as exc:
            log.warning("kubernetes runtime: %s", exc.message)

    async def close(self) -> None:
        await self.drift.close()
        if self._cache is not None:
            await self._cache.stop()
        if self._owns_client and self._api is not None:
            api, self._api = self._api, None
            await api.close()

    def lock(self, slot: str) -> asyncio.Lock:
        return self._locks.setdefault(slot, asyncio.Lock())

    async def apply(self, body: dict[str, Any]) -> None:
        """Server-side apply of one of our objects (created if missing)."""
        res = Deployment if body["kind"] == "Deployment" else Service
        await self._client().patch(
            res,
            body["metadata"]["name"],
            without_nulls(body),
            namespace=self.namespace,
            patch_type=PatchType.APPLY,
            field_manager=FIELD_MANAGER,
            force=True,
        )

    async def confirmed(
        self, res: type[Deployment] | type[Service], slot: str, instance: str | None = None
    ) -> Any:
        """The cached object, or (the cache says there is none) the API's answer: a
        server-side apply must never take over an object created a moment ago by someone
        else, which the cache may not have seen yet."""
        cache = self.cache
        if instance is None:
            instance = cache.serving(slot) if res is Deployment else "0"
        cached = cache.instance(slot, instance) if res is Deployment else cache.service(slot)
        if cached is not None:
            return cached
        name = instance_name(slot, instance) if res is Deployment else object_name(slot)
        try:
            return await self._client().get(res, name, namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError among them
            if exc.response.status_code == 404:
                return None
            raise
