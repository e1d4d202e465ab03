"""Loading's state of one slot: the load in flight, its admission signal, the generation.

At the bottom of :mod:`controller.slots` (each :class:`~.records.SlotRecord` holds one
:class:`LoadFlight`, made with it). The asyncio coordination of loads lives here, not in
fields of the record: the one load task that explicit loads and cold requests join, the
event its admission sets (``start_load`` answers then), its flavour (a background load may
not evict at will), the explicit loads in flight, when it reserved memory (its cold-load
cost is measured from there), the nodes it avoids for now (a cluster), the pull of its
model files while it is ``pulling`` (the task, its latest progress, why it was stopped:
:mod:`.pulling` runs it, an unload or a removal stops it), and the slot's *generation* —
every load, adopted warm-up and surge switch takes a new one, so a superseded load
never serves or unloads its replacement and an eviction planned against an older server
revalidates to nothing.

Its attributes change only in this module's methods; :mod:`.loading` and :mod:`.units`
call them (a unit's load is its members'), :mod:`.pulling` those of the pull and
:mod:`.unloading` the one that stops it, :mod:`.recovery` and :mod:`.surge` take a new
generation for the server they bring (tests/unit/test_record_owners.py keeps that list).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.modelfiles.progress import PullProgress

__all__ = ["LoadFlight"]


class LoadFlight:
    """One slot's loads (see the module docstring)."""

    __slots__ = (
        "_avoid",
        "admitted",
        "background",
        "generation",
        "pull_progress",
        "pull_stopped",
        "pull_task",
        "reserved_at",
        "task",
        "wanted",
    )

    def __init__(self) -> None:
        self.task: asyncio.Task[int] | None = None  # the load every joiner awaits
        self.admitted: asyncio.Event | None = None  # set once its admission is decided
        self.background = False  # the reconciler's or the restore's: may not evict at will
        self.wanted = 0  # explicit load() calls in flight
        self.generation = 0
        self.reserved_at: float | None = None  # monotonic time its load reserved memory
        # Nodes a load avoids until (monotonic) when, and why: the scheduler left the
        # slot's pod Pending there (controller.scheduling.cluster marks them unusable).
        self._avoid: dict[str, tuple[float, str]] = {}
        # The pull of its model files while the load is ``pulling`` (controller.slots.pulling).
        self.pull_task: asyncio.Task[object] | None = None
        self.pull_progress: PullProgress | None = None  # its latest snapshot (views)
        self.pull_stopped: str | None = None  # why an unload or a removal stopped it

    # ---------------------------------------------------------------- reads

    @property
    def running(self) -> bool:
        """A load task is in flight."""
        return self.task is not None and not self.task.done()

    def avoided(self, now: float) -> dict[str, str]:
        """The nodes a load avoids now, and why."""
        return {node: why for node, (until, why) in self._avoid.items() if until > now}

    # ---------------------------------------------------------------- a load

    def begin(self, task: asyncio.Task[int], *, background: bool) -> None:
        """``task`` is the slot's load now (its own, or its co-loaded unit's)."""
        self.task = task
        self.background = background
        self.admitted = asyncio.Event()

    def decided(self) -> None:
        """The load's admission is decided (or the load ended): ``start_load`` answers."""
        if self.admitted is not None:
            self.admitted.set()

    def next_generation(self) -> int:
        """A new load (or server) of the slot: what was decided about the old one is stale."""
        self.generation += 1
        return self.generation

    @contextlib.contextmanager
    def wanting(self) -> Iterator[None]:
        """An explicit load in flight (a cleanup of cancelled waiters leaves it alone)."""
        self.wanted += 1
        try:
            yield
        finally:
            self.wanted -= 1

    def reserve(self, now: float) -> None:
        """The load reserved its memory now (its cold-load cost is timed from here)."""
        self.reserved_at = now

    def ready(self, now: float) -> float | None:
        """The load is ready: the seconds since it reserved (None: not a timed load)."""
        started, self.reserved_at = self.reserved_at, None
        return now - started if started is not None else None

    def abandon(self) -> None:
        """The load failed: nothing to time."""
        self.reserved_at = None

    def avoid(self, node: str, until: float, why: str) -> None:
        """Loads go elsewhere than ``node`` until ``until`` (monotonic)."""
        self._avoid[node] = (until, why)

    # ---------------------------------------------------------------- the pull of a load

    def pulling(self, task: asyncio.Task[object]) -> None:
        """The load waits for ``task``, the pull of its model files, now."""
        self.pull_task = task
        self.pull_progress = None
        self.pull_stopped = None

    def progressed(self, progress: PullProgress) -> None:
        """The pull's latest progress (what the slot's view shows)."""
        self.pull_progress = progress

    def pulled(self) -> None:
        """The pull ended (done, failed or stopped): nothing to show any more."""
        self.pull_task = None
        self.pull_progress = None

    def stop_pull(self, why: str) -> bool:
        """Stop the load's pull (the slot is unloaded or removed): its waiter leaves the
        pull, which the engine cancels when nobody else waits for it. True if one ran."""
        task = self.pull_task
        if task is None or task.done():
            return False
        self.pull_stopped = why
        task.cancel()
        return True
