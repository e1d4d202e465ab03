"""Which of a slot's replicas serves a request: the routing function. Pure (no I/O, no
clock): the same inputs give the same order.

Three policies (a slot's ``routing``, docs/replicas.md):

``prefix`` (the default)
    Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018; what
    KubeAI's ``PrefixHash`` does for its replicas): the request's *prefix key*
    (:func:`prefix_key`: the model, the system prompt and the first message of the
    conversation) is hashed onto a ring of the replicas' virtual points, and the first
    replica clockwise whose in-flight count is under the bound takes it. The bound is
    ``ceil(load_factor x (in-flight of all + 1) / replicas)``: the mean with this request
    counted, times the factor, so some replica is always under it (the least loaded one
    is). Every later turn of a conversation starts with the same system prompt and first
    message, so it lands on the replica whose prefix cache holds it, without a cookie,
    for as long as that replica is not loaded past the bound.
``least-loaded``
    The replica with the fewest requests in flight (then the ring's order).
``round-robin``
    Each request the next replica (``turn``: a counter the caller keeps per slot).

Warm replicas (up and serving) come before cold ones in every policy: a cold replica is
one the demand scaler is bringing up, or one that has to load; a request waits for a
load only when no replica is warm. The result is every replica, best first: the leasing
tries them in that order (:mod:`controller.router.leasing`).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

__all__ = [
    "DEFAULT_LOAD_FACTOR",
    "PREFIX_CHARS",
    "VNODES",
    "ReplicaLoad",
    "bound",
    "prefix_key",
    "rank_replicas",
]

DEFAULT_LOAD_FACTOR: Final = 1.25
VNODES: Final = 64  # virtual points per replica on the ring (an even spread of keys)
PREFIX_CHARS: Final = 2048  # characters of each part of the prefix that count


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica as the routing sees it: its requests in flight and whether it serves
    now (``warm``) or has to load first."""

    name: str
    in_flight: int = 0
    warm: bool = True


def _hash(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=256)
def _ring(names: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ring of ``names`` (sorted): each replica's :data:`VNODES` points, in order."""
    points = sorted((_hash(f"{name}#{v}"), name) for name in names for v in range(VNODES))
    return tuple(p for p, _ in points), tuple(n for _, n in points)


def ring_order(names: Sequence[str], key: str) -> list[str]:
    """``names`` in the order the ring meets them clockwise from ``key``'s point."""
    points, owners = _ring(tuple(sorted(set(names))))
    if not points:
        return []
    start = bisect_left(points, _hash(key))
    seen: dict[str, None] = {}
    wanted = len(set(names))
    for i in range(len(points)):
        owner = owners[(start + i) % len(points)]
        if owner not in seen:
            seen[owner] = None
            if len(seen) == wanted:
                break
    return list(seen)


def bound(loads: Sequence[ReplicaLoad], load_factor: float = DEFAULT_LOAD_FACTOR) -> int:
    """The in-flight count a replica must be *under* to take one more request:
    ``ceil(load_factor x (total + 1) / n)`` (at least 1)."""
    if not loads:
        return 1
    total = sum(r.in_flight for r in loads) + 1
    return max(1, math.ceil(load_factor * total / len(loads) - 1e-9))


def rank_replicas(
    loads: Sequence[ReplicaLoad],
    key: str,
    *,
    routing: str = "prefix",
    load_factor: float = DEFAULT_LOAD_FACTOR,
    turn: int = 0,
) -> list[str]:
    """Every replica of ``loads``, best first, by ``routing`` (see the module docstring):
    the warm ones first, then the cold ones."""
    warm = [r for r in loads if r.warm]
    cold = [r for r in loads if not r.warm]
    return _rank(warm, key, routing, load_factor, turn) + _rank(
        cold, key, routing, load_factor, turn
    )


def _rank(
    loads: Sequence[ReplicaLoad], key: str, routing: str, load_factor: float, turn: int
) -> list[str]:
    if not loads:
        return []
    by_name = {r.name: r for r in loads}
    ring = ring_order(list(by_name), key)
    place = {name: i for i, name in enumerate(ring)}
    if routing == "round-robin":
        names = sorted(by_name)
        at = turn % len(names)
        return names[at:] + names[:at]
    if routing == "least-loaded":
        return sorted(by_name, key=lambda n: (by_name[n].in_flight, place[n]))
    cap = bound(loads, load_factor)
    under = [n for n in ring if by_name[n].in_flight < cap]
    over = sorted(
        (n for n in ring if by_name[n].in_flight >= cap),
        key=lambda n: (
            by_name[n].in_flight,
            place[n],
        ),
    )
    if not under:  # (cannot happen: the least loaded is always under the bound)
        return over
    rest = sorted(under[1:], key=lambda n: (by_name[n].in_flight, place[n]))
    return [under[0], *rest, *over]


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content[:PREFIX_CHARS]
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return "".join(p for p in parts if isinstance(p, str))[:PREFIX_CHARS]
    return ""


def prefix_key(body: Mapping[str, Any], model: str = "") -> str:
    """What a request's prompt starts with, as the routing hashes it: the model (an
    adapter is a model id of its own), the system (and developer) prompt, and the first
    other message of a chat; the first :data:`PREFIX_CHARS` of a completion's prompt
    or an embedding's input; a Responses request's instructions and first input."""
    parts: list[str] = [model]
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            parts.append(_text(message.get("content")))
            if message.get("role") not in ("system", "developer"):
                break  # the first message of the conversation itself
        return "\x1f".join(parts)
    if isinstance(body.get("instructions"), str):
        parts.append(body["instructions"][:PREFIX_CHARS])
    for field in ("prompt", "input"):
        value = body.get(field)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            parts.append(value[:PREFIX_CHARS])
            break
        if isinstance(value, Mapping):
            parts.append(_text(value.get("content")))
            break
    return "\x1f".join(parts)
