"""Eviction: which resident slots make room, how (sleep or unload), and pressure levels.

Pure planning (the manager executes and revalidates each decision right before it acts).
SPEC §6: victims are resident (``ready``/``idle``), not pinned, have no active lease and no
operation in flight; lowest ``priority`` first, and the fewest victims that free enough.
If even every eligible slot cannot free enough, the plan says so and nothing is evicted.

Inside a priority tier (and after the best priority-class weight of a slot's recent users,
issue 23) the order is a *reload-cost score* (issue 22), not plain LRU::

    score = idle time / cost to bring it back      (highest first)

where the cost is the slot's measured wake time when it would sleep, its measured cold
load time otherwise (moving averages kept in ``state.json``; a prior until measured): a
slot that is cheap to bring back and long idle goes first, and a 70B model is not unloaded
to spare an embedder. With equal costs this is LRU.

Each victim gets an *action* (:data:`SLEEP` or :data:`UNLOAD`, see :func:`_act`): sleep when
its server can (``sleep_level``) and host memory holds its weights (the ``host`` room the
caller gives, after the host's own margin); else unload. A sleeper holds its weights (level
1) on its host key (``cpu``): when a new sleeper needs the room, sleepers that matter less
are unloaded fully to make it — in the same order, with the cost an unload *adds* to a wake
(``load_s - wake_s``) as the cost — and a load that needs host memory itself (a CPU slot)
evicts sleepers like any resident slot there.

Room is planned per device (:func:`plan_room`): a load that spans GPUs 0 and 1 needs its
share freed on each, and only slots that hold memory on one of the load's devices are
candidates (a victim that spans a device the load does not use frees that one too: it
is evicted whole). :func:`plan_eviction` is the one-device case. A *whole* device (a
cluster node's GPU without time-slicing, one pod per GPU) is cleared instead
(:func:`plan_clear`): every slot on it goes, or the load does not go there — unloaded,
a sleeper too (a sleeping server's pod still holds its GPU).

Co-loaded units. A unit's members (slots whose ``unit`` is the same, docs/design/0013) are evicted
together or not at all, so the planner judges each member as the unit: its priority the highest
member's, its last use the latest member's, pinned when a member is, busy or leased when a
member is (:func:`unified`; the manager's table hands out candidates this way). A member is
never the victim of a load of its own unit (:func:`without_unit`), and a victim that is a
member takes its mates with it (the manager evicts them right after it: the slot manager's
``Unloading.evict_mates``).

Replicas (issue 38). The replicas of one slot serve one model; while two of them are
resident, every one but the most valuable is an *extra* (:func:`with_replicas`), and
inside a priority tier the extras go first: a second copy of model A goes before the only
copy of model B of the same priority, and the victim's reason says it is an extra replica.
A pinned slot pins its ``min_replicas`` (the desired state pins those replicas only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final

from controller.model.devices import share
from controller.model.lifecycle import SlotState
from controller.model.sizes import format_gib

__all__ = [
    "SLEEP",
    "UNLOAD",
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
    "score",
    "unified",
    "with_replicas",
    "without_unit",
]

_RESIDENT = frozenset({SlotState.READY, SlotState.IDLE})
SLEEP: Final = "sleep"
UNLOAD: Final = "unload"
_MIN_COST_S: Final = 0.05  # a cost below this is noise (and no division by zero)


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
    sleep_level: int = 0  # the level its server would sleep at (0: it cannot sleep)
    asleep: int = 0  # the level it sleeps at now (0: awake); then ``devices`` is its host
    host: str = "cpu"  # the host memory key its weights go to when it sleeps
    load_s: float = 1.0  # what a cold load of it takes (measured, moving average)
    wake_s: float = 1.0  # what a wake of it takes (measured, moving average)
    # The keys of its placement, asleep too (a sleeping pod still holds a whole GPU).
    placed: tuple[str, ...] = ()
    # Its co-loaded unit (controller/scheduling/eviction.py): a unit is evicted whole or not at all.
    unit: str | None = None
    # The slot whose replica it is ("" none: spec.replica_group) and whether it is an
    # *extra* replica (:func:`with_replicas` says so: another replica of its slot serves
    # on without it), which goes before any slot's last server of its priority.
    replica_group: str = ""
    extra: bool = False

    @property
    def host_bytes(self) -> int:
        """What it would hold (or holds) in host memory asleep: its weights at level 1."""
        level = self.asleep or self.sleep_level
        return self.bytes if level == 1 else 0

    @property
    def holds(self) -> tuple[str, ...]:
        """The devices it holds memory on or is placed on (:func:`plan_clear`)."""
        return self.devices + tuple(d for d in self.placed if d not in self.devices)

    @property
    def cost_s(self) -> float:
        """The cost to bring it back after its eviction: a wake when it would sleep, a
        cold load when it is unloaded; for a sleeper (its eviction is an unload from host
        memory) what the unload adds to its wake."""
        if self.asleep:
            return max(_MIN_COST_S, self.load_s - self.wake_s)
        return max(_MIN_COST_S, self.wake_s if self.sleep_level else self.load_s)

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
    action: str = UNLOAD  # SLEEP (its server sleeps: device memory freed) or UNLOAD
    level: int = 0  # the sleep level (SLEEP)
    host: str = ""  # SLEEP: the host key its weights go to
    host_bytes: int = 0  # SLEEP: what it will hold there (its weights at level 1)
    load_s: float = 0.0  # its measured cold load, wake times and score (for ``explain``)
    wake_s: float = 0.0
    score: float = 0.0


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """The victims that free ``need`` on each device (or why they cannot: ``sufficient``)."""

    need: Mapping[str, int]  # bytes to free per device
    victims: tuple[Victim, ...]
    freed: Mapping[str, int]  # bytes the victims free per device (of those in ``need``)
    evictable: Mapping[str, int]  # bytes every eligible slot would free per device
    host: Mapping[str, int] | None = None  # bytes the sleepers add per host key, net
    # Whole devices that cannot be cleared: a holder is not eligible, or the load does
    # not fit there even alone (plan_clear).
    blocked: frozenset[str] = frozenset()

    @property
    def unloads(self) -> int:
        return sum(1 for v in self.victims if v.action == UNLOAD)

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


def score(c: EvictionCandidate, now: float) -> float:
    """``idle time / cost to bring it back``: higher goes first (inside a priority tier)."""
    return max(0.0, now - c.last_used) / c.cost_s


def _key(c: EvictionCandidate, now: float) -> tuple[int, int, float, float, str]:
    """Priority first (SPEC §6), then an extra replica before a slot's last server
    (issue 38), then the best class weight among its recent users (a slot used only by
    batch keys goes before one a person used: issue 23), then the reload-cost score
    (issue 22)."""
    return (c.priority, 0 if c.extra else 1, c.recent_weight, -score(c, now), c.name)


def with_replicas(candidates: Sequence[EvictionCandidate], now: float) -> list[EvictionCandidate]:
    """``candidates`` with each replica's ``extra`` said: of a slot's resident, awake
    replicas, every eligible one is an extra when one that is not eligible serves on
    (leased, busy, pinned), else every one but the most valuable (the last in eviction
    order). Idempotent; candidates without a replica group are returned as they are."""
    groups: dict[str, list[EvictionCandidate]] = {}
    for c in candidates:
        if c.replica_group and c.state in _RESIDENT and not c.asleep:
            groups.setdefault(c.replica_group, []).append(c)
    extras: set[str] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        eligible = [m for m in members if is_eligible(m)]
        if len(eligible) < len(members):
            extras.update(m.name for m in eligible)
            continue
        kept = max(eligible, key=lambda m: _key(replace(m, extra=False), now))
        extras.update(m.name for m in eligible if m is not kept)
    if not extras and not any(c.extra for c in candidates):
        return list(candidates)
    return [
        c if c.extra == (c.name in extras) else replace(c, extra=c.name in extras)
        for c in candidates
    ]


def _order(
    candidates: Iterable[EvictionCandidate], devices: Iterable[str], now: float
) -> list[EvictionCandidate]:
    """The eligible candidates on ``devices``, in eviction order (replicas said)."""
    candidates = with_replicas(list(candidates), now)
    wanted = set(devices)
    eligible = [c for c in candidates if not wanted.isdisjoint(c.devices) and is_eligible(c)]
    return sorted(eligible, key=lambda c: _key(c, now))


def _victim(c: EvictionCandidate, now: float, why: str) -> Victim:
    idle = max(0.0, now - c.last_used)
    where = f" on {'+'.join(c.devices)}" if c.devices else ""
    extra = f", an extra replica of {c.replica_group}" if c.extra else ""
    reason = (
        f"{why}: priority {c.priority}{extra}, idle {idle:.0f}s, frees {format_gib(c.bytes)}{where}"
    )
    return Victim(
        c.name,
        c.bytes,
        c.priority,
        idle,
        c.access,
        reason,
        c.generation,
        c.devices,
        load_s=c.load_s,
        wake_s=c.wake_s,
        score=round(score(c, now), 3),
    )


def _sleeps(v: Victim, c: EvictionCandidate) -> Victim:
    """``v`` put to sleep instead of unloaded (its reason says so)."""
    host = f", {format_gib(c.host_bytes)} to {c.host}" if c.host_bytes else ""
    reason = f"{v.reason} (sleeps at level {c.sleep_level}{host})"
    return replace(
        v, action=SLEEP, level=c.sleep_level, host=c.host, host_bytes=c.host_bytes, reason=reason
    )


def _act(
    chosen: Sequence[EvictionCandidate],
    candidates: Sequence[EvictionCandidate],
    host: Mapping[str, int] | None,
    now: float,
    why: str,
) -> tuple[list[Victim], dict[str, int]]:
    """Each chosen slot's action, in order, and what the sleepers add per host key.

    Sleep when its server can and ``host`` (the room per host key) holds its weights;
    when it does not, the sleepers that matter less there — ordered like victims, with
    what an unload adds to their wake as the cost — are unloaded to make the room (placed
    before the new sleeper: they go first), if together they can; else it is unloaded.
    ``host`` None: no host figures (nothing sleeps).
    """
    room = dict(host or {})
    added: dict[str, int] = {}
    taken = {c.name for c in chosen}
    sleepers = sorted(
        (c for c in candidates if c.asleep and c.name not in taken and is_eligible(c)),
        key=lambda c: _key(c, now),
    )
    out: list[Victim] = []
    for c in chosen:
        victim = _victim(c, now, why)
        if host is None or not c.sleep_level or c.asleep:
            out.append(victim)
            continue
        wanted, have = c.host_bytes, room.get(c.host, 0)
        displaced: list[EvictionCandidate] = []
        # The would-be sleeper's own key on the host: priority, then what keeping it
        # asleep saves per second idle (as for a sleeper: load_s - wake_s).
        mine = _key(replace(c, asleep=c.sleep_level), now)
        for s in sleepers:
            if have >= wanted:
                break
            if s.host == c.host and _key(s, now) < mine:
                displaced.append(s)
                have += s.host_bytes
        if have < wanted:
            out.append(victim)
            continue
        for s in displaced:
            sleepers.remove(s)
            out.append(_victim(s, now, f"{why}: room in {c.host} for {c.name} to sleep"))
            added[c.host] = added.get(c.host, 0) - s.host_bytes
        room[c.host] = have - wanted
        added[c.host] = added.get(c.host, 0) + wanted
        out.append(_sleeps(victim, c))
    return out, added


def _met(need: Mapping[str, int], freed: Mapping[str, int]) -> bool:
    return all(freed[d] >= n for d, n in need.items())


def plan_room(
    candidates: Sequence[EvictionCandidate],
    need: Mapping[str, int],
    now: float,
    *,
    for_slot: str = "",
    host: Mapping[str, int] | None = None,
) -> EvictionPlan:
    """The victims that free ``need[device]`` bytes on every device (empty if they cannot).

    The shortest prefix, in (priority, score) order, of the eligible slots on the devices
    that still need room; then every chosen slot not needed after all is spared, the most
    valuable first (fewest victims); then each victim's action (:func:`_act`; ``host``:
    the room per host key for sleepers, None: every victim is unloaded).
    """
    devices = [d for d, n in need.items() if n > 0]
    candidates = with_replicas(candidates, now)
    ordered = _order(candidates, need, now)
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
    # the most valuable first: higher priority, a last copy before an extra replica
    spare_order = sorted(chosen, key=lambda c: (-c.priority, c.extra, score(c, now), c.name))
    for c in spare_order:
        spared = {d: freed[d] - c.on(d) for d in need}
        if _met(need, spared):
            chosen.remove(c)
            freed = spared
    why = f"make room for {for_slot}" if for_slot else "make room"
    victims, added = _act(chosen, candidates, host, now, why)
    return EvictionPlan(dict(need), tuple(victims), freed, evictable, added)


def plan_clear(
    candidates: Sequence[EvictionCandidate],
    holders: Mapping[str, int],
    now: float,
    *,
    unfit: Iterable[str] = (),
    for_slot: str = "",
) -> EvictionPlan:
    """The victims that empty whole devices: every slot on each of ``holders``' devices
    (``holders[d]``: how many hold it; a sleeper holds the GPUs it is placed on). A device
    is *blocked* when fewer of its holders are eligible than hold it, or when it is in
    ``unfit`` (the load does not fit there even alone): then the plan is not sufficient,
    and nothing is evicted for it. Every victim is unloaded (sleeping frees no GPU)."""
    eligible = [c for c in with_replicas(candidates, now) if is_eligible(c)]
    chosen = sorted(
        (c for c in eligible if any(d in holders for d in c.holds)), key=lambda c: _key(c, now)
    )
    on = {d: [c for c in chosen if d in c.holds] for d in holders}
    blocked = {d for d, n in holders.items() if len(on[d]) < n} | set(unfit)
    bytes_on = {d: sum(c.on(d) for c in on[d]) for d in holders}
    why = f"make room for {for_slot}" if for_slot else "make room"
    victims = () if blocked else tuple(_victim(c, now, why) for c in chosen)
    freed = bytes_on if not blocked else dict.fromkeys(holders, 0)
    return EvictionPlan(bytes_on, victims, freed, bytes_on, blocked=frozenset(blocked))


def plan_eviction(
    candidates: Sequence[EvictionCandidate],
    device: str,
    need_bytes: int,
    now: float,
    *,
    for_slot: str = "",
    host: Mapping[str, int] | None = None,
) -> EvictionPlan:
    """The victims that free ``need_bytes`` on ``device`` (empty plan if it cannot)."""
    return plan_room(candidates, {device: need_bytes}, now, for_slot=for_slot, host=host)


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
    candidates: Sequence[EvictionCandidate],
    device: str,
    level: Pressure,
    now: float,
    *,
    host: Mapping[str, int] | None = None,
) -> list[Victim]:
    """Elevated: the one best victim; critical: every eligible slot; each with its action
    (a sleeper under pressure in host memory is unloaded; ``host``: as for :func:`plan_room`)."""
    candidates = with_replicas(candidates, now)
    ordered = _order(candidates, (device,), now)
    if level is Pressure.NORMAL or not ordered:
        return []
    chosen = ordered if level is Pressure.CRITICAL else ordered[:1]
    victims, _ = _act(chosen, candidates, host, now, f"memory pressure {level.value}")
    return victims


def _by_unit(candidates: Iterable[EvictionCandidate]) -> dict[str, list[EvictionCandidate]]:
    units: dict[str, list[EvictionCandidate]] = {}
    for c in candidates:
        if c.unit is not None:
            units.setdefault(c.unit, []).append(c)
    return units


def unified(candidates: Sequence[EvictionCandidate]) -> list[EvictionCandidate]:
    """Each member of a unit judged as its unit (see the module docstring); every other
    candidate as it is."""
    units = {u: m for u, m in _by_unit(candidates).items() if len(m) > 1}
    if not units:
        return list(candidates)
    out = []
    for c in candidates:
        members = units.get(c.unit) if c.unit is not None else None
        if members is None:
            out.append(c)
            continue
        out.append(
            replace(
                c,
                priority=max(m.priority for m in members),
                last_used=max(m.last_used for m in members),
                pinned=any(m.pinned for m in members),
                leases=sum(m.leases for m in members),
                busy=any(m.busy for m in members),
            )
        )
    return out


def without_unit(
    unit: str | None, candidates: Iterable[EvictionCandidate]
) -> list[EvictionCandidate]:
    """The candidates a load of a member of ``unit`` may evict: none of its own unit."""
    return [c for c in candidates if unit is None or c.unit != unit]
