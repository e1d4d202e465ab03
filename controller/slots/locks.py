"""The manager's locks, and the one order they are taken in.

* a **slot lock** (:attr:`SlotRecord.lock`): one operation at a time per slot (load,
  unload, recovery, a fault); independent slots run concurrently;
* an **exclusive-group lock**: at most one member of a group loads at a time (it unloads
  the loaded member first);
* a **device lock**: admission and reservation on one device, so two loads can never
  both pass admission for the same free memory.

Lock order: group -> slot -> device. An eviction runs under the evicting load's locks and
takes a *victim's* slot lock only when it is free (it checks ``busy`` first, nothing in
between yields), so no cycle can form. Nothing else takes more than one of these locks.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["Locks"]


class Locks:
    def __init__(self) -> None:
        self._groups: dict[str, asyncio.Lock] = {}
        self._devices: dict[str, asyncio.Lock] = {}

    def group(self, name: str | None) -> contextlib.AbstractAsyncContextManager[object]:
        """The exclusive group's lock (a no-op context for a slot without a group)."""
        if not name:
            return contextlib.nullcontext()
        return self._groups.setdefault(name, asyncio.Lock())

    def device(self, name: str) -> asyncio.Lock:
        return self._devices.setdefault(name, asyncio.Lock())
