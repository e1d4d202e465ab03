"""Placement: on which device(s) a load goes, and what has to go first there. Pure.

After kube-scheduler's filter → score → bind, on one host: the candidate device sets
are *filtered* (the GPUs a slot pins, or every ``span``-sized set of the host's GPUs),
each is *scored* by the admission it would get and the evictions it would need there,
and the best one is returned as data; the manager binds it (records it in ``state.json``
before it starts anything) and the runtimes carry it out (visibility variables, device
requests, a pod's GPU count). :func:`controller.scheduling.decision.decide_load` calls :func:`place`
for every load, its dry run and every background load, so they cannot disagree.

Scoring, best first::

    fits without evicting anything   before   needs evictions
    fewest sibling replicas of the same slot on the set (spread: a replica shares a
               sibling's GPU only when no set without one does as well on the line above)
    (evicting) lowest top victim priority, fewest unloads (a victim that sleeps costs
               a wake, not a cold start), fewest victims, fewest bytes evicted
    GPUs whose memory is known before GPUs admitted by count (a cluster's)
    best fit: the least room left on the chosen devices after the load
    ties: the node's name, then the lower GPU indices

Best fit keeps the big holes for big models (a 20 GiB load is not refused because
every GPU was filled to half by small ones). A slot spanning ``K`` GPUs needs
``share(bytes, K)`` on each of them, and every device of the set must fit; the eviction
plan frees room on exactly those devices (:func:`controller.scheduling.eviction.plan_room`: a
victim holds memory on at least one of them), and says per victim whether it sleeps or
is unloaded (``host``: the room in host memory for sleepers, see
:mod:`controller.scheduling.eviction`).

On a cluster the devices are the nodes' GPUs (``NODE/gpu:N``, built by
:mod:`controller.scheduling.cluster`): a set never spans two nodes (each device's
``group`` is its node; multi-node tensor parallel is out of scope), and a node's GPU
without time-slicing is *exclusive* (one pod per GPU): a load needs it to itself, so every
slot on it has to go first, unloaded (:func:`controller.scheduling.eviction.plan_clear`);
one whose memory nobody states (no GPU feature discovery label, no
``memory_budget_gb.gpu``) is admitted by count alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from controller.model.devices import GpuRef, share
from controller.model.errors import DeviceUnavailable, SlotConfigError
from controller.model.sizes import format_gib
from controller.scheduling.eviction import (
    EvictionCandidate,
    EvictionPlan,
    Victim,
    plan_clear,
    plan_room,
)
from controller.scheduling.fit import Admission, DeviceMemory, check_admission

__all__ = [
    "DeviceFacts",
    "JointPlacement",
    "Need",
    "Option",
    "Placement",
    "describe",
    "gpu_figures",
    "place",
    "place_first",
    "place_joint",
    "resolve_pins",
]

# Device sets scored at most: every set on a host of up to 8 GPUs (C(8, 4) = 70); on a
# bigger one, the sets of the GPUs that suit the load best on their own (see _sets).
_MAX_SETS = 256


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """One device a load could use: its numbers with the requester's own bytes excluded."""

    key: str  # gpu:N, cpu, npu, NODE/gpu
    admitted: int  # bytes admitted here (pulling..unloading)
    sample: DeviceMemory | None  # probed now; None: not probed (the budget rules)
    budget: int | None  # bytes; None: the probed total
    margin: int
    # Admitted to loads the probe cannot see yet (pulling/starting/warming): two loads
    # admitted a moment apart must not both count the same free memory.
    reserved: int = 0
    peers: int = 0  # bytes the exclusive-group peers hold here (unloaded first)
    gpu: GpuRef | None = None  # a GPU: what the runtime needs to make it visible
    lost: str | None = None  # the probe cannot read this GPU now: never chosen
    group: str | None = None  # a cluster's node: a device set stays within one group
    # A whole device (a node's GPU without time-slicing): one slot at a time. ``holders``
    # is how many hold it now (the requester and its group peers not counted); with no
    # sample and no budget its memory is unknown and a load is admitted by count alone.
    exclusive: bool = False
    holders: int = 0
    # Replicas of the requester's own slot admitted here (a spread replica avoids them:
    # a sibling's GPU only when no other device set fits without evicting)
    siblings: int = 0


