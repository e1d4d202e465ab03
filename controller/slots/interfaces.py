"""What each caller may ask of the slot manager: one narrow Protocol per caller.

The reconciler, the OpenAI router and the metrics collector type their manager as one of
these (the :class:`~.manager.SlotManager` façade satisfies all of them), so what a caller
uses is visible in one place and a new use is a deliberate change here.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Protocol

from controller.kit.eventbus import EventBus
from controller.model.events import Op
from controller.model.lifecycle import Candidate
from controller.probes.memory import MemoryProbe
from controller.runtime.base import Runtime
from controller.scheduling.decision import LoadDecision
from controller.scheduling.rollout import RolloutDecision
from controller.slots.records import (
    AdapterHold,
    DeviceFigures,
    Lease,
    Requester,
    SlotStatus,
    SlotView,
)
from controller.spec.loader import DesiredSlot
from controller.spec.schema import AdapterSpec, AliasSpec, ControllerSettings, ModelSpec, SlotSpec

__all__ = ["MetricsPort", "ReconcilerPort", "RouterPort"]


class RouterPort(Protocol):
    """The OpenAI router: pick a slot for a model, lease it, release it."""

    @property
    def models(self) -> dict[str, ModelSpec]: ...

    @property
    def settings(self) -> ControllerSettings:
        """The controller settings (the priority classes requests wait in)."""

    @property
    def aliases(self) -> dict[str, AliasSpec]:
        """The ``[[alias]]`` ids a request may name (controller.router.aliases)."""

    @property
    def adapters(self) -> Mapping[str, AdapterSpec]:
        """The ``[[adapter]]`` ids a request may name (controller.router.adapters)."""

    def routing(
        self,
    ) -> tuple[
        ControllerSettings,
        dict[str, ModelSpec],
        dict[str, AliasSpec],
        Mapping[str, AdapterSpec],
        int,
    ]:
        """``(settings, models, aliases, adapters, generation)`` in one call: what a routed
        request reads of them all, and the slot table's routing generation (bumped when
        what a model names, a slot's spec or its model changes)."""

    def adapter_slots(self, adapter: str) -> list[str]:
        """The slots that can serve ``adapter``, those holding it first."""
        ...

    def try_adapter(self, slot: str, adapter: str) -> AdapterHold | None: ...

    async def acquire_adapter(self, slot: str, adapter: str) -> AdapterHold: ...

    def release_adapter(self, hold: AdapterHold) -> None: ...

    def decide(self, name: str, *, background: bool = False) -> LoadDecision:
        """The load decision now (an alias's "fits": its victims)."""

    def views(self) -> list[SlotView]: ...

    def view(self, name: str) -> SlotView: ...

    def routable(self, model: str) -> list[Candidate]: ...

    def routes(self, model: str) -> tuple[str, ...]:
        """The names of :meth:`routable`'s slots, unranked (a lookup, for every request)."""

    def load_of(self, name: str) -> tuple[int, int, bool]:
        """``(in flight, waiting, warm)``: a replica's figures for the routing."""

    def known(self, name: str) -> SlotSpec | None: ...

    def last_used(self, name: str) -> float: ...

    def endpoint(self, name: str) -> str | None: ...

    def upstream_of(self, name: str) -> tuple[str | None, str]:
        """The endpoint and the replica group ("" none) of ``name``, in one look."""

    async def acquire(self, name: str, who: Requester | None = None) -> Lease: ...

    def try_acquire(self, name: str, who: Requester | None = None) -> Lease | None: ...

    def release(self, lease: Lease) -> None: ...


class MetricsPort(Protocol):
    """The Prometheus collector and ``/api/devices``: read-only figures."""

    @property
    def memory(self) -> MemoryProbe: ...

    @property
    def settings(self) -> ControllerSettings: ...

    def views(self) -> list[SlotView]: ...

    def devices(self) -> list[DeviceFigures]: ...


class ReconcilerPort(Protocol):
    """The reconciler: desired state in, loads/unloads/removals out."""

    @property
    def events(self) -> EventBus: ...

    @property
    def runtime(self) -> Runtime: ...

    @property
    def models(self) -> dict[str, ModelSpec]: ...

    def names(self) -> list[str]: ...

    def known(self, name: str) -> SlotSpec | None: ...

    def view(self, name: str) -> SlotView: ...

    def observe(self, name: str) -> SlotStatus | None: ...

    def launch_hash(self, desired: DesiredSlot) -> str | None: ...

    def set_models(self, models: dict[str, ModelSpec], order: list[str] | None = None) -> None: ...

    def set_aliases(self, aliases: dict[str, AliasSpec]) -> None: ...

    def set_adapters(self, adapters: Mapping[str, AdapterSpec]) -> None: ...

    def upsert(self, desired: DesiredSlot) -> None: ...

    def rollout_for(self, desired: DesiredSlot) -> RolloutDecision: ...

    async def roll_out(self, name: str, desired: DesiredSlot) -> RolloutDecision: ...

    def recreating(self, name: str, reason: str) -> AbstractContextManager[None]: ...

    def is_resident(self, name: str) -> bool: ...

    def is_paused(self, name: str) -> bool: ...

    def group_holder(self, name: str) -> str | None: ...

    def waiting(self) -> list[str]: ...

    def waiting_with_room(self) -> list[str]: ...

    async def load(
        self, name: str, *, resident: bool = True, background: bool = False
    ) -> SlotView: ...

    async def unload(
        self,
        name: str,
        *,
        force: bool = False,
        reason: str = "unloaded on request",
        clear_residency: bool = True,
        op: Op = Op.UNLOAD,
        pause: bool = False,
    ) -> SlotView: ...

    async def remove(self, name: str) -> None: ...

    def stop_pull(self, name: str, why: str) -> bool: ...

    async def reap_orphan(self, name: str) -> bool: ...
