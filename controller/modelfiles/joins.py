"""One download however many wait for it: an in-process registry of shared work.

Two slots that need one file join one pull, as two requests join one cold load: the first
:meth:`Joins.join` starts the work (an ``asyncio`` task), later ones for the same key wait
for that same task. Each waiter is counted; a waiter that is cancelled (its slot deleted,
its client gone) only leaves — the work goes on for the others — and the last one to leave
cancels the work. The work's outcome (or its typed error) reaches every waiter. Keys are
destinations (a file or snapshot directory). Called by :mod:`controller.modelfiles.pull`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Joins", "Shared"]

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class Shared(Generic[T]):
    """One piece of shared work and the number of callers waiting for it."""

    task: asyncio.Task[T]
    context: Any = None  # what the starter attached (the pull's progress feed)
    waiters: int = 0


class Joins(Generic[K, T]):
    def __init__(self) -> None:
        self._work: dict[K, Shared[T]] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._work

    def get(self, key: K) -> Shared[T] | None:
        return self._work.get(key)

    def pending(self) -> list[K]:
        return list(self._work)

    def start(
        self, key: K, work: Callable[[], Coroutine[Any, Any, T]], *, name: str, context: Any = None
    ) -> tuple[Shared[T], bool]:
        """The shared work for ``key``, started now if none runs; ``True`` if started."""
        shared = self._work.get(key)
        if shared is not None:
            return shared, False
        task = asyncio.get_running_loop().create_task(work(), name=name)
        shared = Shared(task=task, context=context)
        self._work[key] = shared
        task.add_done_callback(functools.partial(self._done, key))
        return shared, True

    def _done(self, key: K, task: asyncio.Task[T]) -> None:
        shared = self._work.get(key)
        if shared is not None and shared.task is task:
            del self._work[key]
        if not task.cancelled():
            task.exception()  # retrieved: a failure no waiter saw is not "never retrieved"

    async def wait(self, shared: Shared[T]) -> T:
        """Wait for ``shared``'s outcome as one of its waiters (see the module text)."""
        shared.waiters += 1
        try:
            result = await asyncio.shield(shared.task)
        except asyncio.CancelledError:
            shared.waiters -= 1
            if _cancelling() and shared.waiters <= 0 and not shared.task.done():
                shared.task.cancel()  # the last waiter left: nobody needs the work
            raise
        except BaseException:
            shared.waiters -= 1
            raise
        shared.waiters -= 1
        return result


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
