"""Co-loaded units: one load task per unit, all or nothing (docs/design/0013).

A part of the manager (:mod:`controller.slots`), between :mod:`.loading` (whose
``_load_task`` hands a unit member's load here) and :mod:`.admission`. A load of any
member of a unit (a request through the router, an API or CLI load, the reconciler, the
restore at start) is the unit's load: one task, joined by every member's waiters, that

1. takes the unit's joint decision: each member's own checks (activated, model, breaker,
   pinned peers), then :func:`controller.scheduling.placement.place_joint` over the members still to
   load — the biggest first, on the GPUs each will use, never evicting a member of the
   unit — and refuses the whole unit when one member fits nowhere beside the others
   (nothing changed);
2. loads the members in that order through the ordinary per-slot load flow (each takes its
   own locks, admission and evictions on live state: the slot manager's code changes the
   state, as for every load);
3. rolls back when a member fails to load: the members this task loaded are unloaded,
   and the member's error is the unit's.

Evictions take a unit whole (:mod:`controller.scheduling.eviction`, ``Unloading.evict``), so
sleeping and restoring go by unit too. :meth:`UnitLoads.explain` is the unit's dry run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from controller.model.errors import DeviceUnavailable, InsufficientMemory, SlotctlError
from controller.model.events import Op
from controller.model.lifecycle import DISPATCHABLE_STATES, SlotState
from controller.scheduling.decision import LoadDecision, insufficient
from controller.scheduling.eviction import without_unit
from controller.scheduling.placement import JointPlacement, Need, describe, place_joint
from controller.slots.admission import Admission
from controller.slots.core import Core, Part
from controller.slots.dryrun import Action, LoadPlan, Together, UnitPlan
from controller.slots.records import SlotRecord
from controller.slots.unloading import Unloading

__all__ = ["UnitLoads"]

S = SlotState
Flow = Callable[[SlotRecord], Awaitable[int]]


def _loaded(slot: SlotRecord) -> bool:
    return slot.state in DISPATCHABLE_STATES and not slot.asleep and not slot.book.draining


class UnitLoads(Part):
    def __init__(self, core: Core, admission: Admission, unloading: Unloading, flow: Flow):
        super().__init__(core)
        self.admission = admission
        self.unloading = unloading
        self.flow = flow  # the per-slot load flow (Loading._load_flow)

    def members(self, slot: SlotRecord) -> list[SlotRecord]:
        """``slot``'s unit, in the table's order (empty: no unit, or a unit of one)."""
        unit = slot.spec.unit
        if unit is None:
            return []
        members = [s for s in self.table if s.spec.unit == unit]
        return members if len(members) > 1 else []

    def task(
        self, slot: SlotRecord, members: list[SlotRecord], *, background: bool
    ) -> asyncio.Task[int]:
        """The unit's load task: the one running (any member's), else a new one that every
        member's waiters join (a member's own load still running from before it joined
        the unit is waited for by that member's turn: its slot lock)."""
        name = f"load-unit:{slot.spec.unit}"
        for m in members:
            task = m.flight.task
            if task is not None and not task.done() and task.get_name() == name:
                return task
        task = asyncio.create_task(self._flow(slot, members, background), name=name)
        task.add_done_callback(_settled)
        for m in members:
            m.flight.begin(task, background=background)
        return task

    async def _flow(self, slot: SlotRecord, members: list[SlotRecord], background: bool) -> int:
        """The unit's load (see the module docstring); ``slot``'s generation it produced."""
        try:
            order = self._decide(slot, members, background)
            for m in members:
                m.flight.decided()  # the unit is admitted: its members load in turn
            done: list[SlotRecord] = []
            for m in order:
                try:
                    await self.flow(m)
                except (SlotctlError, asyncio.CancelledError) as exc:
                    await self._rollback(slot, done, m, exc)
                    raise
                done.append(m)
            return slot.flight.generation
        finally:
            for m in members:
                m.flight.decided()

    def waiting_with_room(self) -> list[str]:
        """The waiting slots whose background load would be admitted now
        (``Admission.waiting_with_room``), a unit member's only when its whole unit would
        be: else the reconciler would try it again every second, refused every time."""
        out = []
        for name in self.admission.waiting_with_room():
            slot = self.table.records.get(name)
            todo = [m for m in self.members(slot) if not _loaded(m)] if slot else []
            if slot is None or len(todo) < 2 or self.joint(slot, todo, background=True).ok:
                out.append(name)
        return out

    def _decide(
        self, slot: SlotRecord, members: list[SlotRecord], background: bool
    ) -> list[SlotRecord]:
        """The members to load, in order (biggest first); raises the unit's refusal."""
        todo = [m for m in members if not _loaded(m)]
        if len(todo) < 2:
            return todo  # one member to load: its own decision is the unit's
        for m in todo:
            decision = self.admission.decide(m, background=background, evict=False)
            if not decision.ok and not isinstance(
                decision.error, InsufficientMemory | DeviceUnavailable
            ):
                raise self.admission.refuse(slot, self._unit_refusal(slot, m, decision))
        joint = self.joint(slot, todo, background=background)
        if not joint.ok:
            name, placement = joint.members[-1]
            failed = next(m for m in todo if m.name == name)
            error = placement.error or insufficient(name, placement, waiting=background)
            option = placement.option
            decision = LoadDecision(
                "refuse",
                error=error,
                admission=option.admissions[0] if option is not None else None,
                waiting=background,
                placement=placement,
            )
            raise self.admission.refuse(slot, self._unit_refusal(slot, failed, decision))
        by_name = {m.name: m for m in todo}
        return [by_name[name] for name, _ in joint.members]

    def _unit_refusal(
        self, slot: SlotRecord, member: SlotRecord, decision: LoadDecision
    ) -> LoadDecision:
        """A member's refusal as the unit's: its message says so, its details name the
        unit and its members."""
        error = decision.error
        assert error is not None
        names = [m.name for m in self.members(slot)]
        prefix = f"unit {slot.spec.unit!r} ({', '.join(names)}) loads together: "
        if not error.message.startswith(prefix):
            error.message = prefix + error.message
            error.args = (error.message,)
        error.details["unit"] = {"name": slot.spec.unit, "members": names, "failed": member.name}
        return decision

    def joint(
        self, slot: SlotRecord, todo: list[SlotRecord], *, background: bool
    ) -> JointPlacement:
        """The joint placement of the members still to load (pure, on live figures)."""
        now = self.clock.monotonic()
        unit = slot.spec.unit
        top = max(m.spec.priority for m in todo)
        margin = self.settings.min_resident_s

        def candidates() -> list[Any]:
            allowed = without_unit(unit, self.table.usage.candidates(self.admission._recent))
            if background:  # as a background load of one slot: lower priority, idle enough
                allowed = [c for c in allowed if c.priority < top and now - c.last_used >= margin]
            return allowed

        needs = []
        for m in todo:
            devices = self.admission.device_facts(m)
            spans = not m.on_nodes or any(d.group for d in devices)
            span = max(1, m.spec.gpu_count) if spans else 1
            need = Need(m.name, m.memory_bytes, span, Admission._pins(m))
            needs.append((need, devices))
        return place_joint(needs, candidates, now, host=self.admission.host_room)

    async def _rollback(
        self, slot: SlotRecord, done: list[SlotRecord], failed: SlotRecord, exc: BaseException
    ) -> None:
        """Unload the members this load brought up: a unit is loaded whole or not at all."""
        why = exc.message if isinstance(exc, SlotctlError) else "cancelled"
        reason = f"unit {slot.spec.unit!r}: {failed.name} failed to load ({why}): rolled back"
        for m in reversed(done):
            with contextlib.suppress(SlotctlError):
                async with m.lock:
                    if m.state in (S.READY, S.IDLE):
                        await self.unloading.unload_locked(m, reason, Op.LOAD)

    def explain(self, slot: SlotRecord, plan: LoadPlan) -> LoadPlan:
        """The dry run of a unit member's load: ``plan`` (the slot's own) with the unit —
        its members, each explained, and the joint verdict (a refusal of the unit is the
        slot's refusal)."""
        members = self.members(slot)
        if not members:
            return plan
        todo = [m for m in members if not _loaded(m)]
        joint = self.joint(slot, todo, background=False) if len(todo) > 1 else None
        placed = dict(joint.members) if joint is not None else {}
        explained = []
        for m in members:
            own = self.admission.explain(m)
            p = placed.get(m.name)
            if p is not None and p.option is not None and p.error is None:
                together = Together(
                    devices=tuple(d.key for d in p.option.devices),
                    where=describe(p.option),
                    fits=p.option.fits,
                    evict=tuple(v.name for v in p.option.victims),
                )
                own = replace(own, together=together)
            explained.append(own)
        name = slot.spec.unit or ""
        if joint is None:
            unit = UnitPlan(name, tuple(explained), "none" if not todo else plan.action)
            return replace(plan, unit=unit)
        action: Action = (
            "refuse" if not joint.ok else "evict-then-load" if joint.victims else "load"
        )
        unit = UnitPlan(
            name,
            tuple(explained),
            action,
            order=tuple(n for n, _ in joint.members),
            evict=tuple(v.name for v in joint.victims),
            failed=joint.failed,
        )
        if not joint.ok and plan.action != "refuse":
            why = f"{joint.failed} does not fit beside the other members of its unit"
            plan = replace(plan, action="refuse", reason=why)
        return replace(plan, unit=unit)


def _settled(task: asyncio.Task[int]) -> None:
    """Retrieve a unit load's outcome: its joiners got it; nobody else must be warned."""
    if not task.cancelled():
        task.exception()
