"""LoRA adapters inside slots: the residency of each slot's adapters, carried out (the
decision is :mod:`controller.scheduling.adapters`').

A slot whose server loads adapters at run time (``lora_api`` vllm or sglang) holds up to
``max_loras`` of them. A request for an adapter takes an :class:`AdapterHold` on a slot it
leased (:meth:`Adapters.acquire`): resident, the hold is taken at once; loading, the
request joins that one load; else the decision says which idle adapters go first
(lowest priority, then least recently used; pinned ones and ones with requests in flight
never) and one load runs. When none can go the request is refused
(:class:`~controller.model.errors.AdapterUnavailable`, 503 with Retry-After): it is never
answered by the base model or another adapter. An unload drains the adapter's requests
first. A start-time engine (llamacpp, llama-cpp-python) holds the adapters it was started
with, nothing to load.

The resident set belongs to one run of the slot's server: after a restart
(:meth:`Adapters.reapply`, called before the slot is ready again) the adapters held before
are loaded into the new server. The slot's admission counts the bytes of the ``max_loras``
largest adapters of its base model (``SlotRecord.adapter_bytes``, set here through the
table).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from controller.model.errors import (
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterUnavailable,
    SlotctlError,
    SlotNotReady,
)
from controller.model.events import EventKind, Op
from controller.model.lifecycle import DISPATCHABLE_STATES
from controller.probes.adapters import AdapterLoader, HttpAdapterLoader
from controller.providers.base import adapter_path
from controller.providers.launch import launch_context
from controller.scheduling.adapters import (
    RETRY_AFTER_S,
    AdapterSeat,
    Resident,
    adapter_reserve,
    decide_adapter,
    rank_adapter_slots,
)
from controller.slots.core import Core, Part
from controller.slots.dryrun import LoadPlan, PlanAdapters
from controller.slots.records import AdapterHold, RunningServer, SlotRecord
from controller.spec.adapters import RUNTIME_APIS, serves_adapter
from controller.spec.schema import AdapterSpec

__all__ = ["Adapters"]

log = logging.getLogger("slotctl.adapters")

LOAD_TIMEOUT_S: Final = 120.0  # one adapter load or unload call
# How long a request waits for a place in a full slot while one may free (an adapter in
# use, loading or being unloaded); with every place pinned it is refused at once.
WAIT_S: Final = 30.0


@dataclass(slots=True)
class _Held:
    """One adapter resident in one slot's server."""

    spec: AdapterSpec
    in_flight: int = 0
    used_at: float = 0.0
    served: int = 0


@dataclass(slots=True)
class _Shelf:
    """One slot's adapters: those resident in ``run`` (the server they were loaded into),
    the loads in progress (joined), those leaving for an unload."""

    run: RunningServer | None = None
    held: dict[str, _Held] = field(default_factory=dict)
    loads: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    leaving: set[str] = field(default_factory=set)
    # What the run before held (re-applied to the new one before it is ready), and what a
    # surge's new server was given before the switch (its endpoint, its adapters).
    previous: dict[str, _Held] = field(default_factory=dict)
    next: tuple[str, dict[str, _Held]] | None = None
    # Set (and replaced) at every change that may free a place: a hold released, a load
    # or an unload ended.
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def until_changed(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), max(0.0, timeout_s))


