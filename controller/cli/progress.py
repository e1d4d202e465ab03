"""Progress of a command that waits (``stack apply --wait``, ``slot|model load --wait``,
``model pull --wait``).

A waiting command polls the state of its slots; every change it sees is printed as one
:func:`controller.model.events.event_line` (the same text as ``slotctl events`` and ``slotctl
up``), the first column the seconds since the command started and no ``#id`` (a change
seen by polling, not an event of the controller's stream). A slot's first sight is its
state, no transition (an already converged stack shows its slots ``ready``, not a
``- -> ready`` that never happened)::

       0.0s  state       chat              offline
       0.3s  transition  chat              offline -> starting
       2.1s  transition  chat              starting -> ready

A slot ``pulling`` its model (or a ``model pull``) shows a :class:`PullBar` — bytes done
of total, rate, ETA — redrawn in place on a terminal (coloured unless ``NO_COLOR``), a
line per tenth of the way on a pipe or a log::

       0.4s  pull   chat  [########--------]  52.0%  2.13/4.10 GB  35.2 MB/s  ETA 57s
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Final, TextIO

from controller.model.events import Event, EventKind, Op, event_line

__all__ = ["Progress", "PullBar", "bar_text"]

_WIDTH: Final = 24


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def bar_text(progress: Mapping[str, Any], *, colour: bool = False) -> str:
    """A pull's progress (``PullProgress.details()`` as the API answers it) as one bar::

    [########----------------]  33.3%  1.37/4.10 GB  35.2 MB/s  ETA 77s
    """
    phase = str(progress.get("phase") or "")
    done = float(progress.get("bytes_done") or 0)
    total = progress.get("bytes_total")
    percent = progress.get("percent")
    if isinstance(percent, int | float) and not isinstance(percent, bool):
        filled = max(0, min(_WIDTH, int(_WIDTH * float(percent) / 100)))
        bar = "#" * filled
        if colour:
            bar = f"\x1b[32m{bar}\x1b[0m"
        parts = [f"[{bar}{'-' * (_WIDTH - filled)}]", f"{float(percent):5.1f}%"]
    else:
        parts = [f"[{'?' * _WIDTH}]", "    ?%"]
    if isinstance(total, int | float) and total:
        parts.append(f"{_size(done)}/{_size(float(total))}")
    else:
        parts.append(_size(done))
    rate = progress.get("rate_bps")
    if isinstance(rate, int | float) and rate > 0:
        parts.append(f"{rate / 1e6:.1f} MB/s")
    eta = progress.get("eta_s")
    if isinstance(eta, int | float):
        parts.append(f"ETA {eta:.0f}s")
    if phase and phase != "downloading":
        parts.append(phase)
    return "  ".join(parts)


class PullBar:
    """One pull's bar (see the module docstring): redrawn in place on a terminal, a line
    per tenth of the way (and each phase) elsewhere; ``NO_COLOR`` respected."""

    def __init__(self, label: str, *, stream: TextIO | None = None, started: float) -> None:
        self.label = label
        self.stream = stream or sys.stdout
        self.started = started
        self.live = self.stream.isatty() and os.environ.get("TERM") != "dumb"
        self.colour = self.live and not os.environ.get("NO_COLOR")
        self.drawn = False  # a live bar is on the current line
        self._said: tuple[str, int] | None = None

    def show(self, progress: Mapping[str, Any]) -> None:
        stamp = f"{max(0.0, time.time() - self.started):6.1f}s"
        head = f"{stamp}  {'pull':<10}  {self.label:<16}  "
        if self.live:
            text = bar_text(progress, colour=self.colour)
            self.stream.write("\r\x1b[2K" + head + text)
            self.stream.flush()
            self.drawn = True
            return
        percent = progress.get("percent")
        tenth = int(float(percent) // 10) if isinstance(percent, int | float) else -1
        said = (str(progress.get("phase") or ""), tenth)
        if said == self._said:
            return
        self._said = said
        print(head + bar_text(progress), file=self.stream, flush=True)

    def end(self) -> None:
        """Leave the bar's line (before another line is printed)."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


class Progress:
    """Prints each slot's state when it changes (see the module docstring)."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.started = time.time()
        self.quiet = quiet
        self._last: dict[str, str] = {}
        self._bars: dict[str, PullBar] = {}

    @property
    def elapsed(self) -> float:
        return time.time() - self.started

    def seen(
        self, slot: str, state: str, message: str = "", pull: Mapping[str, Any] | None = None
    ) -> None:
        """``slot`` is in ``state`` now: a line if that is news; ``pull``, the progress of
        its model's pull while it is ``pulling`` (a bar)."""
        before = self._last.get(slot)
        if before == state:
            if pull and not self.quiet:
                self.bar(slot).show(pull)
            return
        self._last[slot] = state
        if self.quiet:
            return
        for bar in self._bars.values():
            bar.end()
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
        if pull:
            self.bar(slot).show(pull)

    def bar(self, slot: str) -> PullBar:
        """``slot``'s pull bar (made at its first progress)."""
        found = self._bars.get(slot)
        if found is None:
            found = self._bars[slot] = PullBar(slot, started=self.started)
        return found

    def close(self) -> None:
        """End any bar drawn in place (before the command's last line)."""
        for bar in self._bars.values():
            bar.end()
