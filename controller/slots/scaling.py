"""Demand scaling of replicas, carried out: each slot with room between ``min_replicas``
and ``max_replicas`` looked at every housekeeping tick, the pure decision
(:func:`controller.scheduling.scaling.decide_scale`) taken over the router's own counters
(each replica's leases in flight and requests waiting), and acted on inside admission.

A part of the manager (:mod:`controller.slots`). Up: the replica's load is a
*background* load (:meth:`Loading.load` with ``background=True``): admission places it
without evicting anything of higher priority (or anything a background load may not
touch), and a load that does not fit waits for memory like any background load; it runs
as a task, so the tick never waits for it. Down: the replica is evicted when it has no
request in flight (revalidated: :meth:`Unloading.evict_one`), its memory given back.
Each decision is an event (``scale``) with its reason; a refused scale-up says why too.
"""

from __future__ import annotations

import logging

from controller.model.errors import SlotctlError
from controller.model.events import EventKind, EvictionReason, Op
from controller.model.lifecycle import SlotState
from controller.scheduling.scaling import ReplicaFigures, ScaleMemory, decide_scale
from controller.slots.core import Core, Part
from controller.slots.loading import Loading
from controller.slots.records import SlotRecord

__all__ = ["Scaling"]

log = logging.getLogger("slotctl.manager")

S = SlotState
_COMING = frozenset({S.PULLING, S.STARTING, S.WARMING})


class Scaling(Part):
    def __init__(self, core: Core, loading: Loading) -> None:
        super().__init__(core)
        self.loading = loading
        self.windows: dict[str, ScaleMemory] = {}  # per slot with replicas

    def groups(self) -> dict[str, list[SlotRecord]]:
        """The slots with replicas (their minimum follows a slot loaded on demand; between
        min and max they scale by demand), their replicas in index order."""
        out: dict[str, list[SlotRecord]] = {}
        for slot in self.table:
            spec = slot.spec
            if spec.replica_group and spec.activated:
                out.setdefault(spec.replica_group, []).append(slot)
        for members in out.values():
            members.sort(key=lambda s: s.spec.replica_index)
        return out

    @staticmethod
    def figures(slot: SlotRecord) -> ReplicaFigures:
        book = slot.book
        return ReplicaFigures(
            name=slot.name,
            index=slot.spec.replica_index,
            running=Loading.loaded(slot),
            # coming up, or its load waits for memory (retried when memory comes back)
            coming=slot.state in _COMING or slot.waking or slot.waiting is not None,
            in_flight=book.in_flight,
            waiting=book.queued + book.waiters,
            concurrency=slot.spec.max_concurrency,
            offline=slot.state is S.OFFLINE,
        )

    async def tick(self) -> None:
        """Look at every scaling group once; act on what the decision says."""
        now = self.clock.monotonic()
        groups = self.groups()
        for gone in set(self.windows) - set(groups):
            del self.windows[gone]
        for group, members in groups.items():
            base = next((m for m in members if m.spec.replica_index == 0), members[0])
            spec = base.spec
            decision = decide_scale(
                [self.figures(m) for m in members],
                self.windows.get(group, ScaleMemory()),
                now,
                min_count=spec.min_count,
                max_count=spec.max_count,
                up_after_s=spec.scale_up_after_s,
                down_after_s=spec.scale_down_after_s,
            )
            self.windows[group] = decision.memory
            if decision.action == "hold":
                continue
            target = self.table.records.get(decision.replica)
            if target is None:
                continue
            # a removal revalidated first (it got busy: looked at again after the window)
            if decision.action == "down" and not await self._down(target, decision.reason):
                continue
            self.events.emit(
                EventKind.SCALE,
                Op.SCALE,
                slot=target.name,
                model=target.model_id or None,
                message=decision.reason,
                details={"action": decision.action, "replica": target.name, "slot": group},
            )
            if decision.action == "up":
                self.tasks.spawn(self._up(target, decision.reason), f"scale-up:{target.name}")

    async def _up(self, slot: SlotRecord, reason: str) -> None:
        try:
            await self.loading.load(slot, resident=False, background=True)
        except SlotctlError as exc:  # refused by admission (no room without evicting
            # what it may not): said as an event, looked at again after the window
            self.events.emit(
                EventKind.SCALE,
                Op.SCALE,
                slot=slot.name,
                message=f"scale-up of {slot.name} not admitted: {exc.message}",
                error=exc.code,
                details={"action": "refused", "replica": slot.name},
            )

    async def _down(self, slot: SlotRecord, reason: str) -> bool:
        done = await self.loading.unloading.evict_one(
            slot, f"scale down: {reason}", reason=EvictionReason.SCALE_DOWN
        )
        if not done:
            log.info("scale down of %s deferred: it got busy", slot.name)
        return done
