"""Each flow's share of a slot's line: who gets a place when the line is full. Pure.

A slot's ``max_queue`` bounds the requests waiting for it (its load, or a turn at its
``max_concurrency``). The fair queue (:mod:`.fairqueue`) decides the order in which they
are served; this decides *admission* to the line, per flow (an API key, by its id: the
API token is one flow). Without it one key's flood fills the line and every other key's
first request is refused ``slot.queue_full`` for as long as the flood lasts — the turn
order is fair, the door is not.

The rule (Kubernetes API Priority and Fairness bounds each flow's queue length for the
same reason; a full line here pushes out instead of refusing the newcomer): while the
line has room, everyone gets in; once it is full, a newcomer whose flow holds at least
two fewer places than the largest flow takes the place of **that flow's newest waiter**,
which is refused ``slot.queue_full`` instead; otherwise the newcomer is refused. So every
flow holds about ``max_queue / flows`` places under a flood, a flow's first request
always gets in while any flow holds two or more, and two flows of equal size never push
each other out (no churn). Ties among the largest flows go to the one named first (a
stable choice, not a preference).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Place", "place_for"]


@dataclass(frozen=True, slots=True)
class Place:
    """The answer for a newcomer: ``admitted``, and when it takes another flow's place,
    that flow (``evict``: its newest waiter is refused in its stead)."""

    admitted: bool
    evict: str | None = None


def place_for(holding: Mapping[str, int], flow: str, capacity: int) -> Place:
    """Whether a newcomer of ``flow`` gets a place in a line of ``capacity`` whose flows
    hold ``holding`` places now (see the module docstring)."""
    total = sum(holding.values())
    if total < capacity:
        return Place(True)
    if capacity <= 0 or not holding:
        return Place(False)
    largest = max(sorted(holding), key=lambda f: holding[f])
    if holding[largest] >= holding.get(flow, 0) + 2:
        return Place(True, largest)
    return Place(False)
