"""The kubernetes runtime's InferencePools (:mod:`~controller.runtime.kubernetes.poolspec`
says what they are): told what each should be (:meth:`InferencePools.keep`), it writes
only what changed.

* a pool is written with server-side apply (field manager ``slotctl``) when its want
  differs from what this operator last wrote, and deleted once no model wants it; the
  first pass lists the release namespace's pools of this owner (``slotctl.managed``,
  ``slotctl.owner`` labels) so an earlier run's are known too;
* a slot's pod carries ``slotctl.pool=<pool>`` while the slot is Ready (a JSON merge
  patch of its labels; taken off the same way), read from the runtime's pod cache: a
  pass sends nothing for a pod already labelled as it should be, nor again for one
  patched a moment ago whose watch event has not come yet (until
  :data:`PATCH_TRUST_S`).

At rest nothing is sent. RBAC: ``list``/``create``/``patch``/``delete`` on
``inferencepools`` (group ``inference.networking.k8s.io``) and ``patch`` on ``pods``, in
the release namespace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Final

import httpx2
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from controller.runtime.base import MANAGED_LABEL
from controller.runtime.kubernetes.api import KubernetesApi
from controller.runtime.kubernetes.poolspec import (
    POOL_GROUP,
    POOL_KIND,
    POOL_LABEL,
    POOL_PLURAL,
    POOL_VERSION,
    Picker,
    PoolWant,
    pod_pools,
    pool_body,
)
from controller.runtime.kubernetes.spec import (
    FIELD_MANAGER,
    OWNER_LABEL,
    ours,
    terminating,
    without_nulls,
)

__all__ = ["InferencePool", "InferencePools"]

log = logging.getLogger("slotctl.runtime")

InferencePool = create_namespaced_resource(POOL_GROUP, POOL_VERSION, POOL_KIND, POOL_PLURAL)
PATCH_TRUST_S: Final = 30.0  # a pod label patched, not seen in the cache by then: again


class InferencePools:
    """One per operator (``--inference-pools``): see the module docstring."""

    def __init__(self, api: KubernetesApi, picker: Picker | None = None) -> None:
        self.api = api
        self.picker = picker
        # pool -> the (model, ports) last written (its body; None: not listed yet)
        self._written: dict[str, tuple[str, tuple[int, ...]] | None] | None = None
        self._labelled: dict[str, tuple[str | None, float]] = {}  # pod -> (sent, when)
        self.requests = 0  # what the passes sent (tests, the bench)

    async def keep(self, wants: Mapping[str, PoolWant]) -> None:
        """Bring the pools and their pods' labels to ``wants`` (pool name -> want)."""
        client = self.api.client()
        namespace = self.api.namespace
        if self._written is None:
            selector: dict[str, Any] = {MANAGED_LABEL: "true", OWNER_LABEL: self.api.owner}
            self.requests += 1
            self._written = {
                obj.metadata.name: None  # an earlier run's: rewritten, or deleted
                async for obj in client.list(InferencePool, namespace=namespace, labels=selector)
                # the selector again (an emulator may not filter): never another owner's
                if obj.metadata is not None
                and obj.metadata.name
                and (obj.metadata.labels or {}).items() >= selector.items()
            }
        written = self._written
        for name, want in wants.items():
            if written.get(name) == (want.model, want.ports):
                continue  # its pods' labels say who is Ready: the body is the same
            body = pool_body(name, want, namespace, self.api.owner, self.picker)
            self.requests += 1
            await client.patch(
                InferencePool,
                name,
                without_nulls(body),
                namespace=namespace,
                patch_type=PatchType.APPLY,
                field_manager=FIELD_MANAGER,
                force=True,
            )
            if name not in written:
                log.info("inference pool %s: for model %s", name, want.model)
            written[name] = (want.model, want.ports)
        for name in [n for n in written if n not in wants]:
            self.requests += 1
            try:
                await client.delete(InferencePool, name, namespace=namespace)
            except httpx2.HTTPStatusError as exc:
                if exc.response.status_code != 404:
                    raise
            log.info("inference pool %s: deleted (its model has no slot)", name)
            del written[name]
        await self._label_pods(pod_pools(wants))

    async def _label_pods(self, pools: Mapping[str, str]) -> None:
        cache = self.api.cache
        now = time.monotonic()
        seen: set[str] = set()
        for slot in sorted(cache.by_slot):
            deployment = cache.deployment(slot)
            if deployment is None or not ours(deployment, slot, self.api.owner):
                continue  # another owner's slot (two releases in one namespace)
            for pod in cache.serving_pods(slot):
                meta = pod.metadata
                if meta is None or not meta.name or terminating(pod):
                    continue
                seen.add(meta.name)
                labels = meta.labels or {}
                wanted = pools.get(slot) if _running(pod) else None
                if labels.get(POOL_LABEL) == wanted:
                    self._labelled.pop(meta.name, None)
                    continue
                sent = self._labelled.get(meta.name)
                if sent is not None and sent[0] == wanted and now - sent[1] < PATCH_TRUST_S:
                    continue  # patched a moment ago: its watch event is on its way
                patch: dict[str, Any] = {"metadata": {"labels": {POOL_LABEL: wanted}}}
                self.requests += 1
                try:
                    await self.api.client().patch(
                        Pod,
                        meta.name,
                        patch,
                        namespace=self.api.namespace,
                        patch_type=PatchType.MERGE,
                    )
                except httpx2.HTTPStatusError as exc:
                    if exc.response.status_code != 404:  # gone meanwhile
                        raise
                self._labelled[meta.name] = (wanted, now)
        for name in [n for n in self._labelled if n not in seen]:
            del self._labelled[name]


def _running(pod: Pod) -> bool:
    status = pod.status
    return bool(status and status.phase == "Running" and status.podIP)
