"""The event bus: events emitted, kept for a replay, fed to subscribers, logged.

The slot manager emits (:class:`EventBus.emit`); the event stream (SSE), metrics and
``--wait`` progress consume. Each event gets a monotonically increasing id and sits in a
bounded ring buffer, so an SSE client can resume with ``Last-Event-ID``; live subscribers
get their own bounded queue (a slow subscriber loses the oldest events and is told how
many, it never blocks the manager). The lease flips of every request sit in a ring of
their own (:func:`~controller.model.events.is_lease_flip`), so a burst of requests never
pushes the loads, evictions and applies out of the replay buffer.

A request's ``ready``<->``serving`` flip, twice a request, is emitted by :meth:`EventBus.flip`
(the slot table's lease flips): the same event as :meth:`EventBus.emit` would make, with its
id and time taken then, but built only for whoever takes it then (a subscriber that takes
flips, a listener without ``on_flip``, the log at ``INFO``); the ring keeps its fields and
:meth:`EventBus.since` builds it for a replay. A subscriber that never takes flips says so
(``subscribe(..., flips=False)``: its ``accept`` is not asked of them), and a listener that
only counts them takes ``on_flip(slot, from, to)`` instead of the event (the metrics).

Every event is also one structured log line on the ``slotctl.lifecycle`` logger with
``op``, ``slot``, ``model``, ``from``, ``to`` and ``error`` (JSON with ``--log-format json``).
What an event is: :mod:`controller.model.events`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from controller.model.events import Event, EventKind, Op, is_lease_flip

__all__ = ["EventBus", "FlipCounter", "Subscription"]

log = logging.getLogger("slotctl.lifecycle")

_LOG_FIELDS: Final = ("op", "slot", "model", "from_state", "to_state", "error")

# A lease flip as the ring keeps it until an event is asked of it: id, slot, model, from,
# to, message, time, the slot's requests (its ``details``).
_Flip = tuple[int, str, "str | None", str, str, str, float, int]
# Who counts the flips without their events: (slot, from, to).
FlipCounter = Callable[[str, str, str], None]


def _flip_event(flip: _Flip) -> Event:
    """The event of a flip the ring kept (what :meth:`EventBus.emit` would have made)."""
    eid, slot, model, before, after, message, at, requests = flip
    return Event(
        id=eid,
        kind=EventKind.TRANSITION,
        op=Op.LEASE,
        slot=slot,
        model=model,
        from_state=before,
        to_state=after,
        message=message,
        time=at,
        details={"requests": requests},
    )


class Subscription:
    """A live feed of events; iterate with ``async for``. ``dropped`` counts lost events.

    ``accept`` picks the events the feed gets, at emit time: a subscriber that looks at a
    few kinds is not woken for the others (two lease flips a request)."""

    def __init__(
        self,
        bus: EventBus,
        maxsize: int,
        accept: Callable[[Event], bool] | None = None,
        *,
        flips: bool = True,
    ) -> None:
        self._bus = bus
        self._queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=maxsize)
        self._accept = accept
        self.flips = flips  # offered the lease flips (False: its accept refuses them all)
        self.dropped = 0

    def _offer(self, event: Event) -> None:
        if self._accept is not None and not self._accept(event):
            return
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(event)

    async def get(self) -> Event:
        return await self._queue.get()

    def get_nowait(self) -> Event | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def close(self) -> None:
        self._bus._unsubscribe(self)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            yield await self.get()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventBus:
    """Emits events to subscribers and listeners and keeps the recent ones for a replay:
    ``buffer_size`` of them, and ``flip_buffer_size`` lease flips in a ring of their own
    (a burst of requests does not push the rest out)."""

    def __init__(self, buffer_size: int = 1000, flip_buffer_size: int = 200) -> None:
        self._buffer: collections.deque[Event] = collections.deque(maxlen=buffer_size)
        # The lease flips: an emitted one as its event, a flip()'s as its fields.
        self._flips: collections.deque[Event | _Flip] = collections.deque(maxlen=flip_buffer_size)
        self._subscribers: set[Subscription] = set()
        self._offers: tuple[Subscription, ...] = ()  # the subscribers, as emit walks them
        self._flip_offers: tuple[Subscription, ...] = ()  # those that take the flips
        self._listeners: list[Callable[[Event], None]] = []
        self._flip_listeners: tuple[Callable[[Event], None], ...] = ()  # given flips' events
        self._flip_counters: tuple[FlipCounter, ...] = ()  # told a flip's slot and states
        self._next_id = 1

    def emit(self, kind: EventKind, op: Op, **fields: Any) -> Event:
        event = Event(id=self._next_id, kind=kind, op=op, **fields)
        self._next_id += 1
        (self._flips if is_lease_flip(event) else self._buffer).append(event)
        for sub in self._offers:  # a snapshot: one may close while it is offered
            sub._offer(event)
        for listener in self._listeners:
            listener(event)
        _log(event)
        return event

    def flip(
        self, slot: str, model: str | None, before: str, after: str, message: str, requests: int
    ) -> None:
        """A lease's ``ready``<->``serving`` flip (the slot table's, twice a request): the
        event ``emit(TRANSITION, LEASE, ...)`` would make, with ``details={"requests":
        requests}``, built only for those that take it now (see the module docstring)."""
        eid = self._next_id
        self._next_id = eid + 1
        flip = (eid, slot, model, before, after, message, time.time(), requests)
        self._flips.append(flip)
        for count in self._flip_counters:
            count(slot, before, after)
        offers, listeners = self._flip_offers, self._flip_listeners
        if offers or listeners or log.isEnabledFor(logging.INFO):
            event = _flip_event(flip)
            for sub in offers:
                sub._offer(event)
            for listener in listeners:
                listener(event)
            _log(event)

    def add_listener(
        self, listener: Callable[[Event], None], *, on_flip: FlipCounter | None = None
    ) -> None:
        """A synchronous callback for every event (metrics): must be fast, never raise.
        With ``on_flip``, the lease flips of :meth:`flip` go to it instead, as (slot,
        from, to), with no event built (an emitted one still goes to ``listener``)."""
        self._listeners.append(listener)
        if on_flip is None:
            self._flip_listeners += (listener,)
        else:
            self._flip_counters += (on_flip,)

    def subscribe(
        self,
        maxsize: int = 1000,
        accept: Callable[[Event], bool] | None = None,
        *,
        flips: bool = True,
    ) -> Subscription:
        """A live feed; ``accept`` picks its events. ``flips=False``: it never takes the
        lease flips of :meth:`flip` (``accept`` refuses every one), so none is built for it."""
        sub = Subscription(self, maxsize, accept, flips=flips)
        self._subscribers.add(sub)
        self._offered()
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)
        self._offered()

    def _offered(self) -> None:
        self._offers = tuple(self._subscribers)
        self._flip_offers = tuple(s for s in self._offers if s.flips)

    def since(self, last_id: int) -> list[Event]:
        """Buffered events after ``last_id``, in order (for Last-Event-ID resume); the
        ones no longer buffered are ``last_id - len(...)`` short of :attr:`last_id`."""
        kept = [e for e in self._buffer if e.id > last_id]
        flips = [
            e if isinstance(e, Event) else _flip_event(e)
            for e in self._flips
            if (e.id if isinstance(e, Event) else e[0]) > last_id
        ]
        if not flips:
            return kept
        return sorted(kept + flips, key=lambda e: e.id)

    @property
    def last_id(self) -> int:
        return self._next_id - 1


def _log(event: Event) -> None:
    level = logging.WARNING if event.error else logging.INFO
    if not log.isEnabledFor(level):
        return  # e.g. the lease flips of every request, with text logs (warnings only)
    extra = {name: getattr(event, name) for name in _LOG_FIELDS}
    arrow = f" {event.from_state} -> {event.to_state}" if event.to_state else ""
    text = f"{event.op} slot={event.slot} model={event.model}{arrow}"
    if event.error:
        text += f" error={event.error}"
    if event.message:
        text += f": {event.message}"
    log.log(level, text, extra={"slotctl": extra})
