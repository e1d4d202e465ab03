"""The reconciler (SPEC §8): the pure planner, the requeue mapping, and the work queue.

The planner tests call :func:`plan_slot`/:func:`plans_for` with hand-built desired,
applied and observed state. The work-queue tests run a :class:`Reconciler` over a
SlotManager on FakeRuntime + FakeClock and a tmp config dir written through
:func:`controller.reconcile.apply.apply_to_config` (the writer ``stack apply`` uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.model.errors import (
    InsufficientMemory,
    SlotConfigError,
    SlotCrashLooping,
    SlotHealthFailed,
    SlotSpawnFailed,
)
from controller.model.lifecycle import IdleReason, SlotState
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.reconcile.apply import apply_to_config, plan_stack
from controller.reconcile.reconciler import (
    Action,
    ObservedSlot,
    Reconciler,
    Result,
    plan_slot,
    plans_for,
    requeue_delay,
)
from controller.runtime.fake import FakeRuntime
from controller.slots.records import ManagerConfig
from controller.spec.configdir import ConfigSnapshot, read_config_dir
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.schema import ModelSpec, SlotSpec
from tests.unit.manager_fixtures import Harness, model_spec, slot_spec

S = SlotState


# ===================================================================== helpers


def want(spec: SlotSpec, stack: str = "t") -> DesiredSlot:
    return DesiredSlot(spec=spec, stack=stack)


def launch_hash(spec: SlotSpec, stack: str = "t") -> str:
    model = model_spec(spec.model_id)
    return build_launch(spec, model, BuildContext(runtime="process", stack=stack)).config_hash()


def running(name: str, config_hash: str | None, state: SlotState = S.READY) -> ObservedSlot:
    return ObservedSlot(name=name, state=state, running=True, config_hash=config_hash)


def offline(name: str, state: SlotState = S.OFFLINE) -> ObservedSlot:
    return ObservedSlot(name=name, state=state, running=False)


def with_changes(spec: SlotSpec, **changes: Any) -> SlotSpec:
    return SlotSpec.model_validate({**spec.model_dump(mode="json"), **changes})


# ===================================================================== plan_slot


def test_create_without_autoload() -> None:
    spec = slot_spec("a", autoload=False)
    action = plan_slot("a", want(spec), None, None, want_hash=launch_hash(spec))
    assert action == Action("create", "a", "new slot", {"load": False})


def test_create_with_autoload_will_load() -> None:
    spec = slot_spec("a", autoload=True)
    action = plan_slot("a", want(spec), None, None, want_hash=launch_hash(spec))
    assert action.kind == "create"
    assert action.reason == "new slot (autoload: will load)"
    assert action.details == {"load": True}


def test_recreate_when_the_running_config_hash_differs_names_the_changed_keys() -> None:
    have = slot_spec("a", autoload=True, server={"extra_args": ["--load-seconds", "1"]})
    new = with_changes(have, server={"extra_args": ["--load-seconds", "2"]}, port=have.port + 1)
    old_hash, new_hash = launch_hash(have), launch_hash(new)
    assert old_hash != new_hash
    action = plan_slot("a", want(new), have, running("a", old_hash), want_hash=new_hash)
    assert action.kind == "recreate"
    assert action.reason.startswith(f"config hash {old_hash} -> {new_hash}: ")
    assert f"port {have.port} -> {have.port + 1}" in action.reason
    assert "server changed" in action.reason
    assert action.details == {"from": old_hash, "to": new_hash}


def test_recreate_when_only_the_running_server_differs() -> None:
    """Same spec, but the server runs another config (e.g. the catalogue changed)."""
    spec = slot_spec("a", autoload=True)
    action = plan_slot("a", want(spec), spec, running("a", "0ld"), want_hash=launch_hash(spec))
    assert action.kind == "recreate"
    assert "running server differs from the declared config" in action.reason


@pytest.mark.parametrize(
    ("changes", "keys"),
    [
        ({"priority": 90}, ["priority"]),
        ({"pinned": True}, ["pinned"]),
        ({"idle_timeout_s": 30.0, "ttl_s": 600.0}, ["idle_timeout_s", "ttl_s"]),
        (
            {"warmup_timeout_s": 5.0, "drain_timeout_s": 1.0},
            ["warmup_timeout_s", "drain_timeout_s"],
        ),
    ],
)
def test_update_in_place_for_scheduling_keys_no_restart(
    changes: dict[str, Any], keys: list[str]
) -> None:
    have = slot_spec("a", autoload=True, priority=50)
    new = with_changes(have, **changes)
    assert launch_hash(new) == launch_hash(have)  # nothing the server sees changed
    action = plan_slot(
        "a", want(new), have, running("a", launch_hash(have)), want_hash=launch_hash(new)
    )
    assert action.kind == "update"
    assert action.reason.startswith("in place, no restart: ")
    assert sorted(action.details["keys"]) == sorted(keys)
    for key in keys:
        assert key in action.reason
    if "priority" in changes:
        assert "priority 50 -> 90" in action.reason


def test_runtime_change_of_a_slot_that_is_not_running_is_an_update() -> None:
    have = slot_spec("a", autoload=False)
    new = with_changes(have, server={"extra_args": ["--load-seconds", "9"]})
    action = plan_slot("a", want(new), have, offline("a"), want_hash=launch_hash(new))
    assert action.kind == "update"  # nothing runs: nothing to restart
    assert action.details == {"keys": ["server"]}


@pytest.mark.parametrize("obs_state", [None, S.OFFLINE, S.ERROR])
def test_load_autoload_slot_not_dispatchable(obs_state: SlotState | None) -> None:
    spec = slot_spec("a", autoload=True)
    obs = None if obs_state is None else offline("a", obs_state)
    action = plan_slot("a", want(spec), spec, obs, want_hash=launch_hash(spec))
    shown = obs_state.value if obs_state else "offline"
    assert action == Action("load", "a", f"autoload and {shown}")


def test_load_resident_slot_not_dispatchable() -> None:
    spec = slot_spec("a", autoload=False)
    action = plan_slot(
        "a", want(spec), spec, offline("a"), want_hash=launch_hash(spec), resident=True
    )
    assert action == Action("load", "a", "resident and offline")


def test_noop_when_up_without_a_model() -> None:
    """idle(no_model) is not dispatchable, but a load of it is a no-op: planning "load"
    would loop forever (and keep --wait from converging); the reason says what to do."""
    spec = slot_spec("a", autoload=True)
    obs = ObservedSlot(
        name="a",
        state=S.IDLE,
        idle_reason=IdleReason.NO_MODEL,
        running=True,
        config_hash=launch_hash(spec),
    )
    action = plan_slot("a", want(spec), spec, obs, want_hash=launch_hash(spec))
    assert action.kind == "noop" and "serves no model" in action.reason


@pytest.mark.parametrize("autoload", [True, False])
def test_an_asleep_slot_is_woken_only_when_it_is_kept_loaded(autoload: bool) -> None:
    """Asleep is idle, not dispatchable: an autoload slot comes back (a background load,
    which is a wake), any other sleeps on until a request wakes it."""
    spec = slot_spec("a", autoload=autoload, sleep=True)
    obs = ObservedSlot(
        name="a",
        state=S.IDLE,
        idle_reason=IdleReason.ASLEEP,
        running=True,
        config_hash=launch_hash(spec),
    )
    action = plan_slot("a", want(spec), spec, obs, want_hash=launch_hash(spec))
    if autoload:
        assert action == Action("load", "a", "autoload and idle (asleep: a load wakes it)")
    else:
        assert action == Action("noop", "a", "in sync")


def test_noop_when_crash_loop_blocked() -> None:
    spec = slot_spec("a", autoload=True)
    obs = ObservedSlot(name="a", state=S.ERROR, blocked=True, retry_after_s=30.0)
    action = plan_slot("a", want(spec), spec, obs, want_hash=launch_hash(spec))
    assert action == Action(
        "noop",
        "a",
        "crash-looping: next attempt in 30s (`slotctl slot reset` retries now)",
        {"retry_after_s": 30.0},
    )


def test_noop_when_crash_loop_blocked_for_good() -> None:
    """Past max_consecutive_failures: no retry time, so nothing is requeued."""
    spec = slot_spec("a", autoload=True)
    obs = ObservedSlot(name="a", state=S.ERROR, blocked=True, retry_after_s=0.0)
    action = plan_slot("a", want(spec), spec, obs, want_hash=launch_hash(spec))
    assert action == Action(
        "noop", "a", "crash-looping: blocked until its config changes or `slotctl slot reset`"
    )


def test_noop_for_a_slot_that_cannot_load() -> None:
    spec = slot_spec("a", model="", autoload=True)  # no model bound: not activated
    assert not spec.activated
    action = plan_slot("a", want(spec), spec, None, want_hash=None)
    assert action == Action("noop", "a", "in sync")


@pytest.mark.parametrize("is_running", [False, True])
def test_delete_only_when_may_delete(is_running: bool) -> None:
    have = slot_spec("a")
    obs = running("a", "h") if is_running else offline("a")
    deleted = plan_slot("a", None, have, obs, want_hash=None, may_delete=True)
    assert deleted == Action("delete", "a", "no longer declared: unload and remove")
    kept = plan_slot("a", None, have, obs, want_hash=None, may_delete=False)
    assert kept == Action("noop", "a", "not declared here")


def test_delete_a_running_server_nobody_has_in_config() -> None:
    action = plan_slot("a", None, None, running("a", "h"), want_hash=None)
    assert action.kind == "delete"
    assert plan_slot("a", None, None, None, want_hash=None).kind == "noop"


@pytest.mark.parametrize(
    ("autoload", "obs"),
    [
        (True, "ready"),
        (True, "serving"),
        (True, "idle"),
        (False, "offline"),
        (False, "ready"),
    ],
)
def test_noop_in_sync(autoload: bool, obs: str) -> None:
    spec = slot_spec("a", autoload=autoload)
    h = launch_hash(spec)
    observed = offline("a") if obs == "offline" else running("a", h, SlotState(obs))
    action = plan_slot("a", want(spec), spec, observed, want_hash=h)
    assert action == Action("noop", "a", "in sync")


def test_actions_are_plain_serialisable_data() -> None:
    have = slot_spec("a", autoload=True)
    new = with_changes(have, server={"extra_args": ["-x"]})
    action = plan_slot(
        "a", want(new), have, running("a", launch_hash(have)), want_hash=launch_hash(new)
    )
    data = json.loads(json.dumps(action.to_dict()))
    assert data == {
        "kind": "recreate",
        "slot": "a",
        "reason": action.reason,
        "details": {"from": launch_hash(have), "to": launch_hash(new)},
    }


# ===================================================================== plans_for


def _ten() -> tuple[dict[str, DesiredSlot], dict[str, SlotSpec], dict[str, ObservedSlot]]:
    specs = [
        slot_spec(f"s{i}", autoload=i % 2 == 0, server={"extra_args": ["--load-seconds", "1"]})
        for i in range(10)
    ]
    wants = {s.name: want(s) for s in specs}
    have = {s.name: s for s in specs}
    observed = {s.name: running(s.name, launch_hash(s)) for s in specs}
    return wants, have, observed


RUNTIME_CHANGES: list[dict[str, Any]] = [
    {"server": {"extra_args": ["--load-seconds", "2"]}},
    {"server": {"extra_args": ["--load-seconds", "1"], "env": {"X": "1"}}},
    {"model": {"default": "other-m"}},
]


@settings(max_examples=40, deadline=None)
@given(index=st.integers(0, 9), change=st.sampled_from(RUNTIME_CHANGES))
def test_a_config_change_to_one_slot_recreates_it_and_nothing_else(
    index: int, change: dict[str, Any]
) -> None:
    wants, have, observed = _ten()
    name = f"s{index}"
    wants[name] = want(with_changes(have[name], **change))
    hashes: dict[str, str | None] = {n: launch_hash(w.spec) for n, w in wants.items()}
    assert hashes[name] != observed[name].config_hash
    actions = plans_for(list(wants), wants, have, observed, hashes)
    assert [a.slot for a in actions] == list(wants)
    by_kind = {a.slot: a.kind for a in actions}
    assert by_kind.pop(name) == "recreate"
    assert set(by_kind.values()) == {"noop"}


def test_plans_for_only_deletes_what_is_deletable() -> None:
    wants, have, observed = _ten()
    del wants["s3"], wants["s4"]
    hashes: dict[str, str | None] = {n: launch_hash(w.spec) for n, w in wants.items()}
    actions = plans_for(list(have), wants, have, observed, hashes, deletable=lambda n: n == "s3")
    kinds = {a.slot: a.kind for a in actions}
    assert kinds["s3"] == "delete"
    assert kinds["s4"] == "noop"
    assert {k for n, k in kinds.items() if n not in ("s3", "s4")} == {"noop"}


def test_plans_for_residents_are_loaded() -> None:
    wants, have, _ = _ten()
    hashes: dict[str, str | None] = {n: launch_hash(w.spec) for n, w in wants.items()}
    observed = {n: offline(n) for n in wants}
    actions = plans_for(list(wants), wants, have, observed, hashes, residents=["s1"])
    loads = sorted(a.slot for a in actions if a.kind == "load")
    assert loads == ["s0", "s1", "s2", "s4", "s6", "s8"]  # the autoload ones and s1


# ===================================================================== prune


def _stack(name: str, slots: Sequence[SlotSpec], models: Sequence[ModelSpec]) -> DesiredState:
    return DesiredState(
        stacks=(name,),
        models={m.id: m for m in models},
        slots={s.name: DesiredSlot(spec=s, stack=name) for s in slots},
    )


async def test_prune_touches_only_the_applying_stacks_slots(tmp_path: Path) -> None:
    config = tmp_path / "config"
    one = [slot_spec("one-a", autoload=False), slot_spec("one-b", autoload=False)]
    two = [slot_spec("two-a", autoload=False), slot_spec("two-b", autoload=False)]
    models = [model_spec(s.model_id) for s in [*one, *two]]
    assert apply_to_config(_stack("one", one, models[:2]), config, prune=True)
    assert apply_to_config(_stack("two", two, models[2:]), config, prune=True)
    before = {p.name: p.read_bytes() for p in (config / "slots").iterdir()}
    assert sorted(before) == ["one-a.toml", "one-b.toml", "two-a.toml", "two-b.toml"]

    shrunk = _stack("one", one[:1], models[:2])
    plan = await plan_stack(shrunk, config, tmp_path / "state", FakeRuntime(), prune=True)
    assert {a.slot: a.kind for a in plan.actions} == {"one-a": "noop", "one-b": "delete"}

    # without prune nothing is deleted
    assert apply_to_config(shrunk, config, prune=False) == []
    assert sorted(p.name for p in (config / "slots").iterdir()) == sorted(before)

    assert apply_to_config(shrunk, config, prune=True) == ["one-b"]
    after = {p.name: p.read_bytes() for p in (config / "slots").iterdir()}
    assert sorted(after) == ["one-a.toml", "two-a.toml", "two-b.toml"]
    assert all(after[n] == before[n] for n in after)  # the others are untouched, byte for byte
    snapshot = read_config_dir(config)
    assert {n: s.stack for n, s in snapshot.slots.items()} == {
        "one-a": "one",
        "two-a": "two",
        "two-b": "two",
    }


# ===================================================================== requeue_delay


def test_requeue_result() -> None:
    assert requeue_delay(Result(), 0) is None
    assert requeue_delay(Result(requeue_after=2.5), 3) == 2.5


def test_requeue_crash_looping_waits_for_retry_after() -> None:
    assert requeue_delay(SlotCrashLooping("x", retry_after_s=17.0), 0) == 17.0
    assert requeue_delay(SlotCrashLooping("x", retry_after_s=17.0), 9) == 17.0
    assert requeue_delay(SlotCrashLooping("x", retry_after_s=0.0), 0) == 0.5  # never a spin


def test_requeue_config_error_is_terminal() -> None:
    for failures in (0, 1, 10):
        assert requeue_delay(SlotConfigError("bad", keys=["port"]), failures) is None


def test_requeue_insufficient_memory_is_a_bounded_backoff() -> None:
    def error() -> InsufficientMemory:
        return InsufficientMemory("full", needed_bytes=2, free_bytes=1, evictable_bytes=0)

    delays = [requeue_delay(error(), f) for f in range(30)]
    assert delays[0] == 2.0
    assert all(d is not None and 0 < d <= 60.0 for d in delays)
    assert delays == sorted(delays, key=lambda d: d or 0)  # non-decreasing
    assert delays[-1] == 60.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: SlotSpawnFailed("boom", slot="a"),
        lambda: SlotHealthFailed("boom", slot="a"),
        lambda: RuntimeError("unexpected"),
    ],
)
def test_requeue_other_failures_back_off_exponentially_capped(
    make: Callable[[], BaseException],
) -> None:
    delays = [requeue_delay(make(), f) for f in range(40)]
    assert delays[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert all(d is not None and d <= 300.0 for d in delays)
    assert delays[-1] == 300.0


# ===================================================================== the Reconciler


FAST = ManagerConfig(stop_timeout_s=1.0, monitor_interval_s=0.01, tick_interval_s=0.05)


def harness(tmp: Path, **kw: Any) -> Harness:
    return Harness(tmp, config=kw.pop("config", FAST), **kw)


def quad() -> DesiredState:
    slots = [
        slot_spec("auto-a", autoload=True),
        slot_spec("auto-b", autoload=True),
        slot_spec("lazy-a", autoload=False),
        slot_spec("lazy-b", autoload=False),
    ]
    return _stack("t", slots, [model_spec(s.model_id) for s in slots])


def reconciler(h: Harness, state: DesiredState, **kw: Any) -> Reconciler:
    apply_to_config(state, h.tmp / "config", prune=True)
    return Reconciler(h.manager, h.tmp / "config", resync_s=kw.pop("resync_s", 3600.0), **kw)


@contextlib.asynccontextmanager
async def running_controller(h: Harness, r: Reconciler) -> AsyncIterator[None]:
    """The reconciler plus the manager's background loop (exit detection), as ``up``."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(r.run(stop)), asyncio.create_task(h.manager.run(stop))]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await h.manager.close()


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def states(h: Harness) -> dict[str, SlotState | None]:
    known = {v.name: v.state for v in h.manager.views()}
    return {s: known.get(s) for s in ("auto-a", "auto-b", "lazy-a", "lazy-b", *known)}


