"""Surge rollouts: a changed slot's new server started beside the old one, then switched to.

A part of the manager (:mod:`controller.slots`), above :mod:`.loading`; the reconciler
asks for it (``recreate`` planned, the rollout decided ``surge``:
:func:`controller.scheduling.rollout.decide_rollout`). Under the slot's lock, while the old server
keeps serving::

    decide (old server's memory counted, no eviction) ─ no room / cannot ─► recreate
      │ rollout.json: starting (port, hashes)
      ▼
    start the new server on a fresh port ── probe ready ── failed ─► stopped; the old one
      │ rollout.json: switched                                     keeps serving (breaker)
      ▼
    runtime promote (the new one is the slot's own) ─ port.json ─ endpoint switched (one
    assignment on the loop: a request takes the old or the new, never a not-ready one)
      ▼
    drain the old one (requests in flight before the switch; ``drain_timeout_s``) ─ stop it
      ▼
    rollout.json deleted ─ done

After a restart (:meth:`Rollouts.recover`, before adoption): ``starting`` — the new
server is stopped (and any stray of its spawn), the old one adopted; the reconciler rolls
out again. ``switched`` — the promotion, the port and the old server's stop are finished
(no request of the old controller is in flight any more); on a runtime that settles alone
(kubernetes) the runtime's objects decide instead: ``switched`` is written before the
promotion, so a settle may keep the old server, and the new port is recorded only when
the new server is the one that serves. Either way one server of the
slot remains. Only :class:`~.table.SlotTable` changes state; the rollout record is
written through the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final

from controller.model.devices import GpuRef, share
from controller.model.errors import SlotctlError, SlotHealthFailed, SlotSpawnFailed
from controller.model.events import EventKind, Op
from controller.probes.readiness import ProbeOutcome
from controller.providers.launch import build_launch, launch_context, placement_args, with_port
from controller.runtime.base import LaunchSpec
from controller.runtime.ports import can_bind, pick_free_port
from controller.runtime.surging import SurgeInstances, cannot_surge, settles_alone, surge_of
from controller.scheduling.breaker import Breaker
from controller.scheduling.rollout import (
    RECREATE,
    SURGE,
    RolloutDecision,
    RolloutView,
    decide_rollout,
)
from controller.slots.core import Core, Part, TakenPorts
from controller.slots.loading import Loading
from controller.slots.records import RunningServer, SlotRecord
from controller.spec.loader import DesiredSlot
from controller.store.files import utcnow

__all__ = ["ROLLOUT_RECORD", "Rollouts"]

log = logging.getLogger("slotctl.manager")

ROLLOUT_RECORD: Final = "rollout.json"
STARTING: Final = "starting"
SWITCHED: Final = "switched"


class Rollouts(Part):
    def __init__(self, core: Core, loading: Loading) -> None:
        super().__init__(core)
        self.loading = loading
        # Per slot: the leases in flight on the old server when the endpoint switched.
        self._draining: dict[str, set[int]] = {}
        # Called with the new server's endpoint once it is ready, before the switch (the
        # manager sets it: the old server's adapters loaded into it, slots/adapters.py).
        self.before_switch: Callable[[SlotRecord, str], Awaitable[None]] | None = None

    # ---------------------------------------------------------------- deciding

    def decide(self, slot: SlotRecord | None, desired: DesiredSlot) -> RolloutDecision:
        """Which way ``desired`` would replace ``slot``'s running server now."""
        model = self.table.models.get(desired.spec.model_id) if desired.spec.model_id else None
        on_nodes = slot.on_nodes if slot is not None else False
        probe = SlotRecord(
            spec=desired.spec,
            stack=desired.stack,
            model=model,
            breaker=Breaker(),
            on_nodes=on_nodes,
        )
        running = slot is not None and self.loading.loaded(slot) and not slot.book.draining
        why_not = cannot_surge(self.runtime, desired.name)
        if why_not is None and slot is not None and slot.asleep:
            why_not = "its server sleeps: nobody is served by it until a wake"
        if why_not is None and slot is not None and self.table.usage.group_peers(probe):
            group = model.exclusive_group if model is not None else "?"
            why_not = f"exclusive group {group}: its members run one at a time"
        load = None
        if running and why_not is None and desired.spec.port is None:
            load = self.loading.admission.decide(probe, background=True, evict=False)
        return decide_rollout(
            desired.spec,
            running=running,
            cannot_surge=why_not,
            load=load,
            needed=probe.memory_bytes,
        )

    # ---------------------------------------------------------------- rolling out

    async def roll_out(self, name: str, desired: DesiredSlot) -> RolloutDecision:
        """Surge ``name`` to its (already upserted) spec when the decision says so; the
        decision is returned either way (``recreate``: the caller stops and starts).
        Raises the typed error of a failed new server (the old one keeps serving)."""
        slot = self.table.get(name)
        async with slot.lock:
            decision = self.decide(slot, desired)
            surge = surge_of(self.runtime)
            if not decision.surge or surge is None:
                return decision
            slot.breaker.check(name, self.clock.monotonic(), slot.spec.max_consecutive_failures)
            load = self.loading.admission.decide(self._probe(slot), background=True, evict=False)
            if not load.ok:  # the room went between the two looks
                return RolloutDecision(RECREATE, "no room to surge any more")
            await self._surge(slot, surge, load.gpus, decision)
            return decision

    @contextlib.contextmanager
    def recreating(self, name: str, reason: str) -> Iterator[None]:
        """A recreate (the old server stopped, then the new one started) is shown in the
        slot's view while the caller does it
        (:func:`~controller.scheduling.rollout.shown_rollout`)."""
        live = RolloutView(RECREATE, "stopping", reason, reason, since=utcnow())
        self.table.rollouts[name] = live
        try:
            yield
        finally:
            if self.table.rollouts.get(name) is live:
                del self.table.rollouts[name]

    def _probe(self, slot: SlotRecord) -> SlotRecord:
        return SlotRecord(
            spec=slot.spec,
            stack=slot.stack,
            model=slot.model,
            breaker=Breaker(),
            on_nodes=slot.on_nodes,
        )

    async def _surge(
        self,
        slot: SlotRecord,
        surge: SurgeInstances,
        gpus: tuple[GpuRef, ...],
        decision: RolloutDecision,
    ) -> None:
        old = slot.launch
        assert old is not None
        launch = self._new_launch(slot, gpus, old.port)
        record = {
            "phase": STARTING,
            "port": launch.port,
            "old_port": old.port,
            "from": slot.config_hash,
            "to": launch.config_hash(),
            "gpus": [g.index for g in gpus],
        }
        self._write(slot.name, record)
        self._live(slot.name, decision.reason, "starting", "starting", launch.port, fresh=True)
        self._event(slot, "started", f"surge started on port {launch.port}: {decision.reason}")
        # The new server's memory counts while it starts (reserved: no probe sees it yet).
        self.table.surges[slot.name] = self._holding(slot, gpus, coming_up=True)
        try:
            launch = await self._start_ready(slot, surge, launch)
        except SlotctlError as exc:
            await self._failed(slot, surge, exc)
            raise
        except asyncio.CancelledError:  # the controller stops: the new server goes too
            await asyncio.shield(self._abandon(slot, surge))
            raise
        self._write(slot.name, {**record, "phase": SWITCHED})
        self._live(slot.name, decision.reason, SWITCHED, "ready", launch.port)
        old_holding = self._holding(slot, slot.placement, coming_up=False)
        if self.before_switch is not None:  # its adapters loaded into the new server
            await self.before_switch(slot, launch.endpoint)
        try:
            await self._switch(slot, surge, launch, gpus)
        except SlotctlError as exc:  # the promotion failed: the old server serves on
            await self._failed(slot, surge, exc)
            raise
        self.table.surges[slot.name] = old_holding  # the old server's, until it stops
        try:
            await self._drain(slot)
        finally:  # cancelled too: the old server never outlives the rollout
            await asyncio.shield(self._retire(slot, surge))

    def _holding(
        self, slot: SlotRecord, gpus: tuple[GpuRef, ...], *, coming_up: bool
    ) -> tuple[tuple[str, int, bool], ...]:
        """What one server of ``slot`` holds on ``gpus`` (none: its device kind's key)."""
        if not gpus:
            return ((slot.where, slot.memory_bytes, coming_up),)
        each = share(slot.memory_bytes, len(gpus))
        return tuple((g.key, each, coming_up) for g in gpus)

    async def _abandon(self, slot: SlotRecord, surge: SurgeInstances) -> None:
        self.table.surges.pop(slot.name, None)
        self.table.rollouts.pop(slot.name, None)
        with contextlib.suppress(SlotctlError):
            await surge.stop_instance(slot.name, self.config.stop_timeout_s)
        self._delete(slot.name)

    def _new_launch(self, slot: SlotRecord, gpus: tuple[GpuRef, ...], old_port: int) -> LaunchSpec:
        """The slot's launch on a fresh port (free, no other slot's, not the old one's),
        placed on ``gpus``."""
        taken = TakenPorts(self.core, slot.name, also={old_port})
        port = pick_free_port(taken)
        while not can_bind("127.0.0.1", port):  # pragma: no cover  (a race with another)
            taken.also.add(port)
            port = pick_free_port(taken)
        ctx = launch_context(
            self.runtime.kind, slot.stack, self.core.models_dir, self.core.adapters
        )
        launch = build_launch(with_port(slot.spec, port), slot.model, ctx)
        if not gpus:
            return launch.placed_on(())
        part = share(slot.memory_bytes, len(gpus))
        return launch.placed_on(gpus, placement_args(slot.spec, gpus, part))

    async def _start_ready(
        self, slot: SlotRecord, surge: SurgeInstances, launch: LaunchSpec
    ) -> LaunchSpec:
        """The new server started and probed ready; its launch, reached where it answers
        (a pod's IP, on a cluster)."""
        observed = await surge.start_instance(launch)
        launch = launch.reached_at(observed.endpoint)
        live = self.table.rollouts.get(slot.name)
        if live is not None:
            self._live(slot.name, live.reason, live.phase, "warming", launch.port)

        async def alive() -> bool:
            return (await surge.inspect_instance(slot.name)).running

        result = await self.prober.wait_ready(
            launch.endpoint,
            launch.probe,
            slot=slot.name,
            alive=alive,
            warmup_timeout_s=slot.spec.warmup_timeout_s,
            clock=self.clock,
        )
        if result.outcome is ProbeOutcome.READY:
            return launch
        if result.outcome is ProbeOutcome.EXITED:
            seen = await surge.inspect_instance(slot.name)
            raise SlotSpawnFailed(
                f"new server ({observed.ident}) exited while warming: {seen.message or 'exited'}",
                slot=slot.name,
            )
        raise SlotHealthFailed(f"new server not ready: {result.message}", slot=slot.name)

    async def _failed(self, slot: SlotRecord, surge: SurgeInstances, error: SlotctlError) -> None:
        """A new server that failed: stopped, never switched to; the old one serves on.
        The failure counts on the crash-loop breaker (the reconciler retries under it)."""
        await self._abandon(slot, surge)
        backoff = self.table.failure(slot, error.message)
        message = f"rollout failed: {error.message}; the old server keeps serving"
        if slot.breaker.failures >= slot.spec.max_consecutive_failures:
            message += f" (failed {slot.breaker.failures} times: next try in {backoff:g}s)"
        with contextlib.suppress(SlotctlError):
            self.table.persist(slot, waiting=slot.waiting, message=message)
        live = self.table.rollouts.get(slot.name)
        reason = live.reason if live is not None else ""
        self._live(slot.name, reason, "failed", "failed", None, message=message)
        self._event(slot, "failed", message, error=error.code)

    async def _switch(
        self, slot: SlotRecord, surge: SurgeInstances, launch: LaunchSpec, gpus: tuple[GpuRef, ...]
    ) -> None:
        """The new server becomes the slot's: the runtime's records, the port, then the
        endpoint — one assignment, so a request takes the old endpoint or the new one."""
        await surge.promote(slot.name)
        self.core.record_port(slot, launch.port)  # its hash memo goes: it holds the old port
        in_flight = set(slot.book.leases)
        self.table.run(slot, RunningServer.started(launch))
        # Another server: what was decided about the old one (an exit seen, a liveness
        # miss, an eviction planned) is stale and revalidates to nothing.
        slot.flight.next_generation()
        self._draining[slot.name] = in_flight
        if gpus and gpus != slot.placement:
            with contextlib.suppress(SlotctlError):
                self.table.persist_placement(slot, gpus)
        self._event(slot, "switched", f"switched to the new server on port {launch.port}")

    async def _retire(self, slot: SlotRecord, surge: SurgeInstances) -> None:
        """Stop the old server (drained), then forget the rollout."""
        self._draining.pop(slot.name, None)
        live = self.table.rollouts.get(slot.name)
        try:
            await surge.stop_retiring(slot.name, self.config.stop_timeout_s)
        finally:
            self.table.surges.pop(slot.name, None)
        self._delete(slot.name)
        self.table.rollouts.pop(slot.name, None)
        self.table.rearm(slot)
        message = "rollout done: the old server drained and stopped"
        self._event(slot, "done", message, reason=live.reason if live is not None else None)

    async def _drain(self, slot: SlotRecord) -> None:
        """Until the requests in flight on the old server at the switch are done (bounded
        by ``drain_timeout_s``; the old server is stopped then)."""
        deadline = self.clock.monotonic() + slot.spec.drain_timeout_s
        old = self._draining.get(slot.name, set())
        while old & set(slot.book.leases):
            if self.clock.monotonic() >= deadline:
                left = len(old & set(slot.book.leases))
                log.warning("slot %s: %d request(s) still on the old server", slot.name, left)
                return
            await self.clock.sleep(0.02)

    # ---------------------------------------------------------------- after a restart

    async def recover(self, slot: SlotRecord) -> None:
        """Finish or undo a rollout a restart interrupted (before adoption)."""
        record = self.table.store.read_aux(slot.name, ROLLOUT_RECORD)
        surge = surge_of(self.runtime)
        if record is None and (surge is None or settles_alone(surge) is None):
            return
        phase = record.get("phase") if record is not None else None
        if surge is None:
            self._delete(slot.name)
            return
        alone = settles_alone(surge)
        if alone is not None:  # the runtime's objects say where it stopped
            try:
                done = await alone.settle(slot.name)
            except SlotctlError as exc:  # (the API away: the next restart tries again)
                log.warning("slot %s: settling an interrupted rollout: %s", slot.name, exc.message)
                return
            port = record.get("port") if record is not None else None
            switched = record is not None and phase == SWITCHED
            if switched and isinstance(port, int) and await self._serves(slot, record or {}):
                self.core.record_port(slot, port)  # the settle kept the new server
            self._delete(slot.name)
            if done is not None:
                self._event(slot, "done", f"rollout interrupted by a restart: {done}")
            return
        if record is None:
            return
        if phase == SWITCHED:
            await surge.promote(slot.name)
            port = record.get("port")
            if isinstance(port, int):
                self.core.record_port(slot, port)
            await self._retire(slot, surge)  # no request of the old controller is left
            return
        with contextlib.suppress(SlotctlError):
            await surge.stop_instance(slot.name, self.config.stop_timeout_s)
        self._delete(slot.name)
        self._event(
            slot, "failed", "rollout interrupted by a restart: the new server stopped, the old kept"
        )

    async def _serves(self, slot: SlotRecord, record: dict[str, Any]) -> bool:
        """The rollout's new server is the slot's after a settle (``switched`` is written
        before the promotion: a settle that found the runtime not switched yet kept the
        old server, whose port stays the slot's). Unknown (the runtime away): False."""
        try:
            observed = await self.runtime.inspect(slot.name)
        except SlotctlError:
            return False
        return observed.config_hash == record.get("to")

    async def stop_orphaned(self, name: str) -> bool:
        """A slot nobody declares any more: its surge's servers (a rollout a restart
        interrupted before the slot was removed) are stopped too. True: one was."""
        surge = surge_of(self.runtime)
        if surge is None:
            return False
        second = (await surge.inspect_instance(name)).running
        await surge.stop_instance(name, self.config.stop_timeout_s)
        retired = await surge.stop_retiring(name, self.config.stop_timeout_s)
        self._delete(name)
        return second or retired

    # ---------------------------------------------------------------- records, events

    def _live(
        self,
        name: str,
        reason: str,
        phase: str,
        server: str,
        port: int | None,
        *,
        fresh: bool = False,
        message: str | None = None,
    ) -> None:
        """The rollout the slot's view shows (``table.rollouts``: written here only)."""
        old = None if fresh else self.table.rollouts.get(name)
        since = old.since if old is not None else utcnow()
        if message is None:
            message = f"new server {server}" + (f" on port {port}" if port else "")
        self.table.rollouts[name] = RolloutView(SURGE, phase, reason, message, server, port, since)

    def _write(self, name: str, record: dict[str, Any]) -> None:
        self.table.store.write_aux(name, ROLLOUT_RECORD, record, durable=True)

    def _delete(self, name: str) -> None:
        self.table.store.delete_aux(name, ROLLOUT_RECORD)

    def _event(
        self, slot: SlotRecord, phase: str, message: str, reason: str | None = None, **fields: Any
    ) -> None:
        """A ``rollout`` event; its details name the way and why (the live rollout's,
        or ``reason``) where known."""
        live = self.table.rollouts.get(slot.name)
        why = reason if reason is not None else (live.reason if live is not None else None)
        details: dict[str, Any] = {"phase": phase}
        if why is not None:
            details.update({"rollout": SURGE, "rollout_reason": why})
        self.events.emit(
            EventKind.ROLLOUT,
            Op.ROLLOUT,
            slot=slot.name,
            model=slot.model_id,
            message=message,
            details=details,
            **fields,
        )
