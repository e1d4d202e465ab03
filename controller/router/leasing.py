"""Leasing a slot for a routed request: the model's candidates (best first, of a type that
serves the endpoint), the first that grants a lease, the refusal otherwise.

Both router paths lease here. :func:`lease_now` goes as far as it can without a wait (the
common case: a warm slot, no task, no await); :func:`lease_rest` goes on from the
:class:`Pending` it stopped at (a cold slot's load; concurrent cold requests join one load).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from controller.model.errors import ModelNotFound, SlotctlError, SlotNotReady
from controller.router.access import model_refused
from controller.router.aliases import alias_candidates
from controller.router.context import Call, RouterContext
from controller.router.refusals import (
    model_not_found,
    report_refusal,
    slot_refusal,
    wrong_endpoint,
)
from controller.router.selection import fitting, serving
from controller.slots.interfaces import RouterPort
from controller.slots.records import Lease, Requester

__all__ = [
    "Pending",
    "acquire",
    "acquire_now",
    "acquire_rest",
    "lease_model",
    "lease_now",
    "lease_rest",
]

_NOT_READY_TRIES: Final = 3  # a slot swapped out between its load and our lease: queue again


@dataclass(slots=True)
class Pending:
    """Where :func:`acquire_now` stopped: candidate ``start`` needs a wait (cold, or not
    ready ``tried`` times already); ``errors`` holds the refusals of those before it."""

    candidates: list[str]
    start: int
    tried: int
    errors: list[SlotctlError]


async def acquire(
    manager: RouterPort, candidates: list[str], who: Requester | None = None
) -> Lease:
    """A lease on the best candidate that grants one; else the best one's refusal."""
    now = acquire_now(manager, candidates, who)
    return now if isinstance(now, Lease) else await acquire_rest(manager, now, who)


def acquire_now(
    manager: RouterPort, candidates: list[str], who: Requester | None = None
) -> Lease | Pending:
    """:func:`acquire` up to the first candidate that needs a wait (none in the router's
    common case: no task, no await); raises the best one's refusal when all refuse."""
    errors: list[SlotctlError] = []
    for i, name in enumerate(candidates):
        try:
            lease = manager.try_acquire(name, who)
        except SlotNotReady:
            return Pending(candidates, i, 1, errors)  # unloading: queue again (awaited)
        except SlotctlError as exc:
            errors.append(exc)
            continue
        return lease if lease is not None else Pending(candidates, i, 0, errors)
    raise errors[0]


async def acquire_rest(
    manager: RouterPort, pending: Pending, who: Requester | None = None
) -> Lease:
    """:func:`acquire` from where :func:`acquire_now` stopped."""
    errors, tried = pending.errors, pending.tried
    for name in pending.candidates[pending.start :]:
        try:
            return await _acquire_one(manager, name, who, tried)
        except SlotctlError as exc:
            errors.append(exc)
        tried = 0
    raise errors[0]


async def _acquire_one(
    manager: RouterPort, name: str, who: Requester | None, tried: int = 0
) -> Lease:
    attempt = tried + 1
    while True:
        try:
            return await manager.acquire(name, who)
        except SlotNotReady:
            # Unloading (an exclusive peer's swap, an eviction) or a superseded load just
            # before our turn: queue again (bounded) rather than answer 503 at once.
            if attempt >= _NOT_READY_TRIES:
                raise
            attempt += 1


async def lease_model(ctx: RouterContext, call: Call, model: str, endpoint: str | None) -> Lease:
    """A lease on the best activated slot serving ``model`` whose type serves
    ``endpoint`` (:func:`~controller.router.selection.endpoint_of`; ``call`` records the
    model and the slot); else the refusal, reported once. Both router paths lease
    through it (the data plane in its two steps)."""
    now = lease_now(ctx, call, model, endpoint)
    return now if isinstance(now, Lease) else await lease_rest(ctx, call, now)


def lease_now(ctx: RouterContext, call: Call, model: str, endpoint: str | None) -> Lease | Pending:
    """:func:`lease_model` without a wait: the lease, or where it has to wait
    (:func:`lease_rest` goes on from there). A model whose slots' type does not serve
    ``endpoint`` is refused here, before anything is leased or loaded (400)."""
    manager = ctx.manager
    alias = manager.aliases.get(model) if manager.aliases else None
    if alias is not None and model not in manager.models:  # (a model's id wins)
        model, candidates = alias_candidates(ctx, call, alias, endpoint)
    else:
        candidates = serving(manager, model)
    principal = call.principal
    if principal is not None and not principal.may_use(model):
        raise model_refused(principal, model)
    if not candidates:
        report_refusal(ctx, ModelNotFound(model), model)
        raise model_not_found(model)
    call.model = model
    if endpoint is not None:
        candidates, refused = fitting(manager, candidates, endpoint)
        if not candidates:
            raise wrong_endpoint(model, endpoint, refused)
    if principal is not None:
        limited = ctx.limits.admit(principal, time.monotonic())
        if limited is not None:
            raise slot_refusal(limited)
        call.counted = True
        if principal.name:  # a key's call: its answer's usage counts for it
            call.tail = bytearray()
    try:
        now = acquire_now(manager, candidates, call.who)
    except SlotctlError as exc:
        report_refusal(ctx, exc, model)
        raise slot_refusal(exc) from None
    if isinstance(now, Lease):
        call.lease, call.slot = now, now.slot
    return now


async def lease_rest(ctx: RouterContext, call: Call, pending: Pending) -> Lease:
    began = time.monotonic()
    try:
        lease = await acquire_rest(ctx.manager, pending, call.who)
    except SlotctlError as exc:
        report_refusal(ctx, exc, call.model)
        raise slot_refusal(exc) from None
    finally:
        call.waited = time.monotonic() - began
    call.lease, call.slot = lease, lease.slot
    return lease