async def test_converges_autoload_ready_on_demand_offline(tmp_path: Path) -> None:
    h = harness(tmp_path)
    h.runtime.script("auto-b", load_s=3.0)
    r = reconciler(h, quad())
    assert await r.converge(timeout=10, poll_s=0.01)
    await h.manager.close()
    assert states(h) == {
        "auto-a": S.READY,
        "auto-b": S.READY,
        "lazy-a": S.OFFLINE,
        "lazy-b": S.OFFLINE,
    }
    assert h.runtime.starts == Counter({"auto-a": 1, "auto-b": 1})
    assert all(r.plan(n).kind == "noop" for n in r.all_names())
    assert r.errors == {}


async def test_a_config_change_recreates_only_that_slot(tmp_path: Path) -> None:
    h = harness(tmp_path)
    state = quad()
    r = reconciler(h, state)
    assert await r.converge(timeout=10, poll_s=0.01)
    changed = dict(state.slots)
    spec = changed["auto-a"].spec
    changed["auto-a"] = want(with_changes(spec, server={"extra_args": ["--load-seconds", "9"]}))
    changed["auto-b"] = want(with_changes(changed["auto-b"].spec, priority=99))
    new_state = DesiredState(stacks=state.stacks, models=state.models, slots=changed)
    assert apply_to_config(new_state, h.tmp / "config", prune=True) == ["auto-a", "auto-b"]
    plans: list[Action] = []
    r.on_plan = plans.append
    assert await r.converge(timeout=10, poll_s=0.01)
    await h.manager.close()
    assert {a.slot: a.kind for a in plans} == {"auto-a": "recreate", "auto-b": "update"}
    assert h.runtime.starts == Counter({"auto-a": 2, "auto-b": 1})
    assert h.runtime.stops == Counter({"auto-a": 1})
    assert h.manager.view("auto-b").priority == 99
    assert states(h)["auto-a"] is S.READY


