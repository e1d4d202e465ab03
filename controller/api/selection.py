"""Which slots serve a model, best first: the one ranking the router and the REST routes use.

SPEC §1's selection ranking (:func:`controller.lifecycle.rank_candidates`: dispatchable
first; ties by priority, most recent use, name) over the views the manager gives, so
``POST /api/models/{id}/load`` picks the slot a request for that model would get.
"""

from __future__ import annotations

from collections.abc import Iterable

from controller.lifecycle import Candidate, rank_candidates
from controller.slots import SlotView
from controller.slots.ports import RouterPort

__all__ = ["ranked", "serving"]


def ranked(manager: RouterPort, views: Iterable[SlotView]) -> list[SlotView]:
    """``views`` best first."""
    by_name = {v.name: v for v in views}
    order = rank_candidates(
        Candidate(v.name, v.state, v.priority, manager.last_used(v.name), v.idle_reason)
        for v in by_name.values()
    )
    return [by_name[c.name] for c in order]


def serving(manager: RouterPort, model: str) -> list[str]:
    """The names of the activated slots serving ``model``, best first.

    ``model`` names, in this order of precedence: a catalogue model (the slots bound to
    it), a slot by its name (a self-managed speech server has no catalogue model), or a
    self-managed provider (its model-less slots). Built without a view per slot: the
    router asks this once per request.
    """
    return [c.name for c in rank_candidates(manager.routable(model))]
