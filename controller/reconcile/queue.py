"""A generic keyed work queue, after client-go's ``workqueue`` (what controller-runtime's
reconcilers run on). Pure asyncio, no knowledge of slots: the reconciler
(:mod:`controller.reconcile.reconciler`) queues slot names on it, and anything else that
wants "at most one worker per key, the latest state wins" may queue its own keys.

What it promises, the same as client-go's queue:

* **a key, not an event**: adding a key that is already waiting does nothing (the waiting
  entry already stands for it), so a burst of changes to one key is one pass;
* **per-key serialisation**: a key a worker holds (:meth:`WorkQueue.get` until
  :meth:`WorkQueue.done`) is never handed to a second worker;
* **the dirty mark**: a key added while a worker holds it is marked, and queued again
  when that worker says :meth:`~WorkQueue.done` — the change it was added for is seen by
  a pass that starts after it;
* **requeue after** (:meth:`~WorkQueue.add_after`): a key added once its delay has passed;
  of two delays pending for one key the sooner stands (an extra pass is harmless, a late
  one is not);
* **rate-limited retry** (:meth:`~WorkQueue.add_rate_limited`): an exponential backoff
  per key (:class:`Backoff`) that grows with each retry and is reset by
  :meth:`~WorkQueue.forget`, the call a successful pass makes.

:meth:`~WorkQueue.wait_idle` waits until nothing is queued or held (delayed keys not
counted: they are not work yet; :attr:`~WorkQueue.delayed` says how many there are).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

__all__ = ["DEFAULT_BACKOFF", "Backoff", "QueueShutDown", "WorkQueue"]

K = TypeVar("K", bound=Hashable)


class QueueShutDown(Exception):
    """:meth:`WorkQueue.get` on a queue that was shut down (its workers end)."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """A per-key exponential backoff: ``base * factor ** retries``, at most ``cap``
    (client-go's ``ItemExponentialFailureRateLimiter``)."""

    base: float = 1.0
    cap: float = 300.0
    factor: float = 2.0

    def delay(self, retries: int) -> float:
        # The exponent is bounded before the power: 2.0 ** 2000 is an OverflowError.
        exponent = min(retries, 64)
        return float(min(self.cap, self.base * self.factor**exponent))


DEFAULT_BACKOFF: Final = Backoff()


class WorkQueue(Generic[K]):
    """Keys to work on, each held by at most one worker at a time (module docstring)."""

    def __init__(self) -> None:
        self._queue: deque[K] = deque()  # waiting, in order
        self._dirty: set[K] = set()  # waiting, or to be queued again when done
        self._processing: set[K] = set()  # held by a worker
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}  # add_after: (when, timer)
        self._retries: dict[K, int] = {}
        self._ready = asyncio.Event()  # the queue is not empty
        self._idle = asyncio.Event()  # nothing waiting, nothing held
        self._idle.set()
        self._shut = False

    # ------------------------------------------------------------------ adding

    def add(self, key: K) -> None:
        """Queue ``key`` (nothing if it waits already; marked dirty if a worker holds it)."""
        if self._shut or key in self._dirty:
            return
        self._dirty.add(key)
        if key in self._processing:
            return  # queued again by done()
        self._queue.append(key)
        self._ready.set()
        self._idle.clear()

    def add_all(self, keys: Iterable[K]) -> None:
        for key in keys:
            self.add(key)

    def add_after(self, key: K, delay: float) -> None:
        """Queue ``key`` once ``delay`` seconds have passed (now if ``delay <= 0``); the
        sooner of two pending delays of one key stands."""
        if self._shut:
            return
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        pending = self._timers.get(key)
        if pending is not None:
            if pending[0] <= when:
                return
            pending[1].cancel()
        self._timers[key] = (when, loop.call_at(when, self._fire, key))

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def add_rate_limited(self, key: K, backoff: Backoff = DEFAULT_BACKOFF) -> float:
        """Queue ``key`` after its backoff (one more retry counted); returns the delay."""
        retries = self._retries.get(key, 0)
        self._retries[key] = retries + 1
        delay = backoff.delay(retries)
        self.add_after(key, delay)
        return delay

    def retries(self, key: K) -> int:
        """How many rate-limited retries ``key`` had since it was last forgotten."""
        return self._retries.get(key, 0)

    def forget(self, key: K) -> None:
        """Reset ``key``'s backoff (its pass succeeded, or it is given up on)."""
        self._retries.pop(key, None)

    # ------------------------------------------------------------------ working

    async def get(self) -> K:
        """The next key, now held by the caller until :meth:`done`. Raises
        :class:`QueueShutDown` once the queue is shut down."""
        while not self._queue:
            if self._shut:
                raise QueueShutDown
            self._ready.clear()
            await self._ready.wait()
        key = self._queue.popleft()
        self._dirty.discard(key)
        self._processing.add(key)
        if not self._queue:
            self._ready.clear()
        return key

    def done(self, key: K) -> None:
        """The caller's pass over ``key`` ended; a key marked dirty meanwhile is queued."""
        self._processing.discard(key)
        if key in self._dirty and not self._shut:
            self._queue.append(key)
            self._ready.set()
        elif not self._queue and not self._processing:
            self._idle.set()

    def cancel_delayed(self) -> None:
        """Drop the keys waiting for their delay (their owner stops)."""
        for _, timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def shutdown(self) -> None:
        """No more keys: delayed ones are dropped, waiting workers get
        :class:`QueueShutDown`."""
        self._shut = True
        self.cancel_delayed()
        self._queue.clear()
        self._dirty.clear()
        self._ready.set()
        if not self._processing:
            self._idle.set()

    # ------------------------------------------------------------------ looking

    def __len__(self) -> int:
        """Keys waiting (not held, not delayed)."""
        return len(self._queue)

    @property
    def delayed(self) -> int:
        """Keys whose :meth:`add_after` delay has not passed yet."""
        return len(self._timers)

    def is_dirty(self, key: K) -> bool:
        """``key`` waits, or will be queued again when its worker is done."""
        return key in self._dirty

    def is_processing(self, key: K) -> bool:
        return key in self._processing

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing is held (delayed keys aside)."""
        return not self._queue and not self._processing

    async def wait_idle(self) -> None:
        await self._idle.wait()
