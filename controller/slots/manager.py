"""The SlotManager façade: the single lifecycle authority's public API.

Callers: the reconciler (desired state), the HTTP API and CLI (load/unload/swap/reset/
hold), the router (acquire/release), metrics (views). The work happens in the parts
below it, each in its own module (see the package docstring); this class builds them
over one :class:`~.core.Core` and keeps what spans them: the desired state (catalogue,
specs, upsert/remove), swaps, shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from controller.kit.clock import SYSTEM_CLOCK, Clock
from controller.kit.eventbus import EventBus
from controller.kit.tasks import TaskSet
from controller.model.errors import (
    ModelNotFound,
    SlotctlError,
    SlotNotFound,
    SlotNotReady,
    StateWriteFailed,
)
from controller.model.events import EventKind, EvictionReason, Op
from controller.model.lifecycle import Candidate, SlotState
from controller.probes.memory import MemoryProbe, SystemMemoryProbe
from controller.probes.readiness import HttpProber, Prober
from controller.probes.sleep import HttpSleeper, Sleeper
from controller.probes.usage import ProcessUsage
from controller.runtime.base import Notifying, RunStatus, Runtime, RuntimeKind
from controller.scheduling.breaker import Breaker
from controller.scheduling.decision import LoadDecision
from controller.scheduling.rollout import RolloutDecision
from controller.slots.adapters import Adapters
from controller.slots.admission import Admission
from controller.slots.core import Core, Part, same
from controller.slots.dryrun import LoadPlan
from controller.slots.housekeeping import Housekeeping
from controller.slots.leases import Leases
from controller.slots.loading import Loading
from controller.slots.locks import Locks
from controller.slots.pulling import Pulling
from controller.slots.records import (
    AdapterHold,
    DeviceFigures,
    FootprintView,
    ManagerConfig,
    SlotRecord,
    SlotStatus,
    SlotView,
)
from controller.slots.recovery import Recovery
from controller.slots.residency import Residency
from controller.slots.surge import Rollouts
from controller.slots.table import SlotTable
from controller.slots.unloading import Unloading
from controller.slots.wishes import Wishes
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.schema import AdapterSpec, AliasSpec, ControllerSettings, ModelSpec, SlotSpec
from controller.store.residency import ResidencyStore
from controller.store.state import StateStore

if TYPE_CHECKING:  # the engine: built by the composition root (controller.daemon.root)
    from controller.modelfiles.gc import Reference
    from controller.modelfiles.pull import ModelFiles

__all__ = ["SlotManager"]

log = logging.getLogger("slotctl.manager")


class SlotManager(Part):
    """See the module docstring. Construct, ``await set_desired(...)``, ``await recover()``."""

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
        sleeper: Sleeper | None = None,
        files: ModelFiles | None = None,
        usage: ProcessUsage | None = None,
    ) -> None:
        events = events or EventBus()
        wishes = Wishes(config_dir)
        self.store = StateStore(state_dir)
        memory = memory or SystemMemoryProbe()
        if usage is None:  # per-process GPU figures through the memory probe's NVML
            usage = ProcessUsage(memory.nvml if isinstance(memory, SystemMemoryProbe) else None)
        core = Core(
            runtime=runtime,
            prober=prober or HttpProber(logs=runtime),
            memory=memory,
            clock=clock,
            events=events,
            config=config or ManagerConfig(),
            settings=settings or ControllerSettings(),
            table=SlotTable(self.store, events, clock, wishes),
            wishes=wishes,
            locks=Locks(),
            tasks=TaskSet(log),
            sleeper=sleeper or HttpSleeper(),
            files=files,
            usage=usage,
        )
        super().__init__(core)
        self.tiers = Residency(self.core)  # sleep and wake (``residency``: the wishes' file)
        self.unloading = Unloading(self.core, self.tiers)
        self.pulling = Pulling(self.core)  # a load's model files (the ``files`` seam)
        self.admission = Admission(self.core, self.unloading, self.pulling)
        self.loading = Loading(self.core, self.admission, self.unloading)
        self.leasing = Leases(self.core, self.loading)
        self.housekeeping = Housekeeping(self.core, self.loading, self.leasing)
        self.rollouts = Rollouts(self.core, self.loading)  # surge rollouts
        self.recovery = Recovery(self.core, self.loading, self.rollouts)
        self.roll_out = self.rollouts.roll_out  # a changed slot surged (or: recreate)
        self.recreating = self.rollouts.recreating  # a recreate, shown in the slot's view
        # [[alias]] by id: the router resolves them (controller.router.aliases)
        self.aliases: dict[str, AliasSpec] = {}
        # [[adapter]]: LoRA adapters inside slots (loaded on demand, evicted, re-applied
        # after a restart before the slot is ready again)
        self.lora = Adapters(self.core)
        self.loading.before_ready = self.lora.reapply
        self.rollouts.before_switch = self.lora.prepare_switch
        # What only forwards is the part's own method, bound here (one signature and one
        # docstring, the part's; the ports in .ports name what each caller may call).
        self.waiting_with_room = self.loading.units.waiting_with_room  # units: all fit
        self.unload = self.unloading.unload  # drain, stop, offline
        self.evict = self.unloading.evict  # each victim revalidated first
        self.reset = self.unloading.reset  # the crash-loop breaker cleared
        self.acquire = self.leasing.acquire  # a lease for one request
        self.try_acquire = self.leasing.try_acquire  # one that needs no wait, else None
        self.release = self.leasing.release
        self.routes = core.table.routes  # the router's candidates by model (remembered)
        # upstream_of's replica group per slot, by the spec it was read from
        self._groups: dict[str, tuple[SlotSpec, str]] = {}
        self.hold = self.leasing.hold  # a batch lease for ttl_s
        self.tick = self.housekeeping.tick
        self.check_exits = self.housekeeping.exits
        self.reap_pressure = self.housekeeping.pressure
        self.run = self.housekeeping.run
        self.recover = self.recovery.recover
        self.report_unknown_residents = self.recovery.report_unknown_residents
        self.restore = self.recovery.restore
        if isinstance(runtime, Notifying):  # its watches tell of changes: no polling
            runtime.subscribe(self.housekeeping.mark, self.note)
            self.housekeeping.pushed = True

    # ================================================================= the seams
    # runtime, prober, memory, clock, events, config, settings: from :class:`.core.Part`.

    @property
    def models(self) -> dict[str, ModelSpec]:
        return self.core.table.models

    @property
    def models_dir(self) -> Path:
        """Where hf:// and relative model sources resolve (the launches' models dir)."""
        return self.core.models_dir

    @property
    def files(self) -> ModelFiles | None:
        """The models dir's files (pull, verify, disk admission, GC); None: this controller
        manages none (the kubernetes runtime's pods pull on their nodes)."""
        return self.core.files

    def file_references(self) -> list[Reference]:
        """What a GC of the models dir keeps: the declared models' files (a pinned slot's
        model pinned)."""
        return self.pulling.references()

    @property
    def transitions(self) -> deque[tuple[str, str, str]]:
        return self.core.table.transitions

    @property
    def background(self) -> TaskSet:
        return self.core.tasks

    @property
    def residency(self) -> ResidencyStore:
        """``residency.json`` (the wishes' file; the manager reads it once, at start)."""
        return self.core.wishes.store

    # ================================================================= desired state

    async def set_desired(self, desired: DesiredState) -> None:
        """Take the catalogue and slot specs; new slots start from their state.json.

        Slots no longer desired stay known until :meth:`remove`. Scheduling knobs
        (priority, pinned, timeouts) apply in place.
        """
        self.set_models(desired.models, order=list(desired.slots))
        self.set_aliases({i: a.spec for i, a in desired.aliases.items()})
        for desired_slot in desired.slots.values():
            self.upsert(desired_slot)
        self.set_adapters({i: a.spec for i, a in desired.adapters.items()})

    def set_models(self, models: Mapping[str, ModelSpec], order: list[str] | None = None) -> None:
        """Replace the catalogue (and the catalogue order used by restore)."""
        table = self.core.table
        table.models = dict(models)
        if order is not None:
            table.order = dict.fromkeys(order)
        for slot in table:
            if slot.spec.model_id:
                model = table.models.get(slot.spec.model_id, slot.model)
                table.bind(slot, slot.spec, slot.stack, model)

    def set_aliases(self, aliases: Mapping[str, AliasSpec]) -> None:
        """Replace the aliases (the config dir's ``[[alias]]``, by id)."""
        self.aliases = dict(aliases)

    @property
    def adapters(self) -> Mapping[str, AdapterSpec]:
        """The declared adapters by id (the config dir's ``[[adapter]]``)."""
        return self.lora.catalogue

    def routing(
        self,
    ) -> tuple[
        ControllerSettings,
        dict[str, ModelSpec],
        dict[str, AliasSpec],
        Mapping[str, AdapterSpec],
        int,
    ]:
        """``(settings, models, aliases, adapters, generation)``: the four seams above in one
        call (the router reads them all for every request, whose code runs from cold caches,
        where each function more it touches costs; docs/performance.md, the router), and the
        table's routing generation (bumped when what a model names, a slot's spec or its
        model changes: what a routed call's memo is checked against, router/memo.py)."""
        core = self.core
        table = core.table
        return core.settings, table.models, self.aliases, core.adapters, table.generation

    def set_adapters(self, adapters: Mapping[str, AdapterSpec]) -> None:
        """Replace the adapters (each slot's adapter reserve follows)."""
        self.lora.set_catalogue(adapters)

    def adapter_slots(self, adapter: str) -> list[str]:
        """The slots that can serve ``adapter``, those holding it first."""
        return self.lora.slots_for(adapter)

    def try_adapter(self, slot: str, adapter: str) -> AdapterHold | None:
        """A hold on ``adapter`` in leased ``slot`` needing no load, else None."""
        return self.lora.try_acquire(slot, adapter)

    async def acquire_adapter(self, slot: str, adapter: str) -> AdapterHold:
        """A hold on ``adapter`` in leased ``slot``, loaded first if it must be."""
        return await self.lora.acquire(slot, adapter)

    def release_adapter(self, hold: AdapterHold) -> None:
        self.lora.release(hold)

    def upsert(self, desired: DesiredSlot) -> None:
        """Add a slot (its state restored from state.json) or update its spec in place.

        In place means no restart: scheduling knobs take effect at once; a changed runtime
        config is the reconciler's to act on (recreate). A config change re-arms a slot
        the crash-loop breaker blocked.
        """
        table = self.core.table
        table.order.setdefault(desired.name)
        model = table.models.get(desired.spec.model_id) if desired.spec.model_id else None
        slot = table.records.get(desired.name)
        if slot is None:
            breaker = Breaker(self.config.breaker_base_s, self.config.breaker_cap_s)
            slot = SlotRecord(
                spec=desired.spec,
                stack=desired.stack,
                model=model,
                breaker=breaker,
                on_nodes=self.runtime.kind == RuntimeKind.KUBERNETES,
            )
            table.load_persisted(slot)
            table.add(slot)
            self.core.slot_added(slot)
            self.lora.reserve(slot)
            return
        if (
            slot.stack == desired.stack
            and same(slot.model, model)
            and same(slot.spec, desired.spec)
        ):
            # Unchanged (the usual pass): take the new objects, so that the next pass's
            # comparisons (and the hash memo's) are identity checks.
            table.bind(slot, desired.spec, slot.stack, model)
        else:
            old_hash = self.core.launch_hash(slot)
            if desired.spec.port != slot.spec.port:
                self.core.port_declared(desired.name, desired.spec.port)
            table.bind(slot, desired.spec, desired.stack, model)
            if old_hash != self.core.launch_hash(slot):
                table.rearm(slot)
            self.lora.reserve(slot)
        self.unloading.unwait_if_unwanted(slot)

    def known(self, name: str) -> SlotSpec | None:
        """The spec the manager currently applies to ``name`` (None: unknown slot)."""
        slot = self.core.table.records.get(name)
        return slot.spec if slot else None

    def launch_hash(self, desired: DesiredSlot) -> str | None:
        """The config hash ``desired`` would run with on this manager's runtime.

        The slot's memo answers when the manager already applies an equal spec with the
        same model (every pass of a desired state it has applied); otherwise it is built.
        """
        model = self.models.get(desired.spec.model_id) if desired.spec.model_id else None
        slot = self.core.table.records.get(desired.name)
        if (
            slot is not None
            and slot.stack == desired.stack
            and same(slot.model, model)
            and same(slot.spec, desired.spec)
        ):
            return self.core.launch_hash(slot)
        probe = SlotRecord(spec=desired.spec, stack=desired.stack, model=model, breaker=Breaker())
        return self.core.launch_hash(probe)

    def rollout_for(self, desired: DesiredSlot) -> RolloutDecision:
        """Which way a change to ``desired`` would roll out now (surge or recreate)."""
        return self.rollouts.decide(self.core.table.records.get(desired.name), desired)

    def group_holder(self, name: str) -> str | None:
        """A peer holding ``name``'s exclusive group (loading or loaded), if any."""
        slot = self.core.table.records.get(name)
        peers = self.core.table.usage.group_peers(slot) if slot is not None else []
        return peers[0].name if peers else None

    def is_resident(self, name: str) -> bool:
        return self.core.wishes.is_resident(name)

    def is_paused(self, name: str) -> bool:
        return self.core.wishes.is_paused(name)

    async def remove(self, name: str) -> None:
        """Unload (forced) and forget a slot no longer desired; deletes its state file."""
        table = self.core.table
        if name not in table.records:
            return
        await self.unload(name, force=True, reason="removed from desired state")
        task = table.records[name].flight.task
        if task is not None and not task.done():
            task.cancel()  # a cold request queued behind the unload: not ours
        table.forget(name)  # the record and its state file (no lag write resurrects it)
        self.core.wishes.clear_resident(name)
        self.core.wishes.resume(name)

    def stop_pull(self, name: str, why: str) -> bool:
        """Stop ``name``'s load if it is pulling its model files (the slot was removed or
        disabled meanwhile): it goes ``offline``, its pull is left to any other waiter
        (the engine cancels it when none is left). True if a pull was stopped."""
        slot = self.core.table.records.get(name)
        return slot is not None and slot.flight.stop_pull(why)

    async def reap_orphan(self, name: str) -> bool:
        """Stop a managed runtime object that no slot owns any more (labels say it is ours)."""
        if name in self.core.table.records:
            return False
        second = await self.rollouts.stop_orphaned(name)  # a surge's, if one was left
        observed = await self.runtime.inspect(name)
        if observed.status is RunStatus.MISSING or not observed.managed:
            return second
        await self.runtime.stop(name, self.config.stop_timeout_s)
        self.events.emit(
            EventKind.EVICTION,
            Op.RECONCILE,
            slot=name,
            message="stopped a managed server nobody declares",
            reason=EvictionReason.ORPHAN,
        )
        return True

    def note(self, name: str, words: str) -> None:
        """What a load of ``name`` waits for, as the runtime says it (a pod the scheduler
        leaves Pending, with its reason): the slot's message and one progress event."""
        slot = self.core.table.records.get(name)
        if slot is None or slot.state not in (SlotState.PULLING, SlotState.STARTING):
            return
        if slot.message == words:
            return
        with contextlib.suppress(StateWriteFailed):  # said in the event regardless
            self.core.table.persist(slot, waiting=slot.waiting, message=words)
        self.events.emit(EventKind.PROGRESS, Op.LOAD, slot=name, model=slot.model_id, message=words)

    # ================================================================= views

    def view(self, name: str) -> SlotView:
        table = self.core.table
        return table.view(table.get(name))

    def observe(self, name: str) -> SlotStatus | None:
        """What the reconciler plans with (the fields of :meth:`view`); None: unknown."""
        slot = self.core.table.records.get(name)
        if slot is None:
            return None
        return SlotStatus(
            slot.state,
            slot.idle_reason,
            slot.config_hash,
            slot.message,
            slot.breaker.retry_after(self.clock.monotonic()),
            slot.waiting,
            self.core.wishes.is_paused(name),
        )

    def views(self) -> list[SlotView]:
        table = self.core.table
        return [table.view(slot) for slot in table]

    def model_states(self, model_id: str) -> dict[str, SlotState]:
        """Each slot of ``model_id`` with its state (what a Model's status shows), from the
        table without a view of every slot (a Model's status timer, at 1,000 slots)."""
        return {s.name: s.state for s in self.core.table if s.model_id == model_id}

    def port(self, name: str) -> int | None:
        """The port the slot's server listens on: its running launch's, else its own,
        else the one the controller chose for it (None: none chosen yet)."""
        slot = self.core.table.get(name)
        if slot.launch is not None:
            return slot.launch.port
        return slot.spec.port or self.core.table.store.read_port(name)

    def endpoint(self, name: str) -> str | None:
        """The URL the slot's server answers on (None while it has none)."""
        slot = self.core.table.records.get(name)
        if slot is None:
            raise SlotNotFound(name)
        server = slot.server
        return server.launch.endpoint if server is not None else None

    def upstream_of(self, name: str) -> tuple[str | None, str]:
        """:meth:`endpoint` and the slot's replica group ("" when it is no replica), in one
        look: the router asks both for every request (a routed request's code runs from
        cold caches, where each function more it touches costs; docs/performance.md)."""
        slot = self.core.table.records.get(name)
        if slot is None:
            raise SlotNotFound(name)
        spec = slot.spec
        groups = self._groups
        found = groups.get(name)
        if found is None or found[0] is not spec:  # a new spec: its group read again
            if len(groups) >= 4096:
                groups.clear()
            found = groups[name] = (spec, spec.replica_group)
        server = slot.server
        if server is None:
            return None, found[1]
        launch = server.launch
        return launch._endpoint or launch.endpoint, found[1]  # (made once: the property's)

    def routable(self, model: str) -> list[Candidate]:
        """The activated slots a request for ``model`` may use, unranked (no view built)."""
        return self.core.table.routable(model)

    def load_of(self, name: str) -> tuple[int, int, bool]:
        """``(in flight, waiting, warm)`` of a slot: its leases, the requests waiting for
        its turns or its load, and whether it serves now (the replica routing's figures;
        (0, 0, False) for a slot it does not know)."""
        slot = self.core.table.records.get(name)
        if slot is None:
            return 0, 0, False
        book = slot.book
        return book.in_flight, book.queued + book.waiters, Loading.loaded(slot)

    def names(self) -> list[str]:
        return self.core.table.names()

    def admitted_bytes(self, device: str) -> int:
        return self.core.table.usage.admitted_bytes(device)

    def devices(self) -> list[DeviceFigures]:
        """Every device (each GPU, cpu, npu, a cluster's nodes) with its memory figures."""
        return self.admission.figures()

    def resident_bytes(self, device: str) -> int:
        return self.core.table.usage.resident_bytes(device)

    def lease_count(self) -> int:
        return sum(len(s.book.leases) for s in self.core.table)

    def waiting_by_class(self) -> dict[str, int]:
        """Requests waiting now (for a load or a turn), by priority class, every class
        listed ("" counts the waiters of no class: the API's own leases)."""
        out = {c.name: 0 for c in self.settings.priority_classes}
        for slot in self.core.table:
            book = slot.book
            for cls, count in book.cold_classes.items():
                out[cls] = out.get(cls, 0) + count
            if book.turns is not None:
                for cls in book.turns.waiting_classes():
                    out[cls] = out.get(cls, 0) + book.turns.waiting(cls)
        return out

    def last_used(self, name: str) -> float:
        """Monotonic time of the slot's last lease or release (the ranking's recency)."""
        return self.core.table.get(name).last_used

    def waiting(self) -> list[str]:
        """Slots whose background load waits for memory (the reconciler retries them)."""
        return [s.name for s in self.core.table if s.waiting is not None]

    # ================================================================= loads and unloads

    async def load(self, name: str, *, resident: bool = True, background: bool = False) -> SlotView:
        """Load (or join the load of) a slot. ``resident`` records the wish to keep it.

        ``background``: the reconciler or the restore keeping a slot loaded, not a user:
        such a load evicts only lower-priority slots idle for ``min_resident_s`` and
        otherwise waits for memory (:mod:`controller.scheduling.decision`). A load of a loaded slot
        is a no-op that answers the current state.
        """
        slot = self.core.table.get(name)
        await self.loading.load(slot, resident=resident, background=background)
        return self.core.table.view(slot)

    async def start_load(
        self, name: str, *, resident: bool = True, background: bool = False
    ) -> SlotView:
        """Start a load and return once its admission is decided (the load goes on).

        Raises the typed refusal when the load is refused; for the API's ``202 loading``
        and the ordered restore at start. Joins a load already in flight at once.
        """
        slot = self.core.table.get(name)
        await self.loading.start_load(slot, resident=resident, background=background)
        return self.core.table.view(slot)

    def explain_load(self, name: str) -> LoadPlan:
        """Dry run of a load: the same decision the load takes (a unit member's: the
        unit's, every member explained), as data (the API renders it as JSON). Changes
        nothing."""
        slot = self.core.table.get(name)
        return self.loading.units.explain(slot, self.admission.explain(slot))

    async def explain(self, name: str) -> LoadPlan:
        """:meth:`explain_load` with the model files the load would pull first ("would
        pull 4.1 GB from hf://…"), or the refusal it would meet for them (a file that
        cannot be pulled, a pull that does not fit the disk). May ask the hub for sizes."""
        await self.admission.sizing.estimate(self.core.table.get(name))  # its file, now
        slot = self.core.table.get(name)
        plan = self.lora.explain(slot, self.explain_load(name))
        return await self.pulling.explain(slot, plan)

    async def footprints(self, model_id: str) -> list[FootprintView]:
        """The footprint of ``model_id`` on each slot that binds it (its launch decides
        the context, cache types and device), estimated from its file now."""
        out: list[FootprintView] = []
        for slot in self.core.table:
            if slot.spec.model_id == model_id and slot.model is not None:
                await self.admission.sizing.estimate(slot)
                out.append(FootprintView.of(slot))
        return out

    def decide(self, name: str, *, background: bool = False) -> LoadDecision:
        """The load decision for ``name`` now (what :meth:`explain_load` renders)."""
        return self.admission.decide(self.core.table.get(name), background=background)

    async def swap(self, declared: DesiredSlot) -> SlotView:
        """Serve another catalogue model on a slot: unload, take the declared spec, load.

        ``declared`` is the slot as the config dir now declares it: the caller wrote the
        new binding through the guard and read it back (the API does), so the binding has
        one writer and what runs agrees with what the reconciler reads. The spec is taken
        through :meth:`upsert`, the same path the reconciler uses.
        """
        name, model_id = declared.name, declared.spec.model_id
        slot = self.core.table.get(name)
        if model_id is None or model_id not in self.models:
            raise self.core.table.refuse(slot, Op.LOAD, ModelNotFound(str(model_id)))
        if slot.model is not None and slot.model.id == model_id and self.loading.loaded(slot):
            self.upsert(declared)
            return self.core.table.view(slot)
        await self.unload(name, force=True, reason=f"swapping to {model_id}", clear_residency=False)
        self.upsert(declared)
        return await self.load(name)

    # ================================================================= leases

    # ================================================================= time-driven work

    # ================================================================= start and stop

    async def close(self) -> None:
        await self.core.tasks.cancel()
        await self.core.table.close()  # lease flips still lagging reach state.json
        await self.prober.close()

    def revoke_leases(self, reason: str) -> int:
        """End every lease now, holds included, with a typed error (the router ends a
        stream with an error event): ``up --keep-running`` exits, its servers stay.
        Returns how many leases were ended."""
        ended = 0
        for slot in self.core.table:
            for lease in list(slot.book.leases.values()):
                lease.revoke(SlotNotReady(f"slot {slot.name!r}: {reason}", slot=slot.name))
                self.release(lease)
                ended += 1
        return ended

    def end_drains(self) -> None:
        """Stop waiting for in-flight requests: running and later drains revoke their
        leases at once (a second Ctrl-C of ``slotctl up``)."""
        self.unloading.drains_ended = True

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
        self.loading.stopping = reason  # a waiter of a load cancelled below is told why
        for slot in self.core.table:
            leases = slot.book.leases
            for lease in [x for x in leases.values() if x.expires_at is not None]:
                self.release(lease)
            if leases and on_drain is not None:
                on_drain(slot.name, len(leases), slot.spec.drain_timeout_s)
        pending = [s.flight.task for s in self.core.table if s.flight.task is not None]
        pending += list(self.core.tasks)
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

        await asyncio.gather(*(one(n) for n in self.names()))
