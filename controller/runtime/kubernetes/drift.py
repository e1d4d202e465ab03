"""Drift: what the kubernetes runtime wants each Deployment to be, put back when changed.

Sits under :mod:`controller.runtime.kubernetes.runtime`. The runtime records the body it applies
(:meth:`Drift.intend`); every event of the Deployment (:meth:`Drift.seen`, from the
cache) is compared with it on the fields slotctl owns (:func:`drifted`: the replica
count, its labels and annotations, the pod template's config hash). A difference — a
user's ``kubectl scale --replicas=0``, a label edited — is put back by applying the
body again (server-side apply, forced), a moment later and under the slot's lock, so a
burst of events is one repair; when something keeps changing it, the repairs back off
(1 s doubling to 5 min). A Deployment whose ownership labels were removed is no longer
slotctl's and is left alone. Fields slotctl does not set (another label, an annotation
of a tool) are never touched: server-side apply leaves them to their manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from lightkube.resources.apps_v1 import Deployment

from controller.runtime.base import HASH_LABEL, MANAGED_LABEL, SLOT_LABEL
from controller.runtime.kubernetes.spec import OWNER_LABEL

__all__ = ["Drift", "drifted"]

log = logging.getLogger("slotctl.runtime")

FIRST_S: Final = 1.0
CAP_S: Final = 300.0
QUIET_S: Final = 60.0  # no drift for this long: the backoff starts over
_OWNERSHIP: Final = (MANAGED_LABEL, SLOT_LABEL, OWNER_LABEL)


def _differs(want: Mapping[str, Any], have: Mapping[str, Any] | None, what: str) -> list[str]:
    have = have or {}
    return [f"{what} {k}={have.get(k)!r} (want {v!r})" for k, v in want.items() if have.get(k) != v]


def drifted(intent: Mapping[str, Any], deployment: Deployment) -> list[str]:
    """What of ``intent`` (a Deployment body) ``deployment`` differs in (pure): the
    replica count, slotctl's labels and annotations, the pod template's config hash."""
    meta, spec = deployment.metadata, deployment.spec
    want_spec = intent["spec"]
    out = []
    have = spec.replicas if spec else None
    if have != want_spec["replicas"]:
        out.append(f"replicas {have} (want {want_spec['replicas']})")
    out += _differs(intent["metadata"]["labels"], meta.labels if meta else None, "label")
    out += _differs(
        intent["metadata"]["annotations"], meta.annotations if meta else None, "annotation"
    )
    template = spec.template.metadata if spec and spec.template else None
    wanted = want_spec["template"]["metadata"]["annotations"].get(HASH_LABEL)
    got = (template.annotations or {}).get(HASH_LABEL) if template else None
    if got != wanted:
        out.append(f"pod template {HASH_LABEL}={got!r} (want {wanted!r})")
    return out


class Drift:
    """See the module docstring. ``apply`` writes a body; ``lock(slot)`` is the runtime's
    per-slot lock; ``current(slot)`` the cached Deployment."""

    def __init__(
        self,
        apply: Callable[[dict[str, Any]], Awaitable[None]],
        lock: Callable[[str], asyncio.Lock],
        current: Callable[[str], Deployment | None],
    ) -> None:
        self._apply, self._lock, self._current = apply, lock, current
        self.intents: dict[str, dict[str, Any]] = {}
        self.repaired = 0  # repairs done (tests and the bench read it)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._backoff: dict[str, tuple[float, float]] = {}  # slot -> (delay, last repair)

    def intend(self, slot: str, body: dict[str, Any]) -> None:
        self.intents[slot] = copy.deepcopy(body)

    def rescale(self, slot: str, replicas: int) -> dict[str, Any] | None:
        """The intended body with ``replicas`` (now the intent), or None: none known."""
        body = self.intents.get(slot)
        if body is not None:
            body["spec"]["replicas"] = replicas
        return body

    def forget(self, slot: str) -> None:
        self.intents.pop(slot, None)
        task = self._tasks.pop(slot, None)
        if task is not None:
            task.cancel()

    def seen(self, slot: str, deployment: Deployment | None) -> None:
        """A Deployment event: schedule a repair when it drifted from the intent."""
        intent = self.intents.get(slot)
        if intent is None or deployment is None or not self._ours(intent, deployment):
            return
        if not drifted(intent, deployment) or self._lock(slot).locked():
            return  # in sync, or the runtime is writing it right now
        task = self._tasks.get(slot)
        if task is None or task.done():
            self._tasks[slot] = asyncio.get_running_loop().create_task(
                self._repair(slot), name=f"slotctl-drift-{slot}"
            )

    @staticmethod
    def _ours(intent: Mapping[str, Any], deployment: Deployment) -> bool:
        labels = (deployment.metadata.labels if deployment.metadata else None) or {}
        want = intent["metadata"]["labels"]
        return all(labels.get(k) == want.get(k) for k in _OWNERSHIP)

    async def _repair(self, slot: str) -> None:
        now = time.monotonic()
        delay, last = self._backoff.get(slot, (FIRST_S, 0.0))
        if now - last > QUIET_S:
            delay = FIRST_S
        await asyncio.sleep(delay)
        async with self._lock(slot):
            intent, deployment = self.intents.get(slot), self._current(slot)
            if intent is None or deployment is None or not self._ours(intent, deployment):
                return
            what = drifted(intent, deployment)
            if not what:
                return
            log.warning(
                "slot %s: Deployment changed outside slotctl (%s): put back",
                slot,
                "; ".join(what),
            )
            try:
                await self._apply(intent)
            except Exception as exc:  # noqa: BLE001  (the next event tries again)
                log.warning("slot %s: putting its Deployment back failed: %s", slot, exc)
            self.repaired += 1
            self._backoff[slot] = (min(delay * 2, CAP_S), time.monotonic())

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
