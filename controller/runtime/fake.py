"""An in-memory runtime for unit tests of the manager and the reconciler.

Shipped in the package (DESIGN.md: "one seam per kind of I/O") so every layer above the
runtime can be tested without processes. Behaviour is scripted per slot
(:class:`FakeScript`) and driven by a :class:`~controller.kit.clock.Clock`, so a test with a
``FakeClock`` decides when a server "finishes loading". :meth:`FakeRuntime.probe` answers
what the readiness probe would see, consistent with the script.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from controller.kit.clock import SYSTEM_CLOCK, Clock
from controller.model.errors import SlotSpawnFailed, SlotTerminateTimeout
from controller.probes.readiness import ProbeOutcome, ProbeResult, ProbeSpec, wait_ready
from controller.probes.sleep import SleepMode
from controller.runtime.base import LaunchSpec, Observed, ProgressCallback, RunStatus, RuntimeKind

__all__ = ["FakeProber", "FakeRuntime", "FakeScript", "FakeSleeper"]

Outcome = Literal["ready", "no_model", "hang", "exit"]


@dataclass(slots=True)
class FakeScript:
    """How one slot's fake server behaves."""

    start_error: str | None = None  # start() raises SlotSpawnFailed with this message
    load_s: float = 0.0  # time from start until the outcome applies
    outcome: Outcome = "ready"  # after load_s: ready / no_model / hang (warming) / exit
    exit_code: int = 1  # for outcome "exit"
    needs_pull: bool = False  # prepare() has work to do (then it is cleared)
    unkillable: bool = False  # stop() raises SlotTerminateTimeout
    log: list[str] = field(default_factory=list)
    sleep_error: str | None = None  # FakeSleeper.sleep fails with this
    wake_error: str | None = None  # FakeSleeper.wake fails with this
    wake_s: float = 0.0  # a wake takes this long (on the runtime's clock)


@dataclass(slots=True)
class _FakeObject:
    launch: LaunchSpec
    started: float  # clock.monotonic() at start
    ident: str
    exit_code: int | None = None


class FakeRuntime:
    """Scriptable in-memory runtime. ``starts`` counts start() calls that created a server."""

    kind = RuntimeKind.FAKE

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.scripts: dict[str, FakeScript] = {}
        self.objects: dict[str, _FakeObject] = {}
        self.starts: Counter[str] = Counter()
        self.stops: Counter[str] = Counter()
        self.sleeping: dict[str, int] = {}  # slot -> the level its server sleeps at
        self.sleeps: Counter[str] = Counter()
        self.wakes: Counter[str] = Counter()
        self._next_ident = 1000

    def script(self, slot: str, **changes: object) -> FakeScript:
        current = self.scripts.get(slot, FakeScript())
        self.scripts[slot] = replace(current, **changes)  # type: ignore[arg-type]
        return self.scripts[slot]

    def crash(self, slot: str, exit_code: int = 137) -> None:
        """The server dies now (as if killed by hand or OOM)."""
        obj = self.objects.get(slot)
        if obj is not None and obj.exit_code is None:
            obj.exit_code = exit_code

    def _script(self, slot: str) -> FakeScript:
        return self.scripts.get(slot, FakeScript())

    def _settle(self, slot: str, obj: _FakeObject) -> None:
        script = self._script(slot)
        loaded = self.clock.monotonic() - obj.started >= script.load_s
        if obj.exit_code is None and loaded and script.outcome == "exit":
            obj.exit_code = script.exit_code

    # ------------------------------------------------------------------ protocol

    async def needs_prepare(self, launch: LaunchSpec) -> bool:
        return self._script(launch.slot).needs_pull

    async def prepare(self, launch: LaunchSpec, progress: ProgressCallback | None = None) -> None:
        script = self._script(launch.slot)
        if script.needs_pull and progress is not None:
            result = progress({"slot": launch.slot, "status": "pulling", "current": 1, "total": 1})
            if result is not None:
                await result
        script.needs_pull = False

    async def start(self, launch: LaunchSpec) -> Observed:
        current = await self.inspect(launch.slot)
        if current.running:
            return current
        script = self._script(launch.slot)
        if script.start_error:
            raise SlotSpawnFailed(script.start_error, slot=launch.slot)
        self._next_ident += 1
        self.objects[launch.slot] = _FakeObject(
            launch=launch, started=self.clock.monotonic(), ident=str(self._next_ident)
        )
        self.starts[launch.slot] += 1
        return await self.inspect(launch.slot)

    async def stop(self, slot: str, timeout: float) -> Observed:
        if self._script(slot).unkillable and slot in self.objects:
            raise SlotTerminateTimeout(f"fake slot {slot!r} survived SIGKILL", slot=slot)
        observed = await self.inspect(slot)
        if slot in self.objects:
            self.stops[slot] += 1
            self.sleeping.pop(slot, None)
            obj = self.objects.pop(slot)
            code = obj.exit_code if obj.exit_code is not None else 0
            return replace(observed, status=RunStatus.EXITED, exit_code=code)
        return observed

    async def inspect(self, slot: str) -> Observed:
        obj = self.objects.get(slot)
        if obj is None:
            return Observed(slot=slot, status=RunStatus.MISSING)
        self._settle(slot, obj)
        status = RunStatus.RUNNING if obj.exit_code is None else RunStatus.EXITED
        return Observed(
            slot=slot,
            status=status,
            ident=obj.ident,
            exit_code=obj.exit_code,
            started_at=obj.started,
            config_hash=obj.launch.config_hash(),
            endpoint=obj.launch.endpoint,
            stack=obj.launch.stack,
            message="" if obj.exit_code is None else f"exited with code {obj.exit_code}",
        )

    async def list_managed(self) -> list[Observed]:
        return [await self.inspect(name) for name in sorted(self.objects)]

    async def logs(self, slot: str, tail: int = 100) -> list[str]:
        return self._script(slot).log[-tail:]

    async def close(self) -> None:
        """Nothing to release (the fake servers live in memory)."""

    # ------------------------------------------------------------------ probing

    def probe(self, slot: str) -> ProbeResult:
        """What a readiness probe sees now."""
        obj = self.objects.get(slot)
        if obj is None:
            return ProbeResult(ProbeOutcome.STILL_WARMING, "connection refused")
        self._settle(slot, obj)
        if obj.exit_code is not None:
            return ProbeResult(ProbeOutcome.STILL_WARMING, "connection refused (exited)")
        script = self._script(slot)
        if self.clock.monotonic() - obj.started < script.load_s or script.outcome == "hang":
            return ProbeResult(ProbeOutcome.STILL_WARMING, "HTTP 503 (loading)")
        if script.outcome == "no_model":
            return ProbeResult(ProbeOutcome.NO_MODEL, "server is up but lists no model")
        if slot in self.sleeping:
            return ProbeResult(ProbeOutcome.STILL_WARMING, "sentinel: HTTP 503 (asleep)")
        return ProbeResult(ProbeOutcome.READY, "ready", (obj.launch.model_id,))


