"""Housekeeping: the time-driven engines, one function each, and the loop that runs them.

A part of the manager (:mod:`controller.slots`), above :mod:`.leases` and
:mod:`.loading`. Engines: :meth:`~Housekeeping.exits` (a server that exits goes to
``error`` at once), :meth:`~Housekeeping.holds` (batch leases expire),
:meth:`~Housekeeping.idle_and_ttl` (``ready -> idle``; ``ttl_s`` gives the memory back),
:meth:`~Housekeeping.breakers` (60 s healthy ends a crash loop),
:meth:`~Housekeeping.liveness` (a hung server — silent for ``liveness_failures`` probes in
a row — is stopped and goes to ``error``) and
:meth:`~Housekeeping.pressure` (evictions when other memory use grows) and the demand
scaling of replicas (:mod:`.scaling`). Each decision is
revalidated under the slot's lock before it acts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Final

from controller.model.errors import SlotctlError, SlotHealthFailed
from controller.model.events import EvictionReason, Op
from controller.model.lifecycle import DISPATCHABLE_STATES, IdleReason, SlotState
from controller.model.sizes import GIB
from controller.probes.readiness import ProbeOutcome
from controller.runtime.base import RunStatus
from controller.scheduling.eviction import pressure_level, pressure_victims
from controller.slots.core import Core, Part
from controller.slots.leases import Leases
from controller.slots.loading import Loading
from controller.slots.records import ADMITTED_STATES, SlotRecord
from controller.slots.scaling import Scaling

__all__ = ["Housekeeping"]

log = logging.getLogger("slotctl.manager")

S = SlotState
# Loaded slots, whose server the liveness probe watches (``serving`` too: SPEC §5 once
# skipped it, and a server that hung mid-request then held its leases forever).
LIVE_STATES: Final = frozenset({S.READY, S.SERVING, S.IDLE})


class Housekeeping(Part):
    def __init__(self, core: Core, loading: Loading, leases: Leases) -> None:
        super().__init__(core)
        self.loading = loading
        self.leases = leases
        self.scaling = Scaling(core, loading)  # replicas by demand (issue 38)
        # A runtime that tells of changes (its watches, :meth:`mark`): between ticks the
        # exit checks look only at the slots it named, woken at once.
        self.pushed = False
        self.changed: set[str] = set()
        self._wake = asyncio.Event()

    def mark(self, slot: str) -> None:
        """The runtime saw ``slot``'s server change: check it now."""
        self.changed.add(slot)
        self._wake.set()

    async def tick(self) -> None:
        """One pass of every engine. ``run()`` calls it; fake-clock tests call it directly."""
        await self.exits()
        now = self.clock.monotonic()
        for slot in self.table:
            self.leases.expire_holds(slot, now)
            if slot.book.queued:  # leases revoked by a crash end without a release
                self.leases.admit_waiters(slot)
            await self.idle_and_ttl(slot, now)
            self.breakers(slot, now)
        await self.liveness(now)
        await self.pressure()
        await self.scaling.tick()

    async def exits(self, only: set[str] | None = None) -> None:
        """A server that exits goes to error at once; its leases get a typed error.
        ``only``: these slots (the ones a runtime said changed), else all."""
        for slot in self.table:
            if only is not None and slot.name not in only:
                continue
            if slot.state not in DISPATCHABLE_STATES or slot.busy:
                continue
            gen = slot.flight.generation
            observed = await self.runtime.inspect(slot.name)
            if observed.status is RunStatus.RUNNING or slot.busy:
                continue
            if slot.state not in DISPATCHABLE_STATES:
                continue
            detail = await self.loading.exit_detail(slot)
            error = SlotHealthFailed(f"server exited: {detail}", slot=slot.name)
            async with slot.lock:
                # Revalidate: an unload (or unload + reload) may have run while we looked.
                if slot.flight.generation == gen and slot.state in DISPATCHABLE_STATES:
                    await self.loading.fail(slot, Op.PROBE, error, stop=True)

    async def idle_and_ttl(self, slot: SlotRecord, now: float) -> None:
        if slot.busy or slot.book.leases:
            return
        quiet = now - slot.last_used
        idle_after = slot.spec.idle_timeout_s
        if slot.state is S.READY and idle_after > 0 and quiet >= idle_after:
            self.table.set(
                slot,
                S.IDLE,
                op=Op.IDLE,  # nothing is unloaded: the server stays up and serves
                idle_reason=IdleReason.TIMEOUT,
                message=f"no request for {quiet:.0f}s: the server stays up and loaded",
            )
        ttl = slot.spec.ttl_s
        # ttl_s: give the memory back after this long without requests (keep-loaded
        # autoload slots are exempt: autoload means "keep it loaded"). A co-loaded unit's
        # member: after the whole unit's quiet time, and the unit goes (docs/design/0013).
        mates = self.table.usage.unit_mates(slot)
        quiet = now - max([slot.last_used, *(m.last_used for m in mates)])
        keep = slot.spec.autoload or any(m.spec.autoload or m.busy or m.book.leases for m in mates)
        expired = ttl > 0 and quiet >= ttl and not keep
        serving_model = slot.idle_reason != IdleReason.NO_MODEL
        if expired and slot.state in (S.READY, S.IDLE) and serving_model:
            why = f"ttl: no request for {quiet:.0f}s (ttl_s={ttl:g})"
            unloading = self.loading.unloading
            ttl_reason = EvictionReason.TTL
            if await unloading.evict_one(slot, why, reason=ttl_reason, clear_residency=True):
                await unloading.evict_mates(slot, why, ttl_reason, 0, clear_residency=True)

    def breakers(self, slot: SlotRecord, now: float) -> None:
        """Healthy for ``stable_reset_s``: the crash loop is over, the count starts again."""
        stable = slot.ready_at is not None and now - slot.ready_at >= self.config.stable_reset_s
        if stable and slot.breaker.failures and slot.state in DISPATCHABLE_STATES:
            self.table.rearm(slot)

    async def liveness(self, now: float) -> None:
        """Probe every loaded slot that is due, all at once (a hung one costs the tick its
        ``liveness_timeout_s`` once, not once per slot)."""
        due = [slot for slot in self.table if self._liveness_due(slot, now)]
        if due:
            await asyncio.gather(*(self._probe_liveness(slot, now) for slot in due))

    @staticmethod
    def _liveness_due(slot: SlotRecord, now: float) -> bool:
        if slot.state not in LIVE_STATES or slot.busy or slot.launch is None:
            return False
        if slot.idle_reason == IdleReason.NO_MODEL:
            return False
        return now - slot.last_liveness >= slot.spec.liveness_interval_s

    async def _probe_liveness(self, slot: SlotRecord, now: float) -> None:
        """One liveness probe; only silence counts (``ProbeOutcome.HUNG``: a busy server
        answers late or with a 503, and that is alive). ``serving`` slots are probed too:
        a server that hangs mid-stream holds its leases, and the router's upstream idle
        timeout only ends the requests, not the server."""
        launch = slot.launch
        if launch is None or slot.state not in LIVE_STATES:
            return  # unloaded between the choice of the due slots and this probe's turn
        self.table.probed(slot, now)
        gen = slot.flight.generation
        result = await self.prober.liveness(
            launch.endpoint,
            launch.probe,
            slot=slot.name,
            timeout_s=slot.spec.liveness_timeout_s,
        )
        if slot.flight.generation != gen or slot.state not in LIVE_STATES:
            return  # unloaded or reloaded since: the answer is stale
        misses = self.table.liveness(slot, missed=result.outcome is ProbeOutcome.HUNG)
        if not misses:
            await self.loading.sizing.observe(slot)  # its peak while it serves
            return
        failures = slot.spec.liveness_failures
        log.warning(
            "slot %s: liveness probe missed (%d of %d): %s",
            slot.name,
            misses,
            failures,
            result.message,
        )
        if misses >= failures:
            error = SlotHealthFailed(
                f"liveness probe failed {misses} times in a row "
                f"({result.message}): the server is hung, stopping it",
                slot=slot.name,
            )
            await self._stop_hung(slot, gen, error)

    async def _stop_hung(self, slot: SlotRecord, gen: int, error: SlotHealthFailed) -> None:
        """A hung server: its requests end now (every lease revoked, before the stop,
        which can take ``stop_timeout_s`` and the SIGKILL), no new lease reaches it, then
        it fails as a crash does (stopped, ``error``, counted by the breaker), and the
        reconciler restarts it under the breaker."""
        async with slot.lock:
            if slot.flight.generation != gen or slot.state not in LIVE_STATES:
                return
            slot.book.revoke_all(error)
            with slot.book.drain():  # a new request waits for the restart instead
                await self.loading.fail(slot, Op.PROBE, error, stop=True)

    def _recent(self, slot: SlotRecord, *, now: float) -> float:
        return self.core.recent_weight(slot, now)

    async def pressure(self) -> list[str]:
        """Evict under memory pressure: elevated -> one victim, critical -> all eligible.

        Only memory that admission did not hand out counts: a device that slotctl itself
        filled up to the safety margin is not "under pressure" (evicting there would undo
        admission's own decisions, and an autoload slot would flap). Pressure is something
        else — another process, or servers using more than their estimates — taking more
        than the margin.
        """
        evicted: list[str] = []
        margin = int(self.settings.safety_margin_gb * GIB)
        devices = {d for s in self.table if s.state in ADMITTED_STATES for d in s.devices}
        resident = self.table.usage.all_resident_bytes() if devices else {}
        for device in sorted(devices):
            sample = self.memory.sample(device)
            if sample is None:
                continue
            # What the probe sees in use beyond the servers slotctl has up (loads still
            # coming up have not allocated yet: they would hide real pressure).
            used = sample.total_bytes - sample.free_bytes
            if used - resident.get(device, 0) <= margin:
                continue
            level = pressure_level(
                sample.total_bytes,
                sample.free_bytes,
                elevated_frac=self.config.elevated_free_frac,
                critical_frac=self.config.critical_free_frac,
            )
            now = self.clock.monotonic()
            host = self.loading.admission.host_room()  # a victim sleeps where it fits
            candidates = self.table.usage.candidates(functools.partial(self._recent, now=now))
            victims = pressure_victims(candidates, device, level, now, host=host)
            gone = await self.loading.unloading.evict(victims, reason=EvictionReason.PRESSURE)
            if gone:  # a victim may span the devices still to look at: count them anew
                resident = self.table.usage.all_resident_bytes()
            evicted += gone
        return evicted

    async def run(self, stop: asyncio.Event) -> None:
        """Background loop: exit checks every monitor interval, full tick every tick."""
        next_tick = 0.0
        while not stop.is_set():
            try:
                self.table.retry_unpersisted()
                if self.clock.monotonic() >= next_tick:
                    self.changed.clear()
                    await self.tick()
                    next_tick = self.clock.monotonic() + self.config.tick_interval_s
                elif not self.pushed:
                    await self.exits()
                elif self.changed:
                    names, self.changed = self.changed, set()
                    await self.exits(names)
            except SlotctlError as exc:
                log.warning("background tick: %s", exc.message)
            except Exception:  # e.g. OSError (disk full): log it, keep watching the slots
                log.exception("background tick failed; retrying at the next interval")
            await self._pause(stop)

    async def _pause(self, stop: asyncio.Event) -> None:
        """The monitor interval, or less: a stop, or a change the runtime told of."""
        if self.changed:
            return
        self._wake.clear()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(
                waits, timeout=self.config.monitor_interval_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
