"""Pull counters for ``/metrics``: bytes pulled, pulls by outcome, pulls in flight.

Plain in-memory counts a :class:`~controller.modelfiles.pull.ModelFiles` keeps; the API's
metrics read them (``slotctl_model_pull_bytes_total``,
``slotctl_model_pulls_total{outcome}``, ``slotctl_model_pulls_in_flight`` in the
integration step). Outcomes: ``pulled``, ``resumed`` (finished what an earlier pull left),
``present`` (nothing to do), ``verified`` (a file on disk hashed and found right),
``verify_failed``, ``access_denied``, ``insufficient_disk``, ``failed``, ``cancelled``.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

__all__ = ["OUTCOMES", "PullStats"]

OUTCOMES: Final = (
    "pulled",
    "resumed",
    "present",
    "verified",
    "verify_failed",
    "access_denied",
    "insufficient_disk",
    "failed",
    "cancelled",
)


@dataclass(slots=True)
class PullStats:
    bytes_pulled: int = 0  # bytes fetched over the network and written (all pulls)
    in_flight: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        """(Any thread: the transfers' writers count here.)"""
        with self._lock:
            self.bytes_pulled += n

    def finished(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def snapshot(self) -> dict[str, object]:
        return {
            "bytes_pulled": self.bytes_pulled,
            "in_flight": self.in_flight,
            "outcomes": {name: self.outcomes.get(name, 0) for name in OUTCOMES},
        }
