"""Aliases (``[[alias]] id = "chat", models = [...], prefer = ...``): which member model a
request for an alias goes to, and the request as that member's server must see it.

:func:`choose` is pure: ``warm`` takes the first member already resident (dispatchable),
else the first whose load fits without evicting a slot of higher priority than its own,
else the first member (its load says why it waits or is refused); ``first`` always the
first member; ``spread`` the least busy resident slot of any member (requests in flight
but batch holds, plus waiters), else as ``warm``. :func:`resolve` gathers what it needs
from the manager; the routed call (:mod:`controller.router.call`) calls it
(:func:`alias_candidates`) and rewrites the body's ``model`` to the member
(:func:`controller.router.body.with_model`), so the server sees a model it serves and its
answer's ``model`` says which one served it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from controller.access.keys import Principal
from controller.model.errors import ModelNotFound
from controller.model.lifecycle import SlotState
from controller.router.access import model_refused, served_model
from controller.router.adapters import adapter_entries
from controller.router.context import RouterContext
from controller.router.refusals import (
    model_not_found,
    report_refusal,
    wrong_endpoint,
)
from controller.router.selection import fitting, openai_model, served_models, serving
from controller.slots.interfaces import RouterPort
from controller.spec.schema import AliasSpec

__all__ = [
    "Choice",
    "Seat",
    "alias_candidates",
    "choose",
    "model_entries",
    "resolve",
]

_LOADING = frozenset({SlotState.PULLING, SlotState.STARTING, SlotState.WARMING})


@dataclass(frozen=True, slots=True)
class Seat:
    """One slot serving a member model, as the choice sees it."""

    slot: str
    model: str
    warm: bool  # dispatchable now
    busy: int = 0  # requests in flight (batch holds aside) and waiting
    loading: bool = False  # a load is in flight: joining it needs no other load


@dataclass(frozen=True, slots=True)
class Choice:
    """The member chosen and its slots, best first (the lease tries them in order)."""

    model: str
    candidates: list[str]


def choose(prefer: str, seats: Sequence[Seat], fits: Callable[[str], bool]) -> Choice | None:
    """The member and slots a request goes to. ``seats``: every member's slots, members
    in the alias' order, each member's slots best first; ``fits(slot)``: a cold load of
    ``slot`` needs no eviction of a higher-priority slot. None: no member is served."""
    if not seats:
        return None
    members = list(dict.fromkeys(s.model for s in seats))

    def of(model: str) -> list[str]:
        return [s.slot for s in seats if s.model == model]

    if prefer == "first":
        return Choice(members[0], of(members[0]))
    warm = [s for s in seats if s.warm]
    if prefer == "spread" and warm:
        best = min(warm, key=lambda s: s.busy)  # the first of the least busy
        rest = [n for n in of(best.model) if n != best.slot]
        return Choice(best.model, [best.slot, *rest])
    if warm:
        return Choice(warm[0].model, of(warm[0].model))
    for model in members:
        for seat in (s for s in seats if s.model == model):
            if seat.loading or fits(seat.slot):  # that slot first, then its peers
                return Choice(model, [seat.slot, *(n for n in of(model) if n != seat.slot)])
    return Choice(members[0], of(members[0]))


def _fits(manager: RouterPort, slot: str) -> bool:
    """The manager's load decision for ``slot`` admits it, evicting nothing of a higher
    priority than the slot's own."""
    spec = manager.known(slot)
    if spec is None:
        return False
    decision = manager.decide(slot)
    return decision.ok and all(v.priority <= spec.priority for v in decision.victims)


def resolve(
    manager: RouterPort,
    alias: AliasSpec,
    allowed: Callable[[str], bool] | None = None,
    endpoint: str | None = None,
) -> Choice | None:
    """:func:`choose` over the alias' members a request may use (``allowed``) whose slots
    serve ``endpoint``; None when none is left."""
    seats: list[Seat] = []
    for member in alias.models:
        if allowed is not None and not allowed(member):
            continue
        names = serving(manager, member)
        if allowed is not None:  # on the model each slot serves (a member may be a slot's name)
            names = [n for n in names if allowed(served_model(manager, n))]
        if endpoint is not None:
            names, _ = fitting(manager, names, endpoint)
        for name in names:
            view = manager.view(name)
            busy = view.leases - view.holds + view.waiters
            loading = view.state in _LOADING
            seats.append(Seat(name, member, view.dispatchable, busy, loading))
    return choose(alias.prefer, seats, lambda slot: _fits(manager, slot))


def alias_candidates(
    ctx: RouterContext, principal: Principal | None, alias: AliasSpec, endpoint: str | None
) -> tuple[str, list[str]]:
    """The member a request of ``principal`` for ``alias`` goes to and its slots, or the
    refusal: 403 for a key that may not use the alias (or any member), 400 where no
    member's slots serve ``endpoint``, 404 where no member is served."""
    allowed: Callable[[str], bool] | None = None
    if principal is not None and principal.models:
        if not principal.may_use(alias.id):
            raise model_refused(principal, alias.id)
        allowed = principal.may_use
        if not any(allowed(m) for m in alias.models):
            raise model_refused(principal, alias.models[0])
    choice = resolve(ctx.manager, alias, allowed, endpoint)
    if choice is None and principal is not None and allowed is not None:
        unfiltered = resolve(ctx.manager, alias, None, endpoint)
        if unfiltered is not None:  # served, but only by slots whose model the key may not use
            model = served_model(ctx.manager, unfiltered.candidates[0])
            raise model_refused(principal, model, alias.id)
    if choice is None:
        served = resolve(ctx.manager, alias, allowed) if endpoint is not None else None
        if endpoint is not None and served is not None:
            spec = ctx.manager.known(served.candidates[0])
            raise wrong_endpoint(alias.id, endpoint, spec.type if spec is not None else "")
        report_refusal(ctx, ModelNotFound(alias.id), alias.id)
        raise model_not_found(alias.id)
    return choice.model, choice.candidates


def model_entries(manager: RouterPort, principal: Principal | None = None) -> list[dict[str, Any]]:
    """``GET /v1/models``' ``data``: the models served, then the aliases with a member
    served (``alias: true``, ``members``: the models it names), as the key may use them."""
    served = served_models(manager, principal)
    out = [openai_model(m, kind) for m, kind in served.items()]
    for alias in manager.aliases.values():
        if alias.id in served or (principal is not None and not principal.may_use(alias.id)):
            continue
        kinds = [served[m] for m in alias.models if m in served]
        if kinds:
            entry = openai_model(alias.id, kinds[0])
            entry.update(alias=True, members=list(alias.models), prefer=alias.prefer)
            out.append(entry)
    return out + adapter_entries(manager, served, principal)
