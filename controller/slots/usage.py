"""What the slots hold: memory per device, eviction candidates, exclusive-group holders.

The read side of :class:`~.table.SlotTable` (its ``usage``): sums and lists over the
table's records and surges, no writes. Each GPU is a device of its own (``gpu:N``); a slot
spanning several holds :func:`controller.model.devices.share` of its bytes on each, and a
device *kind* (``gpu``; on a cluster ``NODE/gpu``: that node's ``NODE/gpu:N``) sums its
devices. What a slot holds is its :meth:`~.records.SlotRecord.holdings`: an asleep server
holds its weights on its host (level 1) and nothing on its GPUs.
"""

from __future__ import annotations

from collections.abc import Callable

from controller.model.devices import key_index
from controller.model.lifecycle import SlotState
from controller.scheduling.eviction import EvictionCandidate, unified
from controller.slots.records import ADMITTED_STATES, SlotRecord

__all__ = ["Surges", "Usage"]

S = SlotState


Surges = dict[str, tuple[tuple[str, int, bool], ...]]


class Usage:
    """Sums and lists over the table's ``records`` and ``surges`` (the same dicts, read)."""

    def __init__(self, records: dict[str, SlotRecord], surges: Surges) -> None:
        self.records = records
        # What a surge's second server holds beside its slot's own, by slot (key, bytes,
        # coming up): the new server while it starts, the old one while it drains after the
        # switch (controller.slots.surge). Counted like any slot's holdings.
        self.surges = surges

    def admitted_bytes(self, device: str) -> int:
        return self.device_bytes(device)[0]

    def reserved_bytes(self, device: str, requester: SlotRecord | None = None) -> int:
        """Admitted to loads still coming up: the probed free memory cannot show them yet."""
        return self.device_bytes(device, requester)[1]

    def device_bytes(self, device: str, requester: SlotRecord | None = None) -> tuple[int, int]:
        """(admitted, reserved) on ``device`` in one pass: the bytes of the slots admitted
        there, and of those among them still coming up (but ``requester``'s). A device
        kind (``gpu``, or ``NODE/gpu``) sums its devices (every GPU, or the node's)."""
        admitted = reserved = 0
        for s in self.records.values():
            if s.state not in ADMITTED_STATES:
                continue
            size, loading = s.bytes_on(device)
            admitted += size
            if loading and s is not requester:
                reserved += size
        prefix = device + ":"
        for held in self.surges.values():
            for key, size, loading in held:
                if key == device or key.startswith(prefix):
                    admitted += size
                    reserved += size if loading else 0
        return admitted, reserved

    def all_device_bytes(self, requester: SlotRecord | None = None) -> dict[str, list[int]]:
        """Every admission key with its [admitted, reserved] bytes, in one pass (the
        placement looks at every GPU of a host at once). A sleeper counts on its host
        only (its weights, level 1); a wake holds its devices again, reserved."""
        out: dict[str, list[int]] = {}
        for s in self.records.values():
            if s.state not in ADMITTED_STATES:
                continue
            mine = s is requester
            for key, size, loading in s.holdings():
                figures = out.setdefault(key, [0, 0])
                figures[0] += size
                if loading and not mine:
                    figures[1] += size
        for held in self.surges.values():
            for key, size, loading in held:
                figures = out.setdefault(key, [0, 0])
                figures[0] += size
                figures[1] += size if loading else 0
        return out

    def cluster_holdings(
        self, requester: SlotRecord, leave_out: set[str]
    ) -> tuple[dict[str, list[int]], dict[str, int], dict[str, dict[str, int]]]:
        """:meth:`all_device_bytes` for ``requester`` and, in the same pass over the
        slots (one, not two, per cluster load decision: issue 39), what the admission's
        cluster view counts of every other slot (``leave_out``: the requester's exclusive-
        group peers, unloaded first): GPU key -> slots placed there, node -> slot -> GPUs."""
        out: dict[str, list[int]] = {}
        holders: dict[str, int] = {}
        units: dict[str, dict[str, int]] = {}
        for s in self.records.values():
            if s.state not in ADMITTED_STATES:
                continue
            mine = s is requester
            for key, size, loading in s.holdings():
                figures = out.setdefault(key, [0, 0])
                figures[0] += size
                if loading and not mine:
                    figures[1] += size
            if mine or s.name in leave_out:
                continue
            for g in s.placement:
                if g.node is not None:
                    key = g.key
                    holders[key] = holders.get(key, 0) + 1
                    on = units.setdefault(g.node, {})
                    on[s.name] = on.get(s.name, 0) + 1
        for name, held in self.surges.items():
            counted = name != requester.name and name not in leave_out
            for key, size, loading in held:
                figures = out.setdefault(key, [0, 0])
                figures[0] += size
                figures[1] += size if loading else 0
                # a surge's second pod holds a GPU (a replica) of its own while both run;
                # a CPU slot's surge holds its node's ``NODE/cpu`` key: no GPU
                node, sep, unit = key.partition("/")
                if counted and sep and key_index(unit) is not None:
                    holders[key] = holders.get(key, 0) + 1
                    on = units.setdefault(node, {})
                    on[name] = on.get(name, 0) + 1
        return out, holders, units

    def all_resident_bytes(self) -> dict[str, int]:
        """:meth:`resident_bytes` of every key and device kind (``gpu``, ``NODE/gpu``) at
        once: one pass over the slots, not one per device (housekeeping's pressure check
        looked at 400 cluster GPUs with a pass over 1,000 slots each, every tick)."""
        out: dict[str, int] = {}
        for key, (admitted, reserved) in self.all_device_bytes().items():
            up = admitted - reserved
            out[key] = out.get(key, 0) + up
            kind, sep, _ = key.rpartition(":")  # gpu:1 -> gpu, NODE/gpu:1 -> NODE/gpu
            if sep:
                out[kind] = out.get(kind, 0) + up
        return out

    def resident_bytes(self, device: str) -> int:
        """Bytes of the servers that are up on ``device`` (what a memory probe can see)."""
        admitted, reserved = self.device_bytes(device)
        return admitted - reserved

    def candidates(
        self, recent_weight: Callable[[SlotRecord], float] | None = None
    ) -> list[EvictionCandidate]:
        """Every slot as the eviction planner sees it (it picks the eligible ones);
        ``recent_weight``: the best class weight among its recent users; a unit's
        members as their unit."""
        # a co-loaded unit is judged, and evicted, as one (controller.scheduling.eviction)
        return unified(
            [
                s.candidate(recent_weight(s) if recent_weight is not None else 0.0)
                for s in self.records.values()
            ]
        )

    def unit_mates(self, slot: SlotRecord) -> list[SlotRecord]:
        """The other members of ``slot``'s co-loaded unit (docs/design/0013)."""
        unit = slot.spec.unit
        if unit is None:
            return []
        return [s for s in self.records.values() if s is not slot and s.spec.unit == unit]

    def group_peers(self, slot: SlotRecord) -> list[SlotRecord]:
        """The members of ``slot``'s exclusive group that hold it (loading or loaded)."""
        group = slot.model.exclusive_group if slot.model else None
        if not group:
            return []
        return [
            s
            for s in self.records.values()
            if s is not slot
            and s.model is not None
            and s.model.exclusive_group == group
            and s.state not in (S.OFFLINE, S.ERROR)
        ]
