"""The slot lifecycle: states, the legal-transition table, dispatchability and ranking.

Pure module: the single definition every other layer (slot manager, router, admission,
metrics, views) uses. Only the slot manager *applies* transitions; it calls
:func:`check_transition` before every change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from controller.model.errors import IllegalSlotTransition

__all__ = [
    "DISPATCHABLE_STATES",
    "LEGAL_TRANSITIONS",
    "Candidate",
    "IdleReason",
    "SlotState",
    "can_dispatch",
    "check_transition",
    "describe",
    "is_legal",
    "legal_path",
    "rank_candidates",
    "selection_key",
    "selection_rank",
]


class SlotState(StrEnum):
    OFFLINE = "offline"
    PULLING = "pulling"
    STARTING = "starting"
    WARMING = "warming"
    READY = "ready"
    SERVING = "serving"
    IDLE = "idle"
    UNLOADING = "unloading"
    ERROR = "error"


class IdleReason(StrEnum):
    """Why a slot is ``idle``: both render as ``idle``; the record's ``extra`` says which."""

    NO_MODEL = "no_model"  # warming -> idle: server up, /v1/models empty. Not dispatchable.
    TIMEOUT = "timeout"  # ready -> idle: no request for idle_timeout_s. Dispatchable.
    # The residency tier below ``idle`` (issue 22): the server runs but sleeps (its weights
    # in host memory, or dropped), its device memory released. Not dispatchable: a request
    # wakes it first (``idle -> ready``). The record's ``extra.residency`` says more.
    ASLEEP = "asleep"


_NOT_SERVING: Final = frozenset({IdleReason.NO_MODEL, IdleReason.ASLEEP})


S = SlotState

# What each state means for a person (``slotctl slot get``): whether the server is up, and
# what to expect of a request now.
_MEANINGS: Final[Mapping[str, tuple[str, str]]] = MappingProxyType(
    {
        "offline": ("down", "not running; a request for its model loads it (cold start)"),
        "pulling": ("down", "fetching the model file or image; the server is not started"),
        "starting": ("starting", "the server is starting; requests wait for it"),
        "warming": ("up", "the server is up, loading its model; requests wait for it"),
        "ready": ("up", "loaded and serving"),
        "serving": ("up", "loaded, with requests in flight"),
        "idle": (
            "up",
            "loaded and serving, no request for idle_timeout_s: nothing was unloaded "
            "(ttl_s or an eviction unloads it)",
        ),
        "idle/no_model": ("up", "the server is up but lists no model: not dispatchable"),
        "idle/asleep": (
            "asleep",
            "the server sleeps, its device memory released: a request wakes it (a fraction "
            "of a cold start)",
        ),
        "unloading": ("stopping", "draining its requests, then stopping the server"),
        "error": ("down", "failed: see message and `slotctl slot logs`"),
    }
)


def describe(state: str, idle_reason: str | None = None) -> tuple[str, str]:
    """``(server, meaning)`` of a state: ``up``, ``down``, ``starting``, ``stopping`` or
    ``asleep``, and one sentence of what it means (an unknown state: ``unknown``)."""
    key = f"{state}/{idle_reason}" if state == "idle" and idle_reason in _NOT_SERVING else state
    return _MEANINGS.get(key, ("unknown", f"unknown state {state!r}"))


LEGAL_TRANSITIONS: Final[Mapping[SlotState, frozenset[SlotState]]] = MappingProxyType(
    {
        S.OFFLINE: frozenset({S.PULLING, S.STARTING}),
        S.PULLING: frozenset({S.STARTING, S.ERROR, S.OFFLINE}),
        S.STARTING: frozenset({S.WARMING, S.ERROR, S.OFFLINE}),
        S.WARMING: frozenset({S.READY, S.IDLE, S.ERROR, S.OFFLINE}),
        S.READY: frozenset({S.SERVING, S.IDLE, S.UNLOADING, S.ERROR}),
        S.SERVING: frozenset({S.READY, S.IDLE, S.ERROR}),
        S.IDLE: frozenset({S.SERVING, S.UNLOADING, S.READY}),
        S.UNLOADING: frozenset({S.OFFLINE, S.ERROR}),
        # Re-loadable from error, subject to the crash-loop breaker (enforced by the manager).
        S.ERROR: frozenset({S.OFFLINE, S.PULLING, S.STARTING}),
    }
)