class Adapters(Part):
    """See the module docstring."""

    def __init__(self, core: Core, loader: AdapterLoader | None = None) -> None:
        super().__init__(core)
        self.loader: AdapterLoader = loader or HttpAdapterLoader()
        self._shelves: dict[str, _Shelf] = {}
        self.loads = 0  # adapter loads made (metrics, the bench)
        self.evictions = 0

    # ------------------------------------------------------------------ the catalogue

    @property
    def catalogue(self) -> Mapping[str, AdapterSpec]:
        return self.core.adapters

    def set_catalogue(self, adapters: Mapping[str, AdapterSpec]) -> None:
        """Replace the declared adapters (the config dir's ``[[adapter]]``); each slot's
        reserve follows, and a start-time slot's launch hash is built again."""
        self.core.adapters = dict(adapters)
        for slot in self.table:
            self.reserve(slot)
            if slot.spec.adapters:
                self.core.forget_hash(slot)

    def reserve(self, slot: SlotRecord) -> None:
        """Set the device memory ``slot``'s adapters may take (its admission counts it)."""
        spec = slot.spec
        sizes = [a.memory_bytes for a in self.core.adapters.values() if serves_adapter(spec, a)]
        capacity = len(spec.adapters) if spec.lora_api not in RUNTIME_APIS else spec.max_loras
        self.table.adapter_reserve(slot, adapter_reserve(capacity, sizes))

    def explain(self, slot: SlotRecord, plan: LoadPlan) -> LoadPlan:
        """``plan`` (a load's dry run) naming the slot's adapters: its places, the memory
        reserved for them, those it serves and those it would load again before ready."""
        spec = slot.spec
        if spec.lora_api is None:
            return plan
        serves = tuple(sorted(a.id for a in self.core.adapters.values() if serves_adapter(spec, a)))
        shelf = self._shelves.get(slot.name)
        held = tuple(shelf.held) if shelf is not None and shelf.run is not slot.server else ()
        places = spec.max_loras if spec.lora_api in RUNTIME_APIS else len(spec.adapters)
        adapters = PlanAdapters(spec.lora_api, places, slot.adapter_bytes, serves, held)
        return replace(plan, adapters=adapters)

    def slots_for(self, adapter: str) -> list[str]:
        """The slots that can serve ``adapter``, those holding it first."""
        spec = self.core.adapters.get(adapter)
        if spec is None:
            return []
        seats = [
            AdapterSeat(
                s.name,
                self.holds(s.name, adapter),
                s.server is not None and s.state in DISPATCHABLE_STATES,
                s.spec.max_concurrency is not None and s.book.in_flight >= s.spec.max_concurrency,
            )
            for s in self.table
            if serves_adapter(s.spec, spec)
        ]
        return rank_adapter_slots(seats)

    def holds(self, slot: str, adapter: str) -> bool:
        """``adapter`` is resident (or loading) in ``slot``'s running server."""
        shelf = self._shelves.get(slot)
        if shelf is None:
            return False
        record = self.table.get(slot)
        if record.spec.lora_api not in RUNTIME_APIS:
            return adapter in record.spec.adapters
        fresh = shelf.run is not None and shelf.run is record.server
        return fresh and (adapter in shelf.held or adapter in shelf.loads)

    def resident(self, slot: str) -> list[dict[str, Any]]:
        """``slot``'s adapters as the API shows them."""
        record = self.table.get(slot)
        if record.spec.lora_api not in RUNTIME_APIS:
            return [
                {"id": a, "in_flight": 0, "state": "started", "pinned": True}
                for a in record.spec.adapters
                if record.server is not None
            ]
        shelf = self._shelf(record)
        out = [
            {
                "id": h.spec.id,
                "in_flight": h.in_flight,
                "requests": h.served,
                "state": "draining" if h.spec.id in shelf.leaving else "loaded",
                "pinned": h.spec.pinned,
                "priority": h.spec.priority,
            }
            for h in shelf.held.values()
        ]
        out += [{"id": a, "in_flight": 0, "state": "loading"} for a in shelf.loads]
        return out

    # ------------------------------------------------------------------ requests

    def try_acquire(self, slot: str, adapter: str) -> AdapterHold | None:
        """A hold needing no wait (resident, or a start-time engine's), else None."""
        record = self.table.get(slot)
        spec = self._spec(adapter, record)
        if record.spec.lora_api not in RUNTIME_APIS:
            return self._started(record, spec)
        shelf = self._shelf(record)
        held = shelf.held.get(adapter)
        if held is None or adapter in shelf.leaving:
            return None
        return self._take(record, held)

    async def acquire(self, slot: str, adapter: str) -> AdapterHold:
        """A hold on ``adapter`` in ``slot`` (whose lease the caller holds): loaded first
        if it must be, joining a load in progress; in a full slot it waits (up to
        :data:`WAIT_S`) while a place may free. Raises the typed refusal."""
        deadline = self.clock.monotonic() + WAIT_S
        while True:
            hold = self.try_acquire(slot, adapter)
            if hold is not None:
                return hold
            record = self.table.get(slot)
            shelf = self._shelf(record)
            task = shelf.loads.get(adapter)
            if task is not None:
                await asyncio.shield(task)
                continue
            try:
                if adapter in shelf.leaving:
                    raise self._refusal(record, adapter, "it is being unloaded", waitable=True)
                task = self._start_load(record, shelf, self._spec(adapter, record))
            except AdapterUnavailable as exc:
                left = deadline - self.clock.monotonic()
                if not exc.details.get("waitable") or left <= 0:
                    raise
                await shelf.until_changed(left)
                continue
            await asyncio.shield(task)

    def release(self, hold: AdapterHold) -> None:
        """The request using ``hold`` ended."""
        shelf = self._shelves.get(hold.slot)
        held = shelf.held.get(hold.adapter) if shelf is not None else None
        if shelf is None or held is None or hold.index >= 0:
            return
        held.in_flight = max(0, held.in_flight - 1)
        held.used_at = self.clock.monotonic()
        shelf.notify()

    # ------------------------------------------------------------------ commands

    async def load(self, slot: str, adapter: str) -> None:
        """Make ``adapter`` resident in ``slot`` (``slotctl adapter load``)."""
        hold = await self.acquire(slot, adapter)
        self.release(hold)

    async def unload(self, slot: str, adapter: str, timeout_s: float | None = None) -> bool:
        """Drain ``adapter``'s requests in ``slot`` (new ones are refused meanwhile), then
        unload it. False: it was not resident."""
        record = self.table.get(slot)
        if record.spec.lora_api not in RUNTIME_APIS:
            raise AdapterUnavailable(
                f"slot {slot!r} is given its adapters at start ({record.spec.lora_api}): "
                "change its `adapters` to unload one (a restart)",
                retry_after_s=0,
                slot=slot,
            )
        shelf = self._shelf(record)
        task = shelf.loads.get(adapter)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        held = shelf.held.get(adapter)
        if held is None:
            return False
        shelf.leaving.add(adapter)
        try:
            limit = record.spec.drain_timeout_s if timeout_s is None else timeout_s
            deadline = self.clock.monotonic() + limit
            while held.in_flight and self.clock.monotonic() < deadline:
                await shelf.until_changed(deadline - self.clock.monotonic())
            await self._unload_one(record, shelf, adapter, "unloaded")
        finally:
            shelf.leaving.discard(adapter)
            shelf.notify()
        return True

    async def reapply(self, slot: SlotRecord) -> None:
        """``slot``'s server is new and not ready yet: the adapters held in the one before
        are loaded into it (those that fail are dropped, said in an event)."""
        if slot.name not in self._shelves or slot.spec.lora_api not in RUNTIME_APIS:
            return
        shelf = self._shelf(slot)  # the run before's adapters moved to ``previous``
        before, shelf.previous = list(shelf.previous.values()), {}
        for held in before:
            if not serves_adapter(slot.spec, held.spec) or held.spec.id in shelf.held:
                continue
            error = await self._call_load(slot, held.spec)
            if error:
                self._emit(slot, held.spec.id, "failed", error)
                continue
            shelf.held[held.spec.id] = _Held(held.spec, used_at=held.used_at)
            self._emit(slot, held.spec.id, "reapplied", "loaded into the restarted server")

    async def prepare_switch(self, slot: SlotRecord, endpoint: str) -> None:
        """A surge's new server (at ``endpoint``) is ready and not switched to yet: the
        adapters the old one holds are loaded into it first, so the switch keeps them."""
        if slot.name not in self._shelves or slot.spec.lora_api not in RUNTIME_APIS:
            return
        shelf = self._shelf(slot)
        given: dict[str, _Held] = {}
        for held in list(shelf.held.values()):
            error = await self._call_load(slot, held.spec, endpoint)
            if error:
                self._emit(slot, held.spec.id, "failed", error)
                continue
            given[held.spec.id] = _Held(held.spec, used_at=held.used_at)
            self._emit(slot, held.spec.id, "reapplied", "loaded into the surge's new server")
        shelf.next = (endpoint, given)

    # ------------------------------------------------------------------ the parts

    def _spec(self, adapter: str, record: SlotRecord) -> AdapterSpec:
        spec = self.core.adapters.get(adapter)
        if spec is None or not serves_adapter(record.spec, spec):
            where = f" in slot {record.name!r}" if spec is not None else ""
            raise AdapterNotFound(f"adapter {adapter!r} is not served{where}", adapter=adapter)
        return spec

    def _shelf(self, record: SlotRecord) -> _Shelf:
        shelf = self._shelves.setdefault(record.name, _Shelf())
        if shelf.run is not record.server and not shelf.loads:
            # another run (or none): what was held is gone from the server now running,
            # unless a surge gave it to that server before the switch
            if shelf.held:
                shelf.previous = shelf.held
            given, server = shelf.next, record.server
            kept = given is not None and server is not None and server.launch.endpoint == given[0]
            shelf.held = given[1] if kept and given is not None else {}
            shelf.run, shelf.next = server, None
        return shelf

    def _started(self, record: SlotRecord, spec: AdapterSpec) -> AdapterHold:
        if record.server is None:
            raise SlotNotReady(f"slot {record.name!r} has no server", slot=record.name)
        index = record.spec.adapters.index(spec.id)
        return AdapterHold(record.name, spec.id, record.spec.lora_api or "", index, spec.scale)

    def _take(self, record: SlotRecord, held: _Held) -> AdapterHold:
        held.in_flight += 1
        held.served += 1
        held.used_at = self.clock.monotonic()
        return AdapterHold(record.name, held.spec.id, record.spec.lora_api or "")

    def _start_load(
        self, record: SlotRecord, shelf: _Shelf, spec: AdapterSpec
    ) -> asyncio.Task[None]:
        residents = [
            Resident(h.spec.id, h.spec.priority, h.spec.pinned, h.in_flight, h.used_at)
            for h in shelf.held.values()
            if h.spec.id not in shelf.leaving
        ]
        residents += [Resident(a, loading=True) for a in shelf.loads]
        leaving = len(shelf.leaving)  # an adapter being unloaded still takes its place
        decision = decide_adapter(spec.id, residents, record.spec.max_loras - leaving)
        if not decision.ok:
            frees = leaving or any(r.in_flight or r.loading for r in residents if not r.pinned)
            raise self._refusal(record, spec.id, decision.reason, waitable=bool(frees))
        victims = [shelf.held.pop(v) for v in decision.victims]  # no new request takes them
        shelf.leaving.update(decision.victims)  # a request for one waits until it is gone
        task = asyncio.get_running_loop().create_task(self._load(record, shelf, spec, victims))
        shelf.loads[spec.id] = task
        task.add_done_callback(lambda t: _settled(shelf, spec.id, t))
        return task

    @staticmethod
    def _refusal(
        record: SlotRecord, adapter: str, why: str, *, waitable: bool
    ) -> AdapterUnavailable:
        """``adapter`` has no place in ``record``'s server now (``waitable``: one may free)."""
        return AdapterUnavailable(
            f"adapter {adapter!r} cannot be loaded into slot {record.name!r} now: {why}",
            retry_after_s=RETRY_AFTER_S,
            adapter=adapter,
            slot=record.name,
            waitable=waitable,
        )

    async def _load(
        self, record: SlotRecord, shelf: _Shelf, spec: AdapterSpec, victims: list[_Held]
    ) -> None:
        try:
            for victim in victims:
                error = await self._call_unload(record, victim.spec.id)
                shelf.leaving.discard(victim.spec.id)
                self.evictions += 1
                self._emit(record, victim.spec.id, "evicted", error or f"room for {spec.id!r}")
        finally:
            shelf.leaving.difference_update(v.spec.id for v in victims)
        error = await self._call_load(record, spec)
        if error:
            self._emit(record, spec.id, "failed", error)
            raise AdapterLoadFailed(
                f"slot {record.name!r} could not load adapter {spec.id!r}: {error}",
                adapter=spec.id,
                slot=record.name,
            )
        self.loads += 1
        shelf.held[spec.id] = _Held(spec, used_at=self.clock.monotonic())
        self._emit(record, spec.id, "loaded", f"loaded into {record.name!r}")

    async def _unload_one(
        self, record: SlotRecord, shelf: _Shelf, adapter: str, action: str
    ) -> None:
        shelf.held.pop(adapter, None)
        error = await self._call_unload(record, adapter)
        self._emit(record, adapter, action, error or f"unloaded from {record.name!r}")

    def _endpoint(self, record: SlotRecord) -> str:
        server = record.server
        if server is None:
            raise SlotNotReady(f"slot {record.name!r} has no server", slot=record.name)
        return server.launch.endpoint

    async def _call_load(
        self, record: SlotRecord, spec: AdapterSpec, endpoint: str | None = None
    ) -> str:
        files = self.core.files
        if files is not None:  # pulled and verified as a model's files are
            try:
                await files.ensure(spec.as_model())
            except SlotctlError as exc:
                return f"its files: {exc.message}"
        ctx = launch_context(self.runtime.kind, record.stack, self.core.models_dir)
        path = adapter_path(spec, ctx)
        api = record.spec.lora_api or ""
        where = endpoint or self._endpoint(record)
        return await self.loader.load(where, api, spec.id, path, LOAD_TIMEOUT_S)

    async def _call_unload(self, record: SlotRecord, adapter: str) -> str:
        if record.server is None:
            return ""  # no server: nothing is loaded
        api = record.spec.lora_api or ""
        return await self.loader.unload(self._endpoint(record), api, adapter, LOAD_TIMEOUT_S)

    def _emit(self, record: SlotRecord, adapter: str, action: str, message: str) -> None:
        op = Op.EVICT if action == "evicted" else Op.UNLOAD if action == "unloaded" else Op.LOAD
        self.events.emit(
            EventKind.ADAPTER,
            op,
            slot=record.name,
            model=record.spec.model_id,
            message=f"adapter {adapter} {action}: {message}",
            details={"adapter": adapter, "action": action},
        )


def _settled(shelf: _Shelf, adapter: str, task: asyncio.Task[None]) -> None:
    if shelf.loads.get(adapter) is task:
        del shelf.loads[adapter]
    shelf.notify()
    if not task.cancelled():
        task.exception()  # retrieved: the joiners re-raise it
