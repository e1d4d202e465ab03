"""The one load decision: may a slot load now, and what has to go first? Pure.

The SlotManager calls :func:`decide_load` for a real load — in its one admit loop, under
the device lock: decide, make room (exclusive-group peers unloaded, victims evicted),
decide again, reserve (docs/design/0016) — and for a dry run (``explain_load``,
``slotctl slot load --dry-run``), so the two can never disagree.

Checks, in this order; the first that fails is the refusal::

    activated            -> SlotConfigError (disabled)
    model in catalogue   -> ModelNotFound
    crash-loop breaker   -> SlotCrashLooping (with retry_after_s)
    pinned group peer    -> SlotPinned (a pinned exclusive peer is never swapped out)
    placement, memory    -> load | evict-then-load | InsufficientMemory | DeviceUnavailable

Where the load goes is :func:`controller.scheduling.placement.place`'s choice (the GPU or GPUs, by
best fit after the planned evictions); the decision carries it, and the manager records
it before it starts the server.

Each victim of the plan comes with its action: ``sleep`` when its server can and host
memory holds its weights, else ``unload`` (:mod:`controller.scheduling.eviction`). A *wake* of an
asleep slot is a load like the others, decided here too: pinned to the GPUs it sleeps on
(its server keeps its context there), its victims planned the same way.

Memory is judged as if the exclusive-group peers were already unloaded (the load unloads
them itself; they are never counted as victims). A *background* load — the reconciler
keeping an autoload or resident slot loaded, the restore at start — may only evict slots
of strictly lower priority that have been idle for ``min_resident_s``; when that is not
enough it *waits* (``waiting=True``) instead of evicting, so two slots that do not fit
together can never evict each other in a cycle. A load a user asked for (a request
through the router, an API or CLI load) may evict any eligible slot (SPEC §6).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from controller.model.devices import GpuRef
from controller.model.errors import (
    DeviceUnavailable,
    InsufficientMemory,
    ModelNotFound,
    SlotConfigError,
    SlotctlError,
    SlotPinned,
)
from controller.model.sizes import format_gib
from controller.scheduling.breaker import Breaker
from controller.scheduling.eviction import EvictionCandidate, Victim
from controller.scheduling.fit import Admission
from controller.scheduling.placement import DeviceFacts, Need, Placement, place

__all__ = [
    "WAITING_FOR_DEVICE",
    "WAITING_FOR_MEMORY",
    "DeviceFacts",
    "GroupPeer",
    "LoadDecision",
    "LoadRequest",
    "decide_load",
    "insufficient",
    "not_activated",
]

WAITING_FOR_MEMORY: Final = "waiting_for_memory"
# A background load whose GPUs are not there (a pin to a GPU that is lost, or missing):
# it waits, said once, and is tried again when the probe sees them (a card that comes back).
WAITING_FOR_DEVICE: Final = "waiting_for_device"

Verdict = Literal["load", "evict-then-load", "refuse"]


@dataclass(frozen=True, slots=True)
class GroupPeer:
    """A slot that holds the requester's exclusive group (loading or loaded)."""

    name: str
    pinned: bool
    bytes: int  # admitted in all (each device's share is in its DeviceFacts.peers)


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """What is known of the slot that wants to load."""

    slot: str
    priority: int
    needed: int  # bytes, in all
    activated: bool
    model_id: str
    model_known: bool  # bound model in the catalogue (or no model needed)
    breaker: Breaker
    max_failures: int
    peers: tuple[GroupPeer, ...] = ()
    background: bool = False
    span: int = 1  # devices it spans (a slot's ``gpus``)
    pins: tuple[str, ...] = ()  # pinned GPUs (indices or UUIDs)


