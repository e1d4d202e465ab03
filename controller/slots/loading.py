"""Loading: the load flow from a wish to ``ready`` (or a typed failure).

A part of the manager (:mod:`controller.slots`), above :mod:`.admission` and
:mod:`.unloading`. A load runs as one task per slot that explicit loads and cold
acquirers *join* through ``asyncio.shield`` (a cancelled waiter never cancels it for the
others); it takes the group lock, then the slot lock (:mod:`.locks`), has admission's one
admit loop make room and reserve (exclusive-group peers out, victims evicted), pulls,
starts and probes. A wake is a load of an asleep slot through the same loop. Every load
takes a new generation (its :class:`~.flight.LoadFlight`, which this part owns with the
units): a superseded load never touches its replacement.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

from controller.model.errors import (
    InsufficientMemory,
    SlotctlError,
    SlotHealthFailed,
    SlotLoadStopped,
    SlotNotReady,
    SlotSpawnFailed,
)
from controller.model.events import EventKind, Op
from controller.model.lifecycle import DISPATCHABLE_STATES, IdleReason, SlotState
from controller.probes.readiness import ProbeOutcome, ProbeResult
from controller.runtime.base import LaunchSpec
from controller.scheduling.decision import not_activated
from controller.slots.admission import Admission, Walk
from controller.slots.core import Core, Part
from controller.slots.records import RunningServer, SlotRecord
from controller.slots.units import UnitLoads
from controller.slots.unloading import Unloading

__all__ = ["Loading"]

S = SlotState
# How long a load avoids a node the scheduler left the slot's pod Pending on.
AVOID_S: Final = 300.0


class Loading(Part):
    def __init__(self, core: Core, admission: Admission, unloading: Unloading) -> None:
        super().__init__(core)
        self.admission = admission
        self.unloading = unloading
        self.tiers = unloading.residency
        self.pulling = admission.pulling
        self.sizing = admission.sizing
        self.units = UnitLoads(core, admission, unloading, self._load_flow)
        # Called once a new server passed readiness, before the slot is ready (the manager
        # sets it: its adapters re-applied, controller/slots/adapters.py).
        self.before_ready: Callable[[SlotRecord], Awaitable[None]] | None = None
        self.stopping = ""  # why every load is being stopped (the controller stops)

    @staticmethod
    def loaded(slot: SlotRecord) -> bool:
        """Up and serving its model (an asleep server has to wake first)."""
        return slot.state in DISPATCHABLE_STATES and not slot.asleep

    async def load(self, slot: SlotRecord, *, resident: bool, background: bool) -> None:
        """Load (or join the load of) a slot. ``resident`` records the wish to keep it."""
        async with self._wish(slot, resident, background):
            await self.ensure_loaded(slot, background=background)

    async def start_load(self, slot: SlotRecord, *, resident: bool, background: bool) -> None:
        """Start a load and return once its admission is decided (the load goes on)."""
        async with self._wish(slot, resident, background):
            error = await self._until_admitted(slot, background)
            if isinstance(error, InsufficientMemory) and slot.flight.background and not background:
                # A user joined a background load that waits for memory: user demand
                # beats background restore, it gets a load of its own.
                error = await self._until_admitted(slot, background)
            if error is not None:
                raise error

    async def _until_admitted(self, slot: SlotRecord, background: bool) -> BaseException | None:
        """Wait until the slot's load (started if needed) is admitted or ends; its error."""
        task = self._load_task(slot, background=background)
        admitted = slot.flight.admitted
        if task is None or admitted is None:
            return None
        waiter = asyncio.ensure_future(admitted.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done() and not task.cancelled():
            return task.exception()
        return None

    @contextlib.asynccontextmanager
    async def _wish(
        self, slot: SlotRecord, resident: bool, background: bool
    ) -> AsyncIterator[None]:
        """Residency and ``wanted`` around a load; a refused load leaves no wish behind.

        A user's load resumes an autoload slot that a user's unload paused.
        """
        if not slot.spec.activated:
            raise self.table.refuse(slot, Op.LOAD, not_activated(slot.name))
        resumed = not background and self.wishes.resume(slot.name)
        had_wish = self.wishes.is_resident(slot.name)
        since = slot.since
        if resident:
            self.wishes.set_resident(slot.name, slot.spec.model_id)
        try:
            with slot.flight.wanting():
                yield
        except SlotctlError:
            # A *refused* load (no transition happened) changes nothing, residency included.
            # A load that started and failed keeps the wish: like a resident model that
            # fails at start, it shows error and is tried again (restore, reconciler).
            if slot.since == since:
                if resident and not had_wish:
                    self.unloading.clear_resident(slot.name)
                if resumed:
                    self.wishes.pause(slot.name)
            raise

    def _load_task(self, slot: SlotRecord, *, background: bool) -> asyncio.Task[int] | None:
        """The slot's load task (started if none runs); None when already loaded."""
        if self.loaded(slot) and not slot.book.draining:
            return None
        members = self.units.members(slot)
        if members:  # a co-loaded unit: one load task for its members (slots/units.py)
            return self.units.task(slot, members, background=background)
        task = slot.flight.task
        if task is None or task.done():
            task = asyncio.create_task(self._load_flow(slot), name=f"load:{slot.name}")
            task.add_done_callback(_settled)
            slot.flight.begin(task, background=background)
        return task

    async def ensure_loaded(self, slot: SlotRecord, *, background: bool = False) -> None:
        task = self._load_task(slot, background=background)
        if task is None:
            return
        try:
            await self._joined(slot, task)
        except InsufficientMemory:
            # A user's request joined a background load that waits for memory: user
            # demand beats background restore, so it gets a load of its own.
            if background or not slot.flight.background:
                raise
            task = self._load_task(slot, background=False)
            if task is not None:
                await self._joined(slot, task)

    async def _joined(self, slot: SlotRecord, task: asyncio.Task[int]) -> None:
        """Wait for the load ``task``; one stopped under the waiter (the controller stops,
        the slot was removed) is a typed 503 for it, never a cancellation of its own:
        the router answers it instead of dropping its connection."""
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            waiter = asyncio.current_task()
            if not task.cancelled() or (waiter is not None and waiter.cancelling()):
                raise  # the waiter itself was cancelled (its client left)
            why = self.stopping or "stopped before it finished"
            raise SlotLoadStopped(
                f"slot {slot.name!r}: the load this request waited for was stopped ({why}); "
                "try again",
                retry_after_s=5.0,
                slot=slot.name,
            ) from None

    async def _load_flow(self, slot: SlotRecord) -> int:
        """One load; returns the generation it produced (for stale-cleanup checks)."""
        group = slot.model.exclusive_group if slot.model else None
        try:
            async with self.locks.group(group, lambda: self.core.demand(slot)), slot.lock:
                if self.loaded(slot):
                    return slot.flight.generation
                gen = slot.flight.next_generation()
                await self._load_locked(slot, gen)
                return gen
        finally:
            slot.flight.decided()

    async def _load_locked(self, slot: SlotRecord, gen: int) -> None:
        if slot.asleep and await self._wake(slot):
            return  # else the wake failed: the server was stopped, a cold load follows
        # the disk's half first (a pull that cannot fit, a file that cannot be pulled), then
        # the admit loop: exclusive peers out, victims evicted, reserved (or the refusal)
        await self.pulling.admit(slot)
        await self.sizing.estimate(slot)  # its footprint from its file, when on disk
        admitted = await self.admission.admit(slot, Walk.LOAD)
        slot.flight.reserve(self.clock.monotonic())  # its cold load is timed from here
        slot.flight.decided()
        assert admitted.launch is not None
        launch = self.core.placed(slot, admitted.launch)  # the GPUs admission chose
        if admitted.pulling:
            await self._pull(slot, launch, gen)
            launch = await self._resized(slot, launch)
        await self._start_and_probe(slot, launch, gen)

    async def _resized(self, slot: SlotRecord, launch: LaunchSpec) -> LaunchSpec:
        """Its files pulled: estimated from them; an estimate larger than what was
        admitted is admitted again (a refusal fails the load: ``error``), and the launch
        told its new share (vLLM)."""
        before = slot.memory_bytes
        await self.sizing.estimate(slot)
        if slot.memory_bytes <= before:
            return launch
        try:
            await self.admission.admit(slot, Walk.RESIZED)
        except SlotctlError as exc:
            await self.fail(slot, Op.LOAD, exc, stop=False)
            raise
        return self.core.placed(slot, launch)

    async def _wake(self, slot: SlotRecord) -> bool:
        """Wake an asleep slot (its lock held): the admit loop (pinned to the GPUs it sleeps
        on: exclusive peers out, its victims evicted, the tier ``waking``), the wake calls
        and the readiness probe. True: ``ready``. False: the wake failed, or no room can be
        made where it sleeps but a cold load fits elsewhere (one event either way); its
        server is stopped (``offline``): the caller loads it cold, once. A refusal is
        raised: it stays asleep."""
        admitted = await self.admission.admit(slot, Walk.WAKE)
        if admitted.cold:  # no room where it sleeps, room elsewhere: loaded cold there
            where = ", ".join(g.key for g in slot.placement)
            await self._drop_sleeper(slot, f"no room on {where}, where it sleeps")
            return False
        slot.flight.decided()
        flight = slot.flight
        reason = "background" if flight.background else "request" if slot.book.waiters else "load"
        started = self.clock.monotonic()
        launch = slot.launch
        failed = "no server" if launch is None else await self.tiers.wake_server(slot, launch)
        if not failed:
            now = self.clock.monotonic()
            self.table.ready(slot, now)
            self.table.measured(slot, wake_s=now - started)  # recorded with the transition
            self.table.set(slot, S.READY, op=Op.LOAD, message=f"woke in {now - started:.2f}s")
            self.tiers.woke(slot, now - started, reason)
            return True
        await self._drop_sleeper(slot, failed)
        return False

    async def _drop_sleeper(self, slot: SlotRecord, why: str) -> None:
        """A wake that failed (or cannot happen where it sleeps): one event, its server
        stopped, ``offline`` (its memory released), for the cold load that follows."""
        error = self.tiers.wake_failed(slot, why)
        with contextlib.suppress(SlotctlError):
            await self.runtime.stop(slot.name, self.config.stop_timeout_s)
        self.table.run(slot, None)
        self.table.walk(slot, S.OFFLINE, op=Op.LOAD, message=error.message)

    async def _pull(self, slot: SlotRecord, launch: LaunchSpec, gen: int) -> None:
        """``pulling``: the model files (:mod:`.pulling`), then the runtime's image; a
        failure is ``error`` under the breaker, an unload or removal meanwhile ``offline``."""
        if self.core.files is None and launch.model_missing():
            error = SlotSpawnFailed(
                f"model file not found: {launch.model_path} (source {launch.model_source})",
                slot=slot.name,
                path=launch.model_path,
            )
            await self.fail(slot, Op.LOAD, error, stop=False)
            raise error
        try:
            stopped = await self.pulling.fetch(slot)
        except SlotctlError as exc:
            await self.fail(slot, Op.LOAD, exc, stop=False)
            raise
        if stopped is not None:
            raise await self._stopped(slot, stopped)
        self._check_generation(slot, gen)

        async def progress(data: dict[str, Any]) -> None:
            self.events.emit(
                EventKind.PROGRESS,
                Op.LOAD,
                slot=slot.name,
                model=launch.model_id,
                message=str(data.get("status", "")),
                details=data,
            )

        try:  # a no-op when there is nothing (an image present, no pod pull)
            stopped = await self.pulling.prepare(slot, launch, progress)
        except SlotctlError as exc:
            await self.fail(slot, Op.LOAD, exc, stop=False)
            raise
        if stopped is not None:
            raise await self._stopped(slot, stopped)
        self._check_generation(slot, gen)
        self.table.set(slot, S.STARTING, op=Op.LOAD, message="pulled")

    async def _stopped(self, slot: SlotRecord, why: str) -> SlotNotReady:
        """A pull stopped by an unload or a removal: whatever the runtime made for it is
        stopped (a pod pulling its model), ``pulling -> offline`` (no failure of the
        slot's), and the error its load's joiners get."""
        with contextlib.suppress(SlotctlError):
            await self.runtime.stop(slot.name, self.config.stop_timeout_s)
        self.table.set(slot, S.OFFLINE, op=Op.UNLOAD, message=f"pull stopped: {why}")
        return SlotNotReady(
            f"the load of {slot.name!r} was stopped while pulling: {why}", slot=slot.name
        )

    async def _start_and_probe(self, slot: SlotRecord, launch: LaunchSpec, gen: int) -> None:
        launch = self.core.placed(slot, launch)  # told its GPUs' free memory as of now
        try:
            observed = await self.runtime.start(launch)
        except SlotctlError as exc:
            _avoid(slot, exc, self.clock.monotonic())
            await self.fail(slot, Op.LOAD, exc, stop=False)
            raise
        launch = launch.reached_at(observed.endpoint)  # a pod's IP, on a cluster
        self.pulling.used(slot)  # its model files' last use (the GC's order)
        before = slot.where
        self.table.landed(slot, observed.node)
        self.table.run(slot, RunningServer.started(launch))
        self._check_generation(slot, gen)
        if slot.where != before:  # the scheduler put it elsewhere: admitted there again
            try:
                await self.admission.admit(slot, Walk.LANDED)
            except SlotctlError as exc:
                await self.fail(slot, Op.LOAD, exc, stop=True)
                raise
        self.table.set(slot, S.WARMING, op=Op.LOAD, message=f"started ({observed.ident})")
        result = await self.wait_ready(slot, launch)
        self._check_generation(slot, gen)
        await self.settle_probe(slot, result)

    async def wait_ready(self, slot: SlotRecord, launch: LaunchSpec) -> ProbeResult:
        """Readiness probing on the schedule, ended early if the server exits."""

        async def alive() -> bool:
            return (await self.runtime.inspect(slot.name)).running

        return await self.prober.wait_ready(
            launch.endpoint,
            launch.probe,
            slot=slot.name,
            alive=alive,
            warmup_timeout_s=slot.spec.warmup_timeout_s,
            clock=self.clock,
        )

    async def settle_probe(self, slot: SlotRecord, result: ProbeResult) -> None:
        now = self.clock.monotonic()
        if result.outcome is ProbeOutcome.READY:
            self.table.ready(slot, now)
            took = slot.flight.ready(now)
            if took is not None:  # a cold load's cost (recorded with the state)
                self.table.measured(slot, load_s=took)
            if self.before_ready is not None:  # its adapters re-applied (slots/adapters.py)
                await self.before_ready(slot)
            await self.sizing.observe(slot)  # what it holds at ready (with the state)
            self.table.set(slot, S.READY, op=Op.LOAD, message=result.message)
            return
        if result.outcome is ProbeOutcome.NO_MODEL:
            idle = IdleReason.NO_MODEL
            self.table.set(slot, S.IDLE, op=Op.LOAD, message=result.message, idle_reason=idle)
            return
        if result.outcome is ProbeOutcome.EXITED:
            detail = await self.exit_detail(slot)
            error: SlotctlError = SlotSpawnFailed(
                f"server exited while warming: {detail}", slot=slot.name
            )
        else:
            error = SlotHealthFailed(result.message, slot=slot.name)
        await self.fail(slot, Op.LOAD, error, stop=True)
        raise error

    async def exit_detail(self, slot: SlotRecord) -> str:
        observed = await self.runtime.inspect(slot.name)
        lines = await self.runtime.logs(slot.name, tail=5)
        tail = " | ".join(line.strip() for line in lines if line.strip())[-400:]
        return f"{observed.message or 'exited'}; last output: {tail or '(none)'}"

    @staticmethod
    def _check_generation(slot: SlotRecord, gen: int) -> None:
        if slot.flight.generation != gen:
            raise SlotNotReady(f"load of {slot.name!r} was superseded", slot=slot.name)

    async def fail(self, slot: SlotRecord, op: Op, error: SlotctlError, *, stop: bool) -> None:
        """Move a slot to error (through legal steps), count the failure, revoke leases."""
        if stop:
            with contextlib.suppress(SlotctlError):
                await self.runtime.stop(slot.name, self.config.stop_timeout_s)
            self.table.run(slot, None)
        slot.flight.abandon()
        backoff = self.table.failure(slot, error.message)
        slot.book.revoke_all(error)
        message = error.message
        if slot.breaker.failures >= slot.spec.max_consecutive_failures:
            message += (
                f" (failed {slot.breaker.failures} times in a row: next try in {backoff:g}s; "
                f"`slotctl slot reset {slot.name}` retries now)"
            )
        if slot.state is S.IDLE:
            self.table.set(slot, S.UNLOADING, op=op, message=message)
        if slot.state is not S.ERROR:
            self.table.set(slot, S.ERROR, op=op, message=message, error=error)
        error.reported = True  # its transition to error said it: nobody says it again


def _avoid(slot: SlotRecord, error: SlotctlError, now: float) -> None:
    """A pod the scheduler left Pending on the node the placement chose (the kubernetes
    runtime says which, and why): the next loads go elsewhere for :data:`AVOID_S`."""
    node, reason = error.details.get("node"), error.details.get("unschedulable")
    if isinstance(node, str) and reason:
        why = f"the scheduler left the slot's pod Pending there ({reason})"
        slot.flight.avoid(node, now + AVOID_S, why)


def _settled(task: asyncio.Task[int]) -> None:
    """Retrieve a load task's outcome: its joiners got it; nobody else must be warned."""
    if not task.cancelled():
        task.exception()
