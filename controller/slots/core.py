"""What the manager's parts share: the I/O seams, the table, the wishes, the locks.

:class:`Core` is built once by the :class:`~controller.slots.manager.SlotManager` façade;
each part (:mod:`.loading`, :mod:`.leases`, :mod:`.housekeeping`, :mod:`.recovery`) is a
:class:`Part` over it and reads the seams through it (``settings`` may be replaced while
the manager runs, so parts never keep a copy).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final

from pydantic import BaseModel

from controller.kit.clock import Clock
from controller.kit.eventbus import EventBus
from controller.kit.tasks import TaskSet
from controller.model.devices import GpuRef, share
from controller.probes.memory import MemoryProbe
from controller.probes.readiness import Prober
from controller.probes.sleep import Sleeper
from controller.probes.usage import ProcessUsage
from controller.providers.base import default_models_dir
from controller.providers.launch import (
    build_launch,
    launch_context,
    launch_hash,
    placement_args,
    with_port,
)
from controller.runtime.base import LaunchSpec, Runtime
from controller.runtime.ports import can_bind, pick_free_port
from controller.slots.locks import Locks
from controller.slots.records import ManagerConfig, SlotRecord
from controller.slots.table import SlotTable
from controller.slots.wishes import Wishes
from controller.spec.schema import AdapterSpec, ControllerSettings

if TYPE_CHECKING:  # the engine: built by the composition root (controller.daemon.root)
    from controller.modelfiles.pull import ModelFiles

__all__ = ["Core", "Part", "TakenPorts", "same"]

RECENT_USE_S: Final = 600.0  # "used recently" for the eviction preference by class

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
    # The models dir's files (pull, verify, disk admission, GC): the seam a load pulls
    # through before its server starts (controller.slots.pulling). None: this controller
    # does not manage model files (a test's manager; the kubernetes runtime, whose pods'
    # init containers pull on their nodes): a missing file is the runtime's to report.
    files: ModelFiles | None = None
    # The declared adapters by id (controller/slots/adapters.py keeps it): a start-time
    # engine's launch names the files of those its slot lists.
    adapters: dict[str, AdapterSpec] = field(default_factory=dict)
    # What a server's processes hold (RSS; NVML per process): footprints learnt from
    # what ran (controller.slots.sizing).
    usage: ProcessUsage = field(default_factory=ProcessUsage)
    # Where hf:// and relative model sources resolve: the config's, else
    # $SLOTCTL_MODELS_DIR (default /models) as it is when the manager is built.
    models_dir: Path = field(init=False)
    # Port -> the slots that declared it or were given it, in memory: a superset, each
    # name checked against its slot when asked (:meth:`port_taken`). Whether a port is
    # another slot's is asked for every auto-port slot's launch hash; iterating the table
    # (and reading each port file) for it made a big stack O(N²) on the loop (issue 40).
    port_users: dict[int, set[str]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        configured = self.config.models_dir
        self.models_dir = configured or default_models_dir()

    def demand(self, slot: SlotRecord) -> float:
        """How much the requests waiting for ``slot`` weigh: the best weight among their
        priority classes (0: nobody waits, a background load). The locks serve the
        loads, wakes and swaps by it (:mod:`.locks`)."""
        waiting = slot.book.waiting_classes()
        weights = {c.name: c.weight for c in self.settings.priority_classes}
        return max((weights.get(c, 0.0) for c in waiting), default=0.0)

    def recent_weight(self, slot: SlotRecord, now: float) -> float:
        """The best weight among the classes that used ``slot`` in the last
        :data:`RECENT_USE_S` (0: none): inside a priority tier the eviction plan takes
        the slots used only by lower classes (batch) first."""
        weights = {c.name: c.weight for c in self.settings.priority_classes}
        return max(
            (
                weights.get(c, 0.0)
                for c, at in slot.book.class_used.items()
                if now - at <= RECENT_USE_S
            ),
            default=0.0,
        )

    def build_launch(self, slot: SlotRecord, *, starting: bool = False) -> LaunchSpec:
        """The effective runtime config of ``slot`` on this manager's runtime; a slot that
        leaves its port to the controller gets its chosen one (:meth:`auto_port`)."""
        ctx = launch_context(self.runtime.kind, slot.stack, self.models_dir, self.adapters)
        spec = slot.spec
        if spec.port is None:
            spec = with_port(spec, self.auto_port(slot, starting=starting))
        return build_launch(spec, slot.model, ctx)

    def auto_port(self, slot: SlotRecord, *, starting: bool = False) -> int:
        """The port chosen for a slot without one: the one recorded in its state dir (the
        same across restarts), else a free one, recorded first. Chosen again when another
        slot now declares it, or — ``starting`` its server — when it cannot be bound."""
        name = slot.name
        port = self.table.store.read_port(name)
        if port is not None:
            self._note_port(name, port)
        taken = TakenPorts(self, name)
        if port is None or port in taken or (starting and not can_bind("127.0.0.1", port)):
            port = pick_free_port(taken)
            self.record_port(slot, port, durable=starting)
            log.info("slot %s: port %d chosen by the controller", name, port)
        elif starting and not self.table.store.port_synced(name):
            self.table.store.write_port(name, port)  # durable before its server starts
        return port

    def record_port(self, slot: SlotRecord, port: int, *, durable: bool = True) -> None:
        """``port`` is ``slot``'s now (chosen for it, or a surge's new server's): written
        to its state dir first (durably when a server starts on it), then indexed; its
        hash memo goes (it holds the old one)."""
        self.table.store.write_port(slot.name, port, durable=durable)
        self._note_port(slot.name, port)
        self.forget_hash(slot)

    def slot_added(self, slot: SlotRecord) -> None:
        """A slot entered the table: index its port (declared, or chosen for it before — a
        restart's — read once from its state dir) and let a slot given a port it declares
        choose another."""
        if slot.spec.port is None:
            chosen = self.table.store.read_port(slot.name)
            if chosen is not None:
                self._note_port(slot.name, chosen)
        self.port_declared(slot.name, slot.spec.port)

    def port_declared(self, by: str, port: int | None) -> None:
        """Slot ``by`` now declares ``port``: a slot that was given it chooses another at
        its next build (its hash memo goes, so the reconciler sees the change)."""
        if port is None:
            return
        self._note_port(by, port)
        for other_name in list(self.port_users.get(port, ())):
            other = self.table.records.get(other_name)
            if other is None or other_name == by or other.spec.port is not None:
                continue
            if self.table.store.read_port(other_name) == port:
                self.forget_hash(other)

    def port_taken(self, name: str, port: int) -> bool:
        """Whether another slot than ``name`` declares ``port`` or was given it."""
        users = self.port_users.get(port)
        if not users:
            return False
        taken = False
        for other_name in list(users):
            other = self.table.records.get(other_name)
            if other is None or self._port_of(other) != port:
                users.discard(other_name)  # removed, or on another port now
            elif other_name != name:
                taken = True
        if not users:
            del self.port_users[port]
        return taken

    def _port_of(self, slot: SlotRecord) -> int | None:
        return slot.spec.port or self.table.store.read_port(slot.name)

    def _note_port(self, name: str, port: int) -> None:
        self.port_users.setdefault(port, set()).add(name)

    def placed(self, slot: SlotRecord, launch: LaunchSpec) -> LaunchSpec:
        """``launch`` on the GPUs the slot was placed on, with what its provider needs to
        know of them (vLLM: its share of the GPU)."""
        gpus = slot.placement
        if not gpus:
            return launch.placed_on(())
        gpus = tuple(self._with_free(g) for g in gpus)
        part = share(slot.memory_bytes, len(gpus))
        return launch.placed_on(gpus, placement_args(slot.spec, gpus, part))

    def _with_free(self, gpu: GpuRef) -> GpuRef:
        """``gpu`` with its free memory now (None where the probe cannot tell)."""
        if gpu.node is not None:
            return gpu
        sample = self.memory.sample(gpu.key)
        free = sample.free_bytes if sample is not None and sample.error is None else None
        return replace(gpu, free_bytes=free)

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
        spec = slot.spec
        if spec.port is None:
            spec = with_port(spec, self.auto_port(slot))
        value = launch_hash(
            spec,
            slot.model,
            launch_context(self.runtime.kind, slot.stack, self.models_dir, self.adapters),
        )
        slot.hashed = (slot.spec, slot.model, slot.stack, value)
        return value

    @staticmethod
    def forget_hash(slot: SlotRecord) -> None:
        """Drop ``slot``'s hash memo (its port changed: the next ask builds it again)."""
        slot.hashed = None


class TakenPorts:
    """The ports other slots than one declare or were given, as a container
    (:func:`~controller.runtime.ports.pick_free_port` asks it about the kernel's picks)."""

    __slots__ = ("_core", "_name", "also")

    def __init__(self, core: Core, name: str, also: set[int] | None = None) -> None:
        self._core, self._name = core, name
        self.also: set[int] = also if also is not None else set()  # taken besides

    def __contains__(self, port: object) -> bool:
        if not isinstance(port, int):
            return False
        return port in self.also or self._core.port_taken(self._name, port)


def same(have: BaseModel | None, want: BaseModel | None) -> bool:
    """Equal specs (or models); pydantic's ``==`` compares every field even of the very
    same object, so identity is asked first."""
    return have is want or have == want


class Part:
    """A part of the manager: the shared :class:`Core`'s seams under short names (fixed for
    the manager's life, but ``settings``, which every part reads through the core)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.runtime: Runtime = core.runtime
        self.prober: Prober = core.prober
        self.memory: MemoryProbe = core.memory
        self.clock: Clock = core.clock
        self.events: EventBus = core.events
        self.config: ManagerConfig = core.config
        self.table: SlotTable = core.table
        self.wishes: Wishes = core.wishes
        self.locks: Locks = core.locks
        self.tasks: TaskSet = core.tasks
        self.sleeper: Sleeper = core.sleeper

    @property
    def settings(self) -> ControllerSettings:
        return self.core.settings

    @settings.setter
    def settings(self, value: ControllerSettings) -> None:
        self.core.settings = value  # every part reads it through the core: all see it
