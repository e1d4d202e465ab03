"""Demand scaling of a slot's replicas: when to add one, when to take one away. Pure
(no I/O, no clock: ``now`` is given), after the Kubernetes HPA's stabilisation windows.

Between ``min_replicas`` and ``max_replicas`` (docs/replicas.md), from the router's own
counters of each replica (requests in flight, requests waiting for a turn or a load):

* a replica is *saturated* when requests wait for it, or it has ``max_concurrency``
  requests in flight;
* **the minimum**: once one replica runs (a slot loaded on demand), the replicas below
  ``min_count`` that are offline are loaded too, one at a time;
* **up**: every running replica has been saturated for ``scale_up_after_s`` without a
  break, no replica is coming up already, and fewer than ``max_count`` run: the lowest
  replica not running is loaded (a background load: admission places it without
  evicting anything of higher priority, or it waits);
* **down**: for ``scale_down_after_s`` without a break, the group's demand (in flight and
  waiting) has fit in half the concurrency of one replica fewer, and more than
  ``min_count`` run: the highest running replica above the minimum is unloaded (after
  its requests drain).

Hysteresis: each window restarts when its condition breaks and after every decision, and
the down window is the longer one, so a load that comes and goes faster than the windows
changes nothing (tests drive a square wave). Every decision carries its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["HOLD", "ReplicaFigures", "ScaleDecision", "ScaleMemory", "decide_scale"]

Action = Literal["up", "down", "hold"]
HOLD: Final = "hold"


@dataclass(frozen=True, slots=True)
class ReplicaFigures:
    """One replica as the scaler sees it."""

    name: str
    index: int
    running: bool  # up and serving
    coming: bool = False  # loading, starting, warming (or waking)
    in_flight: int = 0
    waiting: int = 0
    concurrency: int | None = None  # its max_concurrency (None: no limit)
    offline: bool = True  # not loaded and not failed: a load may start it (when not running)

    @property
    def saturated(self) -> bool:
        limit = self.concurrency
        return self.waiting > 0 or (limit is not None and self.in_flight >= limit)


@dataclass(frozen=True, slots=True)
class ScaleMemory:
    """What the scaler remembers of a group between two looks."""

    saturated_since: float | None = None
    quiet_since: float | None = None


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    action: Action
    replica: str = ""
    reason: str = ""
    memory: ScaleMemory = ScaleMemory()


def decide_scale(
    replicas: Sequence[ReplicaFigures],
    memory: ScaleMemory,
    now: float,
    *,
    min_count: int,
    max_count: int,
    up_after_s: float,
    down_after_s: float,
) -> ScaleDecision:
    """The decision for one slot's replicas now (see the module docstring)."""
    running = [r for r in replicas if r.running]
    if any(r.coming for r in replicas) or not running:
        # one is coming up (its own load, or a request's): both windows start afresh
        return ScaleDecision(HOLD, memory=ScaleMemory())
    missing = sorted(
        (r for r in replicas if r.index < min_count and not r.running and r.offline),
        key=lambda r: r.index,
    )
    if missing:  # the slot serves (on demand): its minimum comes with it
        reason = (
            f"{len(running)} of min_replicas = {min_count} running while the slot serves: "
            f"replica {missing[0].index} added"
        )
        return ScaleDecision("up", missing[0].name, reason, ScaleMemory())
    demand = sum(r.in_flight + r.waiting for r in running)
    if all(r.saturated for r in running):
        since = memory.saturated_since if memory.saturated_since is not None else now
        held = ScaleMemory(saturated_since=since)
        if len(running) >= max_count or now - since < up_after_s:
            return ScaleDecision(HOLD, memory=held)
        idle = sorted((r for r in replicas if not r.running), key=lambda r: r.index)
        if not idle:
            return ScaleDecision(HOLD, memory=held)
        waiting = sum(r.waiting for r in running)
        reason = (
            f"every one of {len(running)} running replica(s) saturated for "
            f"{now - since:.0f}s ({demand - waiting} in flight, {waiting} waiting): "
            f"replica {idle[0].index} added"
        )
        return ScaleDecision("up", idle[0].name, reason, ScaleMemory())
    # the one to go: an extra replica, one without requests first, the highest index first
    extras = sorted(
        (r for r in running if r.index >= min_count),
        key=lambda r: (r.in_flight + r.waiting > 0, -r.index),
    )
    limit = running[0].concurrency
    if len(running) <= min_count or not extras or limit is None:
        return ScaleDecision(HOLD, memory=ScaleMemory())
    room = (len(running) - 1) * limit / 2
    if demand > room:
        return ScaleDecision(HOLD, memory=ScaleMemory())
    since = memory.quiet_since if memory.quiet_since is not None else now
    quiet = ScaleMemory(quiet_since=since)
    if now - since < down_after_s:
        return ScaleDecision(HOLD, memory=quiet)
    victim = extras[0]
    reason = (
        f"{demand} request(s) across {len(running)} replicas for {now - since:.0f}s fit "
        f"in {len(running) - 1} at half their concurrency: replica {victim.index} removed"
    )
    return ScaleDecision("down", victim.name, reason, ScaleMemory())