@dataclass(frozen=True, slots=True)
class LoadDecision:
    verdict: Verdict
    error: SlotctlError | None = None
    admission: Admission | None = None  # on the first chosen device (or the closest's)
    peers: tuple[str, ...] = ()  # exclusive-group peers the load unloads first
    victims: tuple[Victim, ...] = ()
    waiting: bool = False  # a background load that waits for memory instead of evicting
    placement: Placement | None = None

    @property
    def ok(self) -> bool:
        return self.verdict != "refuse"

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices the load goes to (empty for a refusal)."""
        return self.placement.devices if self.placement is not None and self.ok else ()

    @property
    def gpus(self) -> tuple[GpuRef, ...]:
        return self.placement.gpus if self.placement is not None and self.ok else ()

    @property
    def admissions(self) -> tuple[Admission, ...]:
        option = self.placement.option if self.placement is not None else None
        return option.admissions if option is not None else ()


def not_activated(slot: str) -> SlotConfigError:
    return SlotConfigError(
        f"slot {slot!r} is not activated: set model.default (or use a self-managed provider)",
        keys=["model.default"],
        slot=slot,
        disabled=True,
    )


def _per_device(placement: Placement) -> list[dict[str, int | str]]:
    """Each device tried, once: needed, free, budget room and evictable bytes there."""
    seen: dict[str, dict[str, int | str]] = {}
    for option in placement.tried:
        evictable = option.plan.evictable if option.plan is not None else {}
        for a in option.admissions:
            seen.setdefault(
                a.device,
                {
                    "device": a.device,
                    "needed_bytes": a.needed,
                    "free_bytes": max(0, a.free_room),
                    "budget_room_bytes": max(0, a.budget_room),
                    "evictable_bytes": evictable.get(a.device, 0),
                },
            )
    return list(seen.values())


def insufficient(slot: str, placement: Placement, *, waiting: bool = False) -> InsufficientMemory:
    """The refusal of a load that fits on no device set, with the figures of each device."""
    option = placement.option
    assert option is not None
    extra: dict[str, object] = {"reason": WAITING_FOR_MEMORY, "waiting": True} if waiting else {}
    evictable = (
        "evicting every slot of lower priority idle long enough"
        if waiting
        else "evicting every eligible slot"
    )
    figures = _per_device(placement)
    if len(figures) > 1:
        extra["gpus"] = figures
    admission = option.admissions[0]
    freeable = option.plan.evictable_bytes if option.plan is not None else 0
    if admission.source == "none":
        return InsufficientMemory(
            f"slot {slot!r} cannot be admitted on {admission.device}: no memory probe answers "
            f"for {admission.device} and no memory_budget_gb.{admission.device} is set (a "
            f'device = "{admission.device}" slot on a host without one?)',
            needed_bytes=admission.needed,
            free_bytes=0,
            evictable_bytes=freeable,
            slot=slot,
            device=admission.device,
            no_probe=True,
            **extra,
        )
    if option.devices and option.devices[0].exclusive:
        return _no_whole_gpu(slot, placement, evictable, extra)
    if len(figures) > 1:
        return _insufficient_on_gpus(slot, placement, figures, evictable, extra)
    return InsufficientMemory(
        f"slot {slot!r} needs {format_gib(admission.needed)} on {admission.device}: "
        f"{format_gib(max(0, admission.free_room))} free after the safety margin, "
        f"{format_gib(max(0, admission.budget_room))} left in the budget, and {evictable} "
        f"would free only {format_gib(freeable)}",
        needed_bytes=admission.needed,
        free_bytes=max(0, admission.free),
        evictable_bytes=freeable,
        slot=slot,
        device=admission.device,
        budget_bytes=admission.budget,
        admitted_bytes=admission.admitted,
        **extra,
    )


def _insufficient_on_gpus(
    slot: str,
    placement: Placement,
    figures: list[dict[str, int | str]],
    evictable: str,
    extra: dict[str, object],
) -> InsufficientMemory:
    option = placement.option
    assert option is not None
    span = len(option.admissions)
    need = option.admissions[0].needed
    each = f"on each of {span} GPUs" if span > 1 else "on one GPU"
    parts = "; ".join(
        f"{f['device']} {format_gib(int(f['free_bytes']))} free, "
        f"{format_gib(int(f['evictable_bytes']))} evictable"
        for f in figures
    )
    return InsufficientMemory(
        f"slot {slot!r} needs {format_gib(need)} {each}, and no GPU set has room even "
        f"{evictable.replace('evicting', 'after evicting')} ({parts})",
        needed_bytes=need * span,
        free_bytes=max(int(f["free_bytes"]) for f in figures),
        evictable_bytes=sum(int(f["evictable_bytes"]) for f in figures),
        slot=slot,
        device=",".join(a.device for a in option.admissions),
        **extra,
    )


def _no_whole_gpu(
    slot: str, placement: Placement, evictable: str, extra: dict[str, object]
) -> InsufficientMemory:
    """The refusal on a cluster's whole GPUs (one slot per GPU): each node's free GPUs,
    those held by slots, and those too small for the load."""
    option = placement.option
    assert option is not None
    span = len(option.admissions)
    nodes: dict[str, list[int]] = {}  # node -> [GPUs, held, too small]
    seen: set[str] = set()
    for tried in placement.tried:
        for d, a in zip(tried.devices, tried.admissions, strict=True):
            if d.key not in seen:
                seen.add(d.key)
                counts = nodes.setdefault(d.group or "", [0, 0, 0])
                counts[0] += 1
                counts[1] += 1 if d.holders else 0
                counts[2] += 1 if a.shortfall else 0
    parts = ", ".join(
        f"{n}: {c[0] - c[1]} of {c[0]} free" + (f", {c[2]} too small" if c[2] else "")
        for n, c in sorted(nodes.items())
    )
    need = option.admissions[0].needed
    each = "a whole GPU" if span == 1 else f"{span} whole GPUs on one node"
    return InsufficientMemory(
        f"slot {slot!r} needs {each} ({format_gib(need)} on each): none has room, and "
        f"{evictable} would not clear one ({parts})",
        needed_bytes=need * span,
        free_bytes=0,
        evictable_bytes=option.plan.evictable_bytes if option.plan is not None else 0,
        slot=slot,
        device=",".join(a.device for a in option.admissions),
        **extra,
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
    devices: Sequence[DeviceFacts],
    candidates: Callable[[], Sequence[EvictionCandidate]],
    now: float,
    *,
    min_resident_s: float = 0.0,
    host: Callable[[], Mapping[str, int]] | None = None,
) -> LoadDecision:
    """The verdict on one load now (see the module docstring for the order of checks).

    ``devices`` are the devices the slot may go to (the host's GPUs for a GPU slot; the
    one device otherwise); ``candidates`` lists every slot as the eviction planner sees
    it; it is called only when no device set fits as it is (building the list is
    O(slots), and most loads fit). ``host`` gives the room in host memory (per host key,
    after its margin) for the victims that can sleep, asked only then too; each victim
    says ``sleep`` or ``unload``.
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
    need = Need(req.slot, req.needed, max(1, req.span), req.pins)
    placement = place(
        need,
        devices,
        lambda: _allowed(req, candidates(), now, min_resident_s),
        now,
        host=host,
    )
    if placement.error is not None:
        waits = req.background and isinstance(placement.error, DeviceUnavailable)
        if waits:  # its GPU may come back (a card that was lost): it waits, said once
            placement.error.details.update(waiting=True, wait=WAITING_FOR_DEVICE)
        return LoadDecision(
            "refuse", error=placement.error, peers=peers, waiting=waits, placement=placement
        )
    option = placement.option
    assert option is not None
    admission = option.admissions[0]
    if not option.fits:
        error = insufficient(req.slot, placement, waiting=req.background)
        return LoadDecision(
            "refuse",
            error=error,
            admission=admission,
            peers=peers,
            waiting=req.background,
            placement=placement,
        )
    verdict: Verdict = "evict-then-load" if option.victims else "load"
    return LoadDecision(
        verdict,
        admission=admission,
        peers=peers,
        victims=option.victims,
        placement=placement,
    )
