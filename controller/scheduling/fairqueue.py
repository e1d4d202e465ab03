"""The fair wait queue: who is served next among requests waiting for one slot. Pure.

Where a request waits — for a cold load, a wake, a swap, or a slot at its
``max_concurrency`` — the waiters are served **by class weight** (stride scheduling:
each class advances by ``1 / weight`` per request served, and the class that has advanced
least goes next, so with every class waiting an ``interactive`` class of weight 8 gets 8
turns for a ``batch`` class's 1; the class whose next turn would end first goes, as in
virtual-finish-time fair queueing), **round-robin per key inside a class** (one key's flood
cannot starve another key of the same class), **first come, first served inside a key**
(and class: a request that lowered its own class waits in that class),
and with **aging**: a waiter older than ``age_s`` goes first whatever its class, so
nothing starves forever (``age_s = 0``: plain first come, first served). A class may
bound its waiters (``limit``): beyond it a push is refused (the router answers 429).

A class that had nothing waiting joins at the current pass of the others, so a class that
was idle cannot claim a burst of turns for the time it did not wait.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

__all__ = ["DEFAULT_AGE_S", "ClassSpec", "FairQueue", "QueueRefusal", "Waiter"]

T = TypeVar("T")
DEFAULT_AGE_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class ClassSpec:
    """A priority class: its weight (turns per round) and its waiters' bound (None: none)."""

    name: str
    weight: float
    limit: int | None = None


@dataclass(slots=True)
class Waiter(Generic[T]):
    key: str  # its flow: the API key's id ("" for the admin token; see queueshare)
    cls: str  # its class
    since: float  # when it began to wait (monotonic seconds)
    item: T
    seq: int = 0  # arrival order (set by the queue)
    served: bool = False
    removed: bool = False


@dataclass(frozen=True, slots=True)
class QueueRefusal:
    """Why a push was refused: the class's waiters are at its limit."""

    cls: str
    limit: int
    waiting: int


@dataclass(slots=True)
class _Class(Generic[T]):
    spec: ClassSpec
    keys: OrderedDict[str, deque[Waiter[T]]] = field(default_factory=OrderedDict)
    size: int = 0
    passed: float = 0.0  # the stride scheduler's pass


class FairQueue(Generic[T]):
    """Waiters of one slot (see the module docstring). Not thread-safe; O(classes) a pop."""

    def __init__(self, classes: Mapping[str, ClassSpec], *, age_s: float = DEFAULT_AGE_S) -> None:
        if not classes:
            raise ValueError("a fair queue needs at least one class")
        self.classes = {name: _Class[T](spec) for name, spec in classes.items()}
        self.age_s = age_s
        self._seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def waiting(self, cls: str) -> int:
        return self.classes[cls].size

    def waiting_classes(self) -> list[str]:
        """The classes with someone waiting."""
        return [name for name, group in self.classes.items() if group.size]

    def push(self, waiter: Waiter[T]) -> QueueRefusal | None:
        """Queue ``waiter`` (its class must be known); a refusal when the class is full."""
        group = self.classes[waiter.cls]
        limit = group.spec.limit
        if limit is not None and group.size >= limit:
            return QueueRefusal(waiter.cls, limit, group.size)
        if group.size == 0:  # joins at the others' pass: no credit for time it was idle
            busy = [c.passed for c in self.classes.values() if c.size]
            group.passed = max(group.passed, min(busy)) if busy else group.passed
        waiter.seq = next(self._seq)
        group.keys.setdefault(waiter.key, deque()).append(waiter)
        group.size += 1
        self._size += 1
        return None

    def remove(self, waiter: Waiter[T]) -> bool:
        """Take a waiter out (it gave up: a client that left, a timeout); True if queued."""
        if waiter.served or waiter.removed:
            return False
        group = self.classes[waiter.cls]
        line = group.keys.get(waiter.key)
        if line is None or waiter not in line:
            return False
        line.remove(waiter)
        if not line:
            del group.keys[waiter.key]
        waiter.removed = True
        group.size -= 1
        self._size -= 1
        return True

    def pop(self, now: float) -> Waiter[T] | None:
        """The next waiter to serve, taken out of the queue (None when empty)."""
        if not self._size:
            return None
        group = self._aged(now) or min(
            (c for c in self.classes.values() if c.size),
            key=lambda c: (c.passed + 1.0 / c.spec.weight, -c.spec.weight),
        )
        key, line = next(iter(group.keys.items()))
        waiter = line.popleft()
        if line:
            group.keys.move_to_end(key)  # round-robin: this key's next waits its turn
        else:
            del group.keys[key]
        group.size -= 1
        self._size -= 1
        group.passed += 1.0 / group.spec.weight
        waiter.served = True
        return waiter

    def _aged(self, now: float) -> _Class[T] | None:
        """The class of the oldest waiter, when it has waited longer than ``age_s``."""
        oldest: Waiter[T] | None = None
        home: _Class[T] | None = None
        for group in self.classes.values():
            for line in group.keys.values():
                head = line[0]
                if oldest is None or head.seq < oldest.seq:
                    oldest, home = head, group
        if oldest is None or home is None or (self.age_s and now - oldest.since <= self.age_s):
            return None
        # the oldest waiter's key goes first in its class, so the oldest one is served
        home.keys.move_to_end(oldest.key, last=False)
        return home

    def __iter__(self) -> Iterator[Waiter[T]]:
        for group in self.classes.values():
            for line in group.keys.values():
                yield from line