@dataclass(frozen=True, slots=True)
class Need:
    """What a load asks for."""

    slot: str
    bytes: int  # in all (a slot spanning K devices needs share(bytes, K) on each)
    span: int = 1
    pins: tuple[str, ...] = ()  # pinned GPUs: indices or UUIDs ("" none: any)


@dataclass(frozen=True, slots=True)
class Option:
    """One device set, judged: the admission on each device and the room plan."""

    devices: tuple[DeviceFacts, ...]
    admissions: tuple[Admission, ...]
    plan: EvictionPlan | None  # None: fits as it is

    @property
    def fits(self) -> bool:
        return self.plan is None or self.plan.sufficient

    @property
    def victims(self) -> tuple[Victim, ...]:
        return self.plan.victims if self.plan is not None else ()

    def score(self) -> tuple[int, int, int, int, int, int, int, int, str, tuple[int, ...]]:
        """Lower is better (see the module docstring); a GPU whose memory is known
        before one admitted by count; a set without the requester's sibling replicas
        before one with them."""
        victims = self.victims
        evicted = sum(v.bytes for v in victims)
        top = max((v.priority for v in victims), default=-1)
        unloads = self.plan.unloads if self.plan is not None else 0
        room = sum(min(a.budget_room, a.free_room) - a.needed for a in self.admissions)
        left = room + (self.plan.freed_bytes if self.plan is not None else 0)
        blind = sum(1 for a in self.admissions if a.source == "gpu-count")
        group = self.devices[0].group or "" if self.devices else ""
        order = tuple(d.gpu.index if d.gpu else 0 for d in self.devices)
        siblings = sum(d.siblings for d in self.devices)
        return (
            1 if victims else 0,
            siblings,
            top,
            unloads,
            len(victims),
            evicted,
            blind,
            left,
            group,
            order,
        )


@dataclass(frozen=True, slots=True)
class Placement:
    """The verdict: the chosen devices and their victims, or why none will do.

    ``option`` is the chosen set (or, for a refusal, the set that came closest: its
    figures explain the refusal); ``error`` is set when nothing fits.
    """

    option: Option | None
    error: DeviceUnavailable | SlotConfigError | None = None
    tried: tuple[Option, ...] = ()  # every set judged (a refusal's figures per GPU)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d.key for d in self.option.devices) if self.option else ()

    @property
    def gpus(self) -> tuple[GpuRef, ...]:
        """The chosen GPUs, each with its memory (what the server is told it may use)."""
        if self.option is None:
            return ()
        return tuple(
            replace(d.gpu, total_bytes=_total(d)) for d in self.option.devices if d.gpu is not None
        )


def _total(facts: DeviceFacts) -> int | None:
    """A GPU's memory as admission counts it: its budget, else the probed total."""
    if facts.budget is not None:
        return facts.budget
    return facts.sample.total_bytes if facts.sample is not None else None


def _admission(need: int, facts: DeviceFacts) -> Admission:
    """Admission on one device as if the exclusive peers there were already gone."""
    if facts.exclusive:
        return _whole(need, facts)
    sample = facts.sample
    if sample is not None:
        free = sample.free_bytes - facts.reserved + facts.peers
        sample = replace(sample, free_bytes=max(0, min(sample.total_bytes, free)))
    return check_admission(
        facts.key, need, facts.admitted - facts.peers, sample, facts.budget, facts.margin
    )


def _whole(need: int, facts: DeviceFacts) -> Admission:
    """Admission on a whole device: the load alone there (its holders must go first). Its
    memory unknown: by count (any load fits a free one, said as ``gpu-count``)."""
    if facts.sample is None and facts.budget is None:
        room = need + facts.margin
        alone = Admission(facts.key, need, 0, room, room, facts.margin, "gpu-count")
    else:
        alone = check_admission(facts.key, need, 0, facts.sample, facts.budget, facts.margin)
    return replace(alone, holders=facts.holders)


