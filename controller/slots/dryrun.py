"""The dry run of a load as data: what it would do, where, what it evicts and why.

Below :mod:`.admission` and :mod:`.units`, which take the one decision on live state and
hand it here (``slotctl slot load --dry-run``, ``POST /api/slots/{name}/load?dry_run=true``,
:meth:`~controller.slots.manager.SlotManager.explain_load`). A :class:`LoadPlan` is frozen
data built from the same :class:`~controller.scheduling.decision.LoadDecision` the load
takes, so the two never disagree; the API renders it as JSON
(:mod:`controller.api.dryrun`), the CLI that JSON as text. Nothing here changes a slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from controller.model.devices import share
from controller.model.errors import SlotctlError
from controller.scheduling.decision import LoadDecision
from controller.scheduling.eviction import Victim
from controller.scheduling.fit import Admission
from controller.slots.records import FootprintView, SlotRecord
from controller.store.state import ReloadCosts

__all__ = [
    "Action",
    "LoadPlan",
    "PlanDevice",
    "PlanPull",
    "PlanTarget",
    "PlanVictim",
    "Refusal",
    "Reload",
    "Together",
    "UnitPlan",
    "plan_of",
]

# none: already loaded; load: it fits; evict-then-load: after its victims; refuse.
Action = Literal["none", "load", "evict-then-load", "refuse"]


@dataclass(frozen=True, slots=True)
class PlanVictim:
    """A slot the load would evict: how (``sleep`` or ``unload``), why, what it frees."""

    slot: str
    action: str  # sleep | unload
    level: int  # the sleep level (sleep)
    priority: int
    idle_s: float
    bytes: int
    devices: tuple[str, ...]  # where it frees memory
    host: str | None  # sleep: the host key its weights go to
    host_bytes: int  # sleep: what it will hold there
    load_s: float  # its cold load and wake times (measured, else the prior)
    wake_s: float
    score: float  # the order's key inside its priority tier
    reason: str

    @classmethod
    def of(cls, v: Victim) -> PlanVictim:
        return cls(
            slot=v.name,
            action=v.action,
            level=v.level,
            priority=v.priority,
            idle_s=round(v.idle_s, 1),
            bytes=v.bytes,
            devices=v.devices,
            host=v.host or None,
            host_bytes=v.host_bytes,
            load_s=round(v.load_s, 3),
            wake_s=round(v.wake_s, 3),
            score=v.score,
            reason=v.reason,
        )


@dataclass(frozen=True, slots=True)
class PlanDevice:
    """One device of the placement: its figures, and the victims that free memory there."""

    device: str
    needed_bytes: int
    free_bytes: int
    budget_bytes: int
    admitted_bytes: int
    probe: str  # where the free figure comes from (nvml, sysfs, budget, ...)
    evict: tuple[str, ...]

    @classmethod
    def of(cls, a: Admission, victims: tuple[Victim, ...]) -> PlanDevice:
        return cls(
            device=a.device,
            needed_bytes=a.needed,
            free_bytes=a.free,
            budget_bytes=a.budget,
            admitted_bytes=a.admitted,
            probe=a.source,
            evict=tuple(v.name for v in victims if a.device in v.devices),
        )


@dataclass(frozen=True, slots=True)
class PlanTarget:
    """Where the load would go: the devices chosen (a refusal: none) and the figures of
    the first (or of the set that came closest), each device's, the peers it unloads."""

    device: str  # the slot's admission scope (gpu, cpu, NODE/gpu)
    devices: tuple[str, ...]
    needed_bytes: int
    free_bytes: int
    budget_bytes: int
    admitted_bytes: int
    probe: str
    exclusive_peers: tuple[str, ...]  # exclusive-group members unloaded first
    placement: tuple[PlanDevice, ...]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the load would be refused: the typed error it would raise, and for a shortage
    the bytes it needs, the free ones and what evicting every eligible slot would free."""

    error: SlotctlError

    def _bytes(self, key: str) -> int | None:
        value = self.error.details.get(key)
        return value if isinstance(value, int) else None

    @property
    def needed_bytes(self) -> int | None:
        return self._bytes("needed_bytes")

    @property
    def free_bytes(self) -> int | None:
        return self._bytes("free_bytes")

    @property
    def evictable_bytes(self) -> int | None:
        return self._bytes("evictable_bytes")


@dataclass(frozen=True, slots=True)
class PlanPull:
    """The model files the load would pull first (``pulling``): from where, how many
    bytes (None: not known), the engine's words ("would pull 4.1 GB from hf://…"), and
    a resolution that failed now (the pull would fail the same way)."""

    action: str  # pull | verify | missing
    source: str
    path: str | None
    bytes: int | None
    bytes_total: int | None
    message: str
    error: dict[str, Any] | None = None
    in_flight: bool = False  # a pull of the same files runs: the load joins it


@dataclass(frozen=True, slots=True)
class Reload:
    """What bringing the slot back costs: its cold load and wake times (measured moving
    averages, else the prior) and the measurements themselves."""

    load_s: float
    wake_s: float
    measured: ReloadCosts | None = None


@dataclass(frozen=True, slots=True)
class Together:
    """A unit member's place in the unit's joint placement (docs/design/0013)."""

    devices: tuple[str, ...]
    where: str  # the devices in words, with their room
    fits: bool
    evict: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PlanAdapters:
    """A slot's LoRA adapters in its load (controller/slots/adapters.py): the places its
    server has, the device memory reserved for them (in ``needed_bytes``), the adapters it
    can hold and those it would (re)load before it is ready."""

    api: str
    places: int
    reserved_bytes: int
    serves: tuple[str, ...]
    reapply: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The dry run of one slot's load (or of an asleep slot's wake)."""

    slot: str
    action: Action
    reason: str | None = None  # none: why; a refusal of its unit: why
    wake: bool = False  # it sleeps: the load is a wake
    fallback: str | None = None  # asleep, but no room where it sleeps: loaded cold
    reload: Reload | None = None
    target: PlanTarget | None = None  # None: refused before a placement (breaker, ...)
    victims: tuple[PlanVictim, ...] = ()
    freed: Mapping[str, int] = field(default_factory=dict)  # given back per key (host: -)
    refusal: Refusal | None = None
    together: Together | None = None  # a unit member's place beside the others
    unit: UnitPlan | None = None  # a unit member's: the unit's dry run
    pull: PlanPull | None = None  # its model files, when the load pulls them first
    adapters: PlanAdapters | None = None  # its LoRA adapters, when it serves any
    footprint: FootprintView | None = None  # what it would hold, part by part (issue 36)


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """A co-loaded unit's dry run: every member's, and the joint verdict."""

    name: str
    members: tuple[LoadPlan, ...]
    action: Action
    order: tuple[str, ...] | None = None  # the members to load, in order (None: one)
    evict: tuple[str, ...] | None = None  # the unit's victims, each once
    failed: str | None = None  # the member that fits nowhere beside the others


