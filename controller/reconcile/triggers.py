"""What puts slot names on the reconciler's work queue: its event sources (controller-
runtime's sources and event handlers). Each enqueues only the names its event touches:

* **a desired-state change** (:func:`desired_names`): the slots it names, the slots
  bound to a model it names, every slot when the controller settings changed;
* **a manager event** (:func:`follow_manager`): the slot an event is about — an autoload
  or resident slot that went offline or into error (evicted, crashed) is looked at again
  a second later — and, since memory may have come back, the slots waiting for it;
* **memory that comes back** without an unload (another process exits,
  :func:`watch_room`): the waiting slots that now have room;
* **the periodic resync** (:meth:`~controller.reconcile.reconciler.Reconciler.run`): every
  slot, after a fresh read of the config dir — what a missed event left behind is seen
  then.

A queued item is only a name; the pass re-reads desired and observed state, so a name
queued twice, or for a reason that no longer holds, costs one cheap pass at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from controller.model.events import Event, EventKind
from controller.model.lifecycle import SlotState
from controller.slots.interfaces import ReconcilerPort
from controller.spec.loader import DesiredSlot
from controller.spec.sources import DesiredChange

__all__ = ["Enqueue", "desired_names", "follow_manager", "watch_room"]

log = logging.getLogger("slotctl.reconcile")

_GONE_STATES = frozenset((SlotState.OFFLINE.value, SlotState.ERROR.value))


class Enqueue(Protocol):
    """The part of the work queue a trigger uses."""

    def add(self, key: str) -> None: ...

    def add_after(self, key: str, delay: float) -> None: ...


def desired_names(
    change: DesiredChange, slots: Mapping[str, DesiredSlot], known: Iterable[str]
) -> set[str]:
    """The slots a desired-state change touches: the ones it names, the ones bound to a
    model it names (their launch changes with the model), every one (declared or known to
    the manager) when the settings changed."""
    if change.settings:
        return set(slots) | set(known)
    names = set(change.slots)
    if change.models:
        names.update(n for n, s in slots.items() if s.spec.model_id in change.models)
    return names


def _gone(event: Event) -> bool:
    """What the follower looks at: a slot that went offline or into error."""
    return event.kind == EventKind.TRANSITION and event.to_state in _GONE_STATES


async def follow_manager(
    manager: ReconcilerPort, slots: Callable[[], Mapping[str, DesiredSlot]], queue: Enqueue
) -> None:
    """An autoload (or resident) slot that went offline or into error is looked at again;
    memory freed by any slot wakes the slots that wait for it. ``slots``: the desired
    state's slots, read at each event."""
    with manager.events.subscribe(accept=_gone, flips=False) as sub:
        async for event in sub:
            if event.slot is None:
                continue
            want = slots().get(event.slot)
            autoload = want is not None and want.autoload
            kept = autoload and not manager.is_paused(event.slot)
            if kept or (want is not None and manager.is_resident(event.slot)):
                queue.add_after(event.slot, 1.0)
            for name in manager.waiting():
                queue.add(name)


async def watch_room(
    manager: ReconcilerPort, queue: Enqueue, stop: asyncio.Event, every_s: float = 1.0
) -> None:
    """Memory that comes back without an unload (another process exits) wakes the slots
    waiting for it: a cheap check, no probe request, no log line."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        try:
            for name in manager.waiting_with_room():
                queue.add(name)
        except Exception:  # a failed memory probe: the next round tries again
            log.exception("checking memory for waiting slots failed")
