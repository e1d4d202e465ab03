"""The SlotManager: the single lifecycle authority. Only this module changes slot state.

Callers: the reconciler (desired state), the HTTP API and CLI (load/unload/swap/reset/
hold), the router (acquire/release). Below it: the runtime (start/stop/inspect), the
prober (readiness, liveness), memory probes and the eviction planner, the store
(state.json, residency.json) and the event bus.

Every change goes through :func:`~controller.lifecycle.check_transition`, is persisted
atomically, emitted as an event and logged as one line. Concurrency rules:

* one operation at a time per slot (``_Slot.lock``); independent slots run concurrently;
* lock order is exclusive-group lock -> slot lock -> device (admission) lock, and an
  eviction only takes a victim's lock when it is free, so no cycle can form;
* a load runs as one task per slot: explicit loads and cold acquirers *join* it through
  ``asyncio.shield``, so a cancelled waiter never cancels the load for the others;
* every load bumps the slot's generation; a stale load or cleanup compares generations and
  never touches its replacement.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from controller.breaker import Breaker
from controller.clock import SYSTEM_CLOCK, Clock
from controller.decision import (
    WAITING_FOR_MEMORY,
    GroupPeer,
    LoadDecision,
    LoadRequest,
    MemoryFacts,
    decide_load,
    not_activated,
)
from controller.errors import (
    InsufficientMemory,
    ModelNotFound,
    SlotctlError,
    SlotHealthFailed,
    SlotNotFound,
    SlotNotReady,
    SlotPinned,
    SlotQueueFull,
    SlotSpawnFailed,
    SlotTerminateTimeout,
    StateWriteFailed,
)
from controller.events import EventBus
from controller.eviction import (
    EvictionCandidate,
    Victim,
    pressure_level,
    pressure_victims,
)
from controller.lifecycle import (
    DISPATCHABLE_STATES,
    LEGAL_TRANSITIONS,
    IdleReason,
    SlotState,
    can_dispatch,
    check_transition,
)
from controller.memory import GIB, MemoryProbe, SystemMemoryProbe
from controller.probe import HttpProber, ProbeOutcome, Prober, ProbeResult
from controller.providers import BuildContext, build_launch
from controller.runtime.base import LaunchSpec, RunStatus, Runtime
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from controller.store import ResidencyStore, SlotStateRecord, StateStore, utcnow
from controller.units import format_gib

__all__ = ["Lease", "ManagerConfig", "SlotManager", "SlotView"]

log = logging.getLogger("slotctl.manager")

S = SlotState
# Memory is admitted from the moment a load passes admission (pulling) until the server
# is gone (unloading -> offline).
ADMITTED_STATES: Final = frozenset(
    {S.PULLING, S.STARTING, S.WARMING, S.READY, S.SERVING, S.IDLE, S.UNLOADING}
)
_LOADING_STATES: Final = frozenset({S.PULLING, S.STARTING, S.WARMING})
_POLL_S: Final = 0.02
_SETTLE_SPINS: Final = 50  # loop iterations for resuming waiters (a few suffice)


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    stop_timeout_s: float = 10.0  # graceful stop before SIGKILL
    exclusive_wait_s: float = 120.0  # bound on waiting for a group peer to unload
    monitor_interval_s: float = 0.25  # exit detection in run()
    tick_interval_s: float = 1.0  # idle/ttl/liveness/pressure in run()
    breaker_base_s: float = 1.0
    breaker_cap_s: float = 300.0
    stable_reset_s: float = 60.0
    elevated_free_frac: float = 0.10
    critical_free_frac: float = 0.05
    models_dir: Path | None = None


class Lease:
    """A claim on a slot for one request (or a batch job): keeps it loaded and serving."""

    _ids = itertools.count(1)

    def __init__(self, slot: str, generation: int, expires_at: float | None = None) -> None:
        self.id = next(Lease._ids)
        self.slot = slot
        self.generation = generation
        self.expires_at = expires_at
        self.released = False
        self.error: SlotctlError | None = None
        self.lost = asyncio.Event()

    def revoke(self, error: SlotctlError) -> None:
        """The slot went away under this lease (crash, forced unload)."""
        if self.error is None:
            self.error = error
        self.lost.set()

    def check(self) -> None:
        """Raise the typed error if the lease was revoked."""
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        return f"Lease({self.slot!r}, id={self.id}, gen={self.generation})"


@dataclass(frozen=True, slots=True)
class SlotView:
    """Read-only snapshot of one slot for the API, CLI, metrics and tests."""

    name: str
    state: SlotState
    idle_reason: str | None
    model_id: str
    device: str
    priority: int
    pinned: bool
    autoload: bool
    resident: bool
    memory_bytes: int
    leases: int
    waiters: int
    generation: int
    since: str
    message: str
    endpoint: str | None
    failures: int
    retry_after_s: float
    config_hash: str | None
    stack: str
    waiting: str | None = None  # "waiting_for_memory": a background load waits for room
    paused: bool = False  # an autoload slot a user unloaded: stays unloaded until a load
    held_for_s: float | None = None  # until the last batch hold (``hold``) expires
    holds: int = 0  # batch holds among ``leases`` (the rest are requests in flight)

    @property
    def dispatchable(self) -> bool:
        return can_dispatch(self.state, self.idle_reason)


def _held_for(slot: _Slot, now: float) -> float | None:
    holds = [lease.expires_at for lease in slot.leases.values() if lease.expires_at is not None]
    return round(max(0.0, max(holds) - now), 1) if holds else None


@dataclass(slots=True)
class _Slot:
    spec: SlotSpec
    stack: str
    model: ModelSpec | None
    breaker: Breaker
    state: SlotState = S.OFFLINE
    idle_reason: str | None = None
    message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    since: str = field(default_factory=utcnow)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    load_task: asyncio.Task[int] | None = None
    generation: int = 0
    leases: dict[int, Lease] = field(default_factory=dict)
    waiters: int = 0
    wanted: int = 0  # explicit load() calls in flight
    draining: bool = False
    last_used: float = 0.0
    access: int = 0
    ready_at: float | None = None
    launch: LaunchSpec | None = None
    # Config hash of the server that actually runs when it is not ``launch``'s: a server
    # adopted after a restart that was started with an older config (the reconciler
    # recreates it). None: the running server is ``launch``.
    running_hash: str | None = None
    liveness_misses: int = 0
    last_liveness: float = 0.0
    # The running load's flavour (background: the reconciler or the restore, which may
    # not evict at will) and the event set once its admission is decided.
    background: bool = False
    admitted: asyncio.Event | None = None
    waiting: str | None = None  # WAITING_FOR_MEMORY while a background load waits

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def memory_bytes(self) -> int:
        if self.spec.memory_gb is not None:
            return int(self.spec.memory_gb * GIB)
        return self.model.memory_bytes if self.model else 0

    @property
    def busy(self) -> bool:
        return self.lock.locked() or (self.load_task is not None and not self.load_task.done())


class SlotManager:
    """See the module docstring. Construct, ``await set_desired(...)``, ``await start()``."""

    def __init__(
        self,
        *,
        runtime: Runtime,
        state_dir: Path,
        config_dir: Path,
        settings: ControllerSettings | None = None,
        prober: Prober | None = None,
        memory: MemoryProbe | None = None,
        clock: Clock = SYSTEM_CLOCK,
        events: EventBus | None = None,
        config: ManagerConfig | None = None,
    ) -> None:
        self.runtime = runtime
        self.store = StateStore(state_dir)
        self.residency = ResidencyStore(config_dir)
        self._resident: dict[str, str] = {n: e.model_id for n, e in self.residency.read().items()}
        # Autoload slots a user unloaded: not reloaded until a user's load resumes them.
        self._paused: dict[str, str] = self.residency.read_paused()
        self.settings = settings or ControllerSettings()
        self.prober: Prober = prober or HttpProber(logs=runtime)
        self.memory: MemoryProbe = memory or SystemMemoryProbe()
        self.clock = clock
        self.events = events or EventBus()
        self.config = config or ManagerConfig()
        self.models: dict[str, ModelSpec] = {}
        self._slots: dict[str, _Slot] = {}
        # Catalogue order (restore loads in it), as an ordered set: upsert() checks
        # membership once per slot and pass, so a list made a resync pass O(n²).
        self._order: dict[str, None] = {}
        self._group_locks: dict[str, asyncio.Lock] = {}
        self._device_locks: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._unpersisted: set[str] = set()  # lease transitions the disk refused (full)
        self._drains_ended = False  # end_drains(): stop waiting for in-flight requests
        self.transitions: deque[tuple[str, str, str]] = deque(maxlen=10_000)

    # ================================================================= desired state

    async def set_desired(self, desired: DesiredState) -> None:
        """Take the catalogue and slot specs; new slots start from their state.json.

        Slots no longer desired stay known (``orphans()``) until :meth:`remove`.
        Scheduling knobs (priority, pinned, timeouts) apply in place.
        """
        self.set_models(desired.models, order=list(desired.slots))
        for desired_slot in desired.slots.values():
            self.upsert(desired_slot)

    def set_models(self, models: Mapping[str, ModelSpec], order: list[str] | None = None) -> None:
        """Replace the catalogue (and the catalogue order used by restore)."""
        self.models = dict(models)
        if order is not None:
            self._order = dict.fromkeys(order)
        for slot in self._slots.values():
            if slot.spec.model_id:
                slot.model = self.models.get(slot.spec.model_id, slot.model)

    def group_holder(self, name: str) -> str | None:
        """A peer holding ``name``'s exclusive group (loading or loaded), if any."""
        slot = self._slots.get(name)
        peers = self._group_peers(slot) if slot is not None else []
        return peers[0].name if peers else None

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def is_paused(self, name: str) -> bool:
        return name in self._paused

    def _keeps_loaded(self, slot: _Slot) -> bool:
        """Autoload (unless a user paused it) or a residency wish: keep it loaded."""
        autoload = bool(slot.spec.autoload) and slot.name not in self._paused
        return autoload or slot.name in self._resident

    def known(self, name: str) -> SlotSpec | None:
        """The spec the manager currently applies to ``name`` (None: unknown slot)."""
        slot = self._slots.get(name)
        return slot.spec if slot else None

    def upsert(self, desired: DesiredSlot) -> None:
        """Add a slot (its state restored from state.json) or update its spec in place.

        In place means no restart: scheduling knobs take effect at once; a changed runtime
        config is the reconciler's to act on (recreate). A config change re-arms a slot
        the crash-loop breaker blocked.
        """
        self._order.setdefault(desired.name)
        model = self.models.get(desired.spec.model_id) if desired.spec.model_id else None
        slot = self._slots.get(desired.name)
        if slot is None:
            breaker = Breaker(self.config.breaker_base_s, self.config.breaker_cap_s)
            slot = _Slot(spec=desired.spec, stack=desired.stack, model=model, breaker=breaker)
            self._restore_record(slot)
            self._slots[desired.name] = slot
            return
        old_hash = self._launch_hash(slot)
        slot.spec, slot.stack, slot.model = desired.spec, desired.stack, model
        if old_hash != self._launch_hash(slot):
            slot.breaker.reset()
        self._unwait_if_unwanted(slot)

    def _launch_hash(self, slot: _Slot) -> str | None:
        try:
            return self._build_launch(slot).config_hash()
        except SlotctlError:
            return None

    def _restore_record(self, slot: _Slot) -> None:
        try:
            record = self.store.read(slot.name)
        except SlotctlError as exc:
            log.warning("ignoring unreadable state of slot %s: %s", slot.name, exc)
            record = None
        if record is not None:
            slot.state = record.state
            slot.message = record.message
            slot.since = record.updated_at
            slot.extra = {k: v for k, v in record.extra.items() if k != "waiting"}
            slot.idle_reason = record.extra.get("idle_reason")
            self._restore_breaker(slot)

    def _restore_breaker(self, slot: _Slot) -> None:
        """The crash-loop breaker survives a controller restart (state.json ``extra``)."""
        try:
            failures = int(slot.extra.get("failures", 0) or 0)
            retry_at = float(slot.extra.get("retry_at", 0) or 0)
        except (TypeError, ValueError):
            return
        if failures <= 0 or slot.state is not S.ERROR:
            return
        slot.breaker.failures = failures
        slot.breaker.last_error = slot.message
        wait = max(0.0, retry_at - self.clock.time())
        slot.breaker.blocked_until = self.clock.monotonic() + wait

    def launch_hash(self, desired: DesiredSlot) -> str | None:
        """The config hash ``desired`` would run with on this manager's runtime."""
        model = self.models.get(desired.spec.model_id) if desired.spec.model_id else None
        probe = _Slot(spec=desired.spec, stack=desired.stack, model=model, breaker=Breaker())
        return self._launch_hash(probe)

    async def reap_orphan(self, name: str) -> bool:
        """Stop a managed runtime object that no slot owns any more (labels say it is ours)."""
        if name in self._slots:
            return False
        observed = await self.runtime.inspect(name)
        if observed.status is RunStatus.MISSING or not observed.managed:
            return False
        await self.runtime.stop(name, self.config.stop_timeout_s)
        self.events.emit(
            "eviction", "reconcile", slot=name, message="stopped a managed server nobody declares"
        )
        return True

    # ================================================================= views

    def _get(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise SlotNotFound(name)
        return slot

    def view(self, name: str) -> SlotView:
        slot = self._get(name)
        now = self.clock.monotonic()
        launch = slot.launch
        return SlotView(
            name=slot.name,
            state=slot.state,
            idle_reason=slot.idle_reason,
            model_id=slot.model.id if slot.model else slot.spec.model_id,
            device=slot.spec.device,
            priority=slot.spec.priority,
            pinned=bool(slot.spec.pinned),
            autoload=bool(slot.spec.autoload),
            resident=slot.name in self._resident,
            memory_bytes=slot.memory_bytes,
            leases=len(slot.leases),
            waiters=slot.waiters,
            generation=slot.generation,
            since=slot.since,
            message=slot.message,
            endpoint=launch.endpoint if launch else None,
            failures=slot.breaker.failures,
            retry_after_s=slot.breaker.retry_after(now),
            config_hash=slot.running_hash or (launch.config_hash() if launch else None),
            stack=slot.stack,
            waiting=slot.waiting,
            paused=slot.name in self._paused,
            held_for_s=_held_for(slot, now),
            holds=sum(1 for lease in slot.leases.values() if lease.expires_at is not None),
        )

    def views(self) -> list[SlotView]:
        return [self.view(n) for n in self._slots]

    def names(self) -> list[str]:
        return list(self._slots)

    def admitted_bytes(self, device: str) -> int:
        return sum(
            s.memory_bytes
            for s in self._slots.values()
            if s.spec.device == device and s.state in ADMITTED_STATES
        )

    def resident_bytes(self, device: str) -> int:
        """Bytes of the servers that are up on ``device`` (what a memory probe can see)."""
        return self.admitted_bytes(device) - self._reserved_bytes(device, None)

    def lease_count(self) -> int:
        return sum(len(s.leases) for s in self._slots.values())

    def last_used(self, name: str) -> float:
        """Monotonic time of the slot's last lease or release (the ranking's recency)."""
        return self._get(name).last_used

    # ================================================================= transitions

    def _set(
        self,
        slot: _Slot,
        to: SlotState,
        *,
        op: str,
        message: str = "",
        idle_reason: str | None = None,
        error: SlotctlError | None = None,
        durable: bool = True,
    ) -> None:
        """The one place slot state changes: check, persist, then commit; emit, log.

        Persist-then-commit: ``state.json`` is written first and only then does the slot
        change in memory, so memory never runs ahead of disk. A failed write raises
        :class:`StateWriteFailed` and changes nothing — except a non-``durable`` lease
        transition (ready <-> serving), which must not fail a request that a ready server
        can answer: it commits, and :meth:`flush_unpersisted` writes it once the disk can.
        """
        current = slot.state
        check_transition(current, to)
        idle = idle_reason if to is S.IDLE else None
        since = utcnow()
        extra = {k: v for k, v in slot.extra.items() if k not in ("idle_reason", "waiting")}
        if idle:
            extra["idle_reason"] = idle
        model_id = slot.model.id if slot.model else slot.spec.model_id
        record = SlotStateRecord(
            name=slot.name,
            state=to,
            model_id=model_id,
            port=slot.spec.port,
            updated_at=since,
            message=message,
            extra=extra,
        )
        try:
            self.store.write(record, durable=durable)
        except StateWriteFailed as exc:
            if durable or slot.name not in self._unpersisted:
                self.events.emit(
                    "error",
                    op,
                    slot=slot.name,
                    model=model_id,
                    message=f"{current.value} -> {to.value} not done: {exc.message}",
                    error=exc.code,
                    details={"path": exc.details.get("path"), "errno": exc.errno},
                )
            if durable:
                raise
            self._unpersisted.add(slot.name)
        else:
            self._unpersisted.discard(slot.name)
        slot.state, slot.idle_reason, slot.message = to, idle, message
        slot.since, slot.extra = since, extra
        slot.waiting = None  # any transition ends a wait for memory
        self.transitions.append((slot.name, current.value, to.value))
        self.events.emit(
            "transition",
            op,
            slot=slot.name,
            model=model_id,
            from_state=current.value,
            to_state=to.value,
            message=message,
            error=error.code if error else None,
            details={"idle_reason": slot.idle_reason} if slot.idle_reason else {},
        )

    def _record(self, slot: _Slot) -> SlotStateRecord:
        """The slot as persisted in state.json."""
        extra = dict(slot.extra)
        if slot.waiting:
            extra["waiting"] = slot.waiting
        return SlotStateRecord(
            name=slot.name,
            state=slot.state,
            model_id=slot.model.id if slot.model else slot.spec.model_id,
            port=slot.spec.port,
            updated_at=slot.since,
            message=slot.message,
            extra=extra,
        )

    def flush_unpersisted(self) -> None:
        """Write the state of slots whose lease transition the disk refused (housekeeping)."""
        for name in sorted(self._unpersisted):
            slot = self._slots.get(name)
            if slot is None:
                self._unpersisted.discard(name)
                continue
            try:
                self.store.write(self._record(slot), durable=False)
            except StateWriteFailed:
                return  # still full: next interval
            self._unpersisted.discard(name)

    def _walk(self, slot: _Slot, target: SlotState, *, op: str, message: str = "") -> None:
        """Reach ``target`` through the shortest chain of legal transitions."""
        path = _legal_path(slot.state, target)
        for step in path:
            self._set(slot, step, op=op, message=message)

    def _refuse(self, slot: _Slot, op: str, error: SlotctlError) -> SlotctlError:
        error.reported = True
        self.events.emit(
            "refusal",
            op,
            slot=slot.name,
            model=slot.spec.model_id,
            message=error.message,
            error=error.code,
            details={k: v for k, v in error.details.items() if k != "problems"},
        )
        return error

    # ================================================================= load

    def _loaded(self, slot: _Slot) -> bool:
        return slot.state in DISPATCHABLE_STATES

    async def load(self, name: str, *, resident: bool = True, background: bool = False) -> SlotView:
        """Load (or join the load of) a slot. ``resident`` records the wish to keep it.

        ``background``: the reconciler or the restore keeping a slot loaded, not a user:
        such a load evicts only lower-priority slots idle for ``min_resident_s`` and
        otherwise waits for memory (:mod:`controller.decision`). A load of a loaded slot
        is a no-op that answers the current state.
        """
        slot = self._get(name)
        async with self._wish(slot, resident, background):
            await self._ensure_loaded(slot, background=background)
        return self.view(name)

    async def start_load(
        self, name: str, *, resident: bool = True, background: bool = False
    ) -> SlotView:
        """Start a load and return once its admission is decided (the load goes on).

        Raises the typed refusal when the load is refused; for the API's ``202 loading``
        and the ordered restore at start. Joins a load already in flight at once.
        """
        slot = self._get(name)
        async with self._wish(slot, resident, background):
            error = await self._until_admitted(slot, background)
            if isinstance(error, InsufficientMemory) and slot.background and not background:
                # A user joined a background load that waits for memory: user demand
                # beats background restore, it gets a load of its own.
                error = await self._until_admitted(slot, background)
            if error is not None:
                raise error
        return self.view(name)

    async def _until_admitted(self, slot: _Slot, background: bool) -> BaseException | None:
        """Wait until the slot's load (started if needed) is admitted or ends; its error."""
        task = self._load_task(slot, background=background)
        if task is None or slot.admitted is None:
            return None
        waiter = asyncio.ensure_future(slot.admitted.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done() and not task.cancelled():
            return task.exception()
        return None

    @contextlib.asynccontextmanager
    async def _wish(self, slot: _Slot, resident: bool, background: bool) -> AsyncIterator[None]:
        """Residency and ``wanted`` around a load; a refused load leaves no wish behind.

        A user's load resumes an autoload slot that a user's unload paused.
        """
        if not slot.spec.activated:
            raise self._refuse(slot, "load", not_activated(slot.name))
        if not background and self._paused.pop(slot.name, None) is not None:
            self.residency.resume(slot.name)
        previous = self._resident.get(slot.name)
        since = slot.since
        if resident:
            self._set_resident(slot.name, slot.spec.model_id)
        slot.wanted += 1
        try:
            yield
        except SlotctlError:
            # A *refused* load (no transition happened) changes nothing, residency included.
            # A load that started and failed keeps the wish: like a resident model that
            # fails at start, it shows error and is tried again (restore, reconciler).
            if resident and previous is None and slot.since == since:
                self._clear_resident(slot.name)
            raise
        finally:
            slot.wanted -= 1

    def _load_task(self, slot: _Slot, *, background: bool) -> asyncio.Task[int] | None:
        """The slot's load task (started if none runs); None when already loaded."""
        if self._loaded(slot) and not slot.draining:
            return None
        task = slot.load_task
        if task is None or task.done():
            slot.background = background
            slot.admitted = asyncio.Event()
            task = asyncio.create_task(self._load_flow(slot), name=f"load:{slot.name}")
            task.add_done_callback(_settled)
            slot.load_task = task
        return task

    async def _ensure_loaded(self, slot: _Slot, *, background: bool = False) -> None:
        task = self._load_task(slot, background=background)
        if task is None:
            return
        try:
            await asyncio.shield(task)
        except InsufficientMemory:
            # A user's request joined a background load that waits for memory: user
            # demand beats background restore, so it gets a load of its own.
            if background or not slot.background:
                raise
            task = self._load_task(slot, background=False)
            if task is not None:
                await asyncio.shield(task)

    async def _load_flow(self, slot: _Slot) -> int:
        """One load; returns the generation it produced (for stale-cleanup checks)."""
        group = slot.model.exclusive_group if slot.model else None
        group_lock = self._group_locks.setdefault(group, asyncio.Lock()) if group else None
        try:
            async with group_lock or contextlib.nullcontext(), slot.lock:
                if self._loaded(slot):
                    return slot.generation
                slot.generation += 1
                await self._load_locked(slot, slot.generation)
                return slot.generation
        finally:
            if slot.admitted is not None:
                slot.admitted.set()

    async def _load_locked(self, slot: _Slot, gen: int) -> None:
        decision = self._decide(slot, background=slot.background)
        if not decision.ok:
            raise self._refuse_load(slot, decision)
        await self._unload_group_peers(slot)
        launch = self._build_launch(slot)
        pulling = await self._admit_and_reserve(slot, launch)
        if pulling:
            await self._pull(slot, launch, gen)
        await self._start_and_probe(slot, launch, gen)

    def _refuse_load(self, slot: _Slot, decision: LoadDecision) -> SlotctlError:
        """A refused load: one event, except while a background load keeps waiting."""
        error = decision.error
        assert error is not None
        op = "admit" if decision.admission is not None else "load"
        if not decision.waiting:
            return self._refuse(slot, op, error)
        if slot.waiting != WAITING_FOR_MEMORY:  # said once, not at every retry
            slot.waiting = WAITING_FOR_MEMORY
            slot.message = f"waiting for memory: {error.message}"
            self._refuse(slot, op, error)
            self.store.write(self._record(slot))
        else:
            error.reported = True  # said when the wait began
        return error

    def _build_launch(self, slot: _Slot) -> LaunchSpec:
        runtime = self.runtime.kind if self.runtime.kind != "fake" else "process"
        ctx = BuildContext(runtime=runtime, stack=slot.stack)
        if self.config.models_dir is not None:
            ctx = replace(ctx, models_dir=self.config.models_dir)
        return build_launch(slot.spec, slot.model, ctx)

    async def _admit_and_reserve(self, slot: _Slot, launch: LaunchSpec) -> bool:
        """Admission (with pre-load eviction), then reserve by leaving offline/error.

        Returns True when the slot entered ``pulling``. Runs under the device lock so two
        loads can never both pass admission for the same free memory; the decision is
        taken again here (the exclusive peers are gone now, other loads may have run).
        """
        device = slot.spec.device
        lock = self._device_locks.setdefault(device, asyncio.Lock())
        async with lock:
            decision = self._decide(slot, background=slot.background)
            if decision.victims:
                await self._evict(decision.victims, kind="preload")
                decision = self._decide(slot, background=slot.background)
                if decision.victims:  # a victim got a request meanwhile: not enough room
                    decision = self._decide(slot, background=slot.background, evict=False)
            if not decision.ok:
                raise self._refuse_load(slot, decision)
            admission = decision.admission
            assert admission is not None
            self.events.emit(
                "admission",
                "admit",
                slot=slot.name,
                model=launch.model_id,
                message=f"admitted {format_gib(slot.memory_bytes)} on {device}",
                details={"needed_bytes": admission.needed, "free_bytes": admission.free},
            )
            needs_pull = await self.runtime.needs_prepare(launch) or _missing_file(launch)
            if slot.state is S.OFFLINE or slot.state is S.ERROR:
                target = S.PULLING if needs_pull else S.STARTING
                self._set(slot, target, op="load", message=f"admitted on {device}")
            else:
                self._walk(slot, S.OFFLINE, op="load", message="reset before load")
                self._set(slot, S.PULLING if needs_pull else S.STARTING, op="load")
            if slot.admitted is not None:
                slot.admitted.set()
            return needs_pull

    def _decide(self, slot: _Slot, *, background: bool, evict: bool = True) -> LoadDecision:
        """The one load decision (:func:`controller.decision.decide_load`) on live state."""
        device = slot.spec.device
        peers = self._group_peers(slot)
        admitted = self.admitted_bytes(device)
        if slot.state in ADMITTED_STATES:
            admitted -= slot.memory_bytes
        request = LoadRequest(
            slot=slot.name,
            device=device,
            priority=slot.spec.priority,
            needed=slot.memory_bytes,
            activated=slot.spec.activated,
            model_id=slot.spec.model_id,
            model_known=slot.model is not None or not slot.spec.model_id,
            breaker=slot.breaker,
            max_failures=slot.spec.max_consecutive_failures,
            peers=tuple(
                GroupPeer(
                    p.name,
                    bool(p.spec.pinned),
                    p.memory_bytes if p.spec.device == device and p.state in ADMITTED_STATES else 0,
                )
                for p in peers
            ),
            background=background,
        )
        budget_gb = self.settings.memory_budget_gb.get(device)
        memory = MemoryFacts(
            admitted=admitted,
            sample=self.memory.sample(device),
            budget=int(budget_gb * GIB) if budget_gb is not None else None,
            margin=int(self.settings.safety_margin_gb * GIB),
            reserved=self._reserved_bytes(device, slot),
        )
        return decide_load(
            request,
            memory,
            self._candidates() if evict else [],
            self.clock.monotonic(),
            min_resident_s=self.settings.min_resident_s,
        )

    def _reserved_bytes(self, device: str, requester: _Slot | None) -> int:
        """Admitted to loads still coming up: the probed free memory cannot show them yet."""
        return sum(
            s.memory_bytes
            for s in self._slots.values()
            if s is not requester and s.spec.device == device and s.state in _LOADING_STATES
        )

    def _candidates(self) -> list[EvictionCandidate]:
        return [
            EvictionCandidate(
                name=s.name,
                device=s.spec.device,
                bytes=s.memory_bytes,
                priority=s.spec.priority,
                last_used=s.last_used,
                state=s.state,
                pinned=bool(s.spec.pinned),
                leases=len(s.leases),
                busy=s.busy or s.draining or s.waiters > 0,
                access=s.access,
                generation=s.generation,
            )
            for s in self._slots.values()
        ]

    def waiting(self) -> list[str]:
        """Slots whose background load waits for memory (the reconciler retries them)."""
        return [n for n, s in self._slots.items() if s.waiting is not None]

    def explain_load(self, name: str) -> dict[str, Any]:
        """Dry run of a load: would it fit, what would be evicted and why. Changes nothing.

        The same decision the load takes (:meth:`_decide`), so the two never disagree.
        """
        slot = self._get(name)
        if self._loaded(slot):
            return {"slot": name, "action": "none", "reason": f"already {slot.state.value}"}
        decision = self._decide(slot, background=False)
        result: dict[str, Any] = {"slot": name}
        admission = decision.admission
        if admission is not None:
            result.update(
                device=slot.spec.device,
                needed_bytes=admission.needed,
                free_bytes=admission.free,
                budget_bytes=admission.budget,
                admitted_bytes=admission.admitted,
                probe=admission.source,
                exclusive_peers=list(decision.peers),
            )
        if decision.error is not None:
            return {**result, "action": "refuse", "error": decision.error.to_dict()["error"]}
        evict = [
            {
                "slot": v.name,
                "priority": v.priority,
                "idle_s": round(v.idle_s, 1),
                "bytes": v.bytes,
                "reason": v.reason,
            }
            for v in decision.victims
        ]
        return {**result, "action": decision.verdict, "evict": evict}

    async def _pull(self, slot: _Slot, launch: LaunchSpec, gen: int) -> None:
        if _missing_file(launch):
            error = SlotSpawnFailed(
                f"model file not found: {launch.model_path} (source {launch.model_source})",
                slot=slot.name,
                path=launch.model_path,
            )
            await self._fail(slot, "load", error, stop=False)
            raise error

        async def progress(data: dict[str, Any]) -> None:
            self.events.emit(
                "progress",
                "load",
                slot=slot.name,
                model=launch.model_id,
                message=str(data.get("status", "")),
                details=data,
            )

        try:
            await self.runtime.prepare(launch, progress)
        except SlotctlError as exc:
            await self._fail(slot, "load", exc, stop=False)
            raise
        self._check_generation(slot, gen)
        self._set(slot, S.STARTING, op="load", message="pulled")

    async def _start_and_probe(self, slot: _Slot, launch: LaunchSpec, gen: int) -> None:
        try:
            observed = await self.runtime.start(launch)
        except SlotctlError as exc:
            await self._fail(slot, "load", exc, stop=False)
            raise
        slot.launch, slot.running_hash = launch, None
        slot.extra.pop("adopted", None)
        slot.extra.pop("config_drift", None)
        self._check_generation(slot, gen)
        self._set(slot, S.WARMING, op="load", message=f"started ({observed.ident})")
        result = await self._wait_ready(slot, launch)
        self._check_generation(slot, gen)
        await self._settle_probe(slot, result)

    async def _wait_ready(self, slot: _Slot, launch: LaunchSpec) -> ProbeResult:
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

    async def _settle_probe(self, slot: _Slot, result: ProbeResult) -> None:
        now = self.clock.monotonic()
        if result.outcome is ProbeOutcome.READY:
            slot.ready_at = now
            slot.last_used = now
            slot.last_liveness = now
            slot.liveness_misses = 0
            self._set(slot, S.READY, op="load", message=result.message)
            return
        if result.outcome is ProbeOutcome.NO_MODEL:
            self._set(
                slot, S.IDLE, op="load", message=result.message, idle_reason=IdleReason.NO_MODEL
            )
            return
        if result.outcome is ProbeOutcome.EXITED:
            detail = await self._exit_detail(slot)
            error: SlotctlError = SlotSpawnFailed(
                f"server exited while warming: {detail}", slot=slot.name
            )
        else:
            error = SlotHealthFailed(result.message, slot=slot.name)
        await self._fail(slot, "load", error, stop=True)
        raise error

    async def _exit_detail(self, slot: _Slot) -> str:
        observed = await self.runtime.inspect(slot.name)
        lines = await self.runtime.logs(slot.name, tail=5)
        tail = " | ".join(line.strip() for line in lines if line.strip())[-400:]
        return f"{observed.message or 'exited'}; last output: {tail or '(none)'}"

    def _check_generation(self, slot: _Slot, gen: int) -> None:
        if slot.generation != gen:
            raise SlotNotReady(f"load of {slot.name!r} was superseded", slot=slot.name)

    async def _fail(self, slot: _Slot, op: str, error: SlotctlError, *, stop: bool) -> None:
        """Move a slot to error (through legal steps), count the failure, revoke leases."""
        if stop:
            with contextlib.suppress(SlotctlError):
                await self.runtime.stop(slot.name, self.config.stop_timeout_s)
            slot.launch, slot.running_hash = None, None
        backoff = slot.breaker.record_failure(
            self.clock.monotonic(), error.message, slot.spec.max_consecutive_failures
        )
        slot.extra["failures"] = slot.breaker.failures
        slot.extra["retry_after_s"] = backoff
        slot.extra["retry_at"] = round(self.clock.time() + backoff, 3)  # wall clock
        for lease in list(slot.leases.values()):
            lease.revoke(error)
        slot.leases.clear()
        message = error.message
        if slot.breaker.failures >= slot.spec.max_consecutive_failures:
            message += (
                f" (failed {slot.breaker.failures} times in a row: next try in {backoff:g}s; "
                f"`slotctl slot reset {slot.name}` retries now)"
            )
        if slot.state is S.IDLE:
            self._set(slot, S.UNLOADING, op=op, message=message)
        if slot.state is not S.ERROR:
            self._set(slot, S.ERROR, op=op, message=message, error=error)

    # ================================================================= exclusive groups

    def _group_peers(self, slot: _Slot) -> list[_Slot]:
        group = slot.model.exclusive_group if slot.model else None
        if not group:
            return []
        return [
            s
            for s in self._slots.values()
            if s is not slot
            and s.model is not None
            and s.model.exclusive_group == group
            and s.state not in (S.OFFLINE, S.ERROR)
        ]

    async def _unload_group_peers(self, slot: _Slot) -> None:
        for peer in self._group_peers(slot):
            if peer.spec.pinned:
                raise self._refuse(slot, "load", SlotPinned(peer.name, "exclusive-group swap"))
            reason = (
                f"exclusive group {slot.model.exclusive_group if slot.model else ''}: "
                f"swapped out for {slot.name}"
            )
            try:
                await asyncio.wait_for(
                    self._unload_peer(peer, reason), self.config.exclusive_wait_s
                )
            except TimeoutError:
                raise self._refuse(
                    slot,
                    "load",
                    SlotNotReady(
                        f"exclusive-group peer {peer.name!r} did not unload within "
                        f"{self.config.exclusive_wait_s:g}s",
                        slot=slot.name,
                    ),
                ) from None

    async def _unload_peer(self, peer: _Slot, reason: str) -> None:
        """Unload an exclusive-group peer (clearing its residency) for a load in its group.

        Unlike :meth:`unload`, never waits for the peer's own pending load: that load queues
        on the group lock the caller holds, so waiting for it would deadlock. It runs after
        this load (and swaps back) if its waiters still want it.
        """
        self._clear_resident(peer.name)
        await self._settle_waiters(peer)
        async with peer.lock:
            await self._unload_locked(peer, reason, "unload")

    async def _settle_waiters(self, slot: _Slot) -> None:
        """Let the cold waiters of a load that just finished take their leases first.

        They resume a few loop iterations after the load task ends, while a swap queued on
        the group lock runs at once: without this it unloaded the peer under them (they
        got ``SlotNotReady``), at every swap, so under steady traffic to both members one
        member's requests were never served. Once they hold leases the drain waits for
        them like for any request in flight.
        """
        for _ in range(_SETTLE_SPINS):
            task = slot.load_task
            if not slot.waiters or task is None or not task.done() or not self._loaded(slot):
                return
            await asyncio.sleep(0)

    # ================================================================= unload

    async def unload(
        self,
        name: str,
        *,
        force: bool = False,
        reason: str = "unloaded on request",
        clear_residency: bool = True,
        op: str = "unload",
        pause: bool = False,
    ) -> SlotView:
        """Drain, stop and go offline. Waits for an in-flight load to settle first.

        ``pause`` (a user's unload): an autoload slot stays unloaded — the reconciler does
        not load it again — until a user's load resumes it; recorded in residency.json.
        """
        slot = self._get(name)
        if slot.spec.pinned and not force:
            raise self._refuse(slot, op, SlotPinned(name, "unload"))
        if pause and slot.spec.autoload and name not in self._paused:
            self._paused[name] = utcnow()
            self.residency.pause(name)
            reason += " (autoload paused: `slotctl slot load` resumes it)"
        if clear_residency:
            self._clear_resident(name)
        self._unwait_if_unwanted(slot)
        task = slot.load_task
        if task is not None and not task.done():
            with contextlib.suppress(SlotctlError, asyncio.CancelledError):
                await asyncio.shield(task)
        async with slot.lock:
            await self._unload_locked(slot, reason, op)
        return self.view(name)

    async def _unload_locked(self, slot: _Slot, reason: str, op: str) -> None:
        if slot.state is S.OFFLINE:
            return
        if slot.state is S.ERROR:
            try:
                await self.runtime.stop(slot.name, self.config.stop_timeout_s)
            except SlotTerminateTimeout:
                raise  # the server survived SIGKILL: it is not offline, the slot stays in error
            except SlotctlError as exc:
                log.warning("stopping errored slot %s: %s", slot.name, exc.message)
            slot.launch, slot.running_hash = None, None
            self._set(slot, S.OFFLINE, op=op, message=f"{reason} (was in error)")
            return
        # Loading: only after a restart that found it mid-load, or a refused state write
        # (disk full); unloading: a stop whose final write was refused. Finish either.
        if slot.state in _LOADING_STATES or slot.state is S.UNLOADING:
            await self._stop_runtime(slot, op, reason)
            self._set(slot, S.OFFLINE, op=op, message=reason)
            return
        await self._drain(slot)
        if slot.state is S.SERVING:  # leases revoked by the drain timeout
            self._set(slot, S.READY, op=op, message="drained")
        self._set(slot, S.UNLOADING, op=op, message=reason)
        await self._stop_runtime(slot, op, reason)
        self._set(slot, S.OFFLINE, op=op, message=reason)

    async def _stop_runtime(self, slot: _Slot, op: str, reason: str) -> None:
        try:
            await self.runtime.stop(slot.name, self.config.stop_timeout_s)
        except SlotTerminateTimeout as exc:
            if slot.state is S.UNLOADING:
                self._set(slot, S.ERROR, op=op, message=exc.message, error=exc)
            raise
        finally:
            slot.launch, slot.running_hash = None, None
            slot.ready_at = None

    async def _drain(self, slot: _Slot) -> None:
        """No new leases; wait for in-flight ones up to drain_timeout_s, then revoke."""
        if not slot.leases:
            return
        slot.draining = True
        try:
            deadline = self.clock.monotonic() + slot.spec.drain_timeout_s
            while slot.leases and self.clock.monotonic() < deadline and not self._drains_ended:
                await self.clock.sleep(_POLL_S)
            if slot.leases:
                error = SlotNotReady(
                    f"slot {slot.name!r} was unloaded: in-flight requests cancelled after "
                    f"drain_timeout_s={slot.spec.drain_timeout_s:g}",
                    slot=slot.name,
                )
                for lease in list(slot.leases.values()):
                    lease.revoke(error)
                slot.leases.clear()
        finally:
            slot.draining = False

    # ================================================================= swap / reset / remove

    async def swap(self, name: str, model_id: str) -> SlotView:
        """Serve another catalogue model on this slot: unload, rebind, load.

        The caller persists the new binding through the guard first (the API does), so
        the reconciler agrees with what runs.
        """
        slot = self._get(name)
        model = self.models.get(model_id)
        if model is None:
            raise self._refuse(slot, "load", ModelNotFound(model_id))
        if slot.model is not None and slot.model.id == model_id and self._loaded(slot):
            return self.view(name)
        await self.unload(name, force=True, reason=f"swapping to {model_id}", clear_residency=False)
        slot.spec = slot.spec.model_copy(
            update={"model": slot.spec.model.model_copy(update={"default": model_id})}
        )
        slot.model = model
        return await self.load(name)

    async def reset(self, name: str) -> SlotView:
        """Clear the crash-loop breaker; an errored slot goes offline."""
        slot = self._get(name)
        slot.breaker.reset()
        slot.extra.pop("failures", None)
        slot.extra.pop("retry_after_s", None)
        async with slot.lock:
            if slot.state is S.ERROR:
                await self._unload_locked(slot, "reset", "unload")
        return self.view(name)

    async def remove(self, name: str) -> None:
        """Unload (forced) and forget a slot no longer desired; deletes its state file."""
        if name not in self._slots:
            return
        await self.unload(name, force=True, reason="removed from desired state")
        del self._slots[name]
        self.store.delete(name)
        self._clear_resident(name)
        if self._paused.pop(name, None) is not None:
            self.residency.resume(name)

    # ================================================================= leases

    async def acquire(self, name: str) -> Lease:
        """A lease for one request; cold slots are loaded (joined) first.

        A request that arrives while the slot drains for an unload gets no lease on the
        draining server: it waits, and a fresh load serves it once the unload is done.
        Raises ``SlotQueueFull`` beyond ``max_queue`` cold waiters, ``SlotNotReady`` when
        the server lists no model, and the load's typed error.
        """
        slot = self._get(name)
        if not self._loaded(slot) or slot.draining:
            await self._wait_cold(slot)
        if slot.draining or slot.state is S.UNLOADING:
            raise SlotNotReady(f"slot {name!r} is unloading", slot=name)
        if not can_dispatch(slot.state, slot.idle_reason):
            raise SlotNotReady(
                f"slot {name!r} is up but serves no model ({slot.message})", slot=name
            )
        return self._take_lease(slot)

    async def _wait_cold(self, slot: _Slot) -> None:
        if slot.waiters >= slot.spec.max_queue:
            raise self._refuse(
                slot,
                "lease",
                SlotQueueFull(
                    f"{slot.waiters} requests already wait for slot {slot.name!r} "
                    f"(max_queue={slot.spec.max_queue})",
                    retry_after_s=1.0,
                    slot=slot.name,
                ),
            )
        if not slot.spec.activated:
            raise self._refuse(slot, "load", not_activated(slot.name))
        slot.waiters += 1
        try:
            await self._ensure_loaded(slot)
        except asyncio.CancelledError:
            slot.waiters -= 1
            self._after_waiter_cancel(slot)
            raise
        except BaseException:
            slot.waiters -= 1
            raise
        slot.waiters -= 1

    def _take_lease(self, slot: _Slot, expires_at: float | None = None) -> Lease:
        lease = Lease(slot.name, slot.generation, expires_at)
        slot.leases[lease.id] = lease
        slot.last_used = self.clock.monotonic()
        slot.access += 1
        if slot.state in (S.READY, S.IDLE):
            self._set(slot, S.SERVING, op="lease", message="request in flight", durable=False)
        return lease

    def release(self, lease: Lease) -> None:
        """Idempotent. The last lease returns the slot to ``ready``."""
        if lease.released:
            return
        lease.released = True
        slot = self._slots.get(lease.slot)
        if slot is None or slot.leases.pop(lease.id, None) is None:
            return  # revoked or from a previous generation: nothing to undo
        slot.last_used = self.clock.monotonic()
        slot.access += 1
        if not slot.leases and slot.state is S.SERVING:
            self._set(slot, S.READY, op="lease", message="idle since last request", durable=False)

    async def hold(self, name: str, ttl_s: float) -> Lease:
        """A batch lease: keeps the slot loaded and unevictable for ``ttl_s`` seconds."""
        lease = await self.acquire(name)
        lease.expires_at = self.clock.monotonic() + ttl_s
        self.events.emit(
            "lease",
            "lease",
            slot=name,
            message=f"held for {ttl_s:g}s",
            details={"lease": lease.id, "ttl_s": ttl_s},
        )
        return lease

    def _wanted(self, slot: _Slot) -> bool:
        return self._keeps_loaded(slot) or slot.wanted > 0

    def _after_waiter_cancel(self, slot: _Slot) -> None:
        """The last cold waiter left: unload once the load settles, if nobody wants it."""
        task = slot.load_task
        if slot.waiters or slot.leases or self._wanted(slot) or task is None or task.done():
            return
        self._spawn(self._cleanup_after(slot, task), f"cleanup:{slot.name}")

    async def _cleanup_after(self, slot: _Slot, task: asyncio.Task[int]) -> None:
        try:
            gen = await asyncio.shield(task)
        except (SlotctlError, asyncio.CancelledError):
            return  # the load failed: nothing to unload
        if slot.waiters or slot.leases or self._wanted(slot) or slot.generation != gen:
            return  # wanted again, or a newer load replaced it: not ours to unload
        if self._slots.get(slot.name) is slot and self._loaded(slot):
            await self.unload(
                slot.name,
                force=True,
                clear_residency=False,
                reason="every waiter cancelled before the load finished",
            )

    def _set_resident(self, name: str, model_id: str) -> None:
        if self._resident.get(name) != model_id:
            self.residency.set(name, model_id)
            self._resident[name] = model_id

    def _clear_resident(self, name: str) -> None:
        if self._resident.pop(name, None) is not None:
            self.residency.clear(name)
            slot = self._slots.get(name)
            if slot is not None:
                self._unwait_if_unwanted(slot)

    def _unwait_if_unwanted(self, slot: _Slot) -> None:
        """Nobody keeps this slot loaded any more: it is not waiting for memory either."""
        if slot.waiting is None or self._keeps_loaded(slot):
            return
        slot.waiting = None
        slot.message = ""
        self.store.write(self._record(slot))

    def waiting_with_room(self) -> list[str]:
        """Waiting slots whose background load would be admitted now (memory came back)."""
        return [
            n
            for n, s in self._slots.items()
            if s.waiting is not None and not s.busy and self._decide(s, background=True).ok
        ]

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ================================================================= time-driven work

    async def tick(self) -> None:
        """One pass of time-driven work: exits, holds, idle, TTL, liveness, breaker, pressure.

        ``run()`` calls it periodically; tests with a fake clock call it directly.
        """
        await self.check_exits()
        now = self.clock.monotonic()
        for slot in list(self._slots.values()):
            self._expire_holds(slot, now)
            await self._idle_and_ttl(slot, now)
            stable = slot.ready_at is not None and now - slot.ready_at >= self.config.stable_reset_s
            if stable and slot.breaker.failures and slot.state in DISPATCHABLE_STATES:
                slot.breaker.reset()  # healthy for stable_reset_s: the crash loop is over
        await self._liveness(now)
        await self.reap_pressure()

    async def check_exits(self) -> None:
        """A server that exits goes to error at once; its leases get a typed error."""
        for slot in list(self._slots.values()):
            if slot.state not in DISPATCHABLE_STATES or slot.busy:
                continue
            gen = slot.generation
            observed = await self.runtime.inspect(slot.name)
            if observed.status is RunStatus.RUNNING or slot.busy:
                continue
            if slot.state not in DISPATCHABLE_STATES:
                continue
            detail = await self._exit_detail(slot)
            error = SlotHealthFailed(f"server exited: {detail}", slot=slot.name)
            async with slot.lock:
                # Revalidate: an unload (or unload + reload) may have run while we looked.
                if slot.generation == gen and slot.state in DISPATCHABLE_STATES:
                    await self._fail(slot, "probe", error, stop=True)

    def _expire_holds(self, slot: _Slot, now: float) -> None:
        for lease in list(slot.leases.values()):
            if lease.expires_at is not None and now >= lease.expires_at:
                self.release(lease)
                self.events.emit(
                    "lease",
                    "lease",
                    slot=slot.name,
                    message="batch lease expired",
                    details={"lease": lease.id},
                )

    async def _idle_and_ttl(self, slot: _Slot, now: float) -> None:
        if slot.busy or slot.leases:
            return
        quiet = now - slot.last_used
        idle_after = slot.spec.idle_timeout_s
        if slot.state is S.READY and idle_after > 0 and quiet >= idle_after:
            self._set(
                slot,
                S.IDLE,
                op="unload",
                idle_reason=IdleReason.TIMEOUT,
                message=f"no request for {quiet:.0f}s",
            )
        ttl = slot.spec.ttl_s
        # ttl_s: give the memory back after this long without requests (keep-loaded
        # autoload slots are exempt: autoload means "keep it loaded").
        expired = ttl > 0 and quiet >= ttl and not slot.spec.autoload
        if expired and slot.state in (S.READY, S.IDLE) and slot.idle_reason != IdleReason.NO_MODEL:
            reason = f"ttl: no request for {quiet:.0f}s (ttl_s={ttl:g})"
            await self._evict_one(slot, reason, kind="ttl", clear_residency=True)

    async def _liveness(self, now: float) -> None:
        for slot in list(self._slots.values()):
            due = now - slot.last_liveness >= slot.spec.liveness_interval_s
            if slot.state not in (S.READY, S.IDLE) or slot.busy or not due:
                continue
            if slot.launch is None or slot.idle_reason == IdleReason.NO_MODEL:
                continue
            slot.last_liveness = now
            gen = slot.generation
            result = await self.prober.liveness(
                slot.launch.endpoint, slot.launch.probe, slot=slot.name
            )
            if slot.generation != gen or slot.state not in (S.READY, S.IDLE):
                continue  # unloaded, reloaded or serving since: the answer is stale
            if result.outcome is ProbeOutcome.READY:
                slot.liveness_misses = 0
                continue
            slot.liveness_misses += 1
            if slot.liveness_misses >= slot.spec.liveness_failures and not slot.busy:
                error = SlotHealthFailed(
                    f"liveness probe failed {slot.liveness_misses} times in a row "
                    f"({result.message})",
                    slot=slot.name,
                )
                async with slot.lock:
                    await self._fail(slot, "probe", error, stop=True)

    async def reap_pressure(self) -> list[str]:
        """Evict under memory pressure: elevated -> one victim, critical -> all eligible.

        Only memory that admission did not hand out counts: a device that slotctl itself
        filled up to the safety margin is not "under pressure" (evicting there would undo
        admission's own decisions, and an autoload slot would flap). Pressure is something
        else — another process, or servers using more than their estimates — taking more
        than the margin.
        """
        evicted: list[str] = []
        margin = int(self.settings.safety_margin_gb * GIB)
        devices = {s.spec.device for s in self._slots.values() if s.state in ADMITTED_STATES}
        for device in sorted(devices):
            sample = self.memory.sample(device)
            if sample is None:
                continue
            unaccounted = sample.total_bytes - sample.free_bytes - self.admitted_bytes(device)
            if unaccounted <= margin:
                continue
            level = pressure_level(
                sample.total_bytes,
                sample.free_bytes,
                elevated_frac=self.config.elevated_free_frac,
                critical_frac=self.config.critical_free_frac,
            )
            victims = pressure_victims(self._candidates(), device, level, self.clock.monotonic())
            evicted += await self._evict(victims, kind="pressure")
        return evicted

    async def _evict(self, victims: Iterable[Victim], *, kind: str) -> list[str]:
        """Unload each victim after revalidating the decision (a request since cancels it)."""
        done = []
        for victim in victims:
            slot = self._slots.get(victim.name)
            if slot is None or slot.access != victim.access:
                continue  # a request came since the decision: not a victim any more
            if slot.generation != victim.generation:
                continue  # unloaded and loaded again (maybe another model) since
            if await self._evict_one(slot, f"evicted to {victim.reason}", kind=kind):
                done.append(victim.name)
        return done

    async def _evict_one(
        self, slot: _Slot, reason: str, *, kind: str, clear_residency: bool = False
    ) -> bool:
        """Unload one victim; ``kind`` (preload | pressure | ttl) classifies the eviction."""
        if slot.state not in (S.READY, S.IDLE) or slot.leases or slot.busy or slot.spec.pinned:
            return False  # revalidation failed: it got busy since the decision
        if slot.draining or slot.waiters:
            return False
        if clear_residency:
            self._clear_resident(slot.name)
        async with slot.lock:  # free (checked above): acquired without waiting
            self.events.emit(
                "eviction",
                "evict",
                slot=slot.name,
                model=slot.spec.model_id,
                message=reason,
                details={"bytes": slot.memory_bytes, "reason": kind},
            )
            await self._unload_locked(slot, reason, "evict")
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Background loop: exit checks every monitor interval, full tick every tick."""
        next_tick = 0.0
        while not stop.is_set():
            try:
                self.flush_unpersisted()
                if self.clock.monotonic() >= next_tick:
                    await self.tick()
                    next_tick = self.clock.monotonic() + self.config.tick_interval_s
                else:
                    await self.check_exits()
            except SlotctlError as exc:
                log.warning("background tick: %s", exc.message)
            except Exception:  # e.g. OSError (disk full): log it, keep watching the slots
                log.exception("background tick failed; retrying at the next interval")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.monitor_interval_s)

    # ================================================================= start / recovery

    async def recover(self) -> None:
        """Rebuild the view after a (controller) restart: adopt live servers, mark gone ones.

        Through legal transitions only; never starts a duplicate.
        """
        for name in list(self._slots):
            slot = self._slots[name]
            async with slot.lock:
                await self._recover_one(slot)

    async def _recover_one(self, slot: _Slot) -> None:
        observed = await self.runtime.inspect(slot.name)
        if observed.status is RunStatus.RUNNING and slot.state is S.UNLOADING:
            # The controller died mid-unload: finish it (the wish was to free the memory).
            await self._stop_runtime(slot, "restore", "unload finished after a restart")
            self._set(slot, S.OFFLINE, op="restore", message="unload finished after a restart")
            return
        if observed.status is RunStatus.RUNNING:
            try:
                launch = self._build_launch(slot)
            except SlotctlError:
                launch = None
            if launch is None:
                return
            drifted = observed.config_hash != launch.config_hash()
            # An adopted server started with an older config reports *its* hash, so the
            # reconciler recreates it (it serves until then).
            slot.launch, slot.running_hash = launch, observed.config_hash if drifted else None
            slot.extra["adopted"] = observed.ident
            slot.extra.pop("config_drift", None)
            if drifted:
                slot.extra["config_drift"] = True
            endpoint = (observed.endpoint if drifted else None) or launch.endpoint
            result = await self.prober.probe(endpoint, launch.probe, slot=slot.name)
            if drifted and result.outcome is not ProbeOutcome.READY:
                # Outdated and not serving (still loading, or no model): replace it now
                # instead of waiting for it to finish loading a config nobody wants.
                with contextlib.suppress(SlotctlError):
                    await self.runtime.stop(slot.name, self.config.stop_timeout_s)
                slot.launch, slot.running_hash = None, None
                slot.extra.pop("adopted", None)
                slot.extra.pop("config_drift", None)
                self._walk(
                    slot,
                    S.OFFLINE,
                    op="restore",
                    message=f"stopped an adopted server with an outdated config ({result.message})",
                )
                return
            what = f"pid {observed.ident}" if str(observed.ident).isdigit() else observed.ident
            self.events.emit(
                "adopt", "restore", slot=slot.name, message=f"adopted {slot.name} ({what})"
            )
            if result.outcome is ProbeOutcome.READY:
                now = self.clock.monotonic()
                slot.ready_at = slot.last_used = slot.last_liveness = now
                if slot.state is not S.IDLE:
                    self._walk(slot, S.READY, op="restore", message="adopted running server")
            elif result.outcome is ProbeOutcome.NO_MODEL:
                self._walk(slot, S.WARMING, op="restore", message="adopted")
                self._set(
                    slot,
                    S.IDLE,
                    op="restore",
                    idle_reason=IdleReason.NO_MODEL,
                    message=result.message,
                )
            else:
                self._walk(slot, S.WARMING, op="restore", message="adopted, still warming")
                slot.generation += 1
                self._spawn(
                    self._continue_warming(slot, launch, slot.generation), f"warm:{slot.name}"
                )
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
            self._set(slot, S.OFFLINE, op="restore", message="stopped while controller was down")
            return
        if slot.state is S.IDLE:
            self._set(slot, S.UNLOADING, op="restore", message="server vanished")
        self._set(
            slot,
            S.ERROR,
            op="restore",
            message=f"server vanished while the controller was down ({detail})",
        )

    async def _continue_warming(self, slot: _Slot, launch: LaunchSpec, gen: int) -> None:
        async with slot.lock:
            if slot.generation != gen or slot.state is not S.WARMING:
                return
            result = await self._wait_ready(slot, launch)
            if slot.generation == gen:
                with contextlib.suppress(SlotctlError):
                    await self._settle_probe(slot, result)

    def report_unknown_residents(self) -> list[str]:
        """Residency wishes for slots the desired state does not have: logged, skipped."""
        unknown = [name for name in self._resident if name not in self._slots]
        for name in unknown:
            self.events.emit(
                "refusal",
                "restore",
                slot=name,
                model=self._resident[name],
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
        position = {name: i for i, name in enumerate(self._order)}
        wanted = [n for n in self._order if n in self._slots and self._wanted_at_start(n)]
        wanted.sort(key=lambda n: (-self._slots[n].spec.priority, position[n]))
        outcomes = {name: await self._restore_one(name) for name in wanted}
        if not wait:
            return outcomes
        for name in wanted:
            task = self._slots[name].load_task
            if task is None or outcomes[name] not in {s.value for s in SlotState}:
                continue
            try:
                await asyncio.shield(task)
            except SlotctlError as exc:
                outcomes[name] = exc.code
            else:
                outcomes[name] = self._slots[name].state.value
        return outcomes

    def _wanted_at_start(self, name: str) -> bool:
        return self._keeps_loaded(self._slots[name])

    async def _restore_one(self, name: str) -> str:
        slot = self._slots[name]
        if not slot.spec.activated:
            return "not activated"
        if self._loaded(slot):
            return slot.state.value
        try:
            view = await self.start_load(name, resident=False, background=True)
        except SlotctlError as exc:
            log.warning("restore of %s: %s", name, exc.message)
            return exc.code
        return view.state.value

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, SlotctlError):
                await task
        close = getattr(self.prober, "close", None)
        if close is not None:
            await close()

    def revoke_leases(self, reason: str) -> int:
        """End every lease now, holds included, with a typed error (the router ends a
        stream with an error event): ``up --keep-running`` exits, its servers stay.
        Returns how many leases were ended."""
        ended = 0
        for slot in self._slots.values():
            for lease in list(slot.leases.values()):
                lease.revoke(SlotNotReady(f"slot {slot.name!r}: {reason}", slot=slot.name))
                self.release(lease)
                ended += 1
        return ended

    def end_drains(self) -> None:
        """Stop waiting for in-flight requests: running and later drains revoke their
        leases at once (a second Ctrl-C of ``slotctl up``)."""
        self._drains_ended = True

    async def stop_all(
        self,
        reason: str = "controller shutdown",
        on_drain: Callable[[str, int, float], None] | None = None,
    ) -> None:
        """Unload every slot (pinned included), concurrently; for ``down``/shutdown.

        In-flight loads are cancelled first (a hung load would otherwise hold its slot up to
        ``warmup_timeout_s``); their servers are stopped like any other. Batch holds are
        released first (a hold is no request: nothing to wait for); ``on_drain(slot,
        requests, drain_timeout_s)`` is told of every slot that waits for requests.
        """
        for slot in self._slots.values():
            for lease in [x for x in slot.leases.values() if x.expires_at is not None]:
                self.release(lease)
            if slot.leases and on_drain is not None:
                on_drain(slot.name, len(slot.leases), slot.spec.drain_timeout_s)
        pending = [s.load_task for s in self._slots.values() if s.load_task is not None]
        pending += list(self._background)
        for task in pending:
            if not task.done():
                task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

        async def one(name: str) -> None:
            try:
                await self.unload(name, force=True, reason=reason, clear_residency=False)
            except StateWriteFailed as exc:
                # The state dir refuses writes (full, read-only): the transition cannot be
                # recorded, but a shutdown must not leak the server. Stop it; the state
                # file keeps its last state and the next controller finds the server gone.
                log.warning("slot %s: stopping its server unrecorded: %s", name, exc.message)
                with contextlib.suppress(SlotctlError):
                    await self.runtime.stop(name, self.config.stop_timeout_s)
            except SlotctlError:
                pass  # reported by the unload (event); the next slot is stopped regardless

        await asyncio.gather(*(one(n) for n in list(self._slots)))


# ===================================================================== helpers


def _legal_path(start: SlotState, target: SlotState) -> list[SlotState]:
    """Shortest sequence of legal transitions from ``start`` to ``target`` (BFS)."""
    if start is target:
        return []
    frontier: deque[list[SlotState]] = deque([[start]])
    seen = {start}
    while frontier:
        path = frontier.popleft()
        for nxt in sorted(LEGAL_TRANSITIONS[path[-1]]):
            if nxt in seen:
                continue
            if nxt is target:
                return [*path[1:], nxt]
            seen.add(nxt)
            frontier.append([*path, nxt])
    raise ValueError(f"no legal path from {start} to {target}")


def _settled(task: asyncio.Task[int]) -> None:
    """Retrieve a load task's outcome: its joiners got it; nobody else must be warned."""
    if not task.cancelled():
        task.exception()


def _missing_file(launch: LaunchSpec) -> bool:
    return launch.model_path is not None and not Path(launch.model_path).exists()