DISPATCHABLE_STATES: Final[frozenset[SlotState]] = frozenset({S.READY, S.SERVING, S.IDLE})

# Selection ranking tiers, best first. Anything not listed (unknown) ranks with ERROR.
_TIERS: Final[tuple[frozenset[SlotState], ...]] = (
    DISPATCHABLE_STATES,
    frozenset({S.WARMING, S.STARTING, S.PULLING}),
    frozenset({S.OFFLINE, S.UNLOADING}),
    frozenset({S.ERROR}),
)


def is_legal(current: SlotState, target: SlotState) -> bool:
    return target in LEGAL_TRANSITIONS[current]


def check_transition(current: SlotState, target: SlotState) -> None:
    """Raise :class:`IllegalSlotTransition` unless ``current -> target`` is in the table."""
    if is_legal(current, target):
        return
    legal = sorted(s.value for s in LEGAL_TRANSITIONS[current])
    raise IllegalSlotTransition(
        f"illegal slot transition {current.value} -> {target.value}; "
        f"from {current.value} the legal next states are: {', '.join(legal)}",
        from_state=current.value,
        to_state=target.value,
        legal=legal,
    )


def legal_path(start: SlotState, target: SlotState) -> list[SlotState]:
    """Shortest sequence of legal transitions from ``start`` to ``target`` (BFS)."""
    if start is target:
        return []
    frontier: deque[list[SlotState]] = deque([[start]])
    seen = {start}
    while frontier:
        path = frontier.popleft()
        for nxt in sorted(LEGAL_TRANSITIONS[path[-1]]):
            if nxt in seen:
                continue
            if nxt is target:
                return [*path[1:], nxt]
            seen.add(nxt)
            frontier.append([*path, nxt])
    raise ValueError(f"no legal path from {start} to {target}")


def can_dispatch(state: SlotState | str, idle_reason: str | None = None) -> bool:
    """True when a request can be sent to the slot now.

    The one place the ``idle`` exceptions live: an idle slot whose server came up without
    a model, or that sleeps (the residency tier), is not dispatchable; an idle slot that
    merely timed out is.
    """
    if state not in DISPATCHABLE_STATES:
        return False
    return not (state == S.IDLE and idle_reason in _NOT_SERVING)


def selection_rank(state: SlotState | str, idle_reason: str | None = None) -> int:
    """Tier of a state in the selection ranking: 0 is best; unknown states rank as error."""
    if state in DISPATCHABLE_STATES and not can_dispatch(state, idle_reason):
        # Up, but without a model (or asleep): it has to (re)load before it serves.
        return 1
    for tier, members in enumerate(_TIERS):
        if state in members:
            return tier
    return len(_TIERS) - 1


def selection_key(state: SlotState | str, idle_reason: str | None = None) -> tuple[int, int]:
    """The ranking's key for a state: its tier, then its place inside the tier. An asleep
    slot is in the tier of the slots that still have to load, and first there: a wake
    takes a fraction of a cold load (so: after every dispatchable slot, before
    ``warming``)."""
    asleep = state == S.IDLE and idle_reason == IdleReason.ASLEEP
    return (selection_rank(state, idle_reason), 0 if asleep else 1)


@dataclass(frozen=True, slots=True)
class Candidate:
    """What ranking needs to know about one slot bound to the requested model."""

    name: str
    state: SlotState | str
    priority: int = 50
    last_used: float = 0.0  # monotonic or wall time; larger is more recent
    idle_reason: str | None = None


def rank_candidates(candidates: Iterable[Candidate]) -> Sequence[Candidate]:
    """Best first: state tier (an asleep slot first among those that have to load), then
    higher priority, then most recently used, then name."""
    return sorted(
        candidates,
        key=lambda c: (selection_key(c.state, c.idle_reason), -c.priority, -c.last_used, c.name),
    )
