"""The one load decision: may a slot load now, and what has to go first? Pure.

The SlotManager calls :func:`decide_load` for a real load (before it unloads exclusive-group
peers, and again under the device lock right before it evicts and reserves) and for a dry
run (``explain_load``, ``slotctl slot load --dry-run``), so the two can never disagree.

Checks, in this order; the first that fails is the refusal::

    activated            -> SlotConfigError (disabled)
    model in catalogue   -> ModelNotFound
    crash-loop breaker   -> SlotCrashLooping (with retry_after_s)
    pinned group peer    -> SlotPinned (a pinned exclusive peer is never swapped out)
    memory              -> load | evict-then-load | InsufficientMemory

Memory is judged as if the exclusive-group peers were already unloaded (the load unloads
them itself; they are never counted as victims). A *background* load — the reconciler
keeping an autoload or resident slot loaded, the restore at start — may only evict slots
of strictly lower priority that have been idle for ``min_resident_s``; when that is not
enough it *waits* (``waiting=True``) instead of evicting, so two slots that do not fit
together can never evict each other in a cycle. A load a user asked for (a request
through the router, an API or CLI load) may evict any eligible slot (SPEC §6).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from controller.breaker import Breaker
from controller.errors import (
    InsufficientMemory,
    ModelNotFound,
    SlotConfigError,
    SlotctlError,
    SlotPinned,
)
from controller.eviction import EvictionCandidate, EvictionPlan, Victim, plan_eviction
from controller.memory import Admission, DeviceMemory, check_admission
from controller.units import format_gib

__all__ = [
    "WAITING_FOR_MEMORY",
    "GroupPeer",
    "LoadDecision",
    "LoadRequest",
    "MemoryFacts",
    "decide_load",
    "insufficient",
    "not_activated",
]

WAITING_FOR_MEMORY: Final = "waiting_for_memory"

Verdict = Literal["load", "evict-then-load", "refuse"]


@dataclass(frozen=True, slots=True)
class GroupPeer:
    """A slot that holds the requester's exclusive group (loading or loaded)."""

    name: str
    pinned: bool
    bytes: int  # admitted on the requester's device (0: another device or not admitted)


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """What is known of the slot that wants to load."""

    slot: str
    device: str
    priority: int
    needed: int  # bytes
    activated: bool
    model_id: str
    model_known: bool  # bound model in the catalogue (or no model needed)
    breaker: Breaker
    max_failures: int
    peers: tuple[GroupPeer, ...] = ()
    background: bool = False


@dataclass(frozen=True, slots=True)
class MemoryFacts:
    """The device's numbers, the requester's own admitted bytes excluded."""

    admitted: int
    sample: DeviceMemory | None
    budget: int | None
    margin: int
    # Bytes admitted to loads the probe cannot see yet (pulling/starting/warming): two
    # loads admitted a moment apart must not both count the same free memory.
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class LoadDecision:
    verdict: Verdict
    error: SlotctlError | None = None
    admission: Admission | None = None
    peers: tuple[str, ...] = ()  # exclusive-group peers the load unloads first
    victims: tuple[Victim, ...] = ()
    waiting: bool = False  # a background load that waits for memory instead of evicting

    @property
    def ok(self) -> bool:
        return self.verdict != "refuse"


def not_activated(slot: str) -> SlotConfigError:
    return SlotConfigError(
        f"slot {slot!r} is not activated: set model.default (or use a self-managed provider)",
        keys=["model.default"],
        slot=slot,
        disabled=True,
    )


def insufficient(
    slot: str, admission: Admission, plan: EvictionPlan, *, waiting: bool = False
) -> InsufficientMemory:
    extra = {"reason": WAITING_FOR_MEMORY, "waiting": True} if waiting else {}
    evictable = (
        "evicting every slot of lower priority idle long enough"
        if waiting
        else "evicting every eligible slot"
    )
    if admission.source == "none":
        return InsufficientMemory(
            f"slot {slot!r} cannot be admitted on {admission.device}: no memory probe answers "
            f"for {admission.device} and no memory_budget_gb.{admission.device} is set (a "
            f'device = "{admission.device}" slot on a host without one?)',
            needed_bytes=admission.needed,
            free_bytes=0,
            evictable_bytes=plan.evictable_bytes,
            slot=slot,
            device=admission.device,
            no_probe=True,
            **extra,
        )
    return InsufficientMemory(
        f"slot {slot!r} needs {format_gib(admission.needed)} on {admission.device}: "
        f"{format_gib(max(0, admission.free_room))} free after the safety margin, "
        f"{format_gib(max(0, admission.budget_room))} left in the budget, and {evictable} "
        f"would free only {format_gib(plan.evictable_bytes)}",
        needed_bytes=admission.needed,
        free_bytes=max(0, admission.free),
        evictable_bytes=plan.evictable_bytes,
        slot=slot,
        device=admission.device,
        budget_bytes=admission.budget,
        admitted_bytes=admission.admitted,
        **extra,
    )


def admission_of(req: LoadRequest, memory: MemoryFacts) -> Admission:
    """Admission as if the exclusive-group peers were already gone."""
    freed = sum(p.bytes for p in req.peers)
    sample = memory.sample
    if sample is not None:
        free = sample.free_bytes - memory.reserved + freed
        sample = replace(sample, free_bytes=max(0, min(sample.total_bytes, free)))
    return check_admission(
        req.device, req.needed, memory.admitted - freed, sample, memory.budget, memory.margin
    )


def _allowed(
    req: LoadRequest, candidates: Sequence[EvictionCandidate], now: float, min_resident_s: float
) -> list[EvictionCandidate]:
    peers = {p.name for p in req.peers}
    allowed = [c for c in candidates if c.name != req.slot and c.name not in peers]
    if req.background:
        allowed = [
            c for c in allowed if c.priority < req.priority and now - c.last_used >= min_resident_s
        ]
    return allowed


def decide_load(
    req: LoadRequest,
    memory: MemoryFacts,
    candidates: Callable[[], Sequence[EvictionCandidate]],
    now: float,
    *,
    min_resident_s: float = 0.0,
) -> LoadDecision:
    """The verdict on one load now (see the module docstring for the order of checks).

    ``candidates`` lists every slot as the eviction planner sees it; it is called only
    when the load does not fit (building the list is O(slots), and most loads fit).
    """
    if not req.activated:
        return LoadDecision("refuse", error=not_activated(req.slot))
    if not req.model_known:
        return LoadDecision("refuse", error=ModelNotFound(req.model_id))
    try:
        req.breaker.check(req.slot, now, req.max_failures)
    except SlotctlError as exc:
        return LoadDecision("refuse", error=exc)
    peers = tuple(p.name for p in req.peers)
    pinned = [p for p in req.peers if p.pinned]
    if pinned:
        refusal = SlotPinned(pinned[0].name, "exclusive-group swap")
        return LoadDecision("refuse", error=refusal, peers=peers)
    admission = admission_of(req, memory)
    if admission.ok:
        return LoadDecision("load", admission=admission, peers=peers)
    allowed = _allowed(req, candidates(), now, min_resident_s)
    plan = plan_eviction(allowed, req.device, admission.shortfall, now, for_slot=req.slot)
    if not plan.sufficient:
        error = insufficient(req.slot, admission, plan, waiting=req.background)
        return LoadDecision(
            "refuse", error=error, admission=admission, peers=peers, waiting=req.background
        )
    return LoadDecision("evict-then-load", admission=admission, peers=peers, victims=plan.victims)
