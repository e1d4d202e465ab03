"""The time seam: everything that waits or times out asks a :class:`Clock`.

``SYSTEM_CLOCK`` is real time. :class:`FakeClock` is for tests: ``sleep`` advances the
clock at once (yielding to the loop), so backoffs and timeouts run without sleeping.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "FakeClock"]


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


@dataclass(frozen=True, slots=True)
class _SystemClock:
    # The functions themselves, not methods that call them: a clock is read on every
    # request (a lease taken and given back).
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK: Final[Clock] = _SystemClock()


class FakeClock:
    """Deterministic time: starts at ``start``; ``sleep`` and ``advance`` move it."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self.now = start
        self.wall_offset = wall_offset
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now + self.wall_offset

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if seconds > 0:
            # Always move forward, as real time does: a sleep shorter than the float
            # resolution at ``now`` would leave it unchanged, and a loop sleeping until a
            # deadline (the remaining 1e-13 s) would then spin forever.
            self.now = max(self.now + seconds, math.nextafter(self.now, math.inf))
        await asyncio.sleep(0)
