"""Admission: the one load decision on live state, the admit loop, the dry run's decision.

A part of the manager (:mod:`controller.slots`), between :mod:`.loading` (which asks it)
and :mod:`.unloading` (which evicts for it). :meth:`Admission.decide` turns the table's
live state into the inputs of the pure :func:`controller.scheduling.decision.decide_load`;
:meth:`Admission.admit` is the one loop every walk that needs memory goes through (a cold
load, a wake, a pod that landed elsewhere: decide, make room, decide again, reserve), and
the dry run (:meth:`Admission.explain`, a :class:`~.dryrun.LoadPlan`) takes the same
decision, so the two never disagree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from controller.model.devices import GpuRef, key_kind
from controller.model.errors import (
    DeviceUnavailable,
    InsufficientMemory,
    SlotConfigError,
    SlotctlError,
    SlotNotReady,
)
from controller.model.events import EventKind, EvictionReason, Op
from controller.model.lifecycle import DISPATCHABLE_STATES, SlotState
from controller.model.sizes import GIB, format_gib
from controller.runtime.base import LaunchSpec
from controller.scheduling.cluster import Held, by_count, cluster_devices
from controller.scheduling.decision import (
    WAITING_FOR_DEVICE,
    WAITING_FOR_MEMORY,
    DeviceFacts,
    GroupPeer,
    LoadDecision,
    LoadRequest,
    decide_load,
)
from controller.scheduling.eviction import without_unit
from controller.scheduling.fit import DeviceMemory, budget_gb_for, check_admission, gpu_inventory
from controller.scheduling.nodes import ClusterProbe, NodeGpus
from controller.scheduling.placement import Need, place_first
from controller.slots.core import Core, Part
from controller.slots.dryrun import LoadPlan, plan_of
from controller.slots.pulling import Pulling
from controller.slots.records import ADMITTED_STATES, DeviceFigures, SlotRecord
from controller.slots.sizing import Sizing
from controller.slots.unloading import Unloading
from controller.spec.schema import SlotSpec

__all__ = ["Admission", "Admitted", "Walk"]

log = logging.getLogger("slotctl.manager")

S = SlotState


class Walk(StrEnum):
    """What an admission is for (:meth:`Admission.admit`)."""

    LOAD = "load"  # a cold load: reserves by leaving offline/error, its GPUs recorded
    WAKE = "wake"  # an asleep slot's wake: reserves by the tier waking, where it sleeps
    LANDED = "landed"  # a pod that landed on another node: admitted again there
    RESIZED = "resized"  # its files pulled, its estimate grew: admitted again for it


@dataclass(frozen=True, slots=True)
class Admitted:
    """An admission's outcome: the decision it reserved for (or a wake's cold fallback)."""

    decision: LoadDecision
    launch: LaunchSpec | None = None  # a load's: what it starts (before its placement)
    pulling: bool = False  # a load: its model files (or image) are fetched first
    cold: bool = False  # a wake that cannot happen where it sleeps: load it cold instead


class Admission(Part):
    def __init__(
        self,
        core: Core,
        unloading: Unloading,
        pulling: Pulling | None = None,
        sizing: Sizing | None = None,
    ) -> None:
        super().__init__(core)
        self.unloading = unloading
        self.pulling = pulling or Pulling(core)  # a load's model files (the disk's half)
        self.sizing = sizing or Sizing(core)  # its footprint: estimated, learnt
        self._by_count: set[str] = set()  # nodes said to be admitted by GPU count

    def _recent(self, slot: SlotRecord) -> float:
        return self.core.recent_weight(slot, self.clock.monotonic())

    def decide(
        self, slot: SlotRecord, *, background: bool, evict: bool = True, cold: bool = False
    ) -> LoadDecision:
        """The one load decision (:func:`controller.scheduling.decision.decide_load`) on live state.

        An asleep slot's load is a wake: pinned to the GPUs its server sleeps on (``cold``:
        a cold load instead, placed anew). The victims' actions come with it (sleep where
        host memory holds them: :meth:`host_room`).
        """
        if slot.on_nodes and slot.spec.device_ref.pins:
            return LoadDecision("refuse", error=pinned_on_a_cluster(slot.spec))
        devices = self._where_it_sleeps(slot, self.device_facts(slot), cold)
        peers = tuple(
            GroupPeer(
                p.name, bool(p.spec.pinned), p.memory_bytes if p.state in ADMITTED_STATES else 0
            )
            for p in self.table.usage.group_peers(slot)
        )
        request = LoadRequest(
            slot=slot.name,
            priority=slot.spec.priority,
            needed=slot.memory_bytes,
            activated=slot.spec.activated,
            model_id=slot.spec.model_id,
            model_known=slot.model is not None or not slot.spec.model_id,
            breaker=slot.breaker,
            max_failures=slot.spec.max_consecutive_failures,
            peers=peers,
            background=background,
            # a node's GPUs when the cluster is known; else the one NODE/gpu key
            span=max(1, slot.spec.gpu_count) if _spans(slot, devices) else 1,
            pins=self._pins(slot, cold),
        )
        return self._explained(
            decide_load(
                request,
                devices,
                # never a member of its own co-loaded unit (controller.scheduling.eviction)
                (lambda: without_unit(slot.spec.unit, self.table.usage.candidates(self._recent)))
                if evict
                else lambda: (),
                self.clock.monotonic(),
                min_resident_s=self.settings.min_resident_s,
                host=self.host_room,
            )
        )

    def _explained(self, decision: LoadDecision) -> LoadDecision:
        """A refusal because no memory probe answers, with the probe's reason and what to
        do ("nvidia-ml-py is not installed: install it…")."""
        error = decision.error
        if error is None or not error.details.get("no_probe"):
            return decision
        why_not = getattr(self.memory, "why_not", None)
        if why_not is None:
            return decision
        reason = str(why_not(str(error.details.get("device", "gpu"))))
        if not isinstance(error, InsufficientMemory) or reason in error.message:
            return decision
        said = InsufficientMemory(f"{error.message}: {reason}", **error.details, probe=reason)
        return replace(decision, error=said)

    def decide_wake(self, slot: SlotRecord, *, background: bool) -> tuple[LoadDecision, bool]:
        """An asleep slot's load and whether it is a wake (True): the wake where its server
        sleeps, else — no room can be made on those GPUs (a pinned slot holds them), but a
        cold load placed anew is admitted — that cold load (False)."""
        decision = self.decide(slot, background=background)
        if decision.ok or not slot.asleep or not slot.placement:
            return decision, bool(slot.asleep)
        cold = self.decide(slot, background=background, cold=True)
        return (cold, False) if cold.ok else (decision, True)

    @staticmethod
    def _where_it_sleeps(
        slot: SlotRecord, devices: list[DeviceFacts], cold: bool
    ) -> list[DeviceFacts]:
        """A wake on a cluster's GPUs: the GPUs its pod sleeps on (it wakes there; a host's
        wake is pinned instead, :meth:`_pins`); any other load: every device."""
        if cold or not (slot.on_nodes and slot.asleep and slot.placement):
            return devices
        keys = {g.key for g in slot.placement}
        there = [d for d in devices if d.key in keys]
        return there if len(there) == len(keys) else devices

    @staticmethod
    def _pins(slot: SlotRecord, cold: bool = False) -> tuple[str, ...]:
        """The GPUs a load must go to: a wake's are the ones its server sleeps on."""
        if slot.on_nodes:
            return ()
        if slot.asleep and slot.placement and not cold:
            return tuple(str(g.index) for g in slot.placement)
        return slot.spec.device_ref.pins

    def host_room(self) -> dict[str, int]:
        """The room per host key for sleepers' weights (SPEC §6's two inequalities, with
        the host's own margin ``host_margin_gb``): every host key a slot could sleep on."""
        held = self.table.usage.all_device_bytes()
        margin = int(self.settings.host_margin_gb * GIB)
        room: dict[str, int] = {}
        for key in sorted({s.host for s in self.table}):
            budget_gb = budget_gb_for(key, self.settings.memory_budget_gb)
            budget = int(budget_gb * GIB) if budget_gb is not None else None
            admitted, reserved = held.get(key, (0, 0))
            sample = self._sample(key)
            if sample is not None:
                sample = replace(sample, free_bytes=max(0, sample.free_bytes - reserved))
            figures = check_admission(key, 0, admitted, sample, budget, margin)
            room[key] = max(0, min(figures.budget_room, figures.free_room))
        return room

    def device_facts(self, slot: SlotRecord) -> list[DeviceFacts]:
        """The devices ``slot`` could load on, as the placement sees them: every GPU of
        the host for a GPU slot (the probe's, else those the budgets name), else the one
        device (``cpu``, ``npu``, ``NODE/DEVICE`` on a cluster). The slot's own bytes and
        its exclusive-group peers' are told apart (the load unloads the peers first)."""
        group = self.table.usage.group_peers(slot)
        nodes = self._cluster() if slot.on_nodes and slot.spec.device_kind == "gpu" else None
        placed: tuple[dict[str, int], dict[str, dict[str, int]]] | None = None
        if nodes is not None:  # the cluster's view too, in the same pass over the slots
            figures, holders, units = self.table.usage.cluster_holdings(
                slot, {p.name for p in group}
            )
            placed = holders, units
        else:
            figures = self.table.usage.all_device_bytes(slot)
        for key, size, _loading in slot.holdings():
            figures[key][0] -= size
        peers: dict[str, int] = {}
        for p in group:
            for key, size, _loading in p.holdings():
                peers[key] = peers.get(key, 0) + size
        budgets = self.settings.memory_budget_gb
        margin = int(self.settings.safety_margin_gb * GIB)
        siblings = self._siblings(slot)

        def facts(
            key: str,
            sample: DeviceMemory | None,
            budget: int | None,
            gpu: GpuRef | None,
            lost: str | None = None,
        ) -> DeviceFacts:
            admitted, reserved = figures.get(key, (0, 0))
            return DeviceFacts(
                key,
                admitted,
                sample,
                budget,
                margin,
                reserved,
                peers.get(key, 0),
                gpu,
                lost,
                siblings=siblings.get(key, 0),
            )

        if nodes is not None and placed is not None:
            found = self._cluster_facts(slot, nodes, figures, peers, margin, *placed)
            by_node = self._siblings(slot, by_node=True)
            if not by_node:
                return found
            # on a cluster, replicas spread across nodes: a node a sibling runs on
            return [replace(d, siblings=by_node.get(d.group or "", 0)) for d in found]
        if slot.on_nodes or slot.spec.device_kind != "gpu":
            key = slot.where
            budget_gb = budget_gb_for(key, budgets)
            budget = int(budget_gb * GIB) if budget_gb is not None else None
            return [facts(key, self.memory.sample(key), budget, None)]
        inventory = gpu_inventory(self.memory.gpus(), budgets)
        if not inventory:  # no probe, no budget: refused with the reason (device "gpu")
            return [facts("gpu", None, None, None)]
        return [facts(g.key, g.sample, g.budget, g.ref, g.error) for g in inventory]

    def _siblings(self, slot: SlotRecord, *, by_node: bool = False) -> dict[str, int]:
        """Per GPU (``by_node``: per node of a cluster), the replicas of ``slot``'s own slot
        admitted there (a spread replica avoids them: :mod:`controller.scheduling.placement`)."""
        group = slot.spec.replica_group
        if not group or slot.spec.replica_placement != "spread":
            return {}
        out: dict[str, int] = {}
        for s in self.table:
            if s is slot or s.spec.replica_group != group or s.state not in ADMITTED_STATES:
                continue
            for g in s.placement:
                key = (g.node or "") if by_node else g.key
                out[key] = out.get(key, 0) + 1
        return out

    def _cluster(self) -> list[NodeGpus] | None:
        """The cluster's nodes when the memory probe knows them (the kubernetes runtime)."""
        probe = self.memory
        return list(probe.cluster()) if isinstance(probe, ClusterProbe) else None

    def _cluster_facts(
        self,
        slot: SlotRecord,
        nodes: list[NodeGpus],
        figures: dict[str, list[int]],
        peers: dict[str, int],
        margin: int,
        holders: dict[str, int],
        units: dict[str, dict[str, int]],
    ) -> list[DeviceFacts]:
        """The cluster's GPUs for ``slot`` (see :mod:`controller.scheduling.cluster`): what the
        other slots hold on each (``holders``, ``units``: :meth:`Usage.cluster_holdings`),
        and the nodes it avoids for now."""
        budget_gb = self.settings.memory_budget_gb.get("gpu")
        per_gpu = int(budget_gb * GIB) if budget_gb is not None else None
        self._say_by_count(nodes, per_gpu)
        now = self.clock.monotonic()
        avoid = slot.flight.avoided(now)
        held = Held(figures, peers, holders, units, own=slot.name)
        span = max(1, slot.spec.gpu_count)
        return cluster_devices(
            nodes, held, span=span, margin=margin, per_gpu=per_gpu, node=slot.spec.node, avoid=avoid
        )

    def _say_by_count(self, nodes: list[NodeGpus], per_gpu: int | None) -> None:
        """Once per node: its GPUs' memory is not known, slots go there by count."""
        for name in by_count(nodes, per_gpu):
            if name not in self._by_count:
                self._by_count.add(name)
                log.warning(
                    "node %s offers GPUs without a nvidia.com/gpu.memory label (no GPU "
                    "feature discovery?) and memory_budget_gb.gpu is not set: slots are "
                    "admitted there by GPU count (one slot per GPU, memory not checked)",
                    name,
                )

    def figures(self) -> list[DeviceFigures]:
        """Every device with its memory: each GPU of the host (probed, or named by a
        budget), the other devices a slot uses or a budget names, a cluster's node keys."""
        held = self.table.usage.all_device_bytes()
        slots: dict[str, list[str]] = {}
        kinds: set[str] = set()
        for s in self.table:
            kinds.add(s.spec.device_kind)
            if s.state in ADMITTED_STATES:
                for key in s.devices:
                    slots.setdefault(key, []).append(s.name)
        budgets = self.settings.memory_budget_gb
        margin = int(self.settings.safety_margin_gb * GIB)

        def one(
            key: str, sample: DeviceMemory | None, budget: int | None, **gpu: Any
        ) -> DeviceFigures:
            admitted, reserved = held.get(key, (0, 0))
            return DeviceFigures(
                device=key,
                kind=key_kind(key),
                total_bytes=sample.total_bytes if sample else None,
                free_bytes=sample.free_bytes if sample else None,
                admitted_bytes=admitted,
                reserved_bytes=reserved,
                resident_bytes=admitted - reserved,
                budget_bytes=budget,
                safety_margin_bytes=margin,
                source=sample.source if sample else ("budget" if budget is not None else None),
                slots=tuple(slots.get(key, ())),
                **gpu,
            )

        out: list[DeviceFigures] = []
        inventory = gpu_inventory(self.memory.gpus(), budgets)
        for g in inventory:
            info = {"index": g.ref.index, "uuid": g.ref.uuid, "name": g.name, "error": g.error}
            out.append(one(g.key, g.sample, g.budget, **info))
        others = {k for k in (kinds | set(budgets)) if ":" not in k} | {k for k in held if "/" in k}
        if inventory:
            others.discard("gpu")
        for key in sorted(others):
            budget_gb = budget_gb_for(key, budgets)
            budget = int(budget_gb * GIB) if budget_gb is not None else None
            out.append(one(key, self._sample(key), budget))
        return out

    def _sample(self, key: str) -> DeviceMemory | None:
        try:
            return self.memory.sample(key)
        except Exception:  # a broken probe must not break a scrape or the dashboard
            log.exception("memory probe for %s failed", key)
            return None

    def place_running(self, slot: SlotRecord) -> tuple[GpuRef, ...]:
        """The GPUs to count a running server on that has none recorded (an adoption):
        where its pod runs on a cluster; on a host the first GPUs in index order that hold
        it (a server of a controller before per-GPU placement saw every GPU, and frameworks
        take GPU 0 first); else the set closest to fitting (it runs already: its memory
        must be counted somewhere). No breaker, no exclusive group, no eviction: nothing
        is loaded."""
        pins = () if slot.on_nodes else slot.spec.device_ref.pins
        need = Need(slot.name, slot.memory_bytes, max(1, slot.spec.gpu_count), pins)
        devices = self.device_facts(slot)
        if slot.on_nodes:  # where its pod runs, even on a GPU the count says is taken
            devices = [replace(d, lost=None) for d in devices if d.group == slot.landed]
        return place_first(need, devices).gpus

    def explain(self, slot: SlotRecord) -> LoadPlan:
        """Dry run of a load (or of an asleep slot's wake): would it fit, where, what would
        be evicted there, how (``sleep`` or ``unload``) and why, and what each device
        gets back — the decision the load would take, as data. Changes nothing."""
        if slot.state in DISPATCHABLE_STATES and not slot.asleep:
            return LoadPlan(slot.name, "none", reason=f"already {slot.state.value}")
        decision, wake = self.decide_wake(slot, background=False)
        return plan_of(slot, decision, wake=wake)

    def waiting_with_room(self) -> list[str]:
        """Waiting slots whose background load would be admitted now (memory came back)."""
        return [
            s.name
            for s in self.table
            if s.waiting is not None
            and not s.busy
            and not self.table.usage.group_peers(s)  # the group is held: the reconciler waits
            and self.decide_wake(s, background=True)[0].ok
        ]

    def refuse(self, slot: SlotRecord, decision: LoadDecision) -> SlotctlError:
        """A refused load: one event, except while a background load keeps waiting."""
        error = decision.error
        assert error is not None
        op = Op.ADMIT if decision.admission is not None else Op.LOAD
        if not decision.waiting:
            return self.table.refuse(slot, op, error)
        device = isinstance(error, DeviceUnavailable)
        wait = WAITING_FOR_DEVICE if device else WAITING_FOR_MEMORY
        if slot.waiting != wait:  # said once, not at every retry
            message = f"waiting for {'its GPU' if device else 'memory'}: {error.message}"
            self.table.persist(slot, waiting=wait, message=message)
            self.table.refuse(slot, op, error)
        else:
            error.reported = True  # said when the wait began
        return error

    async def admit(self, slot: SlotRecord, walk: Walk) -> Admitted:
        """The admit loop — decide, make room, decide again, reserve — for every walk that
        needs memory: a cold load, an asleep slot's wake, and a pod that landed on another
        node than the one it was admitted against.

        Each decision is taken under the device lock, so two loads never both pass for the
        same free memory, and the reservation is made under the same hold. A refusal is
        raised before anything is unloaded for it (SPEC §6: not even all eligible victims
        would make room, a pinned peer, the breaker...). Exclusive-group peers that hold the
        group are unloaded outside the device lock (each takes its own slot lock: the lock
        order, :mod:`.locks`), and the decision is taken again; the plan's victims are
        evicted under it (each revalidated: a request since spares it, and one with a lease
        is never chosen), and the decision is taken once more, evicting nothing: what is
        still missing then (a victim spared) is a refusal. So a load that fits decides
        once, one that evicts twice, a swap twice (three times when it evicts too). A
        load's launch is built once its first decision is taken, before anything goes (a
        slot whose launch cannot be built unloads nothing either).

        A wake's first decision may instead say that no room can be made where its server
        sleeps while a cold load placed anew would fit: :attr:`Admitted.cold`, nothing
        reserved (the caller stops the sleeper and loads it cold).
        """
        background = slot.flight.background
        swapped = False
        launch: LaunchSpec | None = None
        while True:
            async with self.locks.device(slot.lock_key, lambda: self.core.demand(slot)):
                if walk is Walk.WAKE and not swapped:
                    decision, wake = self.decide_wake(slot, background=background)
                    if decision.ok and not wake:
                        return Admitted(decision, cold=True)
                else:
                    decision = self.decide(slot, background=background)
                self._raise_refused(slot, walk, decision)
                if walk is Walk.LOAD and launch is None:
                    launch = self.core.build_launch(slot, starting=True)  # a free auto port
                if not decision.peers:
                    if decision.victims:
                        await self.unloading.evict(decision.victims, reason=EvictionReason.PRELOAD)
                        decision = self.decide(slot, background=background, evict=False)
                        self._raise_refused(slot, walk, decision)
                    return await self._reserve(slot, walk, decision, launch)
            if swapped:  # unloaded, yet still holding the group: never two members at once
                holder = ", ".join(decision.peers)
                error = SlotNotReady(
                    f"exclusive-group peer {holder} still holds the group", slot=slot.name
                )
                raise self.table.refuse(slot, Op.LOAD, error)
            await self.unloading.unload_group_peers(slot)
            swapped = True

    def _raise_refused(self, slot: SlotRecord, walk: Walk, decision: LoadDecision) -> None:
        """A refused decision, raised: said once (:meth:`refuse`), but a landed pod's,
        which its load fails with (the caller stops the server)."""
        if decision.ok:
            return
        if walk in (Walk.LANDED, Walk.RESIZED):
            assert decision.error is not None
            raise decision.error
        raise self.refuse(slot, decision)

    async def _reserve(
        self, slot: SlotRecord, walk: Walk, decision: LoadDecision, launch: LaunchSpec | None
    ) -> Admitted:
        """The admitted walk's reservation, under the device lock, with its one admission
        event: a load leaves offline/error (``pulling`` or ``starting``, its GPUs recorded
        by that durable transition), a wake takes the tier ``waking`` (its device memory
        counted again, durable before the wake calls go out), a landed pod is counted where
        it landed (it holds its memory there already)."""
        size = format_gib(slot.memory_bytes)
        where = ", ".join(decision.devices) or slot.where
        if walk in (Walk.LANDED, Walk.RESIZED):
            why = "landed" if walk is Walk.LANDED else "estimated from its pulled files"
            message = f"admitted {size} on {slot.where} ({why})"
            self.events.emit(EventKind.ADMISSION, Op.ADMIT, slot=slot.name, message=message)
            return Admitted(decision)
        if walk is Walk.WAKE:
            self.events.emit(
                EventKind.ADMISSION,
                Op.ADMIT,
                slot=slot.name,
                model=slot.model_id,
                message=f"admitted {size} on {where} (wake)",
                details={"devices": list(decision.devices), "wake": True},
            )
            message = f"waking on {where}"
            self.table.set_tier(slot, asleep=slot.asleep, waking=True, op=Op.LOAD, message=message)
            return Admitted(decision)
        assert launch is not None, "a load reserves for its launch"
        admission = decision.admission
        assert admission is not None
        self.events.emit(
            EventKind.ADMISSION,
            Op.ADMIT,
            slot=slot.name,
            model=launch.model_id,
            message=f"admitted {size} on {where}",
            details={
                "needed_bytes": admission.needed,
                "free_bytes": admission.free,
                "devices": list(decision.devices),
            },
        )
        needs_pull = self.pulling.needed(slot) or await self.runtime.needs_prepare(launch)
        if self.core.files is None:  # nobody pulls here: a missing file fails the load
            needs_pull = needs_pull or launch.model_missing()
        target = S.PULLING if needs_pull else S.STARTING
        if slot.state is not S.OFFLINE and slot.state is not S.ERROR:
            self.table.walk(slot, S.OFFLINE, op=Op.LOAD, message="reset before load")
        self.table.set(
            slot, target, op=Op.LOAD, message=f"admitted on {where}", placement=decision.gpus
        )
        return Admitted(decision, launch, pulling=needs_pull)


def _spans(slot: SlotRecord, devices: list[DeviceFacts]) -> bool:
    """The slot's ``gpus`` apply: a host's GPUs, or a cluster's node GPUs."""
    return not slot.on_nodes or any(d.group for d in devices)


def pinned_on_a_cluster(spec: SlotSpec) -> SlotConfigError:
    """A slot that pins GPUs on the kubernetes runtime, where the device plugin picks a
    node's GPUs: refused before anything (an exclusive-group peer) is unloaded."""
    return SlotConfigError(
        f"slot {spec.name!r}: device = {spec.device!r} pins GPUs, which the kubernetes "
        'runtime cannot do (the device plugin picks a node\'s GPUs): use device = "gpu" '
        "with gpus = K, and `node` to choose the node",
        keys=["device"],
        slot=spec.name,
    )
