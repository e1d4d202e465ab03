"""The desired state in force: :class:`DesiredCache`, the one owner every reader asks,
merged from its sources and handed on, per key, to its listeners.

Where it sits: on top of :mod:`controller.spec`. Its first source is always the config
dir (:class:`~controller.spec.files.FilesSource`, where the guard writes); the operator
adds its custom resources (:class:`~controller.operator.source.CrSource`) after it. Each
source holds its part in memory and reports the keys a change touched
(:class:`~controller.spec.sources.DesiredChange`); the cache keeps one merged
:class:`~controller.spec.configdir.ConfigSnapshot` up to date key by key (the first source
that declares a slot or an alias holds it: a stack file's over a custom resource's; a
model, the last: a ``Model`` resource replaces the catalogue entry of its id), tells the
sources after the one that changed (they judge their keys against what is ahead of them),
and hands the change to its listeners — the reconciler, which queues exactly the slots a
change touched and keeps the manager's catalogue in step. The API reads the snapshot
from here, never from the files; writers read the disk through :meth:`DesiredCache.read_fresh`
before they write through the guard, then ask for a refresh of what they wrote
(:meth:`DesiredCache.refresh_async` with the slot names, or the whole dir).

Like a controller's informer cache, it is *synced* once every source has its first full
read or listing in (:meth:`DesiredCache.wait_synced`): a restarted operator adopts the
servers its custom resources declare only after it has seen them.

SPEC §8: a stack that fails validation changes nothing and the last good desired state
stays in force (:class:`~controller.spec.files.FilesSource`; a custom resource keeps its
last good spec in its own source).
"""

from __future__ import annotations

import asyncio
import logging
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from controller.spec.adapters import AdapterEntry
from controller.spec.aliases import AliasEntry
from controller.spec.configdir import ConfigSnapshot, ParseCache
from controller.spec.files import FilesSource
from controller.spec.loader import DesiredSlot
from controller.spec.replicas import replica_name, replica_of_name, replica_specs
from controller.spec.schema import ControllerSettings, ModelSpec
from controller.spec.sources import DesiredChange, DesiredSource, DesiredView

__all__ = ["DesiredCache", "Listener"]

log = logging.getLogger("slotctl.spec")

Listener = Callable[[DesiredChange], None]
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class _Ahead:
    """What the sources ahead of one hold, merged (the view it is judged against)."""

    layers: tuple[DesiredView, ...]

    @property
    def settings(self) -> ControllerSettings:
        return self.layers[0].settings

    @property
    def slots(self) -> Mapping[str, DesiredSlot]:
        return ChainMap(*(layer.slots for layer in self.layers))  # type: ignore[arg-type]

    @property
    def models(self) -> Mapping[str, ModelSpec]:
        return ChainMap(*(layer.models for layer in self.layers))  # type: ignore[arg-type]

    @property
    def aliases(self) -> Mapping[str, AliasEntry]:
        return ChainMap(*(layer.aliases for layer in self.layers))  # type: ignore[arg-type]

    @property
    def adapters(self) -> Mapping[str, AdapterEntry]:
        return ChainMap(*(layer.adapters for layer in self.layers))  # type: ignore[arg-type]


