"""Builders for SlotManager unit tests: FakeRuntime, FakeClock, fake memory, no I/O but files."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from controller.kit.clock import FakeClock
from controller.kit.eventbus import Subscription
from controller.model.events import Event
from controller.model.lifecycle import LEGAL_TRANSITIONS, SlotState
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import ProbeResult, ProbeSpec
from controller.runtime.base import LaunchSpec, Observed, ProgressCallback
from controller.runtime.fake import FakeProber, FakeRuntime, FakeSleeper
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec

_PORTS = iter(range(20000, 60000))


def slot_spec(name: str, model: str | None = None, **kw: Any) -> SlotSpec:
    data: dict[str, Any] = {
        "name": name,
        "provider": "demo",
        "port": kw.pop("port", next(_PORTS)),
        "model": {"default": model if model is not None else f"{name}-m"},
        "device": "gpu",
    }
    data.update(kw)
    return normalise(SlotSpec.model_validate(data), ControllerSettings())


def model_spec(model_id: str, gb: float = 1.0, group: str | None = None) -> ModelSpec:
    return ModelSpec(id=model_id, source=f"demo://{model_id}", memory_gb=gb, exclusive_group=group)


def rebound(spec: SlotSpec, model: str, stack: str = "t") -> DesiredSlot:
    """``spec`` bound to ``model``: what a swap writes through the guard and reads back."""
    binding = spec.model.model_copy(update={"default": model})
    return DesiredSlot(spec=spec.model_copy(update={"model": binding}), stack=stack)


def desired(slots: Sequence[SlotSpec], models: Sequence[ModelSpec]) -> DesiredState:
    return DesiredState(
        stacks=("t",),
        models={m.id: m for m in models},
        slots={s.name: DesiredSlot(spec=s, stack="t") for s in slots},
    )


class YieldingRuntime(FakeRuntime):
    """FakeRuntime whose calls suspend, as every real runtime's I/O does.

    Each call first gives the loop ``turns`` turns, so other operations run between a
    manager's check and its next step: real interleavings, still without sleeping.
    """

    turns = 0

    async def _turn(self, turns: int | None = None) -> None:
        for _ in range(self.turns if turns is None else turns):
            await asyncio.sleep(0)

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        await self._turn()
        return await super().needs_prepare(launch)

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        await self._turn()
        await super().prepare(launch, progress)

    async def start(self, launch: LaunchSpec) -> Observed:
        await self._turn()
        return await super().start(launch)

    async def stop(self, slot: str, timeout: float) -> Observed:
        await self._turn()
        return await super().stop(slot, timeout)

    async def inspect(self, slot: str) -> Observed:
        await self._turn()
        return await super().inspect(slot)

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        await self._turn()
        return await super().logs(slot, tail)


class YieldingProber(FakeProber):
    """FakeProber over a :class:`YieldingRuntime`; ``liveness_turns`` makes probes slow."""

    runtime: YieldingRuntime
    liveness_turns: int | None = None

    async def probe(self, endpoint: str, spec: ProbeSpec, *, slot: str) -> ProbeResult:
        await self.runtime._turn()
        return await super().probe(endpoint, spec, slot=slot)

    async def liveness(
        self, endpoint: str, spec: ProbeSpec, *, slot: str, timeout_s: float | None = None
    ) -> ProbeResult:
        await self.runtime._turn(self.liveness_turns)
        return await super().liveness(endpoint, spec, slot=slot, timeout_s=timeout_s)


class Harness:
    def __init__(
        self,
        tmp: Path,
        *,
        gpu_gb: float = 24.0,
        margin_gb: float = 0.0,
        budget_gb: float | None = None,
        config: ManagerConfig | None = None,
    ) -> None:
        self.config = config or ManagerConfig(stop_timeout_s=1.0)
        self.clock = FakeClock(start=100.0)
        self.runtime = YieldingRuntime(self.clock)  # turns=0: a plain FakeRuntime
        self.prober = YieldingProber(self.runtime)
        settings = ControllerSettings(
            safety_margin_gb=margin_gb,
            memory_budget_gb={"gpu": budget_gb} if budget_gb is not None else {},
        )
        self.tmp = tmp
        self.settings = settings
        self.memory = FakeMemoryProbe({"gpu": int(gpu_gb * GIB), "cpu": 64 * GIB})
        self.manager = self.new_manager()

    def new_manager(self) -> SlotManager:
        manager = SlotManager(
            runtime=self.runtime,
            state_dir=self.tmp / "state",
            config_dir=self.tmp / "config",
            settings=self.settings,
            prober=self.prober,
            memory=self.memory,
            clock=self.clock,
            config=self.config,
            sleeper=FakeSleeper(self.runtime),
        )
        # A memory probe sees a server's memory once it is up, not while it is admitted
        # and still coming up (the manager reserves that memory itself).
        self.memory.used_by = manager.resident_bytes
        return manager


def assert_legal_history(transitions: Iterable[tuple[str, str, str]]) -> None:
    """Every recorded transition is in the table, and consecutive per slot."""
    last: dict[str, str] = {}
    for slot, before, after in transitions:
        assert SlotState(after) in LEGAL_TRANSITIONS[SlotState(before)], (slot, before, after)
        if slot in last:
            assert last[slot] == before, f"{slot}: {last[slot]} then {before} -> {after}"
        last[slot] = after


async def settle(manager: SlotManager, *, rounds: int = 100_000) -> None:
    """Let in-flight loads and background work (cleanups) finish; FakeClock: no sleeping."""
    for _ in range(rounds):
        pending = [t for t in manager.core.tasks if not t.done()]
        pending += [
            s.flight.task
            for s in manager.core.table.records.values()
            if s.flight.task is not None and not s.flight.task.done()
        ]
        if not pending:
            return
        await asyncio.sleep(0)
    raise AssertionError("manager did not settle")


def events_of(sub: Subscription, kind: str | None = None) -> list[Event]:
    """Drain a subscription (without waiting); optionally only events of ``kind``."""
    out: list[Event] = []
    while (event := sub.get_nowait()) is not None:
        if kind is None or event.kind == kind:
            out.append(event)
    return out