def plan_of(slot: SlotRecord, decision: LoadDecision, *, wake: bool) -> LoadPlan:
    """The plan of ``slot``'s load as ``decision`` decides it (``wake``: the decision is
    its wake where it sleeps; False for an asleep slot: a cold load instead)."""
    fallback = None
    if slot.asleep and not wake:
        where = ", ".join(g.key for g in slot.placement)
        fallback = f"no room on {where}, where it sleeps: a cold load"
    load_s, wake_s = slot.reload_s()
    reload = Reload(round(load_s, 3), round(wake_s, 3), slot.costs)
    target = None
    admission = decision.admission
    if admission is not None:
        target = PlanTarget(
            device=slot.where,
            devices=decision.devices,
            needed_bytes=slot.memory_bytes,
            free_bytes=admission.free,
            budget_bytes=admission.budget,
            admitted_bytes=admission.admitted,
            probe=admission.source,
            exclusive_peers=decision.peers,
            placement=tuple(PlanDevice.of(a, decision.victims) for a in decision.admissions),
        )
    if decision.error is not None:
        return LoadPlan(
            slot.name,
            "refuse",
            wake=wake,
            fallback=fallback,
            reload=reload,
            target=target,
            refusal=Refusal(decision.error),
            footprint=FootprintView.of(slot),
        )
    return LoadPlan(
        slot.name,
        decision.verdict,
        wake=wake,
        fallback=fallback,
        reload=reload,
        target=target,
        victims=tuple(PlanVictim.of(v) for v in decision.victims),
        freed=_freed(decision.victims),
        footprint=FootprintView.of(slot),
    )


def _freed(victims: tuple[Victim, ...]) -> dict[str, int]:
    """The memory the victims give back per device (a sleeper's host memory: negative)."""
    freed: dict[str, int] = {}
    for v in victims:
        for key in v.devices:
            freed[key] = freed.get(key, 0) + share(v.bytes, len(v.devices))
        if v.host_bytes:
            freed[v.host] = freed.get(v.host, 0) - v.host_bytes
    return freed