class DesiredCache:
    """The desired state in force, merged from its sources (module docstring)."""

    def __init__(self, config_dir: Path) -> None:
        self.config_dir = Path(config_dir)
        self.files = FilesSource(self.config_dir)
        self._sources: list[DesiredSource] = []
        self._listeners: list[Listener] = []
        self._lock: asyncio.Lock | None = None  # made on the loop, at the first async read
        self._merged: ConfigSnapshot | None = None  # built at the first look
        self._synced: asyncio.Event | None = None

    # ------------------------------------------------------------------ sources

    @property
    def parse_cache(self) -> ParseCache:
        """The config dir's parse cache (a member of its files source)."""
        return self.files.cache

    @property
    def broken(self) -> set[str]:
        """Slots whose config file is present but invalid right now (not orphans)."""
        return self.files.broken

    def add_source(self, source: DesiredSource) -> None:
        """Merge ``source`` after the ones there are (the config dir first)."""
        ahead = _Ahead((self.files, *self._sources))
        self._sources.append(source)
        source.attach(ahead, lambda change: self._from_source(source, change))

    @property
    def synced(self) -> bool:
        """Every source has its first full read or listing in."""
        return self.files.synced and all(s.synced for s in self._sources)

    async def wait_synced(self) -> None:
        """Until :attr:`synced` (the config dir is read here, off the loop, if it was not)."""
        if not self.files.synced:
            await self.refresh_async()
        if self.synced:
            return
        if self._synced is None:
            self._synced = asyncio.Event()
        await self._synced.wait()

    # ------------------------------------------------------------------ reading

    @property
    def snapshot(self) -> ConfigSnapshot:
        """The desired state in force, merged (the first look reads the config dir). One
        object, kept up to date key by key: read it on the event loop."""
        if self._merged is None:
            self._merged = self._merge_all()
        return self._merged

    def subscribe(self, listener: Listener) -> None:
        """``listener`` hears of every change from now on (the keys it touched)."""
        self._listeners.append(listener)

    def read_fresh(self) -> ConfigSnapshot:
        """The config dir as it is on disk now, published to nobody (a writer's read
        before it writes; safe off the event loop)."""
        return self.files.read_fresh()

    # ------------------------------------------------------------------ refreshing

    def refresh(self, fresh: ConfigSnapshot | None = None) -> ConfigSnapshot:
        """Read the config dir again (or take ``fresh``, read off the loop), hold it,
        publish what changed. A missing or unlistable config dir changes nothing."""
        first = not self.files.synced
        change = self.files.take(fresh if fresh is not None else self.files.read_fresh())
        if first:
            self._merged = None  # built whole at the next look
        if change is not None:
            self._publish(0, change)
        return self.snapshot

    def refresh_slots(self, names: Iterable[str]) -> ConfigSnapshot:
        """Read only the files of ``names`` again (a write named them) and publish."""
        if not self.files.synced:
            return self.refresh()
        self._publish(0, self.files.take_slots(self.files.read_slots(names)))
        return self.snapshot

    async def refresh_async(self, slots: Iterable[str] | None = None) -> ConfigSnapshot:
        """:meth:`refresh` (or, with ``slots``, :meth:`refresh_slots`) with the reading
        in a worker thread; one at a time, so a slower, older read never replaces a newer
        one."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if slots is not None and self.files.synced:
                names = list(slots)
                reads = await asyncio.to_thread(self.files.read_slots, names)
                self._publish(0, self.files.take_slots(reads))
                return self.snapshot
            fresh = await asyncio.to_thread(self.files.read_fresh)
            return self.refresh(fresh)

    # ------------------------------------------------------------------ merging

    def _layers(self) -> list[DesiredView]:
        return [self.files, *self._sources]

    def _merge_all(self) -> ConfigSnapshot:
        held = self.files.snapshot
        merged = ConfigSnapshot(settings=held.settings)
        self._mirror(merged, held)
        for layer in self._layers():  # the first source that declares a slot holds it
            for name, slot in layer.slots.items():
                merged.slots.setdefault(name, slot)
            merged.models.update(layer.models)  # a model: the last
            for alias_id, alias in layer.aliases.items():
                merged.aliases.setdefault(alias_id, alias)
            for adapter_id, adapter in layer.adapters.items():
                merged.adapters.setdefault(adapter_id, adapter)
        for slot in list(merged.slots.values()):  # a slot's replicas beside it
            for spec in replica_specs(slot.spec):
                merged.slots.setdefault(spec.name, replace(slot, spec=spec))
        return merged

    @staticmethod
    def _mirror(merged: ConfigSnapshot, held: ConfigSnapshot) -> None:
        merged.settings = held.settings
        merged.errors = held.errors
        merged.warnings = held.warnings
        merged.catalogue_ok = held.catalogue_ok
        merged.readable = held.readable
        merged.entries = held.entries
        merged.cross = held.cross

    def _from_source(self, source: DesiredSource, change: DesiredChange) -> None:
        self._publish(self._sources.index(source) + 1, change)

    def _publish(self, index: int, change: DesiredChange) -> None:
        """Source ``index`` (0: the files) changed ``change``: the sources after it judge
        again what it touches, the merged snapshot follows key by key, listeners hear."""
        for later in self._sources[index:]:  # (index 0 is the files: every source)
            change = change | later.before_changed(change)
        if self._merged is not None:
            change = change | self._apply(change)
        else:
            change = change | DesiredChange.of(self._replicas_of(change.slots))
        if change:
            for listener in self._listeners:
                listener(change)
        if self._synced is not None and self.synced:
            self._synced.set()

    def _replicas_of(self, names: Iterable[str]) -> list[str]:
        """The replicas' names of the slots ``names`` as the sources declare them."""
        out: list[str] = []
        for name in names:
            for layer in self._layers():
                slot = layer.slots.get(name)
                if slot is not None:
                    out.extend(s.name for s in replica_specs(slot.spec))
                    break
        return out

    def _apply(self, change: DesiredChange) -> DesiredChange:
        """``change`` into the merged snapshot; what else it touched: the replicas of the
        slots it names (those they had, those they have now)."""
        merged = self._merged
        assert merged is not None
        self._mirror(merged, self.files.snapshot)
        layers = self._layers()
        slot_layers = [layer.slots for layer in layers]
        touched: set[str] = set()
        for name in change.slots:
            old = merged.slots.get(name)
            if old is not None and old.spec.replica_of is None:
                for index in range(1, old.spec.max_count):
                    gone = replica_name(name, index)
                    held = merged.slots.get(gone)
                    if held is not None and held.spec.replica_of == name:
                        del merged.slots[gone]
                        touched.add(gone)
                        _put(merged.slots, gone, slot_layers)  # a source may declare it
            _put(merged.slots, name, slot_layers)
        # Then the replicas, once every declared slot is in (in any order of the names: a
        # declared slot put back after its name was a replica's would drop the replica).
        owners = set(change.slots)
        owners |= {o[0] for o in map(replica_of_name, change.slots) if o is not None}
        for name in sorted(owners):
            new = merged.slots.get(name)
            if new is not None and new.spec.replica_of is None:
                for spec in replica_specs(new.spec):
                    if spec.name not in merged.slots:
                        merged.slots[spec.name] = replace(new, spec=spec)
                        touched.add(spec.name)
        for model_id in change.models:
            _put(merged.models, model_id, [layer.models for layer in reversed(layers)])
        for alias_id in change.aliases:
            _put(merged.aliases, alias_id, [layer.aliases for layer in layers])
        for adapter_id in change.adapters:
            _put(merged.adapters, adapter_id, [layer.adapters for layer in layers])
        return DesiredChange.of(touched - change.slots)


def _put(merged: dict[str, V], key: str, layers: list[Mapping[str, V]]) -> None:
    """``merged[key]`` from the first layer that has it (gone if none has)."""
    for layer in layers:
        value = layer.get(key)
        if value is not None:
            merged[key] = value
            return
    merged.pop(key, None)
