"""Residency: an idle slot's server put to sleep, woken, and asked whether it sleeps.

A part of the manager (:mod:`controller.slots`), below :mod:`.unloading` (an eviction whose
plan says ``sleep`` comes here) and :mod:`.loading` (a load of an asleep slot is a wake).
Sleep is a tier of ``idle``, not a state (docs/lifecycle.md): an asleep slot is ``idle``
with ``idle_reason`` ``asleep`` and its level in ``state.json`` (``extra.residency``,
``extra.sleep_level``); its device memory is released, at level 1 its weights are counted
in host memory. The HTTP goes through the core's :class:`~controller.probes.sleep.Sleeper`
as the launch's :class:`~controller.probes.sleep.SleepMode` says: never a provider's name.
"""

from __future__ import annotations

import contextlib
import logging

from controller.model.errors import SlotctlError, SlotWakeFailed, StateWriteFailed
from controller.model.events import EventKind, EvictionReason, Op
from controller.model.lifecycle import SlotState
from controller.model.sizes import format_gib
from controller.probes.readiness import ProbeOutcome
from controller.runtime.base import LaunchSpec
from controller.slots.core import Part
from controller.slots.records import AWAKE, SlotRecord

__all__ = ["Residency"]

log = logging.getLogger("slotctl.manager")

S = SlotState


class Residency(Part):
    async def sleep_locked(
        self, slot: SlotRecord, level: int, why: str, reason: EvictionReason
    ) -> bool:
        """Put ``slot``'s server to sleep at ``level`` (under its lock, no lease): True once
        it sleeps and that is recorded; False when it cannot or did not (the caller unloads
        it instead: the plan needs its device memory either way)."""
        launch = slot.launch
        mode = launch.sleep if launch is not None else None
        if launch is None or mode is None or slot.state not in (S.READY, S.IDLE):
            return False
        failed = await self.sleeper.sleep(launch.endpoint, mode, level, slot.spec.wake_timeout_s)
        if failed:
            log.warning("slot %s: sleep failed (%s): unloading instead", slot.name, failed)
            return False
        self.emit_sleep(slot, why, reason, level)
        try:
            if slot.state is S.READY:
                self.table.set(slot, S.IDLE, op=Op.EVICT, message=why, asleep=level)
            else:
                self.table.set_tier(slot, asleep=level, waking=False, op=Op.EVICT, message=why)
        except StateWriteFailed:
            # Not recorded: it must not sleep unrecorded (the router would send it requests).
            with contextlib.suppress(SlotctlError):
                await self.sleeper.wake(launch.endpoint, mode, level, slot.spec.wake_timeout_s)
            raise
        return True

    def emit_sleep(self, slot: SlotRecord, why: str, reason: EvictionReason, level: int) -> None:
        """The eviction event of a victim that sleeps (``details.action``: ``sleep``)."""
        held = slot.memory_bytes if level == 1 else 0
        self.events.emit(
            EventKind.EVICTION,
            Op.EVICT,
            slot=slot.name,
            model=slot.spec.model_id,
            message=why,
            reason=reason,
            details={
                "bytes": slot.memory_bytes,
                "action": "sleep",
                "level": level,
                "host_bytes": held,
            },
        )

    async def wake_server(self, slot: SlotRecord, launch: LaunchSpec) -> str:
        """The wake calls, then the readiness probe, within ``wake_timeout_s`` in all:
        "" once it serves again, else what failed."""
        mode = launch.sleep
        if mode is None:
            return "its server cannot sleep (no sleep mode)"
        budget = slot.spec.wake_timeout_s
        started = self.clock.monotonic()
        failed = await self.sleeper.wake(launch.endpoint, mode, slot.asleep or 1, budget)
        if failed:
            return failed
        left = max(0.01, budget - (self.clock.monotonic() - started))

        async def alive() -> bool:
            return (await self.runtime.inspect(slot.name)).running

        result = await self.prober.wait_ready(
            launch.endpoint,
            launch.probe,
            slot=slot.name,
            alive=alive,
            warmup_timeout_s=left,
            clock=self.clock,
        )
        if result.outcome is ProbeOutcome.READY:
            return ""
        return f"not ready after the wake: {result.message}"

    def woke(self, slot: SlotRecord, seconds: float, reason: str) -> None:
        """A wake ended ``ready`` (after the transition, which recorded its cost): one
        event."""
        self.events.emit(
            EventKind.RESIDENCY,
            Op.LOAD,
            slot=slot.name,
            model=slot.model_id,
            message=f"woke in {seconds:.2f}s ({reason})",
            details={"residency": AWAKE, "reason": reason, "seconds": round(seconds, 4)},
        )

    def wake_failed(self, slot: SlotRecord, why: str) -> SlotWakeFailed:
        """The one event of a failed wake (the caller restarts the server, once)."""
        error = SlotWakeFailed(
            f"slot {slot.name!r} did not wake: {why}; restarting its server", slot=slot.name
        )
        self.events.emit(
            EventKind.RESIDENCY,
            Op.LOAD,
            slot=slot.name,
            model=slot.model_id,
            message=error.message,
            error=error.code,
            details={"residency": slot.residency, "reason": "wake_failed"},
        )
        return error

    async def asleep_now(self, slot: SlotRecord, launch: LaunchSpec) -> bool | None:
        """Whether ``slot``'s running server sleeps (None: it cannot say; never raises)."""
        mode = launch.sleep
        if mode is None:
            return None
        try:
            return await self.sleeper.asleep(
                launch.endpoint, mode, min(5.0, slot.spec.wake_timeout_s)
            )
        except (OSError, SlotctlError):
            return None

    def describe(self, slot: SlotRecord) -> str:
        """``asleep (level 1, 4.00 GiB in cpu)``: a sleeper in words."""
        if not slot.asleep:
            return slot.residency
        held = f", {format_gib(slot.memory_bytes)} in {slot.host}" if slot.asleep == 1 else ""
        return f"{slot.residency} (level {slot.asleep}{held})"
