"""The operator's status board: manager events -> wake-ups for the CRs' status timers.

A part of :mod:`controller.operator.run` (its sink): each status timer waits here for a
change it would show — its own slot's events, a sync that changed its verdict
(:meth:`StatusBoard.wake`), or (the timers that read every slot) any change — and the
board keeps each slot's last error and the transitions still to be posted as Events.
No I/O, no kopf.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable, Iterable

from controller.model.events import Event
from controller.model.lifecycle import SlotState
from controller.operator.status import reason_of
from controller.spec.replicas import replica_of_name

__all__ = ["StatusBoard"]


class StatusBoard:
    """Manager events -> wake-ups for the status timers, last errors, pending Events.

    A slot's event wakes the timer of that slot's CR and the timers that read every slot
    (the Models', the Aliases': :meth:`wait` without a slot); a source sync (a CR changed)
    or an event of no slot wakes them all. Waking every timer on every event was O(slots)
    work an event: at 1,000 Slots, a million wake-ups for a converge (issue 28)."""

    def __init__(self) -> None:
        self.version = 0  # every change
        self.pokes = 0  # the changes every timer sees
        self._changed = asyncio.Event()  # replaced on every change: waiters hold the old one
        self._counts: dict[str, int] = {}  # each slot's own changes
        self._woken: dict[str, asyncio.Event] = {}  # a slot's waiting timer's event
        self.last_error: dict[str, tuple[str, str]] = {}
        # each slot's last rollout (the reconciler's plan, a rollout's steps, or one the
        # status saw in flight: an operator's first plans come before the board
        # listens): (strategy, reason)
        self.rollouts: dict[str, tuple[str, str]] = {}
        self.pending: dict[str, list[tuple[str, str, str]]] = {}

    def on_event(self, event: Event) -> None:
        if event.slot is None:
            self.poke()
            return
        if event.error:
            self.last_error[event.slot] = (event.error, event.message)
        way = event.details.get("rollout")
        if isinstance(way, str):  # a rollout decided (a plan), or one's step
            reason = str(event.details.get("rollout_reason", ""))
            self.rollouts[event.slot] = (way, reason)
            if event.kind == "plan":
                self._post(event.slot, "Normal", reason_of(f"rollout {way}"), f"{way}: {reason}")
        if event.kind == "rollout" and event.details.get("phase") in ("failed", "done"):
            failed = event.details.get("phase") == "failed"
            kind = "Warning" if failed else "Normal"
            self._post(
                event.slot, kind, "RolloutFailed" if failed else "RolloutDone", event.message
            )
        if event.kind == "transition":
            kind = "Warning" if event.to_state == SlotState.ERROR.value else "Normal"
            text = f"{event.from_state} -> {event.to_state}"
            if event.message:
                text += f": {event.message}"
            self._post(event.slot, kind, reason_of(event.to_state or "changed"), text)
        # a replica's change is its slot's too (the Slot's status sums its replicas up)
        owner = replica_of_name(event.slot)
        for slot in (event.slot,) if owner is None else (event.slot, owner[0]):
            self._counts[slot] = self._counts.get(slot, 0) + 1
            woken = self._woken.pop(slot, None)
            if woken is not None:
                woken.set()
        self._bump()

    def _post(self, slot: str, kind: str, reason: str, text: str) -> None:
        queue = self.pending.setdefault(slot, [])
        queue.append((kind, reason, text))
        del queue[:-20]  # bounded: a slot nobody looks at does not grow it

    def wake(self, slots: Iterable[str]) -> None:
        """Wake the timers of ``slots`` and the ones that read every slot (a sync that
        changed their verdicts); the other Slots' timers sleep on. A sync used to wake
        every timer: at 1,000 Slots a burst's syncs were each 1,000 timer runs."""
        for slot in set(slots):
            self._counts[slot] = self._counts.get(slot, 0) + 1
            woken = self._woken.pop(slot, None)
            if woken is not None:
                woken.set()
        self._bump()

    def poke(self) -> None:
        self.pokes += 1
        woken, self._woken = self._woken, {}
        for each in woken.values():
            each.set()
        self._bump()

    def _bump(self) -> None:
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def stamp(self, slot: str | None) -> Hashable:
        """What :meth:`wait` compares: every change, or (``slot``) the ones it sees."""
        return self.version if slot is None else (self.pokes, self._counts.get(slot, 0))

    async def wait(self, seen: Hashable, timeout: float, slot: str | None = None) -> Hashable:
        """Until the stamp moves past ``seen`` (a change of ``slot``, or of anything) or
        ``timeout``; returns the stamp."""
        if self.stamp(slot) == seen:
            woken = self._woken
            event = self._changed if slot is None else woken.setdefault(slot, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        return self.stamp(slot)

    def take_events(self, slot: str) -> list[tuple[str, str, str]]:
        return self.pending.pop(slot, [])