async def test_a_slot_is_never_reconciled_twice_at_once(tmp_path: Path) -> None:
    h = harness(tmp_path)
    slots = [slot_spec(f"s{i}", autoload=i < 3) for i in range(8)]
    r = reconciler(h, _stack("t", slots, [model_spec(s.model_id) for s in slots]))
    real = r.reconcile
    active: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    overall = {"now": 0, "peak": 0}

    async def instrumented(name: str) -> Result:
        active[name] += 1
        overall["now"] += 1
        calls[name] += 1
        peak[name] = max(peak[name], active[name])
        overall["peak"] = max(overall["peak"], overall["now"])
        try:
            await asyncio.sleep(0.002)
            return await real(name)
        finally:
            active[name] -= 1
            overall["now"] -= 1

    r.reconcile = instrumented  # type: ignore[method-assign]
    async with running_controller(h, r):
        for _ in range(40):
            r.enqueue_all()
            for s in slots:
                r.enqueue(s.name)
                r.enqueue(s.name, after=0.001)
            await asyncio.sleep(0.001)
        await until(lambda: not r.queue.delayed, "delayed requeues")
        await asyncio.wait_for(r.wait_idle(), 10)
    assert set(calls) == {s.name for s in slots}
    assert max(peak.values()) == 1, peak
    assert overall["peak"] > 1  # different slots do reconcile concurrently
    assert states(h)["s0"] is S.READY


