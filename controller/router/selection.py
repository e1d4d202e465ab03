"""Which slots serve a model, best first: the one ranking the router and the REST routes use.

SPEC §1's selection ranking (:func:`controller.model.lifecycle.rank_candidates`: dispatchable
first; ties by priority, most recent use, name) over the views the manager gives, so
``POST /api/models/{id}/load`` picks the slot a request for that model would get.

And what a slot is for: its ``type`` says which OpenAI endpoints it serves
(:data:`~controller.router.endpoints.SERVES`); the routed call keeps only the candidates
whose type serves the request's endpoint (:func:`fitting`) before anything is leased or
loaded, and ``/v1/models`` says it of every model (:func:`openai_model`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

from controller.access.keys import Principal
from controller.model.lifecycle import Candidate, rank_candidates
from controller.router.endpoints import SERVES, paths_serving
from controller.slots.interfaces import RouterPort
from controller.slots.records import SlotView

__all__ = [
    "fitting",
    "openai_model",
    "ranked",
    "route",
    "served_ids",
    "served_models",
    "serving",
]

_CREATED: Final = int(time.time())  # the ``created`` of every model in /v1/models
_NONE: Final[frozenset[str]] = frozenset()


def fitting(manager: RouterPort, names: Sequence[str], endpoint: str) -> tuple[list[str], str]:
    """``names`` (best first) whose slot type serves ``endpoint``, and the type of the
    first that does not (empty when all do): the caller refuses when none is left."""
    kept: list[str] = []
    refused = ""
    for name in names:
        spec = manager.known(name)
        if spec is None or endpoint in SERVES.get(spec.type, _NONE):
            kept.append(name)  # (None: removed meanwhile; its lease says so)
        elif not refused:
            refused = spec.type
    return kept, refused


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
    names = manager.routes(model)
    if len(names) < 2:  # the common case: nothing to rank
        return list(names)
    return [c.name for c in rank_candidates(manager.routable(model))]


# route()'s answers for a model served by one slot, by (model, endpoint): the table's
# names (the same tuple until what the model names changes), those that serve the
# endpoint, the refused type.
_ONE: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...], str]] = {}
_ONE_MAX: Final = 4096


def route(
    manager: RouterPort, model: str, endpoint: str
) -> tuple[Sequence[str], Sequence[str], str]:
    """:func:`serving` and :func:`fitting` of ``model`` for ``endpoint``: the slots serving
    it best first, those of a type that serves ``endpoint``, and the type of the first that
    does not ("" when all do). Asked for every request: a model served by one slot (nothing
    to rank) is answered from what was found for the same names (the table's tuple, new
    when a binding changes) without looking at the slot again."""
    names = manager.routes(model)
    if len(names) != 1:
        ranked = serving(manager, model)
        kept, refused = fitting(manager, ranked, endpoint)
        return ranked, kept, refused
    key = (model, endpoint)
    found = _ONE.get(key)
    if found is None or found[0] is not names:
        kept, refused = fitting(manager, names, endpoint)
        if len(_ONE) >= _ONE_MAX:
            _ONE.clear()
        found = _ONE[key] = (names, tuple(kept), refused)
    return found


def served_models(manager: RouterPort, principal: Principal | None = None) -> dict[str, str]:
    """What ``model`` may name, with the slot type that serves it: catalogue models with
    an activated slot, in catalogue order, then the model-less (self-managed) activated
    slots by name. A model bound by slots of several types takes the first one's. With a
    ``principal``: only the models its key may use."""
    served: dict[str, str] = {}
    modelless: dict[str, str] = {}
    for view in manager.views():
        spec = manager.known(view.name)
        if spec is None or not spec.activated:
            continue
        if view.model_id:
            served.setdefault(view.model_id, spec.type)
        else:
            modelless[view.name] = spec.type
    out = {m: served[m] for m in manager.models if m in served}
    out.update((n, t) for n, t in modelless.items() if n not in manager.models)
    if principal is not None and principal.models:
        return {m: t for m, t in out.items() if principal.may_use(m)}
    return out


def served_ids(manager: RouterPort) -> list[str]:
    """The ids of :func:`served_models`."""
    return list(served_models(manager))


def openai_model(model_id: str, slot_type: str) -> dict[str, Any]:
    """One entry of ``GET /v1/models``: OpenAI's model object, and what the model is for
    (as LM Studio's ``type`` and Ollama's ``capabilities`` say it): its slot ``type`` and
    the endpoints that serve it (other ``/v1/audio/`` routes pass to a speech slot too)."""
    endpoints = paths_serving(slot_type)
    return {
        "id": model_id,
        "object": "model",
        "created": _CREATED,
        "owned_by": "slotctl",
        "type": slot_type,
        "endpoints": endpoints,
    }