def resolve_pins(
    need: Need, devices: Sequence[DeviceFacts]
) -> tuple[DeviceFacts, ...] | DeviceUnavailable | SlotConfigError:
    """The devices a pinned slot names (by index or UUID), or why they are not there (or
    that two of its pins name one GPU: by its index and by its UUID)."""
    chosen: list[DeviceFacts] = []
    for pin in need.pins:
        found = next((d for d in devices if d.gpu is not None and _names(d.gpu, pin)), None)
        if found is None or found.lost:
            return _unavailable(need, devices, pin, found.lost if found else None)
        if found in chosen:
            return SlotConfigError(
                f"slot {need.slot!r}: device pins {found.key} twice (by its index and its "
                f"UUID {found.gpu.uuid if found.gpu else '?'})",
                keys=["device"],
                slot=need.slot,
            )
        chosen.append(found)
    return tuple(chosen)


def _names(gpu: GpuRef, pin: str) -> bool:
    return str(gpu.index) == pin if pin.isdigit() else gpu.uuid == pin


def _unavailable(
    need: Need, devices: Sequence[DeviceFacts], pin: str | None, lost: str | None = None
) -> DeviceUnavailable:
    gpus = [d for d in devices if d.gpu is not None]
    have = ", ".join(d.key + (" (lost)" if d.lost else "") for d in gpus) or (
        "none: no GPU probe answers and no memory_budget_gb names a GPU"
    )
    if pin is None and any(d.group for d in gpus):
        message = _no_node(need, gpus)
        reason = "too_few"
    elif pin is None:
        usable = sum(1 for d in gpus if not d.lost)
        message = f"slot {need.slot!r} spans {need.span} GPUs, the host has {usable} ({have})"
        reason = "too_few"
    elif lost:
        message = f"slot {need.slot!r} is pinned to GPU {pin}, which cannot be read: {lost}"
        reason = "lost"
    else:
        message = (
            f"slot {need.slot!r} is pinned to GPU {pin}, which this host does not have "
            f"(GPUs: {have})"
        )
        reason = "not_found"
    return DeviceUnavailable(
        message,
        slot=need.slot,
        device=pin or "gpu",
        reason=reason,
        needed_bytes=share(need.bytes, need.span),  # on each GPU it would use
        span=need.span,
        gpus=gpu_figures(gpus),
    )


def _no_node(need: Need, gpus: Sequence[DeviceFacts]) -> str:
    """Why no node of a cluster can take the load: each node's usable GPUs, or why none."""
    nodes: dict[str, list[DeviceFacts]] = {}
    for d in gpus:
        nodes.setdefault(d.group or "", []).append(d)
    parts = []
    for node, devices in sorted(nodes.items()):
        usable = sum(1 for d in devices if not d.lost)
        why = sorted({d.lost for d in devices if d.lost})
        parts.append(
            f"{node}: {usable} of {len(devices)}" + (f" ({'; '.join(why)})" if why else "")
        )
    each = "a GPU" if need.span == 1 else f"{need.span} GPUs on one node"
    return f"slot {need.slot!r} needs {each}, and no node has that free: " + ", ".join(parts)


def gpu_figures(devices: Sequence[DeviceFacts]) -> list[dict[str, object]]:
    """Each device's figures, as a refusal's details carry them."""
    return [
        {
            "device": d.key,
            "uuid": d.gpu.uuid if d.gpu else None,
            "total_bytes": d.sample.total_bytes if d.sample else None,
            "free_bytes": d.sample.free_bytes if d.sample else None,
            "budget_bytes": d.budget,
            "admitted_bytes": d.admitted,
            **({"node": d.group} if d.group else {}),
            **({"error": d.lost} if d.lost else {}),
        }
        for d in devices
    ]


