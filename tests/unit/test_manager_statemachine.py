"""A hypothesis state machine over the SlotManager (DESIGN.md "Tests").

FakeRuntime + FakeClock + FakeMemoryProbe; several slots on ``gpu`` and ``cpu`` with
different priorities, one pinned, two models in one exclusive group and a small GPU
budget, so admission refusals, pre-load evictions, pressure evictions and exclusive swaps
all happen. Every rule runs on one event loop owned by the machine; background work the
manager starts (joined loads, cleanups after cancelled waiters) keeps running across rules.
Besides one operation per rule there are two at once (``concurrently``), a runtime whose
calls can suspend like real I/O (drawn per run), and controller restarts (``restart``: the
in-flight work dies, a new manager recovers from state.json and the running servers).

Typed errors (``SlotctlError``) are legitimate outcomes of a rule, except
``IllegalSlotTransition``: the manager must never attempt an illegal transition. Anything
else fails, and so does a rule that does not finish (a deadlock).

Invariants, checked after every step (and some at every event, as it happens):

* only legal transitions, consecutive per slot, ending in the slot's current state;
* at most one member of an exclusive group admitted (pulling..unloading);
* admitted bytes per device never exceed the budget (minus the safety margin);
* a slot with an active lease is ``serving`` (never offline/unloading), same generation;
* eviction victims are never pinned, leased, or anything but ready/idle;
* state.json always equals the in-memory state, but for observations not written yet
  (SPEC §3: at most a lag window behind, never behind an intent or an outcome); an
  offline slot runs no server.

``SLOTCTL_SOAK=1`` (``make soak``) raises the number of examples and steps a lot.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from controller.kit.clock import FakeClock
from controller.model.errors import IllegalSlotTransition, SlotctlError
from controller.model.events import Event
from controller.model.lifecycle import LEGAL_TRANSITIONS, SlotState
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.runtime.fake import FakeSleeper
from controller.slots.manager import SlotManager
from controller.slots.records import (
    ADMITTED_STATES,
    LOADING_STATES,
    Lease,
    ManagerConfig,
    SlotRecord,
)
from controller.slots.table import OBSERVED
from controller.spec.loader import DesiredSlot
from controller.spec.schema import ControllerSettings, SlotSpec
from tests.unit.manager_fixtures import (
    YieldingProber,
    YieldingRuntime,
    desired,
    model_spec,
    rebound,
    slot_spec,
)

T = TypeVar("T")
S = SlotState

SOAK = os.environ.get("SLOTCTL_SOAK") == "1"
HANG_S = 10.0  # real seconds: a rule that takes longer is a deadlock (FakeClock never sleeps)

GPU_TOTAL_GB = 12.0
GPU_BUDGET_GB = 10.0
CPU_TOTAL_GB = 16.0
MARGIN_GB = 0.5
MAX_FAILURES = 3

_common: dict[str, Any] = {
    "idle_timeout_s": 20,
    "warmup_timeout_s": 20,
    "drain_timeout_s": 2,
    "liveness_interval_s": 5,
    "liveness_failures": 2,
    "max_consecutive_failures": MAX_FAILURES,
    "max_queue": 8,
}
SLOTS = [
    slot_spec("ga", "excl-a", priority=50, autoload=False, **_common),
    slot_spec("gb", "excl-b", priority=60, autoload=True, **_common),
    # mid and huge sleep when evicted (issue 22: the residency tier), huge at level 2
    slot_spec("mid", "mid-m", priority=10, autoload=False, ttl_s=50, sleep=True, **_common),
    slot_spec("pin", "pin-m", priority=90, pinned=True, **_common),
    slot_spec("huge", "huge-m", priority=30, autoload=False, sleep=True, sleep_level=2, **_common),
    slot_spec("ca", "cpu-a", priority=20, device="cpu", autoload=False, **_common),
    slot_spec("cb", "cpu-b", priority=70, device="cpu", autoload=False, ttl_s=80, **_common),
]
MODELS = [
    model_spec("excl-a", 4, group="x"),
    model_spec("excl-b", 4, group="x"),
    model_spec("mid-m", 3),
    model_spec("pin-m", 2),
    model_spec("huge-m", 8),
    model_spec("cpu-a", 6),
    model_spec("cpu-b", 9),
]
NAMES = [s.name for s in SLOTS]
PINNED = {s.name for s in SLOTS if s.pinned}
BUDGET = {
    "gpu": int(GPU_BUDGET_GB * GIB) - int(MARGIN_GB * GIB),
    "cpu": int(CPU_TOTAL_GB * GIB) - int(MARGIN_GB * GIB),
}

names = st.sampled_from(NAMES)
OPS = ["load", "load-transient", "unload", "acquire", "swap", "crash", "tick", "reset", "reap"]
model_ids = st.sampled_from([m.id for m in MODELS])


def _held(slot: SlotRecord, device: str) -> tuple[int, bool]:
    """What ``slot`` holds on ``device`` and whether it is coming up, worked out apart from
    the table's own sums: an asleep server holds its weights (level 1) on the host only; a
    wake holds its device again (reserved) and the host until it is ready."""
    if slot.state not in ADMITTED_STATES:
        return 0, False
    host = slot.memory_bytes if slot.asleep == 1 and device == "cpu" else 0
    if slot.asleep and not slot.waking:
        return host, False
    on = slot.where == device
    loading = on and (slot.state in LOADING_STATES or slot.waking)
    return (slot.memory_bytes if on else 0) + (host if slot.waking else 0), loading


def _scratch_dir() -> Path:
    shm = Path("/dev/shm")  # state.json writes fsync: tmpfs keeps thousands of them cheap
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="slotctl-sm-", dir=base))


class ManagerMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        # Our own worker threads: a "dead" controller's write still in a thread (the lag
        # writer's) ends before the next one starts, as it would with the process.
        self.executor = ThreadPoolExecutor(max_workers=4)
        self.loop.set_default_executor(self.executor)
        self.tmp = _scratch_dir()
        self.clock = FakeClock(start=1000.0)
        self.runtime = YieldingRuntime(self.clock)
        self.prober = YieldingProber(self.runtime)
        self.memory = FakeMemoryProbe(
            {"gpu": int(GPU_TOTAL_GB * GIB), "cpu": int(CPU_TOTAL_GB * GIB)}
        )
        self.violations: list[str] = []
        self.loop_errors: list[str] = []
        self.outcomes: Counter[str] = Counter()
        self.active: list[Lease] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.last_state: dict[str, str] = {}
        self.checked = 0
        # The desired state as the guard would persist it: a swap rebinds the slot's model
        # (the API writes the binding before it swaps), so a restart sees the new binding.
        self.specs = {spec.name: spec for spec in SLOTS}
        self.ever_unkillable = False
        self.restarts = 0
        self.m = self._new_manager()

    def _new_manager(self) -> SlotManager:
        """A manager over this machine's state dir, runtime, clock and memory."""
        manager = SlotManager(
            runtime=self.runtime,
            state_dir=self.tmp / "state",
            config_dir=self.tmp / "config",
            settings=ControllerSettings(
                safety_margin_gb=MARGIN_GB,
                memory_budget_gb={"gpu": GPU_BUDGET_GB},
                default_pinned=[],
            ),
            prober=self.prober,
            memory=self.memory,
            clock=self.clock,
            config=ManagerConfig(stop_timeout_s=1.0, exclusive_wait_s=60.0),
            sleeper=FakeSleeper(self.runtime),
        )
        self.memory.used_by = manager.admitted_bytes
        self.m = manager
        self._hook_events()
        self._spawned_hook()
        return manager

    # ------------------------------------------------------------ plumbing

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, SlotctlError) and not isinstance(exc, IllegalSlotTransition):
            return  # a failed load nobody awaited any more: a legitimate outcome
        self.loop_errors.append(f"{context.get('message')}: {exc!r}")

    def _hook_events(self) -> None:
        """See every event as it is emitted (synchronously, inside the manager)."""
        bus = self.m.events
        emit = bus.emit

        def checking_emit(kind: str, op: str, **fields: Any) -> Event:
            event = emit(kind, op, **fields)
            try:
                self._on_event(event)
            except Exception as exc:
                self.violations.append(f"event check crashed: {exc!r}")
            return event

        bus.emit = checking_emit  # type: ignore[method-assign]

    def _spawned_hook(self) -> None:
        """Keep every background task the manager spawns, to check how it ended."""
        tasks = self.m.core.tasks
        spawn = tasks.spawn

        def tracking_spawn(coro: Any, name: str) -> asyncio.Task[Any]:
            task = spawn(coro, name)
            self.tasks.add(task)
            return task

        tasks.spawn = tracking_spawn  # type: ignore[method-assign]

    def _on_event(self, event: Event) -> None:
        if event.kind == "eviction" and event.slot in self.m.names():
            slot = self.m.core.table.records[event.slot]
            if event.slot in PINNED or slot.spec.pinned:
                self.violations.append(f"pinned slot {event.slot} evicted: {event.message}")
            if slot.book.leases or any(
                lease.slot == event.slot and self._is_active(lease) for lease in self.active
            ):
                self.violations.append(f"slot {event.slot} evicted with an active lease")
            if slot.state not in (S.READY, S.IDLE):
                self.violations.append(f"slot {event.slot} evicted while {slot.state.value}")
        if event.kind == "transition":
            # Checked at every transition, not only between steps: a swap or an eviction
            # must never pass through a state that breaks these, however briefly.
            self._check_exclusive(f"at {event.slot} {event.from_state}->{event.to_state}")
            self._check_budget(f"at {event.slot} {event.from_state}->{event.to_state}")

    def run(self, coro: Coroutine[Any, Any, T]) -> T | None:
        """Run one manager operation to completion; typed errors are outcomes."""

        async def guarded() -> T | None:
            try:
                return await asyncio.wait_for(coro, HANG_S)
            except IllegalSlotTransition:
                raise
            except SlotctlError as exc:
                self.outcomes[exc.code] += 1
                return None
            except TimeoutError:
                raise AssertionError(
                    f"a manager operation did not finish within {HANG_S}s (deadlock?)"
                ) from None

        result = self.loop.run_until_complete(guarded())
        self._track_load_tasks()
        return result

    def _track_load_tasks(self) -> None:
        for slot in self.m.core.table.records.values():
            if slot.flight.task is not None:
                self.tasks.add(slot.flight.task)

    def _spin(self, rounds: int = 50) -> None:
        async def spin() -> None:
            for _ in range(rounds):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())
        self._track_load_tasks()

    @staticmethod
    def _is_active(lease: Lease) -> bool:
        return not lease.released and lease.error is None

    def _keep(self, lease: Lease | None) -> Any:
        if lease is None:
            return multiple()
        self.active.append(lease)
        return lease

    # ------------------------------------------------------------ rules

    @initialize(yielding=st.booleans())
    def desired_state(self, yielding: bool) -> None:
        self.runtime.turns = 1 if yielding else 0
        self.run(self.m.set_desired(desired(list(self.specs.values()), MODELS)))

    @rule(name=names, resident=st.booleans())
    def load(self, name: str, resident: bool) -> None:
        self.run(self.m.load(name, resident=resident))

    @rule(name=names, force=st.booleans())
    def unload(self, name: str, force: bool) -> None:
        self.run(self.m.unload(name, force=force))

    @rule(name=names, model=model_ids)
    def swap(self, name: str, model: str) -> None:
        self.specs[name] = self._declare(name, model)
        self.run(self.m.swap(DesiredSlot(spec=self.specs[name], stack="t")))

    def _declare(self, name: str, model: str) -> SlotSpec:
        """What the swap route does first: the new binding declared (then read back)."""
        return rebound(self.specs[name], model).spec

    @rule(target=leases, name=names)
    def acquire(self, name: str) -> Any:
        return self._keep(self.run(self.m.acquire(name)))

    @rule(target=leases, name=names, ttl=st.sampled_from([5.0, 30.0, 300.0]))
    def hold(self, name: str, ttl: float) -> Any:
        return self._keep(self.run(self.m.hold(name, ttl)))

    @rule(lease=leases)
    def release(self, lease: Lease) -> None:
        self.m.release(lease)  # twice for the same lease is fine: idempotent

    @rule(target=leases, name=names, steps=st.integers(min_value=0, max_value=40))
    def cancel_pending_acquire(self, name: str, steps: int) -> Any:
        async def go() -> Lease | None:
            task = asyncio.create_task(self.m.acquire(name))
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            try:
                return await task  # it may have finished before the cancel
            except asyncio.CancelledError:
                return None

        return self._keep(self.run(go()))

    @rule(seconds=st.sampled_from([0.0, 1.0, 5.0, 15.0, 30.0, 61.0, 400.0]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.run(self.m.tick())

    @rule(name=names, detect_with_tick=st.booleans())
    def crash(self, name: str, detect_with_tick: bool) -> None:
        self.runtime.crash(name)
        self.run(self.m.tick() if detect_with_tick else self.m.check_exits())

    @rule(name=names)
    def wedge(self, name: str) -> None:
        self.prober.liveness_down.symmetric_difference_update({name})

    @rule(device=st.sampled_from(["gpu", "cpu"]), gb=st.sampled_from([0, 1, 3, 7, 10, 11.5, 16]))
    def memory_change(self, device: str, gb: float) -> None:
        self.memory.external[device] = int(gb * GIB)
        self.run(self.m.reap_pressure())

    @rule(
        name=names,
        outcome=st.sampled_from(["ready", "ready", "ready", "no_model", "hang", "exit"]),
        start_error=st.sampled_from([None, None, None, "exec format error"]),
        load_s=st.sampled_from([0.0, 0.0, 1.0, 3.0]),
        needs_pull=st.booleans(),
        unkillable=st.sampled_from([False, False, False, True]),
    )
    def script(
        self,
        name: str,
        outcome: str,
        start_error: str | None,
        load_s: float,
        needs_pull: bool,
        unkillable: bool,
    ) -> None:
        self.runtime.script(
            name,
            outcome=outcome,
            start_error=start_error,
            load_s=load_s,
            needs_pull=needs_pull,
            unkillable=unkillable,
        )
        self.ever_unkillable |= unkillable

    @rule(
        first=st.tuples(st.sampled_from(OPS), names),
        second=st.tuples(st.sampled_from(OPS), names),
        stagger=st.integers(min_value=0, max_value=5),
    )
    def concurrently(self, first: tuple[str, str], second: tuple[str, str], stagger: int) -> None:
        """Two operations at once (the router, the API and the reconciler all call in)."""

        async def one(op: str, name: str, delay: int) -> Lease | None:
            for _ in range(delay):
                await asyncio.sleep(0)
            try:
                return await self._op(op, name)
            except IllegalSlotTransition:
                raise
            except SlotctlError as exc:
                self.outcomes[exc.code] += 1
                return None

        async def both() -> list[Lease | None]:
            return list(await asyncio.gather(one(*first, 0), one(*second, stagger)))

        for lease in self.run(both()) or []:
            if lease is not None:
                self.active.append(lease)
                self.m.release(lease)  # a request that finished

    async def _op(self, op: str, name: str) -> Lease | None:
        if op == "load":
            await self.m.load(name)
        elif op == "load-transient":
            await self.m.load(name, resident=False)
        elif op == "unload":
            await self.m.unload(name, force=True)
        elif op == "acquire":
            return await self.m.acquire(name)
        elif op == "swap":
            model = self.m.view(name).model_id
            assert model is not None
            self.specs[name] = self._declare(name, model)
            await self.m.swap(DesiredSlot(spec=self.specs[name], stack="t"))
        elif op == "crash":
            self.runtime.crash(name)
            await self.m.check_exits()
        elif op == "tick":
            self.clock.advance(7.0)
            await self.m.tick()
        elif op == "reset":
            await self.m.reset(name)
        elif op == "reap":
            await self.m.reap_pressure()
        return None

    @precondition(lambda self: not self.ever_unkillable and self.restarts < 3)
    @rule()
    def restart(self) -> None:
        """The controller dies and comes back: in-flight work stops, servers keep running.

        The new manager rebuilds its view from state.json and the runtime (``recover``)
        through legal transitions, adopting what runs and never starting a duplicate.
        (Not with unkillable servers: an errored slot whose server survived SIGKILL is
        adopted as it runs, unaccounted before; see the report on ERROR accounting.)
        """

        async def controller_dies() -> None:
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        self.loop.run_until_complete(controller_dies())
        self._join_threads()
        self.tasks.clear()
        self.active.clear()  # the old controller's requests died with it
        starts = dict(self.runtime.starts)
        self.restarts += 1
        self.checked = 0
        self.last_state = {}
        for name in NAMES:
            record = self.m.store.read(name)
            if record is not None:
                # A serving record (its lease flip back lagged) loads as ready (SPEC §3).
                state = S.READY if record.state is S.SERVING else record.state
                self.last_state[name] = state.value
        self._new_manager()
        self.run(self.m.set_desired(desired(list(self.specs.values()), MODELS)))
        self.run(self.m.recover())
        assert dict(self.runtime.starts) == starts, "recover started a server"

    @rule(name=names)
    def reset(self, name: str) -> None:
        self.run(self.m.reset(name))

    @rule()
    def settle(self) -> None:
        self._spin(2000)

    # ------------------------------------------------------------ invariants

    def _check_exclusive(self, where: str) -> None:
        groups: dict[str, list[str]] = {}
        for slot in self.m.core.table.records.values():
            group = slot.model.exclusive_group if slot.model else None
            if group and slot.state in ADMITTED_STATES:
                groups.setdefault(group, []).append(f"{slot.name}:{slot.state.value}")
        for group, members in groups.items():
            if len(members) > 1:
                self.violations.append(f"exclusive group {group} {where}: {members}")

    def _check_budget(self, where: str) -> None:
        table = self.m.core.table
        for device, budget in BUDGET.items():
            admitted = self.m.admitted_bytes(device)
            # admission's one-pass sums are the two separate ones, for every requester
            held = {s.name: _held(s, device) for s in table.records.values()}
            summed = sum(size for size, _ in held.values())
            for requester in (None, *table.records.values()):
                both = table.usage.device_bytes(device, requester)
                reserved = sum(
                    size
                    for name, (size, loading) in held.items()
                    if loading and (requester is None or name != requester.name)
                )
                alone = (summed, reserved)
                if both != alone or admitted != summed:
                    self.violations.append(f"{device} {where}: device_bytes {both} != {alone}")
            if admitted > budget:
                self.violations.append(
                    f"{device} {where}: admitted {admitted / GIB:g} GiB > {budget / GIB:g} GiB"
                )

    @invariant()
    def no_violations_as_they_happened(self) -> None:
        assert not self.violations, self.violations
        assert not self.loop_errors, self.loop_errors

    @invariant()
    def background_tasks_end_cleanly(self) -> None:
        for task in list(self.tasks):
            if not task.done():
                continue
            self.tasks.discard(task)
            if task.cancelled():
                continue
            exc = task.exception()  # retrieved: no "never retrieved" noise later
            if exc is None:
                continue
            assert isinstance(exc, SlotctlError), f"{task.get_name()}: {exc!r}"
            assert not isinstance(exc, IllegalSlotTransition), f"{task.get_name()}: {exc!r}"

    @invariant()
    def only_legal_transitions(self) -> None:
        history = list(self.m.transitions)
        assert len(history) < (self.m.transitions.maxlen or 0), "history overflowed"
        for name, before, after in history[self.checked :]:
            assert S(after) in LEGAL_TRANSITIONS[S(before)], (name, before, after)
            previous = self.last_state.get(name, S.OFFLINE.value)
            assert previous == before, f"{name}: was {previous}, then {before} -> {after}"
            self.last_state[name] = after
        self.checked = len(history)
        for name in NAMES:
            current = self.m.view(name).state.value
            assert self.last_state.get(name, S.OFFLINE.value) == current, name

    @invariant()
    def exclusive_groups(self) -> None:
        self._check_exclusive("between steps")
        assert not self.violations, self.violations

    @invariant()
    def admitted_within_budget(self) -> None:
        self._check_budget("between steps")
        assert not self.violations, self.violations

    @invariant()
    def leased_slots_are_serving(self) -> None:
        self.active = [lease for lease in self.active if self._is_active(lease)]
        held = Counter(lease.slot for lease in self.active)
        for name in NAMES:
            view = self.m.view(name)
            assert view.leases == held[name], (name, view.leases, held[name])
            if held[name]:
                assert view.state is S.SERVING, (name, view.state)
        for lease in self.active:
            assert lease.generation == self.m.view(lease.slot).generation, lease

    @invariant()
    def state_files_match_memory(self) -> None:
        for name in NAMES:
            view = self.m.view(name)
            record = self.m.store.read(name)
            if record is None:
                assert view.state is S.OFFLINE, name
                continue
            if name in self.m.core.table.unpersisted:
                # Observations not written yet (SPEC §3: warming, ready, idle, the lease
                # flips): memory is in one, and the file at one too, or at the intent
                # they followed (starting). Never an outcome or an intent behind.
                assert view.state in OBSERVED, (name, view.state)
                assert record.state in OBSERVED | {S.STARTING}, (name, record.state)
            else:
                assert record.state is view.state, (name, record.state, view.state)
            if view.state in ADMITTED_STATES:  # a running server: the model it runs
                assert record.model_id == view.model_id, name
            assert (record.extra.idle_reason is not None) == (record.state is S.IDLE), name

    @invariant()
    def sleepers_agree_with_their_servers(self) -> None:
        for name in NAMES:
            view = self.m.view(name)
            if view.residency == "asleep":
                assert view.state is S.IDLE and not view.dispatchable, (name, view)
                assert self.runtime.sleeping.get(name) == view.sleep_level, name
            elif view.residency == "awake" and view.state is not S.ERROR:
                # ERROR claims nothing of its server: one that survived SIGKILL (a
                # sleeper's unload timed out) may sleep on.
                assert name not in self.runtime.sleeping, f"{name} sleeps, unrecorded"
            record = self.m.store.read(name)
            if record is not None and name not in self.m.core.table.unpersisted:
                assert (record.extra.residency or "awake") == view.residency, name

    @invariant()
    def runtime_agrees(self) -> None:
        for name in NAMES:
            view = self.m.view(name)
            if view.state is S.OFFLINE:
                assert name not in self.runtime.objects, f"{name} is offline but its server runs"
            if view.state in (S.WARMING, S.READY, S.SERVING, S.IDLE):
                assert name in self.runtime.objects, f"{name} is {view.state.value}, no server"
            assert view.failures <= MAX_FAILURES, (name, view.failures)
            assert view.waiters >= 0, name

    # ------------------------------------------------------------ teardown

    def _join_threads(self) -> None:
        """Wait for the worker threads of the controller that died (a cancelled task's
        thread runs on): in a real crash the process takes them along, so no write of
        the old controller may land after the new one has read the state dir."""
        old, self.executor = self.executor, ThreadPoolExecutor(max_workers=4)
        self.loop.set_default_executor(self.executor)
        old.shutdown(wait=True)

    def teardown(self) -> None:
        try:

            async def finish() -> None:
                pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                await self.m.close()

            self.loop.run_until_complete(finish())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.executor.shutdown(wait=True)
            self.loop.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


def _settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        print_blob=True,
    )


def test_manager_state_machine() -> None:
    """The CI run: about 150 examples of 40 steps, well under a minute."""
    run_state_machine_as_test(ManagerMachine, settings=_settings(150, 40))


@pytest.mark.slow
@pytest.mark.skipif(not SOAK, reason="soak run: SLOTCTL_SOAK=1 (make soak)")
def test_manager_state_machine_soak() -> None:
    """``make soak``: many more and longer runs (about 15 minutes)."""
    run_state_machine_as_test(ManagerMachine, settings=_settings(2000, 100))
