"""Co-loaded units as the eviction planner sees them. Pure.

A unit's members (slots whose ``unit`` is the same, docs/design/0013) are evicted together
or not at all, so the planner judges each member as the unit: its priority the highest
member's, its last use the latest member's, pinned when a member is, busy or leased when a
member is (:func:`unified`; the manager's table hands out candidates this way). A member is
never the victim of a load of its own unit (:func:`without_unit`), and a victim that is a
member takes its mates with it (the manager evicts them right after it: the slot manager's
``Unloading.evict_mates``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from controller.eviction import EvictionCandidate

__all__ = ["unified", "without_unit"]


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