async def test_a_requeue_while_active_marks_dirty_and_runs_once_more(tmp_path: Path) -> None:
    h = harness(tmp_path)
    r = reconciler(h, quad())
    real = r.reconcile
    calls: Counter[str] = Counter()
    gate, entered = asyncio.Event(), asyncio.Event()

    async def gated(name: str) -> Result:
        calls[name] += 1
        if name == "lazy-a" and calls[name] == 1:
            entered.set()
            await gate.wait()
        return await real(name)

    r.reconcile = gated  # type: ignore[method-assign]
    async with running_controller(h, r):
        await asyncio.wait_for(entered.wait(), 10)
        for _ in range(5):
            r.enqueue("lazy-a")
        assert r.queue.is_dirty("lazy-a") and r.queue.is_processing("lazy-a")
        assert calls["lazy-a"] == 1  # not started a second time while active
        gate.set()
        await until(lambda: calls["lazy-a"] == 2, "the re-run")
        await asyncio.wait_for(r.wait_idle(), 10)
        await asyncio.sleep(0.05)
        assert calls["lazy-a"] == 2
        assert not r.queue.is_dirty("lazy-a")
        assert calls["lazy-b"] == 1


async def test_the_event_follower_reloads_a_crashed_autoload_slot(tmp_path: Path) -> None:
    h = harness(tmp_path)
    r = reconciler(h, quad())
    async with running_controller(h, r):
        await until(lambda: states(h)["auto-a"] is S.READY, "auto-a ready")
        h.runtime.crash("auto-a")
        await until(lambda: states(h)["auto-a"] is S.ERROR, "the crash to be seen")
        h.clock.advance(h.manager.config.breaker_base_s)  # past the crash-loop backoff
        await until(lambda: states(h)["auto-a"] is S.READY, "auto-a loaded again")
        h.runtime.crash("lazy-a")  # nothing runs there: nothing to reload
        await asyncio.sleep(0.05)
    assert h.runtime.starts["auto-a"] == 2
    assert h.runtime.starts["auto-b"] == 1
    assert h.runtime.starts["lazy-a"] == 0