def _sets(need: Need, devices: Sequence[DeviceFacts]) -> list[tuple[DeviceFacts, ...]]:
    """Every ``span``-sized set, never across groups (a cluster's nodes): within a group
    every set while there are at most ``_MAX_SETS``; beyond, the sets of the ``m`` GPUs
    that suit the load best on their own (fits as it is first, then best fit, then the
    lower index; ``m`` as many as keep the sets within the bound), so a big host's empty
    GPUs are never left out."""
    groups: dict[str | None, list[DeviceFacts]] = {}
    for d in devices:
        groups.setdefault(d.group, []).append(d)
    out: list[tuple[DeviceFacts, ...]] = []
    for members in groups.values():
        out.extend(_group_sets(need, members))
    return out


def _group_sets(need: Need, devices: Sequence[DeviceFacts]) -> list[tuple[DeviceFacts, ...]]:
    k = need.span
    m = len(devices)
    while m > k and math.comb(m, k) > _MAX_SETS:
        m -= 1
    if m < len(devices):
        per = share(need.bytes, k)
        devices = sorted(devices, key=lambda d: _alone(per, d))[:m]
        devices = sorted(devices, key=lambda d: d.gpu.index if d.gpu else 0)
    return list(itertools.combinations(devices, k))


def _alone(need: int, facts: DeviceFacts) -> tuple[int, int, int]:
    """How well one device takes a share on its own (lower is better)."""
    a = _admission(need, facts)
    room = min(a.budget_room, a.free_room) - need
    return (0 if a.ok else 1, room if a.ok else -room, facts.gpu.index if facts.gpu else 0)


def place(
    need: Need,
    devices: Sequence[DeviceFacts],
    candidates: Callable[[], Sequence[EvictionCandidate]],
    now: float,
    *,
    host: Callable[[], Mapping[str, int]] | None = None,
) -> Placement:
    """The best device set for ``need`` (see the module docstring for the order).

    ``candidates`` lists the slots the load may evict (already filtered for a background
    load); it is called only when no device set fits as it is. ``host``: the room in host
    memory per host key for victims that sleep (None: every victim is unloaded); called
    only then too.
    """
    if need.pins:
        pinned = resolve_pins(need, devices)
        if not isinstance(pinned, tuple):
            return Placement(None, error=pinned)
        sets = [pinned]
    else:
        usable = [d for d in devices if not d.lost]
        sets = _sets(need, usable)
        if not sets:
            return Placement(None, error=_unavailable(need, devices, None))
    per_device = share(need.bytes, need.span)
    judged = [Option(s, tuple(_admission(per_device, d) for d in s), None) for s in sets]
    fitting = [o for o in judged if all(a.ok for a in o.admissions)]
    if fitting:
        return Placement(min(fitting, key=Option.score), tried=tuple(judged))
    evictable = candidates()
    room = host() if host is not None else None
    planned = [_with_plan(o, evictable, now, need.slot, room) for o in judged]
    fitting = [o for o in planned if o.fits]
    if fitting:
        return Placement(min(fitting, key=Option.score), tried=tuple(planned))
    return Placement(min(planned, key=_missing), tried=tuple(planned))


def _missing(option: Option) -> int:
    """Bytes still missing on the set after evicting every eligible slot (the closest set
    explains a refusal)."""
    plan = option.plan
    if plan is None:
        return 0
    blocked = sum(a.needed or 1 for a in option.admissions if a.device in plan.blocked)
    return blocked + sum(max(0, n - plan.evictable.get(d, 0)) for d, n in plan.need.items())


def place_first(need: Need, devices: Sequence[DeviceFacts]) -> Placement:
    """The first device set in GPU order that fits as it is, else :func:`place`'s closest
    (no evictions). For a running server whose GPUs nobody recorded (a controller before
    per-GPU placement showed it every GPU, and its framework then takes GPU 0 first)."""
    if need.pins or need.span > len(devices):
        return place(need, devices, lambda: (), 0.0)
    per_device = share(need.bytes, need.span)
    for devices_set in _sets(need, [d for d in devices if not d.lost]):
        option = Option(devices_set, tuple(_admission(per_device, d) for d in devices_set), None)
        if all(a.ok for a in option.admissions):
            return Placement(option, tried=(option,))
    return place(need, devices, lambda: (), 0.0)


