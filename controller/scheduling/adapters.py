"""Adapter residency inside one slot, decided (pure: data in, a decision out).

A slot whose server loads LoRA adapters at run time holds at most ``capacity`` of them
(its ``max_loras``). :func:`decide_adapter` says whether a wanted adapter can be made
resident and which resident ones go first: evicted by priority (lowest first), then least
recently used; a pinned adapter never, one with requests in flight never. When nothing
can go the answer is a refusal the router turns into a 503 with Retry-After: the request
is never answered by the base model or another adapter instead.

:func:`adapter_reserve` is what a slot's admission counts for its adapters: the bytes of
the ``capacity`` largest adapters it may hold, so loading any of them never takes device
memory the slot was not admitted with. :func:`evictable` orders the candidates (also the
order of an explicit ``slotctl adapter unload --idle``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "RETRY_AFTER_S",
    "AdapterDecision",
    "AdapterSeat",
    "Resident",
    "adapter_reserve",
    "decide_adapter",
    "evictable",
    "rank_adapter_slots",
]

RETRY_AFTER_S: Final = 1  # a wanted adapter with no room: ask again this soon


@dataclass(frozen=True, slots=True)
class Resident:
    """One adapter held by a slot's server, as the decision sees it."""

    id: str
    priority: int = 50
    pinned: bool = False
    in_flight: int = 0  # requests using it now
    last_used: float = 0.0  # monotonic
    loading: bool = False  # its load is in progress: it stays


@dataclass(frozen=True, slots=True)
class AdapterDecision:
    """``ok``: the wanted adapter can be resident after unloading ``victims`` (in order);
    else ``reason`` says why not (``retry_after_s``: when asking again may succeed)."""

    ok: bool
    victims: tuple[str, ...] = ()
    resident: bool = False  # already held: nothing to do
    reason: str = ""
    retry_after_s: int = 0


def evictable(residents: Iterable[Resident]) -> list[Resident]:
    """The residents that may go, the first to go first: neither pinned nor in use,
    lowest priority, then least recently used (then by id, so the order is total)."""
    free = [r for r in residents if not r.pinned and r.in_flight == 0 and not r.loading]
    return sorted(free, key=lambda r: (r.priority, r.last_used, r.id))


def decide_adapter(want: str, residents: Sequence[Resident], capacity: int) -> AdapterDecision:
    """Can ``want`` be resident in a slot holding ``residents`` with room for
    ``capacity`` adapters? (See the module docstring.)"""
    if any(r.id == want for r in residents):
        return AdapterDecision(ok=True, resident=True)
    if capacity <= 0:
        return AdapterDecision(ok=False, reason="the slot holds no adapters (max_loras = 0)")
    over = len(residents) + 1 - capacity
    if over <= 0:
        return AdapterDecision(ok=True)
    free = evictable(residents)
    if len(free) < over:
        held = sorted(r.id for r in residents)
        pinned = sum(1 for r in residents if r.pinned)
        loading = sum(1 for r in residents if r.loading and not r.pinned)
        busy = sum(1 for r in residents if r.in_flight and not r.pinned and not r.loading)
        return AdapterDecision(
            ok=False,
            reason=(
                f"all {capacity} adapter places are taken ({', '.join(held)}: {pinned} pinned, "
                f"{busy} with requests in flight, {loading} loading)"
            ),
            retry_after_s=RETRY_AFTER_S,
        )
    return AdapterDecision(ok=True, victims=tuple(r.id for r in free[:over]))


@dataclass(frozen=True, slots=True)
class AdapterSeat:
    """A slot that can serve a wanted adapter, as the routing order sees it."""

    slot: str
    holds: bool  # the adapter is resident (or loading) in its server
    ready: bool  # its server is up (dispatchable)
    saturated: bool  # at its max_concurrency: a request would wait for a turn


def rank_adapter_slots(seats: Sequence[AdapterSeat]) -> list[str]:
    """The slots in the order a request tries them (Ray Serve's rule): one holding the
    adapter, unless it is saturated; then a ready one (it loads the adapter); then the
    saturated holders, the saturated ready ones; then the cold ones (a slot load first).
    Ties keep the given order."""

    def rank(seat: AdapterSeat) -> int:
        if not seat.ready:
            return 4
        if seat.saturated:
            return 2 if seat.holds else 3
        return 0 if seat.holds else 1

    return [s.slot for s in sorted(seats, key=rank)]


def adapter_reserve(capacity: int, sizes: Iterable[int]) -> int:
    """The bytes a slot holding up to ``capacity`` adapters of ``sizes`` may use for them:
    the sum of the ``capacity`` largest."""
    if capacity <= 0:
        return 0
    return sum(sorted(sizes, reverse=True)[:capacity])