async def test_a_crash_looping_autoload_slot_is_retried_after_its_backoff(
    tmp_path: Path,
) -> None:
    """Two crashes in a row: the follower finds the slot backing off (plan: noop) and the
    reconciler must look again when the backoff ends, not only at the next resync."""
    config = ManagerConfig(
        stop_timeout_s=1.0, monitor_interval_s=0.01, tick_interval_s=0.05, breaker_base_s=0.25
    )
    h = harness(tmp_path, config=config)
    r = reconciler(h, quad())
    async with running_controller(h, r):
        await until(lambda: states(h)["auto-a"] is S.READY, "auto-a ready")
        h.runtime.crash("auto-a")
        await until(lambda: states(h)["auto-a"] is S.ERROR, "crash 1")
        h.clock.advance(0.25)
        await until(lambda: states(h)["auto-a"] is S.READY, "reload 1")
        passes = r.passes
        h.runtime.crash("auto-a")  # a second crash: backoff 0.5 s (fake time)
        await until(lambda: states(h)["auto-a"] is S.ERROR, "crash 2")
        await until(lambda: r.passes > passes, "the follower's pass")
        assert r.plan("auto-a").reason.startswith("crash-looping: next attempt in")
        h.clock.advance(0.5)
        await until(lambda: states(h)["auto-a"] is S.READY, "reload after the backoff")
    assert h.runtime.starts["auto-a"] == 3


