"""Events as data: every transition, refusal and eviction, and its one text form.

The slot manager emits them on the event bus (:mod:`controller.kit.eventbus`: ids, the
replay buffers, subscriptions, one structured log line each); the event stream (SSE),
metrics and ``--wait`` progress consume. For people, :func:`event_line` is the one text form of an
event: ``slotctl up`` prints it, and so do ``slotctl events`` (from the wire form,
:meth:`Event.from_dict`) and the progress of ``slotctl stack apply --once|--wait``.

The lease flips of every request (``ready -> serving -> ready``, :func:`is_lease_flip`)
are not events a person reads: they sit in a ring of their own, so a burst of requests
never pushes the loads, evictions and applies out of the replay buffer, and readers fold
them into a per-slot request count (:class:`LeaseFold`: each flip carries the slot's
``requests``), shown in their place unless asked for (``slotctl events --all``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, Final

__all__ = [
    "PROGRESS_KINDS",
    "Event",
    "EventKind",
    "EvictionReason",
    "LeaseFold",
    "Op",
    "event_line",
    "is_lease_flip",
]


class EventKind(StrEnum):
    """What happened (the ``kind`` of an event; plain strings on the wire)."""

    TRANSITION = "transition"  # a slot changed state
    REFUSAL = "refusal"  # an operation was refused (typed error)
    EVICTION = "eviction"  # a slot is unloaded to make room (``reason`` says why)
    ADMISSION = "admission"  # a load passed admission
    PROGRESS = "progress"  # pull progress
    LEASE = "lease"  # batch leases (holds)
    ADOPT = "adopt"  # a running server adopted after a restart
    # An idle slot's residency tier changed (its server fell asleep, a wake began, woke,
    # or a wake failed): ``details.residency`` is the new tier, ``details.reason`` why.
    RESIDENCY = "residency"
    PLAN = "plan"  # the reconciler's plan for a slot
    # A changed slot's surge rollout (controller.slots.surge): ``details.phase`` is
    # started, switched, done or failed.
    ROLLOUT = "rollout"
    # A slot's replicas scaled by demand (controller.slots.scaling): ``details.action``
    # is up or down, ``details.replica`` the replica, the message the reason.
    SCALE = "scale"
    ERROR = "error"  # a failed reconcile pass or background task
    # A LoRA adapter in a slot (controller.slots.adapters): ``details.action`` is loaded,
    # evicted, unloaded, failed or reapplied, ``details.adapter`` which one.
    ADAPTER = "adapter"
    REQUESTS = "requests"  # lease flips folded by a reader (LeaseFold); never on the bus
    STATE = "state"  # a slot's state as a waiting command first saw it; never on the bus


class Op(StrEnum):
    """Which operation an event belongs to (SPEC §1's ``op`` of every log line)."""

    LOAD = "load"
    UNLOAD = "unload"
    ADMIT = "admit"
    EVICT = "evict"
    RESTORE = "restore"
    RECONCILE = "reconcile"
    PROBE = "probe"
    LEASE = "lease"
    API = "api"  # a refusal answered by the HTTP API
    ROUTE = "route"  # a refusal answered by the OpenAI router
    BACKGROUND = "background"  # a background task of the controller
    IDLE = "idle"  # ready -> idle: no request for idle_timeout_s (still loaded)
    ROLLOUT = "rollout"  # a surge rollout (controller.slots.surge)
    PULL = "pull"  # a model's files pulled ahead of any load (``slotctl model pull``)
    SCALE = "scale"  # a replica added or removed by demand (controller.slots.scaling)


class EvictionReason(StrEnum):
    """Why a slot was evicted: a field of every eviction event (metrics count by it)."""

    PRELOAD = "preload"  # room for a load
    PRESSURE = "pressure"  # low free memory
    TTL = "ttl"  # unused past ttl_s
    EXCLUSIVE = "exclusive"  # swapped out by an exclusive-group peer
    ORPHAN = "orphan"  # a managed server nobody declares
    SCALE_DOWN = "scale-down"  # an extra replica the demand no longer needs


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    kind: EventKind
    op: Op
    slot: str | None = None
    model: str | None = None
    from_state: str | None = None
    to_state: str | None = None
    message: str = ""
    error: str | None = None  # the typed error code on failures
    reason: EvictionReason | None = None  # eviction events: why
    time: float = field(default_factory=time.time)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["from"] = data.pop("from_state")
        data["to"] = data.pop("to_state")
        if data["reason"] is None:
            del data["reason"]  # only eviction events carry one
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Event:
        """An event from its wire form (:meth:`to_dict`, ``/api/events``).

        Unknown keys are ignored and an unknown ``kind``, ``op`` or ``reason`` stays the
        plain string it came as (a newer controller may send new ones); ``ValueError``
        when ``id``, ``kind`` or ``op`` is missing.
        """
        known = {f.name for f in fields(cls)} - {"from_state", "to_state"}
        values = {k: v for k, v in data.items() if k in known}
        if not {"id", "kind", "op"} <= set(values):
            raise ValueError("an event needs an id, a kind and an op")
        values["from_state"] = data.get("from")
        values["to_state"] = data.get("to")
        for name, enum in (("kind", EventKind), ("op", Op), ("reason", EvictionReason)):
            if values.get(name) in enum.__members__.values():
                values[name] = enum(values[name])
        return cls(**values)


# What a person following the controller is shown (``slotctl up``, ``apply --once``):
# the rest (admissions, pull progress, leases, plans) is in ``slotctl events`` and the log.
PROGRESS_KINDS: Final = frozenset(
    {
        EventKind.TRANSITION,
        EventKind.ADOPT,
        EventKind.REFUSAL,
        EventKind.EVICTION,
        EventKind.RESIDENCY,
        EventKind.ROLLOUT,
        EventKind.SCALE,
        EventKind.ERROR,
    }
)


def event_line(
    event: Event,
    *,
    started: float | None = None,
    red: Callable[[str], str] = str,
) -> str:
    """One event as one line of text, the same wherever a person reads it::

        12:04:31  #17  transition  chat              warming -> ready  (probe ok)
        12:04:33  #18  refusal     coder             load  [admission.no_memory]  ...

    The first column is the event's wall-clock time, or with ``started`` (a
    ``time.time()``) the seconds since then (``   3.2s``: the progress of one command).
    ``#ID`` is left out for an event that has none (``id`` 0: a change a poller saw).
    A transition shows ``FROM -> TO``, any other event its ``op``; ``red`` paints the
    error code (the CLI's colour on a terminal).
    """
    if started is not None:
        stamp = f"{max(0.0, event.time - started):6.1f}s"
    else:
        stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
    parts = [stamp]
    if event.id:
        parts.append(f"#{event.id}")
    parts += [f"{event.kind:<10}", f"{event.slot or '-':<16}"]
    if event.kind == EventKind.STATE and event.to_state:
        parts.append(event.to_state)  # a state seen, not a transition
    elif event.to_state:
        parts.append(f"{event.from_state or '-'} -> {event.to_state}")
    else:
        parts.append(str(event.op))
    if event.error:
        parts.append(red(f"[{event.error}]"))
    if event.message:
        parts.append(event.message)
    return "  ".join(parts)


_FLIP_STATES: Final = frozenset({"ready", "serving", "idle"})


def is_lease_flip(event: Event) -> bool:
    """A request's ``ready``/``idle`` -> ``serving`` -> ``ready`` (op ``lease``)."""
    return (
        event.kind == EventKind.TRANSITION
        and event.op == Op.LEASE
        and event.from_state in _FLIP_STATES
        and event.to_state in _FLIP_STATES
    )


@dataclass(slots=True)
class _Burst:
    first: float  # when its first flip came
    last: float  # when its last flip came
    base: int  # the slot's request count before the burst
    total: int  # the count at its last flip
    serving: bool  # its last flip went to serving (requests in flight)
    model: str | None


class LeaseFold:
    """Lease flips folded into one ``requests`` event a slot and burst (a reader's, as
    ``slotctl events`` and the dashboard show them): :meth:`feed` takes the events in
    order and returns what to show now; a slot's burst is shown before its next other
    event, by :meth:`quiet` once the slot has been out of ``serving`` for ``quiet_s``,
    and by :meth:`flush`. The count comes from the flips' ``details["requests"]`` (the
    slot's requests served): exact, whatever the flips in between that were not seen."""

    def __init__(self, quiet_s: float = 2.0) -> None:
        self.quiet_s = quiet_s
        self._bursts: dict[str, _Burst] = {}

    def feed(self, event: Event) -> list[Event]:
        slot = event.slot or ""
        if not is_lease_flip(event):
            return [*self._end(slot), event] if slot in self._bursts else [event]
        count = event.details.get("requests")
        total = count if isinstance(count, int) else 0
        serving = event.to_state == "serving"
        burst = self._bursts.get(slot)
        if burst is None:  # a flip out of serving: at least one request ended there
            base = total if serving else max(0, total - 1)
            burst = self._bursts[slot] = _Burst(event.time, event.time, base, total, serving, None)
        burst.last, burst.total, burst.serving = event.time, max(burst.total, total), serving
        burst.model = event.model or burst.model
        return []

    def quiet(self, now: float) -> list[Event]:
        """The bursts of slots out of ``serving`` for ``quiet_s`` (``now``: a ``time.time()``)."""
        done = [
            s for s, b in self._bursts.items() if not b.serving and now - b.last >= self.quiet_s
        ]
        return [e for s in done for e in self._end(s)]

    def flush(self) -> list[Event]:
        return [e for s in list(self._bursts) for e in self._end(s)]

    def _end(self, slot: str) -> list[Event]:
        burst = self._bursts.pop(slot)
        served = burst.total - burst.base
        span = time.strftime("%H:%M:%S", time.localtime(burst.first))
        text = f"{served} request{'s' if served != 1 else ''} since {span}"
        text += f" ({burst.total} in all{'; serving' if burst.serving else ''})"
        return [
            Event(
                id=0,
                kind=EventKind.REQUESTS,
                op=Op.LEASE,
                slot=slot or None,
                model=burst.model,
                message=text,
                time=burst.last,
                details={"requests": served, "total": burst.total, "first": burst.first},
            )
        ]
