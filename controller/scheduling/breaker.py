"""The crash-loop breaker: exponential backoff between failed loads (SPEC §1).

Pure (times are passed in). Consecutive failed loads back off 1 s, 2 s, 4 s ... capped at
300 s; a load inside the window is refused with ``retry_after_s``. After
``max_failures`` the breaker is *open*: it refuses for the whole cap (300 s), then lets
exactly one try through (*half-open*): a success closes it (the count starts over once the
slot stays healthy), a failure opens it for another cap. So a transient fault (a port
held for a while) heals by itself; ``slotctl slot reset`` (or a config change) retries at
once. Staying ready and healthy for ``stable_s`` (60 s) resets the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.model.errors import SlotCrashLooping

__all__ = ["Breaker"]


@dataclass(slots=True)
class Breaker:
    base_s: float = 1.0
    cap_s: float = 300.0
    failures: int = 0
    blocked_until: float = 0.0  # monotonic
    last_error: str = ""

    def check(self, slot: str, now: float, max_failures: int) -> None:
        """Raise :class:`SlotCrashLooping` if a load may not be attempted now."""
        if now >= self.blocked_until:
            return  # closed, or open long enough: half-open lets this one try through
        wait = round(self.blocked_until - now, 3)
        if self.failures >= max_failures:
            raise SlotCrashLooping(
                f"slot {slot!r} failed {self.failures} times in a row (last: "
                f"{self.last_error or 'unknown'}); next try in {wait:g}s, or "
                f"`slotctl slot reset {slot}` to retry now",
                retry_after_s=wait,
                slot=slot,
                failures=self.failures,
                blocked=True,
            )
        raise SlotCrashLooping(
            f"slot {slot!r} is backing off after {self.failures} failed load(s); "
            f"retry in {wait:g}s",
            retry_after_s=wait,
            slot=slot,
            failures=self.failures,
            blocked=False,
        )

    def record_failure(self, now: float, error: str, max_failures: int | None = None) -> float:
        """Count a failed load; returns the backoff before the next attempt.

        From ``max_failures`` on, the breaker is open: the backoff is the cap.
        """
        self.failures += 1
        self.last_error = error
        backoff = float(min(self.cap_s, self.base_s * 2.0 ** (self.failures - 1)))
        if max_failures is not None and self.failures >= max_failures:
            backoff = self.cap_s
        self.blocked_until = now + backoff
        return backoff

    def to_record(self, now: float, wall_now: float) -> dict[str, float]:
        """What ``state.json`` keeps of the breaker (``failures``, ``retry_after_s``,
        ``retry_at`` on the wall clock), so a restarted controller goes on with it."""
        if not self.failures:
            return {}
        wait = self.retry_after(now)
        return {
            "failures": self.failures,
            "retry_after_s": round(wait, 3),
            "retry_at": round(wall_now + wait, 3),
        }

    def restore(
        self, failures: int, retry_at: float, last_error: str, now: float, wall_now: float
    ) -> None:
        """The breaker of a record written by :meth:`to_record` (monotonic ``now``)."""
        self.failures = max(0, failures)
        self.last_error = last_error
        self.blocked_until = now + max(0.0, retry_at - wall_now)

    def reset(self) -> None:
        self.failures = 0
        self.blocked_until = 0.0
        self.last_error = ""

    def retry_after(self, now: float) -> float:
        return max(0.0, self.blocked_until - now)
