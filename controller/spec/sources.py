"""Sources of desired state and the notice of what they changed. Pure (no I/O).

A *source* holds a part of the desired state in memory — the config dir's files
(:class:`~controller.spec.files.FilesSource`), the custom resources
(:class:`~controller.operator.source.CrSource`) — and says, each time it changes, which
keys changed: a :class:`DesiredChange`, slot names, model ids and alias ids, never the
whole state. :class:`~controller.spec.desired.DesiredCache` merges the sources (the first
source that declares a key holds it) and hands each change on to its listeners, so the
reconciler queues exactly the slots a change touches (controller-runtime's informers and
event handlers).

The seams, as protocols: :class:`DesiredView` is what a source offers (and what a later
source judges its own keys against: a custom resource never takes a name, a port or an
alias id a stack file holds); :class:`DesiredSource` adds being *synced* (its first full
read or listing is in: until every source is, nobody acts on the desired state, as a
controller waits for its caches) and being told what the sources before it changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from controller.spec.adapters import AdapterEntry
from controller.spec.aliases import AliasEntry
from controller.spec.loader import DesiredSlot
from controller.spec.schema import ControllerSettings, ModelSpec

__all__ = ["NO_CHANGE", "DesiredChange", "DesiredSource", "DesiredView", "Publish"]


@dataclass(frozen=True, slots=True)
class DesiredChange:
    """The keys one change touched: slot names, model ids, alias ids, adapter ids;
    ``settings``: the
    controller settings changed (every slot's migrations may read differently)."""

    slots: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()
    aliases: frozenset[str] = frozenset()
    settings: bool = False
    adapters: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls,
        slots: Iterable[str] = (),
        models: Iterable[str] = (),
        aliases: Iterable[str] = (),
        *,
        settings: bool = False,
        adapters: Iterable[str] = (),
    ) -> DesiredChange:
        return cls(
            frozenset(slots), frozenset(models), frozenset(aliases), settings, frozenset(adapters)
        )

    def __bool__(self) -> bool:
        return bool(self.slots or self.models or self.aliases or self.settings or self.adapters)

    def __or__(self, other: DesiredChange) -> DesiredChange:
        return DesiredChange(
            self.slots | other.slots,
            self.models | other.models,
            self.aliases | other.aliases,
            self.settings or other.settings,
            self.adapters | other.adapters,
        )


NO_CHANGE = DesiredChange()

Publish = Callable[[DesiredChange], None]


class DesiredView(Protocol):
    """A part of the desired state as its holder keeps it in memory."""

    @property
    def settings(self) -> ControllerSettings: ...

    @property
    def slots(self) -> Mapping[str, DesiredSlot]: ...

    @property
    def models(self) -> Mapping[str, ModelSpec]: ...

    @property
    def aliases(self) -> Mapping[str, AliasEntry]: ...

    @property
    def adapters(self) -> Mapping[str, AdapterEntry]: ...


class DesiredSource(DesiredView, Protocol):
    """A source the desired-state cache merges after the config dir's files."""

    name: str

    @property
    def synced(self) -> bool:
        """Its first full read (or listing) is in."""
        ...

    def attach(self, before: DesiredView, publish: Publish) -> None:
        """Judge against ``before`` (what the sources ahead of it hold) and report every
        change of its own through ``publish``."""
        ...

    def before_changed(self, change: DesiredChange) -> DesiredChange:
        """The sources ahead changed ``change``: judge again what it touches of this
        source's keys; returns what that changed here (published with ``change``)."""
        ...
