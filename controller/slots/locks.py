r"""The manager's locks, and the one order they are taken in.

* a **slot lock** (:attr:`SlotRecord.lock`): one operation at a time per slot (load,
  unload, recovery, a fault); independent slots run concurrently;
* an **exclusive-group lock**: at most one member of a group loads at a time (it unloads
  the loaded member first);
* a **device lock**: admission and reservation on one device, so two loads can never
  both pass admission for the same free memory.

The group and device locks are :class:`PriorityLock`\ s: when one frees, the load whose
requests have the best priority class waiting (:meth:`Core.demand`) goes next, first
come first served among equals — so a swap or a load that a person waits for is not
queued behind a batch job's (issue 23). A load nobody waits for (a restore, autoload)
ranks last.

Lock order: group -> slot -> device. An eviction runs under the evicting load's locks and
takes a *victim's* slot lock only when it is free (it checks ``busy`` first, nothing in
between yields), so no cycle can form. Nothing else takes more than one of these locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

__all__ = ["Locks", "PriorityLock"]

Rank = Callable[[], float]


def _last() -> float:
    return 0.0


class PriorityLock:
    """An asyncio lock that grants the waiter of the best rank when it frees (the rank
    asked then: a waiter's demand changes while it waits), first come first served
    among equal ranks. Cancel-safe: a waiter cancelled after its grant passes it on."""

    def __init__(self) -> None:
        self._locked = False
        self._waiters: list[tuple[int, Rank, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def locked(self) -> bool:
        return self._locked

    @contextlib.asynccontextmanager
    async def hold(self, rank: Rank = _last) -> AsyncIterator[None]:
        await self.acquire(rank)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, rank: Rank = _last) -> None:
        if not self._locked and not self._waiters:
            self._locked = True
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._seq), rank, future)
        self._waiters.append(entry)
        try:
            await future
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif future.done() and not future.cancelled():
                self.release()  # granted as it was cancelled: the next one's turn
            raise

    def release(self) -> None:
        self._locked = False
        live = [w for w in self._waiters if not w[2].done()]
        self._waiters = live
        if not live:
            return
        best = max(live, key=lambda w: (w[1](), -w[0]))
        self._waiters.remove(best)
        self._locked = True
        best[2].set_result(None)


class Locks:
    def __init__(self) -> None:
        self._groups: dict[str, PriorityLock] = {}
        self._devices: dict[str, PriorityLock] = {}

    def group(
        self, name: str | None, rank: Rank = _last
    ) -> contextlib.AbstractAsyncContextManager[object]:
        """The exclusive group's lock (a no-op context for a slot without a group)."""
        if not name:
            return contextlib.nullcontext()
        return self._groups.setdefault(name, PriorityLock()).hold(rank)

    def device(self, name: str, rank: Rank = _last) -> contextlib.AbstractAsyncContextManager[None]:
        return self._devices.setdefault(name, PriorityLock()).hold(rank)
