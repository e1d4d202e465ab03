"""The config dir as a source of desired state: what its files say, held in memory, and
which keys each read changed.

The config dir is where every writer of slot config writes through the guard — ``stack
apply``, GitOps, the API — and what a person may edit by hand. :class:`FilesSource`
reads it (:func:`~controller.spec.configdir.read_config_dir`, with a
:class:`~controller.spec.configdir.ParseCache` of its own: an unchanged file is not parsed
again), keeps the last good of what fails validation (SPEC §8: a slot file that is present
but invalid keeps the slot's last good spec, else a bad hand edit would read as "no longer
declared" and the slot would be unloaded; a broken catalogue keeps the last good
catalogue), and says which slots, models and aliases a read changed
(:class:`~controller.spec.sources.DesiredChange`).

Two ways to read: the whole dir (:meth:`FilesSource.take` of a
:meth:`~FilesSource.read_fresh`: the watcher, the resync, a stack apply), or only the
slots a write named (:meth:`FilesSource.take_slots` of :meth:`~FilesSource.read_slots`:
the API wrote one slot file and re-reads that one; the rules across slots are judged
again over what is held, in memory). The reads do I/O and are safe off the event loop;
the takes change what is held and run on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from controller.spec.adapters import AdapterEntry
from controller.spec.aliases import AliasEntry
from controller.spec.configdir import (
    ConfigSnapshot,
    ParseCache,
    SlotFileRead,
    cross_problems,
    desired_slot,
    read_config_dir,
    read_slot,
    slot_file,
)
from controller.spec.loader import DesiredSlot
from controller.spec.schema import ControllerSettings, ModelSpec
from controller.spec.sources import DesiredChange

__all__ = ["FilesSource", "changed_keys"]

log = logging.getLogger("slotctl.spec")


def changed_keys(old: Mapping[str, object], new: Mapping[str, object]) -> set[str]:
    """The keys whose values differ between two mappings (added, removed, changed)."""
    out = {k for k, v in new.items() if old.get(k) != v}
    out.update(k for k in old if k not in new)
    return out


class FilesSource:
    """The config dir's desired state, read, validated and held (module docstring)."""

    name = "files"

    def __init__(self, config_dir: Path) -> None:
        self.config_dir = Path(config_dir)
        self.cache = ParseCache()  # what each slot file said: parsed again only when changed
        # Slots whose config file is present but invalid (kept, or unknown: not orphans).
        self.broken: set[str] = set()
        self._snapshot: ConfigSnapshot | None = None  # read at the first look

    # ------------------------------------------------------------------ the view

    @property
    def snapshot(self) -> ConfigSnapshot:
        """What is held: the last read taken (the first look reads)."""
        if self._snapshot is None:
            self.take(self.read_fresh())
        assert self._snapshot is not None
        return self._snapshot

    @property
    def synced(self) -> bool:
        return self._snapshot is not None

    @property
    def settings(self) -> ControllerSettings:
        return self.snapshot.settings

    @property
    def slots(self) -> Mapping[str, DesiredSlot]:
        return self.snapshot.slots

    @property
    def models(self) -> Mapping[str, ModelSpec]:
        return self.snapshot.models

    @property
    def aliases(self) -> Mapping[str, AliasEntry]:
        return self.snapshot.aliases

    @property
    def adapters(self) -> Mapping[str, AdapterEntry]:
        return self.snapshot.adapters

    # ------------------------------------------------------------------ the whole dir

    def read_fresh(self) -> ConfigSnapshot:
        """The config dir as it is on disk now, held by nobody (a writer's read before it
        writes; safe off the event loop)."""
        return read_config_dir(self.config_dir, self.cache)

    def take(self, fresh: ConfigSnapshot) -> DesiredChange | None:
        """Hold ``fresh`` (the last good kept of what is invalid); returns what changed.
        None: a missing or unlistable config dir, which changes nothing."""
        if not fresh.readable:
            for problem in fresh.errors:
                log.error("config dir: %s", problem.message)
            if self._snapshot is None:  # nothing held yet: an empty desired state
                self._snapshot = replace(fresh, errors=list(fresh.errors))
                return DesiredChange(settings=True)
            return None
        last = self._snapshot
        self._keep_last_good(fresh, last)
        self._snapshot = fresh
        for problem in fresh.errors:
            log.warning("config dir: %s: %s", problem.where(), problem.message)
        if last is None:
            return DesiredChange.of(
                fresh.slots, fresh.models, fresh.aliases, settings=True, adapters=fresh.adapters
            )
        return DesiredChange.of(
            changed_keys(last.slots, fresh.slots),
            changed_keys(last.models, fresh.models),
            changed_keys(last.aliases, fresh.aliases),
            settings=last.settings != fresh.settings,
            adapters=changed_keys(last.adapters, fresh.adapters),
        )

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

    # ------------------------------------------------------------------ some slots

    def read_slots(self, names: Iterable[str]) -> dict[str, SlotFileRead | None]:
        """The files of ``names`` as they are on disk now (None: no such file); safe off
        the event loop."""
        return {name: read_slot(self.config_dir, name, self.cache) for name in names}

    def take_slots(self, reads: Mapping[str, SlotFileRead | None]) -> DesiredChange:
        """Hold what :meth:`read_slots` read; the rules across slots are judged again over
        what is held (in memory). Returns the slots that changed."""
        held = self.snapshot
        slots, entries = dict(held.slots), dict(held.entries)
        touched = {str(slot_file(self.config_dir, name)) for name in reads}
        cross_ids = {id(p) for p in held.cross}
        errors = [p for p in held.errors if p.file not in touched and id(p) not in cross_ids]
        warnings = [p for p in held.warnings if p.file not in touched]
        broken = set(self.broken)
        for name, read in reads.items():
            broken.discard(name)
            if read is None:
                slots.pop(name, None)
                entries.pop(name, None)
                continue
            entry, stack, file_errors, file_warnings = read
            errors.extend(file_errors)
            warnings.extend(file_warnings)
            if entry is not None:
                slots[name] = desired_slot(entry, stack, held.settings)
                entries[name] = entry
                continue
            entries.pop(name, None)
            if any(p.severity == "error" for p in file_errors):
                broken.add(name)  # present but invalid: its last good spec stays, if any
            if name not in held.slots:
                slots.pop(name, None)
        cross = cross_problems(
            list(entries.values()),
            held.models,
            list(held.aliases.values()),
            list(held.adapters.values()),
        )
        fresh = replace(
            held,
            slots=slots,
            entries=entries,
            errors=errors + cross,
            warnings=warnings,
            cross=cross,
        )
        self._snapshot, self.broken = fresh, broken
        return DesiredChange.of(changed_keys(held.slots, slots))
