"""Eviction: which resident slots to unload to make room, and memory-pressure levels.

Pure planning (the manager executes and revalidates each decision right before it
unloads). SPEC §6: victims are resident (``ready``/``idle``), not pinned, have no active
lease and no operation in flight; lowest ``priority`` first, least recently used inside a
tier, and the fewest victims that free enough. If even every eligible slot cannot free
enough, the plan says so and nothing is unloaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from controller.lifecycle import SlotState
from controller.units import format_gib

__all__ = [
    "EvictionCandidate",
    "EvictionPlan",
    "Pressure",
    "Victim",
    "is_eligible",
    "plan_eviction",
    "pressure_level",
    "pressure_victims",
]

_RESIDENT = frozenset({SlotState.READY, SlotState.IDLE})


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    name: str
    device: str
    bytes: int
    priority: int
    last_used: float  # monotonic seconds
    state: SlotState
    pinned: bool = False
    leases: int = 0
    busy: bool = False  # an operation (load/unload/swap) is in flight
    access: int = 0  # access counter at planning time (for revalidation)
    generation: int = 0  # load generation at planning time (a reload since: not a victim)


@dataclass(frozen=True, slots=True)
class Victim:
    name: str
    bytes: int
    priority: int
    idle_s: float
    access: int
    reason: str
    generation: int = 0


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    device: str
    need_bytes: int
    victims: tuple[Victim, ...]
    freed_bytes: int
    evictable_bytes: int

    @property
    def sufficient(self) -> bool:
        return self.freed_bytes >= self.need_bytes


def is_eligible(c: EvictionCandidate) -> bool:
    return c.state in _RESIDENT and not c.pinned and c.leases == 0 and not c.busy


def _order(candidates: Iterable[EvictionCandidate], device: str) -> list[EvictionCandidate]:
    eligible = [c for c in candidates if c.device == device and is_eligible(c)]
    return sorted(eligible, key=lambda c: (c.priority, c.last_used, c.name))


def _victim(c: EvictionCandidate, now: float, why: str) -> Victim:
    idle = max(0.0, now - c.last_used)
    reason = f"{why}: priority {c.priority}, idle {idle:.0f}s, frees {format_gib(c.bytes)}"
    return Victim(c.name, c.bytes, c.priority, idle, c.access, reason, c.generation)


def plan_eviction(
    candidates: Sequence[EvictionCandidate],
    device: str,
    need_bytes: int,
    now: float,
    *,
    for_slot: str = "",
) -> EvictionPlan:
    """The victims that free ``need_bytes`` on ``device`` (empty plan if it cannot)."""
    ordered = _order(candidates, device)
    evictable = sum(c.bytes for c in ordered)
    if need_bytes <= 0:
        return EvictionPlan(device, need_bytes, (), 0, evictable)
    if evictable < need_bytes:
        return EvictionPlan(device, need_bytes, (), 0, evictable)
    chosen: list[EvictionCandidate] = []
    freed = 0
    for c in ordered:  # the shortest prefix in (priority, LRU) order that frees enough
        chosen.append(c)
        freed += c.bytes
        if freed >= need_bytes:
            break
    # Fewest victims: spare any chosen slot (most valuable first) not needed after all.
    for c in sorted(chosen, key=lambda c: (-c.priority, -c.last_used)):
        if freed - c.bytes >= need_bytes:
            chosen.remove(c)
            freed -= c.bytes
    why = f"make room for {for_slot}" if for_slot else "make room"
    victims = tuple(_victim(c, now, why) for c in chosen)
    return EvictionPlan(device, need_bytes, victims, freed, evictable)


class Pressure(StrEnum):
    NORMAL = "normal"
    ELEVATED = "elevated"
    CRITICAL = "critical"


def pressure_level(
    total: int, free: int, *, elevated_frac: float = 0.10, critical_frac: float = 0.05
) -> Pressure:
    if total <= 0:
        return Pressure.NORMAL
    ratio = free / total
    if ratio < critical_frac:
        return Pressure.CRITICAL
    if ratio < elevated_frac:
        return Pressure.ELEVATED
    return Pressure.NORMAL


def pressure_victims(
    candidates: Sequence[EvictionCandidate], device: str, level: Pressure, now: float
) -> list[Victim]:
    """Elevated: the one best victim; critical: every eligible slot."""
    ordered = _order(candidates, device)
    if level is Pressure.NORMAL or not ordered:
        return []
    chosen = ordered if level is Pressure.CRITICAL else ordered[:1]
    return [_victim(c, now, f"memory pressure {level.value}") for c in chosen]
