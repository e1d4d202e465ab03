"""Leases: the router's whole surface — acquire (cold slots joined), release, hold.

A part of the manager (:mod:`controller.slots`), above :mod:`.loading`. A request takes a
lease: a cold slot is loaded first and concurrent cold requests join that one load (at
most ``max_queue`` wait, each key its share of them: a full line gives a smaller key's
request the place of the largest key's newest, :mod:`controller.scheduling.queueshare`);
a waiter that gives up never cancels the load for the others, and when the last one gives
up the slot is unloaded once the load settles, unless something else wants it. Leases hold
the slot in ``serving`` and block unload and eviction; a *hold* is a lease that expires by
itself. The ``ready``↔``serving`` flips of a request are coalesced and written off the
event loop (:mod:`.table`, SPEC §3).

A slot with ``max_concurrency`` takes that many requests at once; the others wait for
their *turn* in the slot's fair queue (:mod:`controller.scheduling.fairqueue`: by the requester's
priority class, round-robin between keys, aging), each granted as a request ends. A
waiter whose turn comes while the slot is not dispatchable (it was unloaded, it crashed)
starts again from the top: a cold wait, a load.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from controller.model.errors import SlotctlError, SlotNotFound, SlotNotReady, SlotQueueFull
from controller.model.events import EventKind, Op
from controller.model.lifecycle import SlotState, can_dispatch
from controller.scheduling.decision import not_activated
from controller.scheduling.fairqueue import ClassSpec, FairQueue, Waiter
from controller.scheduling.queueshare import place_for
from controller.slots.core import Core, Part
from controller.slots.leasebook import Lease, Requester, Turns, Waiting
from controller.slots.loading import Loading
from controller.slots.records import SlotRecord

__all__ = ["Leases"]

S = SlotState
# As module constants on the request path (``S.READY`` is a lookup through the enum's
# metaclass, ~70 ns).
_READY: Final = S.READY
_SERVING: Final = S.SERVING
_IDLE: Final = S.IDLE


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
            ready = self.loading.loaded(slot) and not slot.book.draining
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
        slot = self.table.records.get(name)
        if slot is None:
            raise SlotNotFound(name)
        state = slot.state
        if (
            (state is _READY or state is _SERVING)  # loaded, dispatchable, awake
            and not slot.book.draining
            and slot.spec.max_concurrency is None  # room: no turns
        ):
            # _take(slot, cls), in line: a routed request's code runs from cold caches,
            # where each function more it touches costs (docs/performance.md, the router)
            if state is _READY:  # a coalesced flip (SPEC §3: written off the loop)
                self.table.flip(slot, _SERVING, "request in flight")
            lease = Lease(slot.spec.name, slot.flight.generation)
            now = self.clock.monotonic()
            # through the owners (the book its leases, the table the recency: design/0016);
            # folding them in line saved no measurable CPU (docs/performance.md, the router)
            slot.book.add(lease, None if who is None else who.cls, now)
            self.table.used(slot, now)
            return lease
        if not self.loading.loaded(slot) or slot.book.draining or not self._has_room(slot):
            return None
        return self._take_now(slot, who)

    @staticmethod
    def _has_room(slot: SlotRecord) -> bool:
        """Room for one more request now (nobody waiting for a turn ahead of it)."""
        limit = slot.spec.max_concurrency
        return limit is None or (slot.book.in_flight < limit and not slot.book.queued)

    async def _wait_turn(self, slot: SlotRecord, who: Requester) -> Lease | None:
        """Wait in the slot's fair queue (loading it first when it is cold); the lease when
        its turn comes (None: its turn came while the slot could not serve: start over)."""
        turns = self._turns(slot)
        cls = self.settings.priority_class(who.cls).name
        if cls not in turns.classes:  # the classes changed while others wait: the first
            cls = next(iter(turns.classes))
        if not slot.spec.activated:
            raise self.table.refuse(slot, Op.LOAD, not_activated(slot.name))
        future: asyncio.Future[Lease | None] = asyncio.get_running_loop().create_future()
        place = self._enter_line(slot, who, future)
        waiter = Waiter(who.line, cls, self.clock.monotonic(), future)
        refused = turns.push(waiter)
        if refused is not None:
            slot.book.leave(place)
            raise self._full(slot, f"(class {cls}: queue_limit={refused.limit})")
        try:
            if not self.loading.loaded(slot) or slot.book.draining:
                await self.loading.ensure_loaded(slot)  # joined: every waiter's turn waits
                self.admit_waiters(slot)
            return await future
        except BaseException as exc:
            granted = future.done() and not future.cancelled() and future.exception() is None
            if not turns.remove(waiter) and granted:
                lease = future.result()  # granted as the waiter gave up: give it back
                if lease is not None:
                    self.release(lease)
            if not slot.book.waiters and not slot.book.queued:
                self._after_waiter_cancel(slot)
            if place.shed and isinstance(exc, asyncio.CancelledError):
                raise self._shed(slot) from None
            raise
        finally:
            slot.book.leave(place)

    def _turns(self, slot: SlotRecord) -> Turns:
        settings = self.settings

        def make() -> Turns:
            classes = {
                c.name: ClassSpec(c.name, c.weight, c.queue_limit)
                for c in settings.priority_classes
            }
            return FairQueue(classes, age_s=settings.queue_aging_s)

        return slot.book.queue({c.name for c in settings.priority_classes}, make)

    def _full(self, slot: SlotRecord, why: str) -> SlotctlError:
        error = SlotQueueFull(
            f"{sum(slot.book.holding().values())} requests already wait for slot "
            f"{slot.name!r} {why}",
            retry_after_s=1.0,
            slot=slot.name,
        )
        return self.table.refuse(slot, Op.LEASE, error)

    def _enter_line(
        self,
        slot: SlotRecord,
        who: Requester | None,
        turn: asyncio.Future[Lease | None] | None = None,
    ) -> Waiting:
        """A place in the slot's line for ``who``'s request, its flow's share kept
        (:func:`controller.scheduling.queueshare.place_for`): in the line's room, or in
        the place of the largest flow's newest waiter; else ``slot.queue_full``."""
        book = slot.book
        flow = who.line if who is not None else ""
        decided = place_for(book.holding(), flow, slot.spec.max_queue)
        if not decided.admitted:
            raise self._full(slot, f"(max_queue={slot.spec.max_queue})")
        if decided.evict is not None:
            book.shed_newest(decided.evict)
        return book.enter(flow, asyncio.current_task(), turn)

    def _shed(self, slot: SlotRecord) -> SlotctlError:
        """The answer of a waiter whose place went to another key's request: its task's
        cancellation (the shedding) is taken back, the refusal raised instead."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return self._full(
            slot,
            f"(max_queue={slot.spec.max_queue}; this key holds the most places in line, "
            "and its newest request gave its place to another key's)",
        )

    def admit_waiters(self, slot: SlotRecord) -> None:
        """Grant turns while the slot has room: as a request ends, and each housekeeping
        tick (leases revoked by a crash end without a release). A waiter whose turn comes
        while the slot cannot serve is told to start over."""
        turns = slot.book.turns
        while turns is not None and len(turns):
            dispatchable = self.loading.loaded(slot) and not slot.book.draining
            limit = slot.spec.max_concurrency
            if dispatchable and limit is not None and slot.book.in_flight >= limit:
                return
            waiter = turns.pop(self.clock.monotonic())
            if waiter is None or waiter.item.done():
                continue
            lease: Lease | None = None
            if dispatchable:
                with contextlib.suppress(SlotctlError):
                    lease = self._take_now(slot, Requester(cls=waiter.cls, flow=waiter.key))
            waiter.item.set_result(lease)

    def _take_now(self, slot: SlotRecord, who: Requester | None = None) -> Lease:
        if slot.book.draining or slot.state is S.UNLOADING:
            raise SlotNotReady(f"slot {slot.name!r} is unloading", slot=slot.name)
        if not can_dispatch(slot.state, slot.idle_reason):
            raise SlotNotReady(
                f"slot {slot.name!r} is up but serves no model ({slot.message})", slot=slot.name
            )
        # its class resolved by the router (a declared one, or "")
        return self._take(slot, who.cls if who is not None else None)

    async def _wait_cold(self, slot: SlotRecord, who: Requester | None = None) -> None:
        book = slot.book
        if not slot.spec.activated:
            raise self.table.refuse(slot, Op.LOAD, not_activated(slot.name))
        place = self._enter_line(slot, who)
        cls = self.settings.priority_class(who.cls).name if who is not None else ""
        book.join_cold(cls)  # its class weighs in the load's demand
        try:
            await self.loading.ensure_loaded(slot)
        except asyncio.CancelledError:
            book.leave_cold(cls)
            book.leave(place)
            self._after_waiter_cancel(slot)
            if place.shed:
                raise self._shed(slot) from None
            raise
        except BaseException:
            book.leave_cold(cls)
            raise
        finally:
            book.leave(place)
        book.leave_cold(cls)

    def _take(self, slot: SlotRecord, cls: str | None = None) -> Lease:
        state = slot.state
        if state is _READY:
            # A coalesced flip (SPEC §3: written off the loop, a moment later).
            self.table.flip(slot, _SERVING, "request in flight")
        elif state is _IDLE:
            # Written first (a refused write refuses the request, typed, and takes no lease).
            message = "request in flight"
            self.table.set(slot, _SERVING, op=Op.LEASE, message=message, durable=True)
        lease = Lease(slot.spec.name, slot.flight.generation)
        now = self.clock.monotonic()
        slot.book.add(lease, cls, now)
        self.table.used(slot, now)
        return lease

    def release(self, lease: Lease) -> None:
        """Idempotent. The last lease returns the slot to ``ready``."""
        if lease.released:
            return
        lease.released = True
        slot = self.table.records.get(lease.slot)
        if slot is None or not slot.book.remove(lease):
            return  # revoked or from a previous generation: nothing to undo
        # a request's lease is served (a batch hold has an expiry)
        self.table.used(slot, self.clock.monotonic(), served=lease.expires_at is None)
        book = slot.book
        if book.turns is not None and book.queued:  # the next request in turn takes its place
            self.admit_waiters(slot)
        if not book.leases and slot.state is _SERVING:
            # ready (not idle: that is idle_timeout_s later), a coalesced flip
            self.table.flip(slot, _READY, "no request in flight")

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
        for lease in list(slot.book.leases.values()):
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
        return self.wishes.keeps_loaded(slot.name, autoload) or slot.flight.wanted > 0

    def _after_waiter_cancel(self, slot: SlotRecord) -> None:
        """The last cold waiter left: unload once the load settles, if nobody wants it."""
        task = slot.flight.task
        busy = slot.book.waiters or slot.book.queued or slot.book.leases
        if busy or self.wanted(slot) or task is None or task.done():
            return
        self.tasks.spawn(self.cleanup_after(slot, task), f"cleanup:{slot.name}")

    async def cleanup_after(self, slot: SlotRecord, task: asyncio.Task[int]) -> None:
        try:
            gen = await asyncio.shield(task)
        except (SlotctlError, asyncio.CancelledError):
            return  # the load failed: nothing to unload
        if slot.book.waiters or slot.book.queued or slot.book.leases or self.wanted(slot):
            return  # wanted again: not ours to unload
        if slot.flight.generation != gen:
            return  # a newer load replaced it: not ours to unload
        if self.table.records.get(slot.name) is slot and self.loading.loaded(slot):
            await self.loading.unloading.unload(
                slot.name,
                force=True,
                clear_residency=False,
                reason="every waiter cancelled before the load finished",
            )
