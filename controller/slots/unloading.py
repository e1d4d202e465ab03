"""Unloading: drain, stop, go offline; evictions with their revalidation; wishes cleared.

A part of the manager (:mod:`controller.slots`), below :mod:`.loading` (a load unloads its
exclusive-group peers and evicts victims through this part). Every unload waits for an
in-flight load of the slot to settle first, drains leases for ``drain_timeout_s`` (no new
ones meanwhile), then revokes what is left, and goes ``unloading -> offline`` through the
table's one writer. A load still pulling its model files is stopped rather than waited for
(it goes ``pulling -> offline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Final

from controller.model.errors import SlotctlError, SlotNotReady, SlotPinned, SlotTerminateTimeout
from controller.model.events import EventKind, EvictionReason, Op
from controller.model.lifecycle import SlotState
from controller.scheduling.eviction import SLEEP, Victim
from controller.slots.core import Core, Part
from controller.slots.records import LOADING_STATES, SlotRecord, SlotView
from controller.slots.residency import Residency

__all__ = ["Unloading"]

log = logging.getLogger("slotctl.manager")

S = SlotState
_POLL_S: Final = 0.02
_SETTLE_SPINS: Final = 50  # loop iterations for resuming waiters (a few suffice)


class Unloading(Part):
    def __init__(self, core: Core, residency: Residency) -> None:
        super().__init__(core)
        self.residency = residency
        self.drains_ended = False  # a second Ctrl-C: drains revoke their leases at once

    async def unload(
        self,
        name: str,
        *,
        force: bool = False,
        reason: str = "unloaded on request",
        clear_residency: bool = True,
        op: Op = Op.UNLOAD,
        pause: bool = False,
    ) -> SlotView:
        """Drain, stop and go offline. Waits for an in-flight load to settle first.

        ``pause`` (a user's unload): an autoload slot stays unloaded — the reconciler does
        not load it again — until a user's load resumes it; recorded in residency.json.
        """
        slot = self.table.get(name)
        if slot.spec.pinned and not force:
            raise self.table.refuse(slot, op, SlotPinned(name, "unload"))
        if pause and slot.spec.autoload and self.wishes.pause(name):
            reason += " (autoload paused: `slotctl slot load` resumes it)"
        if clear_residency:
            self.clear_resident(name)
        self.unwait_if_unwanted(slot)
        # A load still pulling its model files is stopped, not waited for: this slot
        # leaves the pull (the engine cancels it when nobody else waits for it).
        slot.flight.stop_pull(reason)
        task = slot.flight.task
        if task is not None and not task.done():
            with contextlib.suppress(SlotctlError, asyncio.CancelledError):
                await asyncio.shield(task)
        async with slot.lock:
            await self.unload_locked(slot, reason, op)
        return self.table.view(slot)

    async def unload_locked(
        self, slot: SlotRecord, reason: str, op: Op, *, evicted: EvictionReason | None = None
    ) -> None:
        """Unload under the slot's lock; ``evicted``: an eviction (said once drained)."""
        if slot.state is S.OFFLINE:
            return
        if slot.state is S.ERROR:
            try:
                await self.runtime.stop(slot.name, self.config.stop_timeout_s)
            except SlotTerminateTimeout:
                raise  # the server survived SIGKILL: it is not offline, the slot stays in error
            except SlotctlError as exc:
                log.warning("stopping errored slot %s: %s", slot.name, exc.message)
            self.table.run(slot, None)
            self.table.set(slot, S.OFFLINE, op=op, message=f"{reason} (was in error)")
            return
        # Loading: only after a restart that found it mid-load, or a refused state write
        # (disk full); unloading: a stop whose final write was refused. Finish either.
        if slot.state in LOADING_STATES or slot.state is S.UNLOADING:
            await self.stop_runtime(slot, op)
            self.table.set(slot, S.OFFLINE, op=op, message=reason)
            return
        await self._drain(slot)
        if slot.state is S.SERVING:  # leases revoked by the drain timeout
            self.table.set(slot, S.READY, op=op, message="drained")
        if evicted is not None:
            self.emit_eviction(slot, reason, evicted)
        self.table.set(slot, S.UNLOADING, op=op, message=reason)
        await self.stop_runtime(slot, op)
        self.table.set(slot, S.OFFLINE, op=op, message=reason)

    async def stop_runtime(self, slot: SlotRecord, op: Op) -> None:
        try:
            await self.runtime.stop(slot.name, self.config.stop_timeout_s)
        except SlotTerminateTimeout as exc:
            if slot.state is S.UNLOADING:
                self.table.set(slot, S.ERROR, op=op, message=exc.message, error=exc)
            raise
        finally:
            self.table.run(slot, None)

    async def _drain(self, slot: SlotRecord) -> None:
        """No new leases; wait for in-flight ones up to drain_timeout_s, then revoke."""
        book = slot.book
        if not book.leases:
            return
        with book.drain():
            deadline = self.clock.monotonic() + slot.spec.drain_timeout_s
            while book.leases and self.clock.monotonic() < deadline and not self.drains_ended:
                await self.clock.sleep(_POLL_S)
            if book.leases:
                error = SlotNotReady(
                    f"slot {slot.name!r} was unloaded: in-flight requests cancelled after "
                    f"drain_timeout_s={slot.spec.drain_timeout_s:g}",
                    slot=slot.name,
                )
                book.revoke_all(error)

    async def evict(self, victims: Iterable[Victim], *, reason: EvictionReason) -> list[str]:
        """Carry out each victim's action (put to sleep, or unload) after revalidating the
        decision (a request since cancels it)."""
        done = []
        for victim in victims:
            slot = self.table.records.get(victim.name)
            if slot is None or slot.access != victim.access:
                continue  # a request came since the decision: not a victim any more
            if slot.flight.generation != victim.generation:
                continue  # unloaded and loaded again (maybe another model) since
            if victim.action == SLEEP and slot.asleep:
                continue  # asleep already (its device memory is free)
            level = victim.level if victim.action == SLEEP else 0
            why = f"{'put to sleep' if level else 'evicted'} to {victim.reason}"
            if await self.evict_one(slot, why, reason=reason, sleep=level):
                done.append(victim.name)
                done += await self.evict_mates(slot, why, reason, level)
        return done

    async def evict_mates(
        self,
        slot: SlotRecord,
        why: str,
        reason: EvictionReason,
        level: int,
        *,
        clear_residency: bool = False,
    ) -> list[str]:
        """A co-loaded unit goes whole (controller.scheduling.eviction): ``slot``'s mates evicted
        with it, each put to sleep too when it slept and its server can."""
        done = []
        for mate in self.table.usage.unit_mates(slot):
            if mate.state not in (S.READY, S.IDLE) or mate.asleep:
                continue
            sleep = level if level and mate.candidate().sleep_level else 0
            also = f"{why} (unit {slot.spec.unit!r}: goes with {slot.name})"
            if await self.evict_one(
                mate, also, reason=reason, sleep=sleep, clear_residency=clear_residency
            ):
                done.append(mate.name)
        return done

    async def evict_one(
        self,
        slot: SlotRecord,
        why: str,
        *,
        reason: EvictionReason,
        clear_residency: bool = False,
        sleep: int = 0,
    ) -> bool:
        """Evict one victim (``reason``: its class, a field of the eviction event): its
        server put to sleep at level ``sleep`` (0: unloaded; a sleep that fails unloads)."""
        book = slot.book
        if slot.state not in (S.READY, S.IDLE) or book.leases or slot.busy or slot.spec.pinned:
            return False  # revalidation failed: it got busy since the decision
        if book.draining or book.waiters:
            return False
        if clear_residency:
            self.clear_resident(slot.name)
        async with slot.lock:  # free (checked above): acquired without waiting
            if sleep and await self.residency.sleep_locked(slot, sleep, why, reason):
                return True
            await self.unload_locked(slot, why, Op.EVICT, evicted=reason)
        return True

    def emit_eviction(self, slot: SlotRecord, why: str, reason: EvictionReason) -> None:
        details: dict[str, object] = {"bytes": slot.memory_bytes, "action": "unload"}
        if slot.asleep:
            details["was"] = "asleep"  # a sleeper unloaded from host memory
        self.events.emit(
            EventKind.EVICTION,
            Op.EVICT,
            slot=slot.name,
            model=slot.spec.model_id,
            message=why,
            reason=reason,
            details=details,
        )

    async def reset(self, name: str) -> SlotView:
        """Clear the crash-loop breaker; an errored slot goes offline."""
        slot = self.table.get(name)
        self.table.rearm(slot)
        async with slot.lock:
            if slot.state is S.ERROR:
                await self.unload_locked(slot, "reset", Op.UNLOAD)
        return self.table.view(slot)

    async def unload_group_peers(self, slot: SlotRecord) -> None:
        """Unload the exclusive-group members that hold ``slot``'s group (a swap), bounded."""
        for peer in self.table.usage.group_peers(slot):
            if peer.spec.pinned:
                error = SlotPinned(peer.name, "exclusive-group swap")
                raise self.table.refuse(slot, Op.LOAD, error)
            why = (
                f"exclusive group {slot.model.exclusive_group if slot.model else ''}: "
                f"swapped out for {slot.name}"
            )
            try:
                await asyncio.wait_for(self._unload_peer(peer, why), self.config.exclusive_wait_s)
            except TimeoutError:
                late = SlotNotReady(
                    f"exclusive-group peer {peer.name!r} did not unload within "
                    f"{self.config.exclusive_wait_s:g}s",
                    slot=slot.name,
                )
                raise self.table.refuse(slot, Op.LOAD, late) from None

    async def _unload_peer(self, peer: SlotRecord, why: str) -> None:
        """Unload an exclusive-group peer (clearing its residency) for a load in its group.

        Unlike :meth:`unload`, never waits for the peer's own pending load: that load queues
        on the group lock the caller holds, so waiting for it would deadlock. It runs after
        this load (and swaps back) if its waiters still want it.
        """
        self.clear_resident(peer.name)
        await self._settle_waiters(peer)
        async with peer.lock:
            await self.unload_locked(peer, why, Op.UNLOAD, evicted=EvictionReason.EXCLUSIVE)

    async def _settle_waiters(self, slot: SlotRecord) -> None:
        """Let the cold waiters of a load that just finished take their leases first.

        They resume a few loop iterations after the load task ends, while a swap queued on
        the group lock runs at once: without this it unloaded the peer under them (they
        got ``SlotNotReady``), at every swap, so under steady traffic to both members one
        member's requests were never served. Once they hold leases the drain waits for
        them like for any request in flight.
        """
        for _ in range(_SETTLE_SPINS):
            task = slot.flight.task
            loaded = slot.state in (S.READY, S.IDLE, S.SERVING)
            if not slot.book.waiters or task is None or not task.done() or not loaded:
                return
            await asyncio.sleep(0)

    def clear_resident(self, name: str) -> None:
        if self.wishes.clear_resident(name):
            slot = self.table.records.get(name)
            if slot is not None:
                self.unwait_if_unwanted(slot)

    def unwait_if_unwanted(self, slot: SlotRecord) -> None:
        """Nobody keeps this slot loaded any more: it is not waiting for memory either."""
        if slot.waiting is None or self.wishes.keeps_loaded(slot.name, bool(slot.spec.autoload)):
            return
        self.table.persist(slot, waiting=None, message="")
