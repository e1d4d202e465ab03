"""Leases: the router's whole surface — acquire (cold slots joined), release, hold.

A part of the manager (:mod:`controller.slots`), above :mod:`.loading`. A request takes a
lease: a cold slot is loaded first and concurrent cold requests join that one load (at
most ``max_queue`` wait); a waiter that gives up never cancels the load for the others,
and when the last one gives up the slot is unloaded once the load settles, unless
something else wants it. Leases hold the slot in ``serving`` and block unload and
eviction; a *hold* is a lease that expires by itself. The ``ready``↔``serving`` flips of
a request are coalesced and written off the event loop (:mod:`.table`, SPEC §3).
"""

from __future__ import annotations

import asyncio

from controller.decision import not_activated
from controller.errors import SlotctlError, SlotNotReady, SlotQueueFull
from controller.events import EventKind, Op
from controller.lifecycle import SlotState, can_dispatch
from controller.slots.core import Core, Part
from controller.slots.loading import Loading
from controller.slots.records import Lease, SlotRecord

__all__ = ["Leases"]

S = SlotState


class Leases(Part):
    def __init__(self, core: Core, loading: Loading) -> None:
        super().__init__(core)
        self.loading = loading

    async def acquire(self, name: str) -> Lease:
        """A lease for one request; cold slots are loaded (joined) first.

        A request that arrives while the slot drains for an unload gets no lease on the
        draining server: it waits, and a fresh load serves it once the unload is done.
        Raises ``SlotQueueFull`` beyond ``max_queue`` cold waiters, ``SlotNotReady`` when
        the server lists no model, and the load's typed error.
        """
        slot = self.table.get(name)
        if not self.loading.loaded(slot) or slot.draining:
            await self._wait_cold(slot)
        return self._take_now(slot)

    def try_acquire(self, name: str) -> Lease | None:
        """:meth:`acquire` when it needs no wait (the router's common case: no task, no
        await); None when the slot is cold or draining, for which :meth:`acquire` waits."""
        slot = self.table.get(name)
        if not self.loading.loaded(slot) or slot.draining:
            return None
        return self._take_now(slot)

    def _take_now(self, slot: SlotRecord) -> Lease:
        if slot.draining or slot.state is S.UNLOADING:
            raise SlotNotReady(f"slot {slot.name!r} is unloading", slot=slot.name)
        if not can_dispatch(slot.state, slot.idle_reason):
            raise SlotNotReady(
                f"slot {slot.name!r} is up but serves no model ({slot.message})", slot=slot.name
            )
        return self._take(slot)

    async def _wait_cold(self, slot: SlotRecord) -> None:
        if slot.waiters >= slot.spec.max_queue:
            error = SlotQueueFull(
                f"{slot.waiters} requests already wait for slot {slot.name!r} "
                f"(max_queue={slot.spec.max_queue})",
                retry_after_s=1.0,
                slot=slot.name,
            )
            raise self.table.refuse(slot, Op.LEASE, error)
        if not slot.spec.activated:
            raise self.table.refuse(slot, Op.LOAD, not_activated(slot.name))
        slot.waiters += 1
        try:
            await self.loading.ensure_loaded(slot)
        except asyncio.CancelledError:
            slot.waiters -= 1
            self._after_waiter_cancel(slot)
            raise
        except BaseException:
            slot.waiters -= 1
            raise
        slot.waiters -= 1

    def _take(self, slot: SlotRecord, expires_at: float | None = None) -> Lease:
        if slot.state in (S.READY, S.IDLE):
            # ready -> serving is a coalesced flip (SPEC §3: written off the loop, a moment
            # later); idle -> serving is durable like every other transition (a refused
            # write refuses the request, typed, and takes no lease).
            durable = slot.state is S.IDLE
            message = "request in flight"
            self.table.set(slot, S.SERVING, op=Op.LEASE, message=message, durable=durable)
        lease = Lease(slot.name, slot.generation, expires_at)
        slot.leases[lease.id] = lease
        slot.last_used = self.clock.monotonic()
        slot.access += 1
        return lease

    def release(self, lease: Lease) -> None:
        """Idempotent. The last lease returns the slot to ``ready``."""
        if lease.released:
            return
        lease.released = True
        slot = self.table.records.get(lease.slot)
        if slot is None or slot.leases.pop(lease.id, None) is None:
            return  # revoked or from a previous generation: nothing to undo
        slot.last_used = self.clock.monotonic()
        slot.access += 1
        if lease.expires_at is None:  # a request (a batch hold has an expiry)
            slot.requests += 1
        if not slot.leases and slot.state is S.SERVING:
            message = "no request in flight"  # ready (not idle: that is idle_timeout_s later)
            self.table.set(slot, S.READY, op=Op.LEASE, message=message, durable=False)

    async def hold(self, name: str, ttl_s: float) -> Lease:
        """A batch lease: keeps the slot loaded and unevictable for ``ttl_s`` seconds."""
        lease = await self.acquire(name)
        lease.expires_at = self.clock.monotonic() + ttl_s
        self.events.emit(
            EventKind.LEASE,
            Op.LEASE,
            slot=name,
            message=f"held for {ttl_s:g}s",
            details={"lease": lease.id, "ttl_s": ttl_s},
        )
        return lease

    def expire_holds(self, slot: SlotRecord, now: float) -> None:
        for lease in list(slot.leases.values()):
            if lease.expires_at is not None and now >= lease.expires_at:
                self.release(lease)
                self.events.emit(
                    EventKind.LEASE,
                    Op.LEASE,
                    slot=slot.name,
                    message="batch lease expired",
                    details={"lease": lease.id},
                )

    def wanted(self, slot: SlotRecord) -> bool:
        autoload = bool(slot.spec.autoload)
        return self.wishes.keeps_loaded(slot.name, autoload) or slot.wanted > 0

    def _after_waiter_cancel(self, slot: SlotRecord) -> None:
        """The last cold waiter left: unload once the load settles, if nobody wants it."""
        task = slot.load_task
        if slot.waiters or slot.leases or self.wanted(slot) or task is None or task.done():
            return
        self.tasks.spawn(self.cleanup_after(slot, task), f"cleanup:{slot.name}")

    async def cleanup_after(self, slot: SlotRecord, task: asyncio.Task[int]) -> None:
        try:
            gen = await asyncio.shield(task)
        except (SlotctlError, asyncio.CancelledError):
            return  # the load failed: nothing to unload
        if slot.waiters or slot.leases or self.wanted(slot) or slot.generation != gen:
            return  # wanted again, or a newer load replaced it: not ours to unload
        if self.table.records.get(slot.name) is slot and self.loading.loaded(slot):
            await self.loading.unloading.unload(
                slot.name,
                force=True,
                clear_residency=False,
                reason="every waiter cancelled before the load finished",
            )
