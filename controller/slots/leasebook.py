"""Leasing's book of one slot: its leases, the requests waiting for it, the drain gate.

At the bottom of :mod:`controller.slots` (each :class:`~.records.SlotRecord` holds one
:class:`LeaseBook`, made with it). The asyncio coordination of requests lives here, not in
fields of the record: the leases in flight (:class:`Lease`), the cold waiters and their
priority classes, the turns of a slot at its ``max_concurrency`` (a fair queue), the class
of each recent user, and the gate an unload closes while it drains. Its attributes change
only in this module's methods; :mod:`.leases` calls them, and the parts that end a server
under its requests (a failed load, a drain's timeout, a hung server, shutdown) revoke or
drain through them (tests/unit/test_record_owners.py keeps that list).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from controller.model.errors import SlotctlError
from controller.scheduling.fairqueue import FairQueue

__all__ = ["Lease", "LeaseBook", "Requester", "Turns", "Waiting"]


_LEASE_IDS: Final = itertools.count(1)  # (a module's name, not a class attribute: faster)


@dataclass(frozen=True, slots=True)
class Requester:
    """Who asks for a lease: the API key's name ("" for the API token), the priority
    class it waits in (where requests wait, :mod:`controller.scheduling.fairqueue`) and
    its flow: the key's id (never its name: a key made again under a revoked key's name
    is another flow), by which its places in line are counted and taken in turn."""

    key: str = ""
    cls: str = ""  # "": the controller's default class
    flow: str = ""  # the key's id ("": not told: the key's name stands for it)

    @property
    def line(self) -> str:
        """What its places in line are counted and taken in turn by: its flow, else its
        key's name (a caller that knows no id: the API's own leases, a bench)."""
        return self.flow or self.key


class Lease:
    """A claim on a slot for one request (or a batch job): keeps it loaded and serving."""

    # What every lease starts with, as class attributes: __init__ writes only what differs
    # (a lease is made for every routed request; docs/performance.md, the router).
    expires_at: float | None = None  # a batch hold's expiry (None: a request's)
    released = False
    error: SlotctlError | None = None
    _lost: asyncio.Event | None = None  # made when asked for: most never are

    def __init__(self, slot: str, generation: int, expires_at: float | None = None) -> None:
        self.id = next(_LEASE_IDS)
        self.slot = slot
        self.generation = generation
        if expires_at is not None:
            self.expires_at = expires_at

    @property
    def revoked(self) -> bool:
        return self.error is not None

    @property
    def lost(self) -> asyncio.Event:
        """Set once the lease is revoked (to wait for it)."""
        if self._lost is None:
            self._lost = asyncio.Event()
            if self.error is not None:
                self._lost.set()
        return self._lost

    def revoke(self, error: SlotctlError) -> None:
        """The slot went away under this lease (crash, forced unload)."""
        if self.error is None:
            self.error = error
        if self._lost is not None:
            self._lost.set()

    def check(self) -> None:
        """Raise the typed error if the lease was revoked."""
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        return f"Lease({self.slot!r}, id={self.id}, gen={self.generation})"


# Requests waiting for their turn: each waiter's future gets its lease, or None.
Turns = FairQueue[asyncio.Future[Lease | None]]


@dataclass(eq=False, slots=True)
class Waiting:
    """One request's place in a slot's line (waiting for its load or for a turn)."""

    flow: str  # its key's id
    task: asyncio.Task[Any] | None  # the request's task (cancelled when it is shed)
    turn: asyncio.Future[Lease | None] | None = None  # its turn, at max_concurrency
    shed: bool = False  # refused: its place went to another flow's request


class LeaseBook:
    """One slot's leases and waiting requests (see the module docstring)."""

    __slots__ = (
        "class_used",
        "cold_classes",
        "draining",
        "leases",
        "places",
        "turns",
        "waiters",
    )

    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}
        self.waiters = 0  # requests waiting for the slot's load (joined)
        # The classes of those cold waiters (no max_concurrency: no turns), and when each
        # class last took a lease (the eviction plan's preference).
        self.cold_classes: dict[str, int] = {}
        self.class_used: dict[str, float] = {}
        # Requests waiting for their turn at max_concurrency, served by class (made when
        # one first waits): each waiter's future gets its lease, or None (start over).
        self.turns: Turns | None = None
        self.draining = False  # an unload drains: no new lease
        # Every request in line (cold or for a turn), by flow, oldest first: the line's
        # admission counts places per flow (controller.scheduling.queueshare).
        self.places: dict[str, list[Waiting]] = {}

    # ---------------------------------------------------------------- reads

    @property
    def in_flight(self) -> int:
        """Requests holding a lease now (batch holds aside)."""
        return sum(1 for lease in self.leases.values() if lease.expires_at is None)

    @property
    def holds(self) -> int:
        """Batch holds among the leases."""
        return sum(1 for lease in self.leases.values() if lease.expires_at is not None)

    @property
    def queued(self) -> int:
        """Requests waiting for their turn (max_concurrency)."""
        return len(self.turns) if self.turns is not None else 0

    def held_for(self, now: float) -> float | None:
        """Seconds until the last batch hold expires (None: no hold)."""
        holds = [x.expires_at for x in self.leases.values() if x.expires_at is not None]
        return round(max(0.0, max(holds) - now), 1) if holds else None

    # ---------------------------------------------------------------- leases

    def add(self, lease: Lease, cls: str | None, now: float) -> None:
        """A lease taken (``cls``: its requester's class, resolved; None: not told)."""
        self.leases[lease.id] = lease
        if cls is not None:
            self.class_used[cls] = now

    def remove(self, lease: Lease) -> bool:
        """A lease given back; False when it was not in the book (revoked, or of an earlier
        generation: nothing to undo)."""
        return self.leases.pop(lease.id, None) is not None

    def revoke_all(self, error: SlotctlError) -> int:
        """Every lease ends with ``error`` (its server is gone or going); how many."""
        leases = list(self.leases.values())
        for lease in leases:
            lease.revoke(error)
        self.leases.clear()
        return len(leases)

    @contextlib.contextmanager
    def drain(self) -> Iterator[None]:
        """No new lease while the caller drains or stops the slot's server."""
        self.draining = True
        try:
            yield
        finally:
            self.draining = False

    # ---------------------------------------------------------------- waiting

    def join_cold(self, cls: str) -> None:
        """A request waits for the slot's load (its class weighs in the load's demand)."""
        self.waiters += 1
        self.cold_classes[cls] = self.cold_classes.get(cls, 0) + 1

    def leave_cold(self, cls: str) -> None:
        self.waiters -= 1
        left = self.cold_classes.get(cls, 0) - 1
        if left > 0:
            self.cold_classes[cls] = left
        else:
            self.cold_classes.pop(cls, None)

    def holding(self) -> dict[str, int]:
        """The places each flow holds in the line."""
        return {flow: len(line) for flow, line in self.places.items()}

    def enter(
        self,
        flow: str,
        task: asyncio.Task[Any] | None,
        turn: asyncio.Future[Lease | None] | None = None,
    ) -> Waiting:
        """A request of ``flow`` takes a place in the line (the caller decided it may)."""
        place = Waiting(flow, task, turn)
        self.places.setdefault(flow, []).append(place)
        return place

    def leave(self, place: Waiting) -> None:
        """A request's place is given up (served, refused, gone); idempotent."""
        line = self.places.get(place.flow)
        if line is not None and place in line:
            line.remove(place)
            if not line:
                del self.places[place.flow]

    def shed_newest(self, flow: str) -> Waiting | None:
        """``flow``'s newest waiter loses its place (one whose turn was not granted yet):
        marked shed, out of the line, its task cancelled (the waiter answers
        ``slot.queue_full``). None when it has none to give."""
        line = self.places.get(flow, [])
        for place in reversed(line):
            if place.turn is not None and place.turn.done():
                continue  # granted meanwhile: it is served, not shed
            place.shed = True
            self.leave(place)
            if place.task is not None:
                place.task.cancel()
            return place
        return None

    def waiting_classes(self) -> list[str]:
        """The classes of every request waiting now (for the load or for a turn)."""
        waiting = [c for c, n in self.cold_classes.items() if n > 0]
        if self.turns is not None:
            waiting += self.turns.waiting_classes()
        return waiting

    def queue(self, names: set[str], make: Callable[[], Turns]) -> Turns:
        """The slot's fair queue of turns: made when one first waits, and made again once
        empty when the priority classes (``names``) changed."""
        turns = self.turns
        if turns is None or (not len(turns) and set(turns.classes) != names):
            turns = self.turns = make()
        return turns

    def end_turns(self) -> None:
        """Every request waiting for its turn starts over (the slot is gone: each then
        gets the typed answer of a slot that does not exist)."""
        turns = self.turns
        if turns is None:
            return
        for waiter in list(turns):
            turns.remove(waiter)
            if not waiter.item.done():
                waiter.item.set_result(None)
