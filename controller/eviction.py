"""Eviction: which resident slots to unload to make room, and memory-pressure levels.

Pure planning (the manager executes and revalidates each decision right before it
unloads). SPEC §6: victims are resident (``ready``/``idle``), not pinned, have no active
lease and no operation in flight; lowest ``priority`` first, least recently used inside a
tier, and the fewest victims that free enough. If even every eligible slot cannot free
enough, the plan says so and nothing is unloaded.

Room is planned per device (:func:`plan_room`): a load that spans GPUs 0 and 1 needs its
share freed on each, and only slots that hold memory on one of the load's devices are
candidates (a victim that spans a device the load does not use frees that one too: it
is evicted whole). :func:`plan_eviction` is the one-device case. A *whole* device (a
cluster node's GPU without time-slicing, one pod per GPU) is cleared instead
(:func:`plan_clear`): every slot on it goes, or the load does not go there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from controller.devices import share
from controller.lifecycle import SlotState
from controller.units import format_gib

__all__ = [
    "EvictionCandidate",
    "EvictionPlan",
    "Pressure",
    "Victim",
    "is_eligible",
    "plan_clear",
    "plan_eviction",
    "plan_room",
    "pressure_level",
    "pressure_victims",
]

_RESIDENT = frozenset({SlotState.READY, SlotState.IDLE})


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    name: str
    devices: tuple[str, ...]  # the admission keys it holds memory on (its share on each)
    bytes: int  # in all
    priority: int
    last_used: float  # monotonic seconds
    state: SlotState
    pinned: bool = False
    leases: int = 0
    busy: bool = False  # an operation (load/unload/swap) is in flight
    access: int = 0  # access counter at planning time (for revalidation)
    generation: int = 0  # load generation at planning time (a reload since: not a victim)
    # The best priority-class weight among its recent users (0: none): inside a priority
    # tier, a slot used only by batch keys goes before one a person used (issue 23).
    recent_weight: float = 0.0

    def on(self, device: str) -> int:
        """Bytes it holds on ``device`` (its share there; 0 when it is not there)."""
        devices = self.devices
        if device not in devices:
            return 0
        return self.bytes if len(devices) == 1 else share(self.bytes, len(devices))


@dataclass(frozen=True, slots=True)
class Victim:
    name: str
    bytes: int
    priority: int
    idle_s: float
    access: int
    reason: str
    generation: int = 0
    devices: tuple[str, ...] = ()  # where it frees memory


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """The victims that free ``need`` on each device (or why they cannot: ``sufficient``)."""

    need: Mapping[str, int]  # bytes to free per device
    victims: tuple[Victim, ...]
    freed: Mapping[str, int]  # bytes the victims free per device (of those in ``need``)
    evictable: Mapping[str, int]  # bytes every eligible slot would free per device
    # Whole devices that cannot be cleared: a holder is not eligible, or the load does
    # not fit there even alone (plan_clear).
    blocked: frozenset[str] = frozenset()

    @property
    def sufficient(self) -> bool:
        if self.blocked:
            return False
        return all(self.freed.get(d, 0) >= n for d, n in self.need.items())

    @property
    def need_bytes(self) -> int:
        return sum(max(0, n) for n in self.need.values())

    @property
    def freed_bytes(self) -> int:
        return sum(self.freed.values())

    @property
    def evictable_bytes(self) -> int:
        return sum(self.evictable.values())


def is_eligible(c: EvictionCandidate) -> bool:
    return c.state in _RESIDENT and not c.pinned and c.leases == 0 and not c.busy


def _order(
    candidates: Iterable[EvictionCandidate], devices: Iterable[str]
) -> list[EvictionCandidate]:
    wanted = set(devices)
    eligible = [c for c in candidates if not wanted.isdisjoint(c.devices) and is_eligible(c)]
    return sorted(eligible, key=lambda c: (c.priority, c.recent_weight, c.last_used, c.name))


def _victim(c: EvictionCandidate, now: float, why: str) -> Victim:
    idle = max(0.0, now - c.last_used)
    where = f" on {'+'.join(c.devices)}" if c.devices else ""
    reason = f"{why}: priority {c.priority}, idle {idle:.0f}s, frees {format_gib(c.bytes)}{where}"
    return Victim(c.name, c.bytes, c.priority, idle, c.access, reason, c.generation, c.devices)


def _met(need: Mapping[str, int], freed: Mapping[str, int]) -> bool:
    return all(freed[d] >= n for d, n in need.items())


def plan_room(
    candidates: Sequence[EvictionCandidate],
    need: Mapping[str, int],
    now: float,
    *,
    for_slot: str = "",
) -> EvictionPlan:
    """The victims that free ``need[device]`` bytes on every device (empty if they cannot).

    The shortest prefix, in (priority, LRU) order, of the eligible slots on the devices
    that still need room; then every chosen slot not needed after all is spared, the most
    valuable first (fewest victims).
    """
    devices = [d for d, n in need.items() if n > 0]
    ordered = _order(candidates, need)
    evictable = {d: sum(c.on(d) for c in ordered) for d in need}
    freed = dict.fromkeys(need, 0)
    if not devices:
        return EvictionPlan(dict(need), (), freed, evictable)
    if any(evictable[d] < need[d] for d in devices):
        return EvictionPlan(dict(need), (), freed, evictable)
    chosen: list[EvictionCandidate] = []
    for c in ordered:
        if not any(freed[d] < need[d] and c.on(d) for d in devices):
            continue  # frees nothing where room is still missing
        chosen.append(c)
        for d in need:
            freed[d] += c.on(d)
        if _met(need, freed):
            break
    for c in sorted(chosen, key=lambda c: (-c.priority, -c.last_used)):
        spared = {d: freed[d] - c.on(d) for d in need}
        if _met(need, spared):
            chosen.remove(c)
            freed = spared
    why = f"make room for {for_slot}" if for_slot else "make room"
    victims = tuple(_victim(c, now, why) for c in chosen)
    return EvictionPlan(dict(need), victims, freed, evictable)


def plan_clear(
    candidates: Sequence[EvictionCandidate],
    holders: Mapping[str, int],
    now: float,
    *,
    unfit: Iterable[str] = (),
    for_slot: str = "",
) -> EvictionPlan:
    """The victims that empty whole devices: every slot on each of ``holders``' devices
    (``holders[d]``: how many hold it). A device is *blocked* when fewer of its holders
    are eligible than hold it, or when it is in ``unfit`` (the load does not fit there
    even alone): then the plan is not sufficient, and nothing is evicted for it."""
    ordered = _order(candidates, holders)
    chosen = [c for c in ordered if any(d in holders for d in c.devices)]
    on = {d: [c for c in chosen if d in c.devices] for d in holders}
    blocked = {d for d, n in holders.items() if len(on[d]) < n} | set(unfit)
    bytes_on = {d: sum(c.on(d) for c in on[d]) for d in holders}
    why = f"make room for {for_slot}" if for_slot else "make room"
    victims = () if blocked else tuple(_victim(c, now, why) for c in chosen)
    freed = bytes_on if not blocked else dict.fromkeys(holders, 0)
    return EvictionPlan(bytes_on, victims, freed, bytes_on, frozenset(blocked))


def plan_eviction(
    candidates: Sequence[EvictionCandidate],
    device: str,
    need_bytes: int,
    now: float,
    *,
    for_slot: str = "",
) -> EvictionPlan:
    """The victims that free ``need_bytes`` on ``device`` (empty plan if it cannot)."""
    return plan_room(candidates, {device: need_bytes}, now, for_slot=for_slot)


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
    ordered = _order(candidates, (device,))
    if level is Pressure.NORMAL or not ordered:
        return []
    chosen = ordered if level is Pressure.CRITICAL else ordered[:1]
    return [_victim(c, now, f"memory pressure {level.value}") for c in chosen]