def _with_plan(
    option: Option,
    evictable: Sequence[EvictionCandidate],
    now: float,
    slot: str,
    host: Mapping[str, int] | None = None,
) -> Option:
    if any(d.exclusive for d in option.devices):  # a node's whole GPUs: cleared
        holders = {d.key: d.holders for d in option.devices}
        unfit = [a.device for a in option.admissions if a.shortfall]
        plan = plan_clear(evictable, holders, now, unfit=unfit, for_slot=slot)
        return replace(option, plan=plan)
    need = {a.device: a.shortfall for a in option.admissions}
    plan = plan_room(evictable, need, now, for_slot=slot, host=host)
    return replace(option, plan=plan)


def describe(option: Option) -> str:
    """``gpu:0 (4.00 GiB free), gpu:1 (…)``: where a load would go, in words."""
    return ", ".join(
        f"{a.device} ({format_gib(max(0, min(a.free_room, a.budget_room)))} free)"
        for a in option.admissions
    )


@dataclass(frozen=True, slots=True)
class JointPlacement:
    """A co-loaded unit's placement (:func:`place_joint`): each member's, in the order
    placed, and the member that fits nowhere beside those before it (None: all fit)."""

    members: tuple[tuple[str, Placement], ...]
    failed: str | None = None

    @property
    def ok(self) -> bool:
        return self.failed is None

    @property
    def victims(self) -> tuple[Victim, ...]:
        """Every member's victims, each once."""
        seen: dict[str, Victim] = {}
        for _, placement in self.members:
            if placement.option is not None:
                for v in placement.option.victims:
                    seen.setdefault(v.name, v)
        return tuple(seen.values())


def place_joint(
    needs: Sequence[tuple[Need, Sequence[DeviceFacts]]],
    candidates: Callable[[], Sequence[EvictionCandidate]],
    now: float,
    *,
    host: Callable[[], Mapping[str, int]] | None = None,
) -> JointPlacement:
    """A unit's members placed together, all or nothing (docs/design/0013): greedy, the
    biggest member first, each by :func:`place` on its devices as the members before it
    leave them (their bytes admitted and reserved there, their victims' bytes freed, their
    victims no longer candidates). ``failed`` names the first member that fits nowhere."""
    added: dict[str, int] = {}
    gone: set[str] = set()
    placed: list[tuple[str, Placement]] = []
    for need, devices in sorted(needs, key=lambda nd: (-nd[0].bytes, nd[0].slot)):
        facts = [_with_added(d, added.get(d.key, 0)) for d in devices]
        placement = place(
            need, facts, lambda: [c for c in candidates() if c.name not in gone], now, host=host
        )
        placed.append((need.slot, placement))
        option = placement.option
        if placement.error is not None or option is None or not option.fits:
            return JointPlacement(tuple(placed), failed=need.slot)
        for d in option.devices:
            added[d.key] = added.get(d.key, 0) + share(need.bytes, need.span)
        for v in option.victims:
            if v.name not in gone:
                gone.add(v.name)
                for key in v.devices:
                    added[key] = added.get(key, 0) - share(v.bytes, len(v.devices))
    return JointPlacement(tuple(placed))


def _with_added(facts: DeviceFacts, extra: int) -> DeviceFacts:
    """A device as a member placed before leaves it: ``extra`` bytes more admitted (and
    reserved: no probe sees them yet), fewer when its victims free more than it takes."""
    if not extra:
        return facts
    holders = facts.holders + (1 if facts.exclusive and extra > 0 else 0)
    return replace(
        facts, admitted=facts.admitted + extra, reserved=facts.reserved + extra, holders=holders
    )
