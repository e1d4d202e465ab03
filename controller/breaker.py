"""The crash-loop breaker: exponential backoff between failed loads (SPEC §1).

Pure (times are passed in). Consecutive failed loads back off 1 s, 2 s, 4 s ... capped at
300 s; a load inside the window is refused with ``retry_after_s``. After
``max_failures`` the slot stays blocked until its config changes or it is reset.
Staying ready and healthy for ``stable_s`` (60 s) resets the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.errors import SlotCrashLooping

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
        if self.failures >= max_failures:
            raise SlotCrashLooping(
                f"slot {slot!r} failed {self.failures} times in a row (last: "
                f"{self.last_error or 'unknown'}); it stays in error until its config "
                f"changes or `slotctl slot reset {slot}`",
                retry_after_s=self.cap_s,
                slot=slot,
                failures=self.failures,
                blocked=True,
            )
        if now < self.blocked_until:
            wait = round(self.blocked_until - now, 3)
            raise SlotCrashLooping(
                f"slot {slot!r} is backing off after {self.failures} failed load(s); "
                f"retry in {wait:g}s",
                retry_after_s=wait,
                slot=slot,
                failures=self.failures,
                blocked=False,
            )

    def record_failure(self, now: float, error: str) -> float:
        """Count a failed load; returns the backoff before the next attempt."""
        self.failures += 1
        self.last_error = error
        backoff = float(min(self.cap_s, self.base_s * 2.0 ** (self.failures - 1)))
        self.blocked_until = now + backoff
        return backoff

    def reset(self) -> None:
        self.failures = 0
        self.blocked_until = 0.0
        self.last_error = ""

    def retry_after(self, now: float) -> float:
        return max(0.0, self.blocked_until - now)
