"""Leases: the router's whole surface — acquire (cold slots joined), release, hold.

A part of the manager (:mod:`controller.slots`), above :mod:`.loading`. A request takes a
lease: a cold slot is loaded first and concurrent cold requests join that one load (at
most ``max_queue`` wait); a waiter that gives up never cancels the load for the others,
and when the last one gives up the slot is unloaded once the load settles, unless
something else wants it. Leases hold the slot in ``serving`` and block unload and
eviction; a *hold* is a lease that expires by itself. The ``ready``↔``serving`` flips of
a request are coalesced and written off the event loop (:mod:`.table`, SPEC §3).

A slot with ``max_concurrency`` takes that many requests at once; the others wait for
their *turn* in the slot's fair queue (:mod:`controller.scheduling.fairqueue`: by the requester's
priority class, round-robin between keys, aging), each granted as a request ends. A
waiter whose turn comes while the slot is not dispatchable (it was unloaded, it crashed)
starts again from the top: a cold wait, a load.
"""

from __future__ import annotations

import asyncio
import contextlib

from controller.model.errors import SlotctlError, SlotNotReady, SlotQueueFull
from controller.model.events import EventKind, Op
from controller.model.lifecycle import SlotState, can_dispatch
from controller.scheduling.decision import not_activated
from controller.scheduling.fairqueue import ClassSpec, FairQueue, Waiter
from controller.slots.core import Core, Part
from controller.slots.loading import Loading
from controller.slots.records import Lease, Requester, SlotRecord

__all__ = ["Leases"]

S = SlotState


