"""Leasing one of a model's slots: the candidates tried best first, the first that grants
a lease, the best one's refusal otherwise.

The routed call (:mod:`controller.router.call`) leases through it: :func:`acquire_now`
goes as far as it can without a wait (the common case: a warm slot, no task, no await);
:func:`acquire_rest` goes on from the :class:`Pending` it stopped at (a cold slot's load;
concurrent cold requests join one load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from controller.model.errors import SlotctlError, SlotNotReady
from controller.slots.interfaces import RouterPort
from controller.slots.records import Lease, Requester

__all__ = ["Pending", "acquire", "acquire_now", "acquire_rest"]

_NOT_READY_TRIES: Final = 3  # a slot swapped out between its load and our lease: queue again


@dataclass(slots=True)
class Pending:
    """Where :func:`acquire_now` stopped: candidate ``start`` needs a wait (cold, or not
    ready ``tried`` times already); ``errors`` holds the refusals of those before it."""

    candidates: Sequence[str]
    start: int
    tried: int
    errors: list[SlotctlError]


async def acquire(
    manager: RouterPort, candidates: Sequence[str], who: Requester | None = None
) -> Lease:
    """A lease on the best candidate that grants one; else the best one's refusal."""
    now = acquire_now(manager, candidates, who)
    return now if isinstance(now, Lease) else await acquire_rest(manager, now, who)


def acquire_now(
    manager: RouterPort, candidates: Sequence[str], who: Requester | None = None
) -> Lease | Pending:
    """:func:`acquire` up to the first candidate that needs a wait (none in the router's
    common case: no task, no await); raises the best one's refusal when all refuse."""
    if len(candidates) == 1:  # the common case: one slot serves the model
        try:
            lease = manager.try_acquire(candidates[0], who)
        except SlotNotReady:
            return Pending(candidates, 0, 1, [])  # unloading: queue again (awaited)
        return lease if lease is not None else Pending(candidates, 0, 0, [])
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
