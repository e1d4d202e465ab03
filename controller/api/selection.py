"""Which slots serve a model, best first: the one ranking the router and the REST routes use.

SPEC §1's selection ranking (:func:`controller.lifecycle.rank_candidates`: dispatchable
first; ties by priority, most recent use, name) over the views the manager gives, so
``POST /api/models/{id}/load`` picks the slot a request for that model would get.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Final

from controller.lifecycle import Candidate, rank_candidates
from controller.slots import SlotView
from controller.slots.ports import RouterPort

__all__ = ["openai_model", "ranked", "served_ids", "serving"]

_CREATED: Final = int(time.time())  # the ``created`` of every model in /v1/models


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
    candidates = manager.routable(model)
    if len(candidates) == 1:  # the common case: nothing to rank
        return [candidates[0].name]
    return [c.name for c in rank_candidates(candidates)]


def served_ids(manager: RouterPort) -> list[str]:
    """What ``model`` may name: catalogue models with an activated slot, in catalogue
    order, then the model-less (self-managed) activated slots by name."""
    served: set[str] = set()
    modelless: list[str] = []
    for view in manager.views():
        spec = manager.known(view.name)
        if spec is None or not spec.activated:
            continue
        if view.model_id:
            served.add(view.model_id)
        else:
            modelless.append(view.name)
    return [m for m in manager.models if m in served] + [
        n for n in modelless if n not in manager.models
    ]


def openai_model(model_id: str) -> dict[str, Any]:
    """One entry of ``GET /v1/models`` (OpenAI's model object)."""
    return {"id": model_id, "object": "model", "created": _CREATED, "owned_by": "slotctl"}