async def test_orphans_are_reaped(tmp_path: Path) -> None:
    h = harness(tmp_path)
    ghost = slot_spec("ghost", autoload=True)
    launch = build_launch(ghost, model_spec(ghost.model_id), BuildContext(stack="old"))
    await h.runtime.start(launch)
    r = reconciler(h, quad())
    seen: list[str] = []
    with h.manager.events.subscribe() as sub:
        assert await r.converge(timeout=10, poll_s=0.01)
        while (event := sub.get_nowait()) is not None:
            if event.kind == "eviction":
                seen.append(event.slot or "")
    await h.manager.close()
    assert "ghost" not in h.runtime.objects
    assert h.runtime.stops == Counter({"ghost": 1})
    assert seen == ["ghost"]
    assert sorted(h.runtime.objects) == ["auto-a", "auto-b"]  # declared ones untouched
    assert await r.reap_orphans() == []


async def test_converge_reads_the_config_dir_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``apply --once`` reads every slot file once: the loop it starts takes the read it
    has just made (its own first resync used to read them all again); orphans are still
    reaped at that first resync (test_orphans_are_reaped)."""
    import controller.spec.files as files_module

    h = harness(tmp_path)
    r = reconciler(h, quad())
    reads: list[Path] = []
    real = files_module.read_config_dir

    def counted(config_dir: Path, cache: Any = None) -> ConfigSnapshot:
        reads.append(config_dir)
        return real(config_dir, cache)

    monkeypatch.setattr(files_module, "read_config_dir", counted)
    assert await r.converge(timeout=10, poll_s=0.01)
    await h.manager.close()
    assert reads == [h.tmp / "config"]
    assert states(h)["auto-a"] is S.READY


async def test_an_invalid_hand_edit_keeps_the_last_good_slot(tmp_path: Path) -> None:
    """A slot file made invalid by hand is reported; the slot is not deleted (nor reaped
    by a restarted controller): the last good desired state stays in force."""
    h = harness(tmp_path)
    r = reconciler(h, quad())
    assert await r.converge(timeout=10, poll_s=0.01)
    path = h.tmp / "config" / "slots" / "auto-a.toml"
    good = path.read_text()
    path.write_text(good.replace("pinned = false", 'pinned = false\npriority = "high"'))
    snapshot = r.refresh()
    assert [p.file for p in snapshot.errors] == [str(path)]
    assert r.plan("auto-a").kind == "noop"
    assert await r.converge(timeout=10, poll_s=0.01)
    assert states(h)["auto-a"] is S.READY
    assert h.runtime.stops["auto-a"] == 0
    await h.manager.close()

    # a controller restarted while the file is invalid does not reap its server
    manager = h.new_manager()
    fresh = Reconciler(manager, h.tmp / "config", resync_s=3600.0)
    assert "auto-a" not in fresh.snapshot.slots
    assert await fresh.reap_orphans() == []
    assert "auto-a" in h.runtime.objects

    # the fixed file applies again (here: as it was)
    path.write_text(good)
    assert await fresh.converge(timeout=10, poll_s=0.01)
    await manager.close()
    assert manager.view("auto-a").state is S.READY
    assert h.runtime.starts["auto-a"] == 1  # adopted, never restarted


async def test_a_broken_catalogue_keeps_the_last_good_one_and_restarts_nothing(
    tmp_path: Path,
) -> None:
    """A typo in models.toml must not unload or recreate the slots bound to its models."""
    from controller.reconcile.apply import apply_to_config
    from controller.reconcile.reconciler import Reconciler
    from controller.spec.loader import DesiredSlot, DesiredState
    from tests.unit.manager_fixtures import Harness, model_spec, slot_spec

    h = Harness(tmp_path)
    config = tmp_path / "config"
    slot = slot_spec("a", autoload=True)
    apply_to_config(
        DesiredState(
            stacks=("t",),
            models={"a-m": model_spec("a-m", 1)},
            slots={"a": DesiredSlot(spec=slot, stack="t")},
        ),
        config,
        prune=False,
    )
    reconciler = Reconciler(h.manager, config)
    await h.manager.set_desired(reconciler.refresh().desired())
    await reconciler.act(reconciler.plan("a"))
    assert h.manager.view("a").state.value == "ready"
    (config / "models.toml").write_text("[[model]]\nid = 'a-m'\nmemory_gb = 'oops'\n")
    reconciler.refresh()
    assert "a-m" in reconciler.snapshot.models  # the last good catalogue stays
    assert reconciler.plan("a").kind == "noop"
    (config / "models.toml").write_text("this is not toml [[[\n")
    reconciler.refresh()
    assert reconciler.plan("a").kind == "noop"
    assert h.runtime.starts["a"] == 1 and h.manager.view("a").state.value == "ready"


def _state(ports: dict[str, int]) -> Any:
    from controller.spec.loader import DesiredSlot, DesiredState
    from tests.unit.manager_fixtures import model_spec, slot_spec

    slots = {n: DesiredSlot(spec=slot_spec(n, port=p), stack="t") for n, p in ports.items()}
    models = {f"{n}-m": model_spec(f"{n}-m") for n in ports}
    return DesiredState(stacks=("t",), models=models, slots=slots)


def test_apply_is_all_or_nothing_and_judges_the_whole_set(tmp_path: Path) -> None:
    from controller.model.errors import SlotConfigError
    from controller.reconcile.apply import apply_to_config
    from controller.spec.configdir import read_config_dir

    config = tmp_path / "config"
    apply_to_config(_state({"a": 8081, "b": 8082, "c": 8090}), config, prune=False)
    # A port swap is legal as a set (never as two single writes).
    apply_to_config(_state({"a": 8082, "b": 8081, "c": 8090}), config, prune=False)
    ports = {n: s.spec.port for n, s in read_config_dir(config).slots.items()}
    assert ports == {"a": 8082, "b": 8081, "c": 8090}
    before = {p.name: p.read_bytes() for p in (config / "slots").iterdir()}
    # A set with a conflict (b takes c's port while c keeps it) changes nothing at all.
    with pytest.raises(SlotConfigError) as err:
        apply_to_config(_state({"a": 8085, "b": 8090, "c": 8090}), config, prune=False)
    assert "slot.duplicate_port" in {p["code"] for p in err.value.problems}
    assert {p.name: p.read_bytes() for p in (config / "slots").iterdir()} == before


async def test_a_desired_change_queues_only_the_slots_it_touches(tmp_path: Path) -> None:
    """Issue 41, item 6: a change used to enqueue every slot. Now a slot's change queues
    that slot, a model's the slots bound to it, and only the resync queues them all."""
    h = harness(tmp_path)
    state = quad()
    r = reconciler(h, state)
    assert await r.converge(timeout=10, poll_s=0.01)
    passed: list[str] = []
    real = r.reconcile

    async def counted(name: str) -> Result:
        passed.append(name)
        return await real(name)

    r.reconcile = counted  # type: ignore[method-assign]
    changed = dict(state.slots)
    changed["lazy-b"] = want(with_changes(changed["lazy-b"].spec, priority=7))
    models = dict(state.models)
    models["auto-a-m"] = model_spec("auto-a-m", 2)  # a model: the slot bound to it
    apply_to_config(
        DesiredState(stacks=state.stacks, models=models, slots=changed),
        h.tmp / "config",
        prune=True,
    )
    r.refresh()
    assert {n for n in ("auto-a", "auto-b", "lazy-a", "lazy-b") if r.queue.is_dirty(n)} == {
        "auto-a",
        "lazy-b",
    }
    stop = asyncio.Event()
    loop = asyncio.create_task(r.run(stop, read_first=False))  # no resync at the start
    try:
        await until(lambda: h.manager.view("lazy-b").priority == 7, "the update")
        await until(lambda: r.queue.idle and not r.queue.delayed, "the passes")
    finally:
        stop.set()
        await loop
        await h.manager.close()
    assert set(passed) == {"auto-a", "lazy-b"}, passed
    r.enqueue_all()  # the resync: every slot
    assert all(r.queue.is_dirty(n) for n in ("auto-a", "auto-b", "lazy-a", "lazy-b"))
