"""Pull progress: bytes done of total, rate and ETA, as data and as a feed.

:class:`PullProgress` is what every consumer reads — the slot manager's ``progress``
events (:meth:`PullProgress.details` is an event's ``details``), the CLI's bar, the
dashboard and the metrics. :class:`ProgressMeter` counts the bytes as a pull's transfers
write them (from worker threads too: the hub's client is synchronous) and publishes a
snapshot on the event loop at most every ``interval`` seconds, and always at a phase
change; :class:`ProgressFeed` hands the snapshots to any number of waiters (a joined pull
has several), as a callback or an async iterator. Time is the injected clock's.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Final, Literal

from controller.kit.clock import Clock
from controller.modelfiles.redact import redact_url

__all__ = ["Phase", "ProgressFeed", "ProgressMeter", "PullProgress", "progress_words"]

Phase = Literal["checking", "downloading", "verifying", "done", "failed"]
_FINAL: Final = frozenset({"done", "failed"})
_RATE_WINDOW_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class PullProgress:
    """One snapshot of a pull (the ``details`` of a ``progress`` event)."""

    model: str
    source: str
    phase: Phase
    bytes_done: int = 0  # on disk for this pull, resumed bytes included
    bytes_total: int | None = None  # None until the size is known
    rate_bps: float = 0.0  # bytes per second over the last few seconds
    eta_s: float | None = None  # None while the rate or the total is unknown
    file: str | None = None  # the file being pulled (path in the repository, or name)
    files_done: int = 0
    files_total: int = 0
    bytes_resumed: int = 0  # found on disk from an earlier, interrupted pull

    @property
    def percent(self) -> float | None:
        if not self.bytes_total:
            return None
        return min(100.0, 100.0 * self.bytes_done / self.bytes_total)

    def details(self) -> dict[str, Any]:
        out = asdict(self)
        out["percent"] = None if self.percent is None else round(self.percent, 1)
        return out


class ProgressFeed:
    """The latest snapshot, for callbacks and async iterators (latest wins: a slow reader
    skips snapshots, never falls behind). Loop-thread only."""

    def __init__(self) -> None:
        self.latest: PullProgress | None = None
        self._changed = asyncio.Event()
        self._closed = False
        self._callbacks: list[Callable[[PullProgress], None]] = []

    def add_callback(self, callback: Callable[[PullProgress], None]) -> None:
        self._callbacks.append(callback)
        if self.latest is not None:
            callback(self.latest)

    def remove_callback(self, callback: Callable[[PullProgress], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def publish(self, progress: PullProgress) -> None:
        self.latest = progress
        event, self._changed = self._changed, asyncio.Event()
        event.set()
        for callback in list(self._callbacks):
            callback(progress)
        if progress.phase in _FINAL:
            self._closed = True

    async def updates(self) -> AsyncIterator[PullProgress]:
        """Every snapshot from the latest on, ending after the final one."""
        seen: PullProgress | None = None
        while True:
            changed = self._changed
            if self.latest is not None and self.latest is not seen:
                seen = self.latest
                yield seen
                continue
            if self._closed:
                return
            await changed.wait()


class ProgressMeter:
    """Counts one pull's bytes (any thread) and publishes snapshots (the loop's thread)."""

    def __init__(
        self,
        feed: ProgressFeed,
        start: PullProgress,
        clock: Clock,
        loop: asyncio.AbstractEventLoop,
        *,
        interval: float = 0.25,
    ) -> None:
        self._feed = feed
        self._state = start
        self._clock = clock
        self._loop = loop
        self._interval = interval
        self._lock = threading.Lock()
        self._done = start.bytes_done
        self._samples: deque[tuple[float, int]] = deque()
        self._last_publish = -1e18
        self._scheduled = False
        self._ended = False  # the final snapshot (done, failed) was published

    # -- counting (any thread) ----------------------------------------------------------

    def add(self, n: int) -> None:
        """``n`` more bytes are on disk. Published at once when the last publication is
        ``interval`` old, else when it will be (a trailing publication: the last bytes of
        a burst are shown even when nothing follows them — a held or stalled transfer)."""
        now = self._clock.monotonic()
        with self._lock:
            self._done += n
            self._samples.append((now, self._done))
            while self._samples and now - self._samples[0][0] > _RATE_WINDOW_S:
                self._samples.popleft()
            if self._scheduled:
                return
            self._scheduled = True
            delay = self._interval - (now - self._last_publish)
        self._loop.call_soon_threadsafe(self._publish_in, delay)

    def _publish_in(self, delay: float) -> None:
        if delay <= 0:
            self._publish_due()
        else:
            self._loop.call_later(delay, self._publish_due)

    def rewind(self, n: int) -> None:
        """``n`` bytes counted were dropped (a transfer restarted from zero)."""
        with self._lock:
            self._done = max(0, self._done - n)
            self._samples.clear()

    # -- state changes (loop thread) ----------------------------------------------------

    def update(self, **changes: Any) -> None:
        """Change the snapshot's fields (phase, file, totals) and publish at once."""
        with self._lock:
            if "bytes_done" in changes:
                self._done = int(changes["bytes_done"])
                self._samples.clear()
                # the rate's first sample: the first bytes that arrive give a rate at once
                self._samples.append((self._clock.monotonic(), self._done))
            self._state = replace(self._state, **changes)
        self._publish()

    def snapshot(self) -> PullProgress:
        now = self._clock.monotonic()
        with self._lock:
            done = self._done
            rate = 0.0
            if len(self._samples) >= 2:
                (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
                if t1 > t0:
                    rate = (b1 - b0) / (t1 - t0)
            if self._samples and now - self._samples[-1][0] > _RATE_WINDOW_S:
                rate = 0.0  # nothing arrived for a while
            state = self._state
        total = state.bytes_total
        eta = (total - done) / rate if total is not None and rate > 0 else None
        return replace(state, bytes_done=done, rate_bps=rate, eta_s=eta)

    def _publish_due(self) -> None:
        with self._lock:
            self._scheduled = False
        self._publish()

    def _publish(self) -> None:
        if self._ended:
            return  # a trailing publication after the final one: nothing new to say
        self._last_publish = self._clock.monotonic()
        snapshot = self.snapshot()
        self._ended = snapshot.phase in _FINAL
        self._feed.publish(snapshot)


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def progress_words(p: PullProgress) -> str:
    """A pull's progress in words (a ``progress`` event's message, the CLI's line)::

    pulling 52.0% (2.13 GB of 4.10 GB), 35.2 MB/s, ETA 57s
    """
    if p.phase != "downloading":
        return f"pulling {redact_url(p.source)}: {p.phase}"
    if p.bytes_total and p.percent is not None:
        words = f"pulling {p.percent:.1f}% ({_size(p.bytes_done)} of {_size(p.bytes_total)})"
    else:
        words = f"pulling {_size(p.bytes_done)}"
    if p.rate_bps > 0:
        words += f", {p.rate_bps / 1e6:.1f} MB/s"
    if p.eta_s is not None:
        words += f", ETA {p.eta_s:.0f}s"
    return words
