"""Recovery: after a controller restart, adopt what runs, finish what was interrupted,
mark what vanished; then restore the wished-for slots in priority order.

A part of the manager (:mod:`controller.slots`), above :mod:`.loading`. Only legal
transitions, never a duplicate start: a running server with the slot's labels is adopted
(probed; one with an outdated config is kept until the reconciler recreates it, or
replaced at once when it does not serve), an unload the previous controller died in is
finished, a server that is gone moves its slot to ``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from controller.model.errors import SlotctlError
from controller.model.events import EventKind, Op
from controller.model.lifecycle import IdleReason, SlotState
from controller.probes.readiness import ProbeOutcome
from controller.runtime.base import LaunchSpec, Observed, RunStatus
from controller.slots.core import Core, Part
from controller.slots.loading import Loading
from controller.slots.records import LOADING_STATES, RunningServer, SlotRecord
from controller.slots.surge import Rollouts

__all__ = ["Recovery"]

log = logging.getLogger("slotctl.manager")

# Slots recovered at once after a restart (their servers probed side by side).
RECOVER_AT_ONCE: Final = 32

S = SlotState


class Recovery(Part):
    def __init__(self, core: Core, loading: Loading, rollouts: Rollouts) -> None:
        super().__init__(core)
        self.loading = loading
        self.rollouts = rollouts

    async def recover(self) -> None:
        """Rebuild the view after a (controller) restart: adopt live servers, mark gone ones.

        Up to :data:`RECOVER_AT_ONCE` slots at once, each under its own lock (a slot's
        recovery changes that slot only): what takes the time is each adopted server's
        probe, and 1,000 of them one after another kept a restarted operator from its first
        decision for ~20 s (issue 39). Every slot is recovered even when one fails; the
        first failure is raised then."""
        gate = asyncio.Semaphore(RECOVER_AT_ONCE)

        async def one(slot: SlotRecord) -> None:
            async with gate, slot.lock:
                await self.rollouts.recover(slot)  # a rollout the restart interrupted
                await self._recover_one(slot)

        outcomes = await asyncio.gather(*(one(s) for s in list(self.table)), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _recover_one(self, slot: SlotRecord) -> None:
        observed = await self.runtime.inspect(slot.name)
        if observed.status is RunStatus.RUNNING and slot.state is S.UNLOADING:
            # The controller died mid-unload: finish it (the wish was to free the memory).
            await self.loading.unloading.stop_runtime(slot, Op.RESTORE)
            message = "unload finished after a restart"
            self.table.set(slot, S.OFFLINE, op=Op.RESTORE, message=message)
            return
        if observed.status is RunStatus.RUNNING:
            await self._adopt(slot, observed)
            return
        if slot.state in (S.OFFLINE, S.ERROR):
            if observed.status is RunStatus.EXITED:
                with contextlib.suppress(SlotctlError):
                    await self.runtime.stop(slot.name, self.config.stop_timeout_s)
            return
        detail = observed.message or "no server found"
        with contextlib.suppress(SlotctlError):
            await self.runtime.stop(slot.name, self.config.stop_timeout_s)
        if slot.state is S.UNLOADING:
            message = "stopped while controller was down"
            self.table.set(slot, S.OFFLINE, op=Op.RESTORE, message=message)
            return
        if slot.state is S.PULLING:
            # No server started yet: the pull stopped with the controller, its bytes kept
            # (the next load resumes it). Not a failure of the slot's.
            message = "pull interrupted by a controller restart: the next load resumes it"
            self.table.set(slot, S.OFFLINE, op=Op.RESTORE, message=message)
            return
        if slot.state is S.IDLE:
            self.table.set(slot, S.UNLOADING, op=Op.RESTORE, message="server vanished")
        self.table.set(
            slot,
            S.ERROR,
            op=Op.RESTORE,
            message=f"server vanished while the controller was down ({detail})",
        )

    async def _adopt(self, slot: SlotRecord, observed: Observed) -> None:
        """A running server with the slot's labels: adopt it (probed), or replace it."""
        try:
            launch = self.core.build_launch(slot)
        except SlotctlError:
            return
        drifted = observed.config_hash != launch.config_hash()
        launch = launch.reached_at(observed.endpoint)  # a pod's IP, on a cluster
        self.table.landed(slot, observed.node)
        self._keep_placement(slot)
        launch = self.core.placed(slot, launch)
        # An adopted server started with an older config reports *its* hash, so the
        # reconciler recreates it (it serves until then).
        server = RunningServer.adopted_as(launch, observed.ident, observed.config_hash)
        self.table.run(slot, server)
        if await self.loading.tiers.asleep_now(slot, launch):
            self._adopt_sleeper(slot, observed)
            return
        endpoint = launch.endpoint
        result = await self.prober.probe(endpoint, launch.probe, slot=slot.name)
        if drifted and result.outcome is not ProbeOutcome.READY:
            # Outdated and not serving (still loading, or no model): replace it now
            # instead of waiting for it to finish loading a config nobody wants.
            with contextlib.suppress(SlotctlError):
                await self.runtime.stop(slot.name, self.config.stop_timeout_s)
            self.table.run(slot, None)
            self.table.walk(
                slot,
                S.OFFLINE,
                op=Op.RESTORE,
                message=f"stopped an adopted server with an outdated config ({result.message})",
            )
            return
        what = f"pid {observed.ident}" if str(observed.ident).isdigit() else observed.ident
        message = f"adopted {slot.name} ({what})"
        self.events.emit(EventKind.ADOPT, Op.RESTORE, slot=slot.name, message=message)
        if result.outcome is ProbeOutcome.READY:
            self.table.ready(slot, self.clock.monotonic())
            if slot.state is not S.IDLE or slot.asleep:  # recorded asleep, but it is awake
                self.table.walk(slot, S.READY, op=Op.RESTORE, message="adopted running server")
        elif result.outcome is ProbeOutcome.NO_MODEL:
            self.table.walk(slot, S.WARMING, op=Op.RESTORE, message="adopted")
            self.table.set(
                slot,
                S.IDLE,
                op=Op.RESTORE,
                idle_reason=IdleReason.NO_MODEL,
                message=result.message,
            )
        else:
            self.table.walk(slot, S.WARMING, op=Op.RESTORE, message="adopted, still warming")
            gen = slot.flight.next_generation()  # a load of sorts: its warm-up goes on
            warming = self._continue_warming(slot, launch, gen)
            self.tasks.spawn(warming, f"warm:{slot.name}")

    def _adopt_sleeper(self, slot: SlotRecord, observed: Observed) -> None:
        """A running server that says it sleeps (``/is_sleeping``): adopted asleep, at the
        level ``state.json`` recorded (else the slot's), counted once: on its host (level
        1), never on its GPUs, which it keeps for its wake."""
        level = slot.asleep or slot.spec.sleep_level
        what = f"pid {observed.ident}" if str(observed.ident).isdigit() else observed.ident
        message = f"adopted {slot.name} asleep at level {level} ({what})"
        self.events.emit(EventKind.ADOPT, Op.RESTORE, slot=slot.name, message=message)
        self.table.seen(slot, self.clock.monotonic())
        if slot.state is S.IDLE:
            self.table.set_tier(slot, asleep=level, waking=False, op=Op.RESTORE, message=message)
            return
        if slot.state is not S.READY:
            self.table.walk(slot, S.WARMING, op=Op.RESTORE, message="adopted")
        self.table.set(slot, S.IDLE, op=Op.RESTORE, message=message, asleep=level)

    def _keep_placement(self, slot: SlotRecord) -> None:
        """An adopted GPU server keeps the GPUs ``state.json`` recorded; one recorded
        without them (by a controller before per-GPU placement, or a record written
        before its load's) is placed now, where it fits without evicting anything,
        and the choice recorded, so its memory is counted on a GPU."""
        if slot.spec.device_kind != "gpu":
            return
        if slot.on_nodes:  # a cluster: counted on the node its pod runs on
            placed = slot.placement[0].node if slot.placement else None
            if slot.landed is None or placed == slot.landed:
                return
        elif slot.placement:
            return
        gpus = self.loading.admission.place_running(slot)
        if gpus:
            self.table.persist_placement(slot, gpus)
            log.info("adopted %s: counted on %s", slot.name, ", ".join(g.key for g in gpus))

    async def _continue_warming(self, slot: SlotRecord, launch: LaunchSpec, gen: int) -> None:
        async with slot.lock:
            if slot.flight.generation != gen or slot.state is not S.WARMING:
                return
            result = await self.loading.wait_ready(slot, launch)
            if slot.flight.generation == gen:
                with contextlib.suppress(SlotctlError):
                    await self.loading.settle_probe(slot, result)

    def report_unknown_residents(self) -> list[str]:
        """Residency wishes for slots the desired state does not have: logged, skipped."""
        unknown = [name for name in self.wishes.resident if name not in self.table.records]
        for name in unknown:
            self.events.emit(
                EventKind.REFUSAL,
                Op.RESTORE,
                slot=name,
                model=self.wishes.resident[name],
                message="resident slot is not in the desired state: skipped",
                error="slot.not_found",
            )
        return unknown

    async def restore(self, *, wait: bool = True) -> dict[str, str]:
        """Load resident and autoload slots in priority order, then catalogue order.

        Each load's admission is decided before the next one starts, so the most important
        slots get the memory first; the loads then run concurrently. These are background
        loads: a slot that does not fit *waits* for memory (it evicts nothing of equal or
        higher priority and nothing used recently). Returns slot -> outcome: the state
        (``wait``: once every load settled; else once admitted) or the refusal's code.
        """
        self.report_unknown_residents()
        position = {name: i for i, name in enumerate(self.table.order)}
        wanted = [
            self.table.records[n]
            for n in self.table.order
            if n in self.table.records
            and self.wishes.keeps_loaded(n, bool(self.table.records[n].spec.autoload))
        ]
        wanted.sort(key=lambda s: (-s.spec.priority, position[s.name]))
        outcomes = {slot.name: await self._restore_one(slot) for slot in wanted}
        if not wait:
            return outcomes
        states = {s.value for s in SlotState}
        for slot in wanted:
            task = slot.flight.task
            if task is None or outcomes[slot.name] not in states:
                continue
            try:
                await asyncio.shield(task)
            except SlotctlError as exc:
                outcomes[slot.name] = exc.code
            else:
                outcomes[slot.name] = slot.state.value
        return outcomes

    async def _restore_one(self, slot: SlotRecord) -> str:
        if not slot.spec.activated:
            return "not activated"
        if self.loading.loaded(slot) or slot.state in LOADING_STATES or slot.busy:
            # Up, or an adopted server still warming (its warm-up holds the slot): waiting
            # for it here would hold the whole start (reconciler, exit checks, /readyz).
            return slot.state.value
        if not self.wishes.keeps_loaded(slot.name, bool(slot.spec.autoload)):
            return "not wanted"  # a load before this one swapped it out of its group
        holder = self.table.usage.group_peers(slot)
        if holder:
            # A peer holds the exclusive group (a user's swap before the restart): a
            # background load never takes it over; the reconciler waits for the group.
            return f"waiting: {holder[0].name} holds the exclusive group"
        try:
            await self.loading.start_load(slot, resident=False, background=True)
        except SlotctlError as exc:
            log.warning("restore of %s: %s", slot.name, exc.message)
            return exc.code
        return slot.state.value
