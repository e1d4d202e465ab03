"""The slot table: the records, catalogue order, views, memory sums, the state writer.

The bottom of the manager's parts (above the plain records, the wishes and the locks).
:meth:`SlotTable.set` is **the one place slot state changes**: it checks the transition
against the legal table, persists ``state.json`` atomically, emits the event and logs the
line. A lease's ``ready``<->``serving`` flip, twice a request, is its lean form,
:meth:`SlotTable.flip`: the same commit, lag write, history and event for the two edges
that concern nothing else (no placement, tier, idle reason or wait), without the generic
checks and with the event built only for whoever takes it (:meth:`EventBus.flip`). Every
other part reads the table and asks it to write — every *fact* of a record, not only its
state (docs/design/0016): the transition and its placement and tier
(:meth:`~SlotTable.set`, :meth:`~SlotTable.flip`, :meth:`~SlotTable.set_tier`,
:meth:`~SlotTable.persist`, :meth:`~SlotTable.persist_placement`), a new record
(:meth:`~SlotTable.add`), the binding (:meth:`~SlotTable.bind`), the server
that runs, replaced whole (:meth:`~SlotTable.run`, :meth:`~SlotTable.landed`), its health
and use (:meth:`~SlotTable.ready`, :meth:`~SlotTable.seen`, :meth:`~SlotTable.probed`,
:meth:`~SlotTable.liveness`, :meth:`~SlotTable.used`), the reload costs
(:meth:`~SlotTable.measured`) and the crash breaker (:meth:`~SlotTable.failure`,
:meth:`~SlotTable.rearm`). tests/unit/test_record_owners.py checks that nobody else does.

One exception to "disk first" (SPEC §3): *observations*, the transitions a restarted
controller derives again by probing — to ``warming``, ``ready``, ``idle`` and the
``ready``↔``serving`` flips of leases (a restarted controller has no leases; a ``serving``
record recovers as ``ready``) — commit in memory at once, and a *lag writer* writes the
slot's latest state within :data:`LAG_WRITE_S` in a worker thread, coalescing the
transitions in between. No request and no load waits on a disk write for them. Intents and
outcomes (``pulling``, ``starting`` with its process record, ``unloading``, ``offline``,
``error``, and any transition that changes the placement) are durable before the slot
changes in memory. Every write intent takes a sequence number and the writes of one table
are serialised by one lock, so a late lag write never overwrites a newer durable one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterator
from typing import Final

from controller.kit.clock import Clock
from controller.kit.eventbus import EventBus
from controller.model.devices import GpuRef
from controller.model.errors import SlotctlError, SlotNotFound, StateWriteFailed
from controller.model.events import EventKind, Op
from controller.model.lifecycle import (
    Candidate,
    IdleReason,
    SlotState,
    can_dispatch,
    check_transition,
    legal_path,
)
from controller.scheduling.rollout import RolloutView, shown_rollout
from controller.slots.records import (
    ADMITTED_STATES,
    ASLEEP,
    WAKING,
    PullView,
    RunningServer,
    Sizing,
    SlotRecord,
    SlotView,
    tier_name,
)
from controller.slots.usage import Surges, Usage
from controller.slots.wishes import Wishes
from controller.spec.schema import ModelSpec, SlotSpec
from controller.store.files import utcnow
from controller.store.state import (
    PlacedGpu,
    ReloadCosts,
    SeenUse,
    SlotStateRecord,
    StateExtra,
    StateStore,
)

__all__ = ["SlotTable"]

log = logging.getLogger("slotctl.manager")

S = SlotState
_HISTORY: Final = 10_000  # transitions kept for tests and the dashboard
_VALUE: Final = {state: state.value for state in S}  # without the enum's descriptor
COST_WEIGHT: Final = 0.3  # a new measured reload cost's weight in its moving average
LAG_WRITE_S: Final = 0.25  # observations within this window reach state.json as one write
# Transitions to these are observations (SPEC §3): they may lag the disk by LAG_WRITE_S.
OBSERVED: Final = frozenset({S.WARMING, S.READY, S.IDLE, S.SERVING})
_ROUTES_MAX: Final = 4096  # models remembered by SlotTable.routes
# The lease flips SlotTable.flip takes, by the state they leave: the one they reach.
_FLIPS: Final = {S.READY: S.SERVING, S.SERVING: S.READY}


class SlotTable:
    def __init__(self, store: StateStore, events: EventBus, clock: Clock, wishes: Wishes) -> None:
        self.store = store
        self.events = events
        self.clock = clock
        self.wishes = wishes
        self.records: dict[str, SlotRecord] = {}
        self.surges: Surges = {}  # a surge's second server's memory (Usage.surges)
        self.rollouts: dict[str, RolloutView] = {}  # shown in views (slots.surge writes)
        # The read side: memory per device, eviction candidates, group and unit mates.
        self.usage = Usage(self.records, self.surges)
        self.models: dict[str, ModelSpec] = {}
        # Catalogue order (restore loads in it), as an ordered set: upsert() checks
        # membership once per slot and pass, so a list made a resync pass O(n²).
        self.order: dict[str, None] = {}
        self.transitions: deque[tuple[str, str, str]] = deque(maxlen=_HISTORY)
        # The router's candidates by the model a request names (routes()): remembered per
        # model until a record is added, bound or forgotten (the writers drop it).
        self._routes: dict[str, tuple[str, ...]] = {}
        # Bumped with every such change (what a model names, a slot's spec or model): the
        # routing generation a routed call's memo is checked against (router/memo.py).
        self.generation = 0
        # Slots whose state.json lags memory: lease flips not written yet (the lag writer
        # has them) or refused by the disk (housekeeping retries: flush_unpersisted).
        self.unpersisted: set[str] = set()
        self._refused: set[str] = set()  # of those, the ones the disk refused
        self._seq: dict[str, int] = {}  # write intents per slot; a stale write is skipped
        self._write_lock = threading.Lock()  # one state.json write at a time (loop + writer)
        self._writer: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lookup

    def get(self, name: str) -> SlotRecord:
        record = self.records.get(name)
        if record is None:
            raise SlotNotFound(name)
        return record

    def __iter__(self) -> Iterator[SlotRecord]:
        return iter(list(self.records.values()))

    def names(self) -> list[str]:
        return list(self.records)

    # ------------------------------------------------------------------ views

    def view(self, slot: SlotRecord) -> SlotView:
        now = self.clock.monotonic()
        launch = slot.launch
        progress = slot.flight.pull_progress
        return SlotView(
            name=slot.name,
            state=slot.state,
            idle_reason=slot.idle_reason,
            dispatchable=can_dispatch(slot.state, slot.idle_reason),
            model_id=slot.model_id,
            device=slot.spec.device,
            priority=slot.spec.priority,
            pinned=bool(slot.spec.pinned),
            autoload=bool(slot.spec.autoload),
            resident=self.wishes.is_resident(slot.name),
            memory_bytes=slot.memory_bytes,
            memory_basis=slot.footprint.basis,
            leases=len(slot.book.leases),
            waiters=slot.book.waiters,
            generation=slot.flight.generation,
            since=slot.since,
            message=slot.message,
            endpoint=launch.endpoint if launch else None,
            failures=slot.breaker.failures,
            retry_after_s=slot.breaker.retry_after(now),
            config_hash=slot.config_hash,
            stack=slot.stack,
            waiting=slot.waiting,
            paused=self.wishes.is_paused(slot.name),
            held_for_s=slot.book.held_for(now),
            holds=slot.book.holds,
            node=slot.node,
            unit=slot.spec.unit,
            gpus=tuple(g.index for g in slot.placement),
            devices=slot.devices if slot.state in ADMITTED_STATES else (),
            requests=slot.requests,
            residency=slot.residency,
            sleep_level=slot.asleep,
            host_bytes=slot.memory_bytes if slot.asleep == 1 else 0,
            can_sleep=launch is not None and launch.sleep is not None,
            load_s=slot.costs.load_s if slot.costs else None,
            wake_s=slot.costs.wake_s if slot.costs else None,
            rollout=shown_rollout(
                self.rollouts.get(slot.name), _VALUE[slot.state], slot.breaker.failures
            ),
            pull=None if progress is None else PullView.of(progress),
            replica_of=slot.spec.replica_group or None,
            replica_index=slot.spec.replica_index,
        )

    def routes(self, model: str) -> tuple[str, ...]:
        """The names of the activated slots serving ``model``, unranked, in table order.

        ``model`` names, in this order of precedence: a catalogue model (the slots bound
        to it), a slot by its name (a self-managed speech server has no catalogue model),
        or a self-managed provider (its model-less slots). What a model names changes
        only when a record is added (:meth:`add`), bound (:meth:`bind`) or forgotten
        (:meth:`forget`), so the answer is remembered until then: the router asks it for
        every request (a dict lookup, not a scan of every slot).
        """
        found = self._routes.get(model)
        if found is None:
            if len(self._routes) >= _ROUTES_MAX:  # models nobody serves, asked for
                self._routes.clear()
            found = self._routes[model] = tuple(s.spec.name for s in self._serving(model))
        return found

    def _serving(self, model: str) -> list[SlotRecord]:
        records = self.records.values()
        found = [s for s in records if s.model_id == model and s.spec.activated]
        if not found:
            named = self.records.get(model)
            found = [named] if named is not None and named.spec.activated else []
        if not found:
            found = [
                s
                for s in records
                if not s.model_id and s.spec.provider == model and s.spec.activated
            ]
        return found

    def routable(self, model: str) -> list[Candidate]:
        """The activated slots serving ``model`` (:meth:`routes`), as the ranking sees
        them (no view built)."""
        records = self.records
        return [
            Candidate(s.name, s.state, s.spec.priority, s.last_used, s.idle_reason)
            for s in (records[name] for name in self.routes(model))
        ]

    # ------------------------------------------------------------------ the writer

    def set(
        self,
        slot: SlotRecord,
        to: SlotState,
        *,
        op: Op,
        message: str = "",
        idle_reason: str | None = None,
        error: SlotctlError | None = None,
        durable: bool | None = None,
        placement: tuple[GpuRef, ...] | None = None,
        asleep: int = 0,
    ) -> None:
        """The one place slot state changes: check, persist, then commit; emit, log.

        ``placement``: the GPUs a load was admitted on (with the transition that reserves
        them); going ``offline`` or to ``error`` releases them. ``asleep``: the sleep
        level of a slot going ``idle`` because its server sleeps (the residency tier);
        any transition ends a wake, and only ``unloading`` keeps a sleeper's level (its
        host memory is held until the server is gone).

        Persist-then-commit: ``state.json`` is written first and only then does the slot
        change in memory, so memory never runs ahead of disk. A failed write raises
        :class:`StateWriteFailed` and changes nothing. The exception are observations
        (to :data:`OBSERVED`, SPEC §3; ``durable=True`` makes one durable all the same):
        they commit at once and the lag writer persists them off the event loop
        (coalesced); a refused lag write fails nothing, and :meth:`flush_unpersisted`
        writes it once the disk can. A transition that changes the placement or the
        residency tier (what the slot holds) is durable.
        """
        current, name = slot.state, slot.name
        check_transition(current, to)
        if to is S.OFFLINE or to is S.ERROR:
            placement = ()
        if to is S.IDLE and asleep:
            idle_reason = IdleReason.ASLEEP
        level = asleep if to is S.IDLE else slot.asleep if to is S.UNLOADING else 0
        placed = placement is not None and placement != slot.placement
        durable = durable is True or to not in OBSERVED or placed or level != slot.asleep
        idle = idle_reason if to is S.IDLE else None
        since = utcnow()
        if durable:
            record = self._record(
                slot, to, idle, message, since, waiting=None, gpus=placement, tier=(level, False)
            )
            try:
                self._write_now(record, durable=True)
            except StateWriteFailed as exc:
                self._write_failed(slot, op, f"{current.value} -> {to.value} not done", exc)
                raise
        if placement is not None:
            slot.placement = placement
        slot.asleep, slot.waking = level, False
        slot.state, slot.idle_reason, slot.message, slot.since = to, idle, message, since
        slot.waiting = None  # any transition ends a wait for memory
        if not durable:
            self._lag(slot)
        before, after = _VALUE[current], _VALUE[to]
        self.transitions.append((name, before, after))
        self.events.emit(
            EventKind.TRANSITION,
            op,
            slot=name,
            model=slot.model_id,
            from_state=before,
            to_state=after,
            message=message,
            error=error.code if error else None,
            details=self._details(slot, op),
        )

    def flip(self, slot: SlotRecord, to: SlotState, message: str) -> None:
        """A lease's flip, ``ready -> serving`` (its first request) or ``serving -> ready``
        (its last one done): what ``set(slot, to, op=Op.LEASE, message=message,
        durable=False)`` does for these two edges — an observation committed in memory,
        written by the lag writer (SPEC §3), one transition in the history, one event
        (``details``: the slot's ``requests``) — without the checks and fields that
        never concern them: a ``ready`` or ``serving`` slot has no idle reason, wait or
        sleep level, and a flip moves no placement. Any other edge goes to :meth:`set`."""
        current = slot.state
        if _FLIPS.get(current) is not to:
            self.set(slot, to, op=Op.LEASE, message=message, durable=False)
            return
        slot.state, slot.idle_reason, slot.message, slot.since = to, None, message, utcnow()
        slot.waiting = None
        slot.asleep, slot.waking = 0, False
        name = slot.spec.name
        # _lag(slot), its common case in line (the lag writer already running: this flip
        # is written with the others): a request's code is run from cold caches, where
        # each function more it touches costs (docs/performance.md, the router).
        seq = self._seq
        seq[name] = seq.get(name, 0) + 1  # _intent
        self.unpersisted.add(name)
        writer = self._writer
        if (
            writer is None
            or writer.done()
            or name in self._refused
            or writer.get_loop().is_closed()
        ):
            self._lag(slot, intent=False)
        before, after = _VALUE[current], _VALUE[to]
        self.transitions.append((name, before, after))
        model = slot.model
        self.events.flip(
            name,
            model.id if model is not None else slot.spec.model_id,
            before,
            after,
            message,
            slot.requests,
        )

    @staticmethod
    def _details(slot: SlotRecord, op: Op) -> dict[str, object]:
        """A transition's details: why a slot is idle; a lease flip's the slot's request
        count (readers fold the flips into it: ``events.LeaseFold``)."""
        details: dict[str, object] = {"idle_reason": slot.idle_reason} if slot.idle_reason else {}
        if op is Op.LEASE:
            details["requests"] = slot.requests
        if slot.asleep:  # the residency tier of an idle slot
            details.update(residency=slot.residency, level=slot.asleep)
        return details

    def _write_failed(self, slot: SlotRecord, op: Op, what: str, exc: StateWriteFailed) -> None:
        self.events.emit(
            EventKind.ERROR,
            op,
            slot=slot.name,
            model=slot.model_id,
            message=f"{what}: {exc.message}",
            error=exc.code,
            details={"path": exc.details.get("path"), "errno": exc.errno},
        )

    # ------------------------------------------------------------------ writes

    def _intent(self, name: str) -> int:
        seq = self._seq.get(name, 0) + 1
        self._seq[name] = seq
        return seq

    def _write_now(self, record: SlotStateRecord, *, durable: bool) -> None:
        """Write on the calling thread (the loop): newer than any lag write in flight."""
        name = record.name
        self._intent(name)
        with self._write_lock:
            self.store.write(record, durable=durable)
        self.unpersisted.discard(name)
        self._refused.discard(name)

    def _write_if_current(self, name: str, seq: int, record: SlotStateRecord) -> bool:
        """The lag writer's write (a worker thread): skipped when a newer intent exists."""
        with self._write_lock:
            if self._seq.get(name) != seq:
                return False
            self.store.write(record, durable=False)
            return True

    def _lag(self, slot: SlotRecord, *, intent: bool = True) -> None:
        """An observation committed in memory: have the lag writer persist it
        (``intent=False``: its intent already counted, by :meth:`flip`)."""
        name = slot.spec.name
        if intent:
            self._intent(name)
            self.unpersisted.add(name)
        if name in self._refused:
            return  # the disk is refusing: housekeeping retries (flush_unpersisted)
        writer = self._writer
        if writer is not None and not writer.done() and not writer.get_loop().is_closed():
            return  # it writes this flip with the others
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): write now, as before
            self._flush_one(slot)
            return
        self._writer = loop.create_task(self._lag_writer(), name="state-lag-writer")

    async def _lag_writer(self) -> None:
        """Write the lagging slots' latest state in a worker thread, until none lags."""
        while True:
            await asyncio.sleep(LAG_WRITE_S)
            batch = [
                (name, self._seq.get(name, 0), self.persisted(slot))
                for name in sorted(self.unpersisted - self._refused)
                if (slot := self.records.get(name)) is not None
            ]
            self.unpersisted.difference_update(
                [n for n in self.unpersisted if n not in self.records]
            )
            if not batch:
                return
            outcome = await asyncio.to_thread(self._write_batch, batch)
            for (name, seq, _), done in zip(batch, outcome, strict=True):
                if isinstance(done, StateWriteFailed):
                    slot = self.records.get(name)
                    if slot is not None and name not in self._refused:
                        self._refused.add(name)
                        self._write_failed(slot, Op.LEASE, "observed state not written", done)
                elif done and self._seq.get(name) == seq:
                    self.unpersisted.discard(name)

    def _write_batch(
        self, batch: list[tuple[str, int, SlotStateRecord]]
    ) -> list[bool | StateWriteFailed]:
        outcome: list[bool | StateWriteFailed] = []
        for name, seq, record in batch:
            try:
                outcome.append(self._write_if_current(name, seq, record))
            except StateWriteFailed as exc:
                outcome.append(exc)
        return outcome

    async def close(self) -> None:
        """Write what lags (best effort: a refusing disk keeps the last written state)."""
        writer, self._writer = self._writer, None
        if writer is not None and not writer.done():
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        self.flush_unpersisted()

    def walk(self, slot: SlotRecord, target: SlotState, *, op: Op, message: str = "") -> None:
        """Reach ``target`` through the shortest chain of legal transitions.

        The slot's placement survives an ``offline``/``error`` step on the way (``ready ->
        error -> starting -> warming`` re-walks an adopted server): only a target of
        ``offline`` or ``error`` releases its GPUs."""
        keep = slot.placement
        for step in legal_path(slot.state, target):
            self.set(slot, step, op=op, message=message, placement=keep)

    def persist(self, slot: SlotRecord, *, waiting: str | None, message: str) -> None:
        """Write a fact that is no transition (waiting for memory, a cleared wait), then
        keep it in memory: a refused write (``StateWriteFailed``) changes nothing."""
        self._write_now(
            self._record(slot, slot.state, slot.idle_reason, message, slot.since, waiting),
            durable=True,
        )
        slot.waiting, slot.message = waiting, message

    def set_tier(
        self, slot: SlotRecord, *, asleep: int, waking: bool, op: Op, message: str
    ) -> None:
        """An idle slot's residency tier changes (its server fell asleep, or a wake holds
        its device memory again): no transition, but durable before the controller acts
        on it (SPEC §3); one event and log line. A refused write changes nothing."""
        assert slot.state is S.IDLE, slot.state
        before, reason = slot.residency, IdleReason.ASLEEP
        tier = (asleep, waking)
        record = self._record(slot, S.IDLE, reason, message, slot.since, slot.waiting, tier=tier)
        try:
            self._write_now(record, durable=True)
        except StateWriteFailed as exc:
            self._write_failed(slot, op, f"{before} -> {record.extra.residency} not done", exc)
            raise
        slot.asleep, slot.waking, slot.idle_reason, slot.message = asleep, waking, reason, message
        self.events.emit(
            EventKind.RESIDENCY,
            op,
            slot=slot.name,
            model=slot.model_id,
            message=message,
            details={"residency": slot.residency, "from": before, "level": asleep},
        )

    def persist_placement(self, slot: SlotRecord, gpus: tuple[GpuRef, ...]) -> None:
        """Record the GPUs of a slot that has none recorded (an adopted server), then keep
        them: a refused write (``StateWriteFailed``) changes nothing."""
        self._write_now(
            self._record(
                slot, slot.state, slot.idle_reason, slot.message, slot.since, slot.waiting, gpus
            ),
            durable=True,
        )
        slot.placement = gpus

    # ------------------------------------------------------------------ other facts
    # The facts that are no transition, each written here only (the record's owners:
    # tests/unit/test_record_owners.py). In memory: state.json takes what it records of
    # them (the server's ident and drift, the costs, the breaker) with the next write.

    def add(self, slot: SlotRecord) -> None:
        """A new slot's record (the manager's upsert), under its name."""
        self.records[slot.spec.name] = slot
        self._routes.clear()
        self.generation += 1

    def bind(self, slot: SlotRecord, spec: SlotSpec, stack: str, model: ModelSpec | None) -> None:
        """The slot's desired binding: its spec, stack and model (the reconciler's upsert,
        a new catalogue). What runs changes only when the reconciler acts on it."""
        if spec is not slot.spec or model is not slot.model:
            self._routes.clear()  # what a model names may change (routes())
            self.generation += 1
        slot.spec, slot.stack, slot.model = spec, stack, model

    def run(self, slot: SlotRecord, server: RunningServer | None) -> None:
        """The server that runs for ``slot`` now, replaced whole: one this controller
        started, one it adopted, a surge's new one; None once it is stopped (no longer
        ready either)."""
        slot.server = server
        if server is None:
            slot.ready_at = None

    def adapter_reserve(self, slot: SlotRecord, size: int) -> None:
        """The device memory ``slot``'s adapters may take (counted in its admission)."""
        slot.adapter_bytes = max(0, size)

    def landed(self, slot: SlotRecord, node: str | None) -> None:
        """Its server runs on ``node``, as the runtime says (a cluster; None: not told)."""
        if node:
            slot.landed = node

    def ready(self, slot: SlotRecord, now: float) -> None:
        """Its server passed readiness (a load, a wake, an adoption): ready, used and
        alive as of ``now``."""
        slot.ready_at = slot.last_used = slot.last_liveness = now
        slot.liveness_misses = 0

    def seen(self, slot: SlotRecord, now: float) -> None:
        """Its server was seen alive and counts as used as of ``now`` (an adopted sleeper:
        not ready, but no idle timeout or liveness probe is due at once)."""
        slot.last_used = slot.last_liveness = now

    def probed(self, slot: SlotRecord, now: float) -> None:
        """A liveness probe of its server starts now."""
        slot.last_liveness = now

    def liveness(self, slot: SlotRecord, *, missed: bool) -> int:
        """A liveness probe's verdict: the misses in a row now (0: it answered)."""
        slot.liveness_misses = slot.liveness_misses + 1 if missed else 0
        return slot.liveness_misses

    def used(self, slot: SlotRecord, now: float, served: bool = False) -> None:
        """A lease taken or given back now (``served``: a request's, done): the ranking's
        recency, and the access count a planned eviction is revalidated against."""
        slot.last_used = now
        slot.access += 1
        if served:
            slot.requests += 1

    def measured(
        self, slot: SlotRecord, *, load_s: float | None = None, wake_s: float | None = None
    ) -> None:
        """Fold one measured cold load or wake into the moving averages (weight
        :data:`COST_WEIGHT`); state.json takes them with the transition that follows."""
        costs = slot.costs
        if costs is None or costs.model != slot.model_id:
            costs = ReloadCosts(model=slot.model_id)

        def fold(old: float | None, new: float | None) -> float | None:
            if new is None:
                return old
            return round(new if old is None else old + COST_WEIGHT * (new - old), 4)

        slot.costs = costs.model_copy(
            update={"load_s": fold(costs.load_s, load_s), "wake_s": fold(costs.wake_s, wake_s)}
        )

    def sized(self, slot: SlotRecord, sizing: Sizing | None) -> None:
        """What the slot's model file and launch say it will hold (``slots.sizing``: read
        before a load, the dry run, ``model footprint``); None: nothing to read."""
        slot.sizing = sizing

    def observed(
        self, slot: SlotRecord, config_hash: str, device: int, host: int, source: str
    ) -> SeenUse:
        """One sample of what its server holds: the peak per model and launch config
        (another config starts over); state.json takes it with the next write."""
        seen = slot.seen
        if seen is None or seen.model != slot.model_id or seen.config_hash != config_hash:
            seen = SeenUse(model=slot.model_id, config_hash=config_hash)
        grew = device > seen.device_bytes or host > seen.host_bytes
        slot.seen = seen.model_copy(
            update={
                "device_bytes": max(seen.device_bytes, device),
                "host_bytes": max(seen.host_bytes, host),
                "source": source,
                "samples": seen.samples + 1,
                "at": utcnow() if grew else seen.at,
            }
        )
        return slot.seen

    def warned(self, slot: SlotRecord, key: str) -> bool:
        """Whether ``key`` was said of the slot already (then True); remembers it."""
        if key in slot.warned:
            return True
        slot.warned = slot.warned | {key}
        return False

    def failure(self, slot: SlotRecord, message: str) -> float:
        """One failed load (or rollout) on the crash-loop breaker; its backoff (seconds).
        The failure count reaches state.json with the ``error`` transition after it."""
        now = self.clock.monotonic()
        return slot.breaker.record_failure(now, message, slot.spec.max_consecutive_failures)

    def rearm(self, slot: SlotRecord) -> None:
        """The crash-loop breaker starts again (a reset, a changed config, a server that
        stayed healthy, a rollout done)."""
        slot.breaker.reset()

    def retry_unpersisted(self) -> None:
        """Housekeeping, each interval: write, on the loop, the lease states the disk
        refused; the others too when no lag writer runs, but not those a running lag
        writer is about to write in its thread (a write on the loop per interval, before,
        under steady traffic)."""
        writer = self._writer
        if writer is None or writer.done():
            self.flush_unpersisted()
        elif self._refused & self.unpersisted:
            self._flush(sorted(self._refused & self.unpersisted))

    def flush_unpersisted(self) -> None:
        """Write the state of every slot whose state.json lags memory, now (``close``
        ends with it; housekeeping through :meth:`retry_unpersisted`)."""
        self._flush(sorted(self.unpersisted))

    def _flush(self, names: list[str]) -> None:
        for name in names:
            slot = self.records.get(name)
            if slot is None:
                self.unpersisted.discard(name)
                continue
            if not self._flush_one(slot):
                return  # still refused: next interval

    def _flush_one(self, slot: SlotRecord) -> bool:
        try:
            self._write_now(self.persisted(slot), durable=False)
        except StateWriteFailed as exc:
            if slot.name not in self._refused:
                self._refused.add(slot.name)
                self._write_failed(slot, Op.LEASE, "observed state not written", exc)
            return False
        return True

    def forget(self, name: str) -> None:
        """Drop a removed slot and its state file (a lag write in flight is skipped)."""
        gone = self.records.pop(name, None)
        self._routes.clear()
        self.generation += 1
        if gone is not None:
            gone.book.end_turns()
        self.rollouts.pop(name, None)
        self._intent(name)
        self.unpersisted.discard(name)
        self._refused.discard(name)
        with self._write_lock:
            self.store.delete(name)

    def persisted(self, slot: SlotRecord) -> SlotStateRecord:
        """The slot as ``state.json`` holds it now."""
        return self._record(
            slot, slot.state, slot.idle_reason, slot.message, slot.since, slot.waiting
        )

    def _record(
        self,
        slot: SlotRecord,
        state: SlotState,
        idle_reason: str | None,
        message: str,
        since: str,
        waiting: str | None,
        gpus: tuple[GpuRef, ...] | None = None,
        tier: tuple[int, bool] | None = None,
    ) -> SlotStateRecord:
        """The slot as ``state.json`` holds it, with these values (the breaker serialises
        itself; ``gpus``: a new placement, else the slot's own; ``tier``: (sleep level,
        waking), else the slot's own)."""
        breaker = slot.breaker.to_record(self.clock.monotonic(), self.clock.time())
        placed = slot.placement if gpus is None else gpus
        level, waking = (slot.asleep, slot.waking) if tier is None else tier
        extra = StateExtra(
            idle_reason=idle_reason,
            adopted=slot.server.adopted if slot.server is not None else None,
            config_drift=slot.server is not None and slot.server.drifted,
            waiting=waiting,
            gpus=tuple(
                PlacedGpu(index=g.index, uuid=g.uuid, vendor=g.vendor, node=g.node) for g in placed
            ),
            residency=tier_name(level, waking),
            sleep_level=level,
            reload=slot.costs,
            seen=slot.seen,
            **breaker,
        )
        return SlotStateRecord(
            name=slot.name,
            state=state,
            model_id=slot.model_id,
            port=slot.launch.port if slot.launch is not None else slot.spec.port,
            updated_at=since,
            message=message,
            extra=extra,
        )

    def load_persisted(self, slot: SlotRecord) -> None:
        """A new record starts from its ``state.json`` (an unreadable one is ignored)."""
        try:
            saved = self.store.read(slot.name)
        except SlotctlError as exc:
            log.warning("ignoring unreadable state of slot %s: %s", slot.name, exc)
            return
        if saved is None:
            return
        slot.state, slot.message, slot.since = saved.state, saved.message, saved.updated_at
        slot.idle_reason = saved.extra.idle_reason
        slot.costs = saved.extra.reload
        slot.seen = saved.extra.seen
        if slot.state in ADMITTED_STATES:
            slot.placement = tuple(
                GpuRef(g.index, g.uuid, g.vendor, g.node) for g in saved.extra.gpus
            )
        if slot.state in (S.IDLE, S.UNLOADING) and saved.extra.residency in (ASLEEP, WAKING):
            # A wake the previous controller died in is a sleeper until its server says
            # otherwise (recovery asks it), counted once.
            level = saved.extra.sleep_level
            slot.asleep = level if level in (1, 2) else 1
            if slot.state is S.IDLE:
                slot.idle_reason = IdleReason.ASLEEP
        if slot.state is S.SERVING:
            # A new table has no leases: a ``serving`` record (its lease flip back to ready
            # lagged, or the controller died mid-request) recovers as ``ready`` (SPEC §3),
            # on disk too (a refusing disk: housekeeping writes it later).
            slot.state = S.READY
            self.unpersisted.add(slot.name)
            self._flush_one(slot)
        if saved.extra.failures > 0 and slot.state is S.ERROR:
            # The crash-loop breaker survives a controller restart.
            slot.breaker.restore(
                saved.extra.failures,
                saved.extra.retry_at,
                slot.message,
                self.clock.monotonic(),
                self.clock.time(),
            )

    def refuse(self, slot: SlotRecord, op: Op, error: SlotctlError) -> SlotctlError:
        """A refused operation: one event and log line (and the error marked reported)."""
        error.reported = True
        self.events.emit(
            EventKind.REFUSAL,
            op,
            slot=slot.name,
            model=slot.spec.model_id,
            message=error.message,
            error=error.code,
            details={k: v for k, v in error.details.items() if k != "problems"},
        )
        return error
