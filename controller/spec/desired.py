"""The live desired state's one owner: :class:`DesiredCache` reads the config dir, keeps the
last good spec of what fails validation, publishes the snapshot and tells its listeners.

Where it sits: on top of :mod:`controller.spec` (over the reader, :mod:`.configdir`, and
the guard's writes, which every writer makes before it asks for a refresh). The
reconciler holds one (its listener keeps the manager's catalogue in step), the API reads
the reconciler's, GitOps and the operator's CR source read the disk through it before
they write; a CLI command with no controller reads the config dir once, itself.

SPEC §8: a stack that fails validation changes nothing and the last good desired state
stays in force: a slot file that is present but invalid keeps the slot's last good spec
(without it, a bad hand edit would read as "no longer declared" and the slot would be
unloaded), a broken catalogue keeps the last good catalogue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from controller.spec.configdir import ConfigSnapshot, read_config_dir

__all__ = ["DesiredCache", "Listener"]

log = logging.getLogger("slotctl.spec")

Listener = Callable[[ConfigSnapshot], None]


class DesiredCache:
    """The config dir's desired state, read, validated and published (module docstring)."""

    def __init__(self, config_dir: Path) -> None:
        self.config_dir = Path(config_dir)
        self._listeners: list[Listener] = []
        self._lock: asyncio.Lock | None = None  # made on the loop, at the first async read
        # Slots whose config file is present but invalid (kept, or unknown: not orphans).
        self.broken: set[str] = set()
        self._snapshot: ConfigSnapshot | None = None  # read at the first look

    @property
    def snapshot(self) -> ConfigSnapshot:
        """The desired state in force: the last snapshot published (the first look reads)."""
        if self._snapshot is None:
            first = self.read_fresh()
            self._keep_last_good(first, None)
            self._snapshot = first
        return self._snapshot

    def subscribe(self, listener: Listener) -> None:
        """``listener`` hears of every snapshot published from now on."""
        self._listeners.append(listener)

    def read_fresh(self) -> ConfigSnapshot:
        """The config dir as it is on disk now, published to nobody (a writer's read
        before it writes; safe off the event loop)."""
        return read_config_dir(self.config_dir)

    def refresh(self, fresh: ConfigSnapshot | None = None) -> ConfigSnapshot:
        """Read the config dir again (or take ``fresh``, read off the loop), keep the last
        good of what is invalid, publish, tell the listeners. A missing or unlistable
        config dir changes nothing."""
        fresh = fresh if fresh is not None else self.read_fresh()
        if not fresh.readable:
            for problem in fresh.errors:
                log.error("config dir: %s", problem.message)
            return self.snapshot
        self._keep_last_good(fresh, self._snapshot)
        self._snapshot = fresh
        for problem in fresh.errors:
            log.warning("config dir: %s: %s", problem.where(), problem.message)
        for listener in self._listeners:
            listener(fresh)
        return fresh

    async def refresh_async(self) -> ConfigSnapshot:
        """:meth:`refresh` with the read (parsing every file) in a worker thread; one at a
        time, so a slower, older read never replaces a newer one."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            fresh = await asyncio.to_thread(self.read_fresh)
            return self.refresh(fresh)

    def _keep_last_good(self, fresh: ConfigSnapshot, last: ConfigSnapshot | None) -> None:
        invalid = {
            Path(p.file).resolve()
            for p in fresh.errors
            if p.file and p.severity == "error" and Path(p.file).exists()
        }
        if not fresh.catalogue_ok and last is not None:
            # A broken catalogue keeps the last good one: otherwise every slot bound to a
            # model would read as changed (recreate) or unknown (unload).
            fresh.models = dict(last.models)
        kept = set()
        for name, good in last.slots.items() if last is not None else ():
            if name not in fresh.slots and good.file and Path(good.file).resolve() in invalid:
                fresh.slots[name] = good
                kept.add(name)
        # Also without a last good spec (a controller started while the file is broken):
        # the slot a broken file names is not an orphan. The catalogue and the settings
        # sit in the config dir itself; slot files below it.
        config_dir = self.config_dir.resolve()
        self.broken = kept | {
            path.stem
            for path in invalid
            if path.parent != config_dir and path.stem not in fresh.slots
        }
