"""What the manager's parts share: the I/O seams, the table, the wishes, the locks.

:class:`Core` is built once by the :class:`~controller.slots.manager.SlotManager` façade;
each part (:mod:`.loading`, :mod:`.leases`, :mod:`.housekeeping`, :mod:`.recovery`) is a
:class:`Part` over it and reads the seams through it (``settings`` may be replaced while
the manager runs, so parts never keep a copy).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from controller.clock import Clock
from controller.events import EventBus
from controller.memory import MemoryProbe
from controller.probe import Prober
from controller.providers import BuildContext, build_launch
from controller.runtime.base import LaunchSpec, Runtime
from controller.slots.locks import Locks
from controller.slots.records import ManagerConfig, SlotRecord
from controller.slots.table import SlotTable
from controller.slots.wishes import Wishes
from controller.spec.schema import ControllerSettings
from controller.tasks import TaskSet

__all__ = ["Core", "Part"]

log = logging.getLogger("slotctl.manager")


@dataclass(slots=True)
class Core:
    runtime: Runtime
    prober: Prober
    memory: MemoryProbe
    clock: Clock
    events: EventBus
    config: ManagerConfig
    settings: ControllerSettings
    table: SlotTable
    wishes: Wishes
    locks: Locks
    tasks: TaskSet

    def build_launch(self, slot: SlotRecord) -> LaunchSpec:
        """The effective runtime config of ``slot`` on this manager's runtime."""
        runtime = self.runtime.kind if self.runtime.kind != "fake" else "process"
        ctx = BuildContext(runtime=runtime, stack=slot.stack)
        models_dir: Path | None = self.config.models_dir
        if models_dir is not None:
            ctx = replace(ctx, models_dir=models_dir)
        return build_launch(slot.spec, slot.model, ctx)


class Part:
    """A part of the manager: the shared :class:`Core` under short names."""

    def __init__(self, core: Core) -> None:
        self.core = core

    @property
    def runtime(self) -> Runtime:
        return self.core.runtime

    @property
    def prober(self) -> Prober:
        return self.core.prober

    @property
    def memory(self) -> MemoryProbe:
        return self.core.memory

    @property
    def clock(self) -> Clock:
        return self.core.clock

    @property
    def events(self) -> EventBus:
        return self.core.events

    @property
    def config(self) -> ManagerConfig:
        return self.core.config

    @property
    def settings(self) -> ControllerSettings:
        return self.core.settings

    @settings.setter
    def settings(self, value: ControllerSettings) -> None:
        self.core.settings = value  # every part reads it through the core: all see it

    @property
    def table(self) -> SlotTable:
        return self.core.table

    @property
    def wishes(self) -> Wishes:
        return self.core.wishes

    @property
    def locks(self) -> Locks:
        return self.core.locks

    @property
    def tasks(self) -> TaskSet:
        return self.core.tasks