class Leases(Part):
    def __init__(self, core: Core, loading: Loading) -> None:
        super().__init__(core)
        self.loading = loading

    async def acquire(self, name: str, who: Requester | None = None) -> Lease:
        """A lease for one request; cold slots are loaded (joined) first, and a slot at its
        ``max_concurrency`` is waited for, in turn (``who``'s class and key; the turns of
        a cold slot's waiters are taken in that order once it is loaded).

        A request that arrives while the slot drains for an unload gets no lease on the
        draining server: it waits, and a fresh load serves it once the unload is done.
        Raises ``SlotQueueFull`` beyond ``max_queue`` waiters (or its class's
        ``queue_limit``), ``SlotNotReady`` when the server lists no model, and the load's
        typed error.
        """
        slot = self.table.get(name)
        while True:
            ready = self.loading.loaded(slot) and not slot.draining
            if ready and self._has_room(slot):
                return self._take_now(slot, who)
            if slot.spec.max_concurrency is None:  # no turns: join the load, then take one
                await self._wait_cold(slot, who)
                return self._take_now(slot, who)
            lease = await self._wait_turn(slot, who or Requester())
            if lease is not None:
                return lease
            slot = self.table.get(name)  # its turn came while it was not dispatchable

    def try_acquire(self, name: str, who: Requester | None = None) -> Lease | None:
        """:meth:`acquire` when it needs no wait (the router's common case: no task, no
        await); None when the slot is cold, draining or at its concurrency limit, for which
        :meth:`acquire` waits."""
        slot = self.table.get(name)
        if not self.loading.loaded(slot) or slot.draining or not self._has_room(slot):
            return None
        return self._take_now(slot, who)

    @staticmethod
    def _has_room(slot: SlotRecord) -> bool:
        """Room for one more request now (nobody waiting for a turn ahead of it)."""
        limit = slot.spec.max_concurrency
        return limit is None or (slot.in_flight < limit and not slot.queued)

    async def _wait_turn(self, slot: SlotRecord, who: Requester) -> Lease | None:
        """Wait in the slot's fair queue (loading it first when it is cold); the lease when
        its turn comes (None: its turn came while the slot could not serve: start over)."""
        turns = self._turns(slot)
        cls = self.settings.priority_class(who.cls).name
        if cls not in turns.classes:  # the classes changed while others wait: the first
            cls = next(iter(turns.classes))
        if slot.waiters + len(turns) >= slot.spec.max_queue:
            raise self._full(slot, f"(max_queue={slot.spec.max_queue})")
        if not slot.spec.activated:
            raise self.table.refuse(slot, Op.LOAD, not_activated(slot.name))
        future: asyncio.Future[Lease | None] = asyncio.get_running_loop().create_future()
        waiter = Waiter(who.key, cls, self.clock.monotonic(), future)
        refused = turns.push(waiter)
        if refused is not None:
            raise self._full(slot, f"(class {cls}: queue_limit={refused.limit})")
        try:
            if not self.loading.loaded(slot) or slot.draining:
                await self.loading.ensure_loaded(slot)  # joined: every waiter's turn waits
                self.admit_waiters(slot)
            return await future
        except BaseException:
            if not turns.remove(waiter) and future.done() and not future.cancelled():
                lease = future.result()  # granted as the waiter gave up: give it back
                if lease is not None:
                    self.release(lease)
            if not slot.waiters and not slot.queued:
                self._after_waiter_cancel(slot)
            raise

    def _turns(self, slot: SlotRecord) -> FairQueue[asyncio.Future[Lease | None]]:
        names = {c.name for c in self.settings.priority_classes}
        if slot.turns is None or (not len(slot.turns) and set(slot.turns.classes) != names):
            # made when one first waits; made again once empty after the classes changed
            classes = {
                c.name: ClassSpec(c.name, c.weight, c.queue_limit)
                for c in self.settings.priority_classes
            }
            slot.turns = FairQueue(classes, age_s=self.settings.queue_aging_s)
        return slot.turns

    def _full(self, slot: SlotRecord, why: str) -> SlotctlError:
        error = SlotQueueFull(
            f"{slot.waiters + slot.queued} requests already wait for slot {slot.name!r} {why}",
            retry_after_s=1.0,
            slot=slot.name,
        )
        return self.table.refuse(slot, Op.LEASE, error)

    def admit_waiters(self, slot: SlotRecord) -> None:
        """Grant turns while the slot has room: as a request ends, and each housekeeping
        tick (leases revoked by a crash end without a release). A waiter whose turn comes
        while the slot cannot serve is told to start over."""
        turns = slot.turns
        while turns is not None and len(turns):
            dispatchable = self.loading.loaded(slot) and not slot.draining
            limit = slot.spec.max_concurrency
            if dispatchable and limit is not None and slot.in_flight >= limit:
                return
            waiter = turns.pop(self.clock.monotonic())
            if waiter is None or waiter.item.done():
                continue
            lease: Lease | None = None
            if dispatchable:
                with contextlib.suppress(SlotctlError):
                    lease = self._take_now(slot, Requester(waiter.key, waiter.cls))
            waiter.item.set_result(lease)

    def _take_now(self, slot: SlotRecord, who: Requester | None = None) -> Lease:
        if slot.draining or slot.state is S.UNLOADING:
            raise SlotNotReady(f"slot {slot.name!r} is unloading", slot=slot.name)
        if not can_dispatch(slot.state, slot.idle_reason):
            raise SlotNotReady(
                f"slot {slot.name!r} is up but serves no model ({slot.message})", slot=slot.name
            )
        lease = self._take(slot)
        if who is not None:  # its class resolved by the router (a declared one, or "")
            slot.class_used[who.cls] = slot.last_used
        return lease

    async def _wait_cold(self, slot: SlotRecord, who: Requester | None = None) -> None:
        if slot.waiters + slot.queued >= slot.spec.max_queue:
            raise self._full(slot, f"(max_queue={slot.spec.max_queue})")
        if not slot.spec.activated:
            raise self.table.refuse(slot, Op.LOAD, not_activated(slot.name))
        cls = self.settings.priority_class(who.cls).name if who is not None else ""
        slot.waiters += 1
        slot.cold_classes[cls] = slot.cold_classes.get(cls, 0) + 1  # the load's demand
        try:
            await self.loading.ensure_loaded(slot)
        except asyncio.CancelledError:
            self._left_cold(slot, cls)
            self._after_waiter_cancel(slot)
            raise
        except BaseException:
            self._left_cold(slot, cls)
            raise
        self._left_cold(slot, cls)

    @staticmethod
    def _left_cold(slot: SlotRecord, cls: str) -> None:
        slot.waiters -= 1
        left = slot.cold_classes.get(cls, 0) - 1
        if left > 0:
            slot.cold_classes[cls] = left
        else:
            slot.cold_classes.pop(cls, None)

    def _take(self, slot: SlotRecord, expires_at: float | None = None) -> Lease:
        if slot.state in (S.READY, S.IDLE):
            # ready -> serving is a coalesced flip (SPEC §3: written off the loop, a moment
            # later); idle -> serving is written first (a refused write refuses the
            # request, typed, and takes no lease).
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
        if slot.queued:  # the next request in turn takes this one's place
            self.admit_waiters(slot)
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
        busy = slot.waiters or slot.queued or slot.leases
        if busy or self.wanted(slot) or task is None or task.done():
            return
        self.tasks.spawn(self.cleanup_after(slot, task), f"cleanup:{slot.name}")

    async def cleanup_after(self, slot: SlotRecord, task: asyncio.Task[int]) -> None:
        try:
            gen = await asyncio.shield(task)
        except (SlotctlError, asyncio.CancelledError):
            return  # the load failed: nothing to unload
        if slot.waiters or slot.queued or slot.leases or self.wanted(slot):
            return  # wanted again: not ours to unload
        if slot.generation != gen:
            return  # a newer load replaced it: not ours to unload
        if self.table.records.get(slot.name) is slot and self.loading.loaded(slot):
            await self.loading.unloading.unload(
                slot.name,
                force=True,
                clear_residency=False,
                reason="every waiter cancelled before the load finished",
            )
