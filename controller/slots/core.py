"""What the manager's parts share: the I/O seams, the table, the wishes, the locks.

:class:`Core` is built once by the :class:`~controller.slots.manager.SlotManager` façade;
each part (:mod:`.loading`, :mod:`.leases`, :mod:`.housekeeping`, :mod:`.recovery`) is a
:class:`Part` over it and reads the seams through it (``settings`` may be replaced while
the manager runs, so parts never keep a copy).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from controller.clock import Clock
from controller.errors import SlotctlError
from controller.events import EventBus
from controller.memory import MemoryProbe
from controller.probe import Prober
from controller.providers import BuildContext, build_launch
from controller.runtime.base import LaunchSpec, Runtime
from controller.sleepmode import Sleeper
from controller.slots.locks import Locks
from controller.slots.records import ManagerConfig, SlotRecord
from controller.slots.table import SlotTable
from controller.slots.wishes import Wishes
from controller.spec.schema import ControllerSettings
from controller.tasks import TaskSet

__all__ = ["Core", "Part", "same"]

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
    sleeper: Sleeper  # sleeps, wakes and asks servers that can sleep (the launch says)
    # Where hf:// and relative model sources resolve: the config's, else
    # $SLOTCTL_MODELS_DIR (default /models) as it is when the manager is built.
    models_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        configured = self.config.models_dir
        self.models_dir = configured or Path(os.environ.get("SLOTCTL_MODELS_DIR", "/models"))

    def build_launch(self, slot: SlotRecord) -> LaunchSpec:
        """The effective runtime config of ``slot`` on this manager's runtime."""
        runtime = self.runtime.kind if self.runtime.kind != "fake" else "process"
        ctx = BuildContext(runtime=runtime, stack=slot.stack, models_dir=self.models_dir)
        return build_launch(slot.spec, slot.model, ctx)

    def launch_hash(self, slot: SlotRecord) -> str | None:
        """The config hash ``slot`` would run with (None: its launch cannot be built).

        Memoised on the record: specs and models are immutable and the build context is
        fixed for the manager's life, so while the record holds the same spec, model and
        stack the hash is the same. A new desired state (a config read, a swap) brings new
        objects: equal ones take the memo over (compared once, then by identity again),
        changed ones are built again.
        """
        memo = slot.hashed
        if memo is not None and memo[2] == slot.stack:
            spec, model = memo[0], memo[1]
            if spec is slot.spec and model is slot.model:
                return memo[3]
            if same(spec, slot.spec) and same(model, slot.model):  # a re-read: new, equal
                slot.hashed = (slot.spec, slot.model, slot.stack, memo[3])
                return memo[3]
        try:
            value: str | None = self.build_launch(slot).config_hash()
        except SlotctlError:
            value = None
        slot.hashed = (slot.spec, slot.model, slot.stack, value)
        return value


def same(have: BaseModel | None, want: BaseModel | None) -> bool:
    """Equal specs (or models); pydantic's ``==`` compares every field even of the very
    same object, so identity is asked first."""
    return have is want or have == want


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

    @property
    def sleeper(self) -> Sleeper:
        return self.core.sleeper
