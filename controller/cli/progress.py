"""Progress of a command that waits (``stack apply --wait``, ``slot|model load --wait``).

A waiting command polls the state of its slots; every change it sees is printed as one
:func:`controller.model.events.event_line` (the same text as ``slotctl events`` and ``slotctl
up``), the first column the seconds since the command started and no ``#id`` (a change
seen by polling, not an event of the controller's stream). A slot's first sight is its
state, no transition (an already converged stack shows its slots ``ready``, not a
``- -> ready`` that never happened)::

       0.0s  state       chat              offline
       0.3s  transition  chat              offline -> starting
       2.1s  transition  chat              starting -> ready
"""

from __future__ import annotations

import time

from controller.model.events import Event, EventKind, Op, event_line

__all__ = ["Progress"]


class Progress:
    """Prints each slot's state when it changes (see the module docstring)."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.started = time.time()
        self.quiet = quiet
        self._last: dict[str, str] = {}

    @property
    def elapsed(self) -> float:
        return time.time() - self.started

    def seen(self, slot: str, state: str, message: str = "") -> None:
        """``slot`` is in ``state`` now: a line if that is news."""
        before = self._last.get(slot)
        if before == state:
            return
        self._last[slot] = state
        if self.quiet:
            return
        change = Event(
            id=0,
            # the first sight: where the slot is, not a transition
            kind=EventKind.TRANSITION if before is not None else EventKind.STATE,
            op=Op.RECONCILE,
            slot=slot,
            from_state=before,
            to_state=state,
            message=message,
        )
        print(event_line(change, started=self.started), flush=True)