class FakeSleeper:
    """The sleep seam for a :class:`FakeRuntime`: its servers sleep and wake in memory
    (``FakeScript.sleep_error``, ``wake_error`` and ``wake_s`` script them)."""

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def _running(self, endpoint: str) -> str | None:
        return next(
            (n for n, o in self.runtime.objects.items() if o.launch.endpoint == endpoint), None
        )

    async def sleep(self, endpoint: str, mode: SleepMode, level: int, timeout_s: float) -> str:
        slot = self._running(endpoint)
        if slot is None:
            return "connection refused"
        error = self.runtime._script(slot).sleep_error
        if error:
            return error
        self.runtime.sleeping[slot] = level
        self.runtime.sleeps[slot] += 1
        return ""

    async def wake(self, endpoint: str, mode: SleepMode, level: int, timeout_s: float) -> str:
        slot = self._running(endpoint)
        if slot is None:
            return "connection refused"
        script = self.runtime._script(slot)
        self.runtime.wakes[slot] += 1
        if script.wake_s > timeout_s:  # as HttpSleeper's: the wake's budget is spent
            await self.runtime.clock.sleep(timeout_s)
            return f"POST /wake_up: TimeoutError ({timeout_s:g}s spent)"
        if script.wake_s:
            await self.runtime.clock.sleep(script.wake_s)
        if script.wake_error:
            return script.wake_error
        self.runtime.sleeping.pop(slot, None)
        return ""

    async def asleep(self, endpoint: str, mode: SleepMode, timeout_s: float) -> bool | None:
        slot = self._running(endpoint)
        return None if slot is None else slot in self.runtime.sleeping


class FakeProber:
    """The probe seam for a :class:`FakeRuntime`: answers from the scripted servers.

    ``liveness_down`` makes liveness probes of a slot fail (a wedged server).
    """

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.liveness_down: set[str] = set()

    async def close(self) -> None:
        """Nothing to release."""

    async def wait_ready(
        self,
        endpoint: str,
        spec: ProbeSpec,
        *,
        slot: str,
        alive: Callable[[], Awaitable[bool]],
        warmup_timeout_s: float,
        clock: Clock,
    ) -> ProbeResult:
        async def attempt() -> ProbeResult:
            return self.runtime.probe(slot)

        return await wait_ready(
            attempt, alive=alive, warmup_timeout_s=warmup_timeout_s, clock=clock
        )

    async def probe(self, endpoint: str, spec: ProbeSpec, *, slot: str) -> ProbeResult:
        return self.runtime.probe(slot)

    async def liveness(
        self, endpoint: str, spec: ProbeSpec, *, slot: str, timeout_s: float | None = None
    ) -> ProbeResult:
        if slot in self.liveness_down:
            return ProbeResult(ProbeOutcome.HUNG, "liveness: no byte within the timeout")
        return self.runtime.probe(slot)
