"""Residency under contention (issue 10): no thrash, restore in order, one load decision.

SlotManager + Reconciler on FakeRuntime and a FakeClock: reconcile passes are driven by
hand (in any order hypothesis picks), so a cycle of evictions shows up as an unbounded
number of starts instead of a flaky timing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.api.dryrun import plan_json
from controller.model.errors import InsufficientMemory, ModelNotFound, SlotctlError, SlotPinned
from controller.model.events import EvictionReason
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.reconcile.apply import apply_to_config
from controller.reconcile.reconciler import Reconciler
from controller.scheduling.decision import WAITING_FOR_MEMORY
from controller.slots.manager import SlotManager
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.unit.manager_fixtures import (
    Harness,
    assert_legal_history,
    desired,
    events_of,
    model_spec,
    settle,
    slot_spec,
)

S = SlotState
HYPO = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _stack(slots: Sequence[SlotSpec], models: Sequence[ModelSpec]) -> DesiredState:
    return DesiredState(
        stacks=("t",),
        models={m.id: m for m in models},
        slots={s.name: DesiredSlot(spec=s, stack="t") for s in slots},
    )


def harness(tmp: Path, budget_gb: float, **kw: Any) -> Harness:
    h = Harness(tmp, gpu_gb=1000.0, budget_gb=budget_gb, **kw)
    return h


def reconciler(h: Harness, state: DesiredState) -> Reconciler:
    apply_to_config(state, h.tmp / "config", prune=True)
    return Reconciler(h.manager, h.tmp / "config", resync_s=3600.0)


async def drive(
    h: Harness, r: Reconciler, rounds: int, *, step_s: float, orders: Sequence[Any] = ()
) -> None:
    """Level-triggered passes over every slot, ``step_s`` of fake time between rounds."""
    r.refresh()
    for i in range(rounds):
        names = r.all_names()
        if i < len(orders):
            names = [names[j] for j in orders[i] if j < len(names)]
        for name in names:
            with contextlib.suppress(SlotctlError):
                await r.reconcile(name)
            await settle(h.manager)
        h.clock.advance(step_s)
        await h.manager.tick()


def loaded(m: SlotManager) -> set[str]:
    return {v.name for v in m.views() if v.state in (S.READY, S.SERVING, S.IDLE)}


# ================================================================= no thrash


async def test_two_autoload_slots_that_do_not_fit_together_do_not_evict_each_other(
    tmp_path: Path,
) -> None:
    h = harness(tmp_path, budget_gb=6)
    slots = [slot_spec("a", autoload=True), slot_spec("b", autoload=True)]
    r = reconciler(h, _stack(slots, [model_spec("a-m", 4), model_spec("b-m", 4)]))
    sub = h.manager.events.subscribe()
    await drive(h, r, rounds=3, step_s=1.0)
    first = events_of(sub)
    await drive(h, r, rounds=30, step_s=1.0)
    # Before: every pass evicted the other one (one cold start a round, forever).
    assert sum(h.runtime.starts.values()) == 1
    assert loaded(h.manager) == {"a"}
    b = h.manager.view("b")
    assert b.state is S.OFFLINE and b.waiting == WAITING_FOR_MEMORY
    # Said once (then on change), not at every retry: one refusal, no error events.
    assert [e.error for e in first if e.kind == "refusal" and e.slot == "b"] == [
        "model.insufficient_memory"
    ]
    assert [e for e in first if e.kind == "error"] == []
    assert events_of(sub) == []  # 30 more retries: not a line
    record = h.manager.store.read("b")
    assert record is not None and record.extra.waiting == WAITING_FOR_MEMORY
    assert "waiting for memory" in record.message
    assert_legal_history(h.manager.transitions)


async def test_a_low_priority_autoload_slot_never_evicts_a_higher_priority_one(
    tmp_path: Path,
) -> None:
    h = harness(tmp_path, budget_gb=6)
    slots = [
        slot_spec("low", autoload=True, priority=10),
        slot_spec("high", autoload=False, priority=90),
    ]
    r = reconciler(h, _stack(slots, [model_spec("low-m", 4), model_spec("high-m", 4)]))
    await drive(h, r, rounds=1, step_s=1.0)
    assert loaded(h.manager) == {"low"}
    # A request loads "high" (user demand evicts the autoload slot), then finishes.
    lease = await h.manager.acquire("high")
    h.manager.release(lease)
    assert loaded(h.manager) == {"high"}
    await drive(h, r, rounds=200, step_s=1.0)  # 200 s: far past min_resident_s
    assert loaded(h.manager) == {"high"}
    assert h.manager.view("low").waiting == WAITING_FOR_MEMORY
    assert h.runtime.starts["low"] == 1


async def test_a_higher_priority_autoload_slot_evicts_only_after_the_hysteresis(
    tmp_path: Path,
) -> None:
    h = harness(tmp_path, budget_gb=6)
    slots = [
        slot_spec("low", autoload=False, priority=10),
        slot_spec("high", autoload=True, priority=90),
    ]
    r = reconciler(h, _stack(slots, [model_spec("low-m", 4), model_spec("high-m", 4)]))
    h.manager.set_models(r.snapshot.models, order=list(r.snapshot.slots))
    for want in r.snapshot.slots.values():
        h.manager.upsert(want)
    lease = await h.manager.acquire("low")  # a request keeps "low" busy
    await drive(h, r, rounds=5, step_s=1.0)
    assert loaded(h.manager) == {"low"}  # never a victim while a request is in flight
    h.manager.release(lease)
    min_resident = ControllerSettings().min_resident_s
    await drive(h, r, rounds=int(min_resident // 10) - 1, step_s=10.0)
    assert loaded(h.manager) == {"low"}, "evicted before min_resident_s"
    await drive(h, r, rounds=3, step_s=10.0)
    assert loaded(h.manager) == {"high"}
    assert h.runtime.starts == {"low": 1, "high": 1}


async def test_a_waiting_slot_comes_back_when_memory_is_freed(tmp_path: Path) -> None:
    h = harness(tmp_path, budget_gb=6, config=None)
    slots = [slot_spec("a", autoload=True), slot_spec("b", autoload=True)]
    r = reconciler(h, _stack(slots, [model_spec("a-m", 4), model_spec("b-m", 4)]))
    stop = asyncio.Event()
    runner = asyncio.create_task(r.run(stop))
    try:
        await _until(lambda: "b" in h.manager.names() and h.manager.view("b").waiting is not None)
        await h.manager.unload("a")  # room appears: no retry timer needed, it is woken
        await _until(lambda: loaded(h.manager) == {"b"})
    finally:
        stop.set()
        await runner
    assert h.manager.view("b").waiting is None
    assert (h.manager.store.read("b") or pytest.fail("no state")).extra.waiting is None


async def _until(cond: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@HYPO
@given(
    data=st.data(),
    n=st.integers(min_value=2, max_value=5),
    budget=st.integers(min_value=2, max_value=12),
)
async def test_autoload_residency_converges_to_the_priority_set_without_cycles(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, n: int, budget: int
) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    priorities = data.draw(st.permutations(list(range(10, 10 + 10 * n, 10))))
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    orders = data.draw(st.lists(st.permutations(list(range(n))), min_size=6, max_size=6))
    h = harness(tmp, budget_gb=budget)
    slots = [slot_spec(f"s{i}", autoload=True, priority=priorities[i]) for i in range(n)]
    models = [model_spec(f"s{i}-m", sizes[i]) for i in range(n)]
    r = reconciler(h, _stack(slots, models))
    await drive(h, r, rounds=6, step_s=61.0, orders=orders)
    starts = sum(h.runtime.starts.values())
    # A slot is only evicted by a strictly higher priority: at most k+1 loads for the
    # k-th most important slot.
    assert starts <= n * (n + 1) // 2
    # The highest-priority set that fits (greedy by priority) is what stays loaded.
    expected, used = set(), 0
    for i in sorted(range(n), key=lambda i: -priorities[i]):
        if used + sizes[i] <= budget:
            expected.add(f"s{i}")
            used += sizes[i]
    assert loaded(h.manager) == expected
    await drive(h, r, rounds=3, step_s=61.0)  # stable: nothing moves any more
    assert sum(h.runtime.starts.values()) == starts
    assert_legal_history(h.manager.transitions)


# ================================================================= restore


async def test_restore_loads_in_priority_order_and_leaves_the_rest_waiting(
    tmp_path: Path,
) -> None:
    slots = [
        slot_spec("low", autoload=True, priority=10),
        slot_spec("mid", autoload=False, priority=50),  # resident
        slot_spec("top", autoload=True, priority=90),
    ]
    models = [model_spec("low-m", 4), model_spec("mid-m", 4), model_spec("top-m", 4)]
    h = harness(tmp_path, budget_gb=8)
    h.manager.residency.set("mid", "mid-m")
    m = h.new_manager()
    await m.set_desired(desired(slots, models))
    sub = m.events.subscribe()
    outcome = await m.restore()
    assert outcome == {"top": "ready", "mid": "ready", "low": "model.insufficient_memory"}
    events = events_of(sub)
    assert [e.slot for e in events if e.kind == "admission"] == ["top", "mid"]
    assert [e for e in events if e.kind == "eviction"] == []
    assert m.view("low").waiting == WAITING_FOR_MEMORY
    assert h.runtime.starts == {"top": 1, "mid": 1}


async def test_restore_without_wait_returns_once_admitted(tmp_path: Path) -> None:
    slots = [slot_spec("a", autoload=True)]
    h = harness(tmp_path, budget_gb=8)
    h.runtime.script("a", load_s=30.0)
    await h.manager.set_desired(desired(slots, [model_spec("a-m", 4)]))
    outcome = await h.manager.restore(wait=False)
    assert outcome == {"a": "starting"} or outcome == {"a": "warming"}
    h.clock.advance(30)
    await settle(h.manager)
    assert h.manager.view("a").state is S.READY


# ================================================================= one load decision


async def test_dry_run_and_load_agree_on_a_model_missing_from_the_catalogue(
    tmp_path: Path,
) -> None:
    h = harness(tmp_path, budget_gb=8)
    await h.manager.set_desired(desired([slot_spec("a")], []))
    plan = plan_json(h.manager.explain_load("a"))
    assert plan["action"] == "refuse" and plan["error"]["code"] == "model.not_found"
    with pytest.raises(ModelNotFound):
        await h.manager.load("a")


async def test_dry_run_and_load_agree_on_a_pinned_peer_with_a_memory_shortfall(
    tmp_path: Path,
) -> None:
    slots = [slot_spec("p", pinned=True), slot_spec("a")]
    models = [model_spec("p-m", 4, group="g"), model_spec("a-m", 20, group="g")]
    h = harness(tmp_path, budget_gb=8)
    await h.manager.set_desired(desired(slots, models))
    await h.manager.load("p")
    plan = plan_json(h.manager.explain_load("a"))
    assert plan["error"]["code"] == "slot.pinned"
    with pytest.raises(SlotPinned):
        await h.manager.load("a")


@HYPO
@given(data=st.data())
async def test_the_dry_run_verdict_is_the_loads_verdict(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    tmp = tmp_path_factory.mktemp("decide")
    n = data.draw(st.integers(2, 5))
    group = st.sampled_from([None, None, "g"])
    models = [
        model_spec(f"s{i}-m", data.draw(st.integers(1, 6)), group=data.draw(group))
        for i in range(n)
    ]
    missing = data.draw(st.integers(-1, n - 1))  # one slot's model absent from the catalogue
    slots = [
        slot_spec(
            f"s{i}",
            priority=data.draw(st.integers(0, 100)),
            pinned=data.draw(st.booleans()),
        )
        for i in range(n)
    ]
    h = harness(tmp, budget_gb=data.draw(st.integers(4, 14)))
    m = h.manager
    await m.set_desired(desired(slots, [md for i, md in enumerate(models) if i != missing]))
    for i in data.draw(st.lists(st.integers(0, n - 1), max_size=n)):
        with contextlib.suppress(SlotctlError):
            await m.load(f"s{i}")
        h.clock.advance(data.draw(st.integers(0, 100)))
    leases = [
        await m.acquire(v.name) for v in m.views() if v.dispatchable and data.draw(st.booleans())
    ]
    target = f"s{data.draw(st.integers(0, n - 1))}"
    plan = plan_json(m.explain_load(target))
    before = loaded(m)
    try:
        await m.load(target)
    except SlotctlError as exc:
        assert plan["action"] == "refuse", (plan, exc)
        assert plan["error"]["code"] == exc.code
        assert loaded(m) == before  # a refusal changes nothing
    else:
        if plan["action"] == "none":
            assert loaded(m) == before
        else:
            assert plan["action"] in ("load", "evict-then-load"), plan
            evicted = before - loaded(m) - set(plan.get("exclusive_peers", []))
            assert evicted == {v["slot"] for v in plan["evict"]}
    for lease in leases:
        m.release(lease)


# ================================================================= reservation, revalidation


async def test_two_cold_loads_cannot_both_count_the_same_free_memory(tmp_path: Path) -> None:
    h = Harness(tmp_path, gpu_gb=10)  # no budget: the probed free memory is the limit
    slots = [slot_spec("a"), slot_spec("b")]
    await h.manager.set_desired(desired(slots, [model_spec("a-m", 6), model_spec("b-m", 6)]))
    h.runtime.script("a", load_s=5.0)
    h.runtime.script("b", load_s=5.0)
    results = await asyncio.gather(
        h.manager.start_load("a"), h.manager.start_load("b"), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, InsufficientMemory)]
    assert len(refused) == 1, results  # before: both admitted, 12 GiB promised on 10
    h.clock.advance(5)
    await settle(h.manager)
    assert h.manager.admitted_bytes("gpu") == 6 * GIB


async def test_a_request_between_plan_and_unload_spares_the_victim(tmp_path: Path) -> None:
    slots = [slot_spec("v1", priority=10), slot_spec("v2", priority=20), slot_spec("new")]
    models = [model_spec("v1-m", 4), model_spec("v2-m", 4), model_spec("new-m", 8)]
    h = harness(tmp_path, budget_gb=8)
    m = h.manager
    await m.set_desired(desired(slots, models))
    await m.load("v1")
    await m.load("v2")
    h.clock.advance(100)
    h.runtime.turns = 2  # stopping v1 yields: a request for v2 lands meanwhile
    load = asyncio.create_task(m.load("new"))
    while m.view("v1").state is not S.UNLOADING:
        await asyncio.sleep(0)
    lease = await m.acquire("v2")
    with pytest.raises(InsufficientMemory):
        await load
    assert m.view("v2").state is S.SERVING  # spared: it got a request since the plan
    m.release(lease)


async def test_a_victim_reloaded_since_the_plan_is_spared(tmp_path: Path) -> None:
    slots = [slot_spec("v1", priority=10), slot_spec("v2", priority=20), slot_spec("new")]
    models = [model_spec("v1-m", 4), model_spec("v2-m", 4), model_spec("new-m", 8)]
    h = harness(tmp_path, budget_gb=8)
    m = h.manager
    await m.set_desired(desired(slots, models))
    await m.load("v1")
    await m.load("v2")
    h.clock.advance(100)
    plan = m.decide("new")
    generation = m.view("v2").generation
    await m.unload("v2")
    await m.load("v2")
    assert m.view("v2").generation == generation + 1
    assert await m.evict(list(plan.victims), reason=EvictionReason.PRELOAD) == ["v1"]
    assert m.view("v2").state is S.READY


# ================================================================= validate warning


def test_stack_validate_warns_when_autoload_slots_exceed_the_budget(tmp_path: Path) -> None:
    from controller.spec.loader import load_stack_texts

    text = """
[stack]
name = "t"
[[model]]
id = "big"
memory_gb = 10
[[model]]
id = "small"
memory_gb = 4
[[slot]]
name = "first"
provider = "demo"
port = 9001
model.default = "big"
priority = 90
[[slot]]
name = "second"
provider = "demo"
port = 9002
model.default = "small"
priority = 10
"""
    settings = ControllerSettings(memory_budget_gb={"gpu": 12.0}, safety_margin_gb=0.5)
    report = load_stack_texts([("t.toml", text)], settings)
    assert report.ok
    (warning,) = [w for w in report.warnings if w.code == "slot.autoload_over_budget"]
    assert warning.slot == "second" and "wait for memory" in warning.message
    roomy = ControllerSettings(memory_budget_gb={"gpu": 20.0})
    report = load_stack_texts([("t.toml", text)], roomy)
    assert not [w for w in report.warnings if w.code == "slot.autoload_over_budget"]


async def test_a_waiting_slot_comes_back_when_other_memory_use_drops(tmp_path: Path) -> None:
    h = Harness(tmp_path, gpu_gb=10)  # no budget: the probed free memory is the limit
    h.memory.external["gpu"] = 8 * GIB  # another process holds most of the GPU
    r = reconciler(h, _stack([slot_spec("a", autoload=True)], [model_spec("a-m", 4)]))
    stop = asyncio.Event()
    runner = asyncio.create_task(r.run(stop))
    try:
        await _until(lambda: "a" in h.manager.names() and h.manager.view("a").waiting is not None)
        starts = sum(h.runtime.starts.values())
        h.memory.external["gpu"] = 0  # it exits: no unload event, only the probe shows it
        await _until(lambda: loaded(h.manager) == {"a"})
    finally:
        stop.set()
        await runner
    assert starts == 0 and h.runtime.starts["a"] == 1


async def test_an_open_breaker_is_retried_after_its_cap_without_a_reset(tmp_path: Path) -> None:
    h = harness(tmp_path, budget_gb=8)
    h.runtime.script("a", start_error="port 8081 in use")
    spec = slot_spec("a", autoload=True, max_consecutive_failures=2)
    r = reconciler(h, _stack([spec], [model_spec("a-m", 1)]))
    await drive(h, r, rounds=4, step_s=2.0)
    view = h.manager.view("a")
    assert view.state is S.ERROR and view.failures == 2 and view.retry_after_s > 250
    assert "slotctl slot reset a" in view.message
    h.runtime.script("a", start_error=None)  # the port is free again
    await drive(h, r, rounds=3, step_s=150.0)  # past the cap: half-open, one try
    assert h.manager.view("a").state is S.READY


# ================================================================= pause (issue 14 item 7)


async def test_a_users_unload_of_an_autoload_slot_sticks_until_a_load(tmp_path: Path) -> None:
    h = harness(tmp_path, budget_gb=8)
    r = reconciler(h, _stack([slot_spec("a", autoload=True)], [model_spec("a-m", 1)]))
    await drive(h, r, rounds=1, step_s=1.0)
    assert loaded(h.manager) == {"a"}
    view = await h.manager.unload("a", pause=True)
    assert view.paused and view.state is S.OFFLINE
    await drive(h, r, rounds=10, step_s=5.0)
    # Before: the reconciler loaded it again a second later ("unloaded" was a lie).
    assert loaded(h.manager) == set() and h.runtime.starts["a"] == 1
    assert "slotctl slot load a" in r.plan("a").reason
    # A restarted controller keeps the pause (residency.json), restore skips the slot.
    fresh = h.new_manager()
    await fresh.set_desired(r.snapshot.desired())
    assert fresh.view("a").paused
    assert await fresh.restore() == {}
    # A user's load resumes it: autoload keeps it loaded again.
    view = await h.manager.load("a", resident=False)
    assert not view.paused and view.state is S.READY
    assert h.manager.residency.read_paused() == {}
    await h.manager.unload("a")  # an internal unload (no pause): the reconciler reloads
    await drive(h, r, rounds=1, step_s=1.0)
    assert loaded(h.manager) == {"a"}


async def test_a_request_does_not_resume_a_paused_slot(tmp_path: Path) -> None:
    h = harness(tmp_path, budget_gb=8)
    await h.manager.set_desired(desired([slot_spec("a", autoload=True)], [model_spec("a-m", 1)]))
    await h.manager.load("a")
    await h.manager.unload("a", pause=True)
    lease = await h.manager.acquire("a")  # on demand, like a slot without autoload
    h.manager.release(lease)
    assert h.manager.view("a").paused


async def test_a_user_load_of_a_waiting_slot_still_evicts(tmp_path: Path) -> None:
    h = harness(tmp_path, budget_gb=6)
    slots = [slot_spec("a", autoload=True), slot_spec("b", autoload=True)]
    r = reconciler(h, _stack(slots, [model_spec("a-m", 4), model_spec("b-m", 4)]))
    await drive(h, r, rounds=2, step_s=1.0)
    assert h.manager.view("b").waiting == WAITING_FOR_MEMORY
    view = await h.manager.start_load("b")  # the API's load: user demand wins
    assert view.state in (S.STARTING, S.PULLING, S.WARMING, S.READY)
    await settle(h.manager)
    assert loaded(h.manager) == {"b"} and h.manager.view("b").waiting is None
    assert h.manager.view("a").state is S.OFFLINE


async def test_every_eviction_event_carries_its_reason(tmp_path: Path) -> None:
    """Preload, TTL and exclusive swaps all say why in the event's ``reason`` field."""
    slots = [
        slot_spec("lo", priority=10),
        slot_spec("big"),
        slot_spec("ga", "ga-m"),
        slot_spec("gb", "gb-m"),
        slot_spec("short", ttl_s=10, autoload=False),
    ]
    models = [
        model_spec("lo-m", 4),
        model_spec("big-m", 6),
        model_spec("ga-m", 1, group="g"),
        model_spec("gb-m", 1, group="g"),
        model_spec("short-m", 1),
    ]
    h = harness(tmp_path, budget_gb=10)
    m = h.manager
    await m.set_desired(desired(slots, models))
    sub = m.events.subscribe()
    await m.load("lo")
    h.clock.advance(100)
    await m.load("big")  # evicts lo: preload
    await m.load("ga")
    await m.load("gb")  # swaps ga out: exclusive
    await m.unload("big")
    await m.load("short", resident=False)
    h.clock.advance(11)
    await m.tick()  # short unused past ttl_s: ttl
    reasons = {(e.slot, e.reason) for e in events_of(sub, "eviction")}
    assert reasons == {
        ("lo", EvictionReason.PRELOAD),
        ("ga", EvictionReason.EXCLUSIVE),
        ("short", EvictionReason.TTL),
    }


async def test_a_gpu_slot_on_a_host_without_a_gpu_says_so_once(tmp_path: Path) -> None:
    """No GPU probe and no budget: the autoload slot waits, with the reason in its message,
    said once however often the reconciler retries (issue 14: not every 2 s, not bytes)."""
    h = Harness(tmp_path)
    h.memory.totals.pop("gpu")  # no NVML, no amdgpu: the probe has nothing for "gpu"
    r = reconciler(h, _stack([slot_spec("chat", autoload=True)], [model_spec("chat-m", 4)]))
    sub = h.manager.events.subscribe()
    await drive(h, r, rounds=20, step_s=2.0)
    view = h.manager.view("chat")
    assert view.state is S.OFFLINE and view.waiting == WAITING_FOR_MEMORY
    assert "no memory probe answers for gpu" in view.message
    assert "memory_budget_gb.gpu" in view.message
    refusals = [e for e in events_of(sub) if e.kind == "refusal"]
    assert len(refusals) == 1 and refusals[0].details.get("no_probe") is True


# ================================================================= review findings


async def test_a_restart_after_a_swap_keeps_the_users_group_member(tmp_path: Path) -> None:
    slots = [slot_spec("ga", "ga-m", autoload=True), slot_spec("gb", "gb-m", autoload=False)]
    models = [model_spec("ga-m", 1, group="g"), model_spec("gb-m", 1, group="g")]
    h = harness(tmp_path, budget_gb=8)
    await h.manager.set_desired(desired(slots, models))
    await h.manager.load("ga")
    await h.manager.load("gb")  # the user swaps the group over to gb (resident)
    fresh = h.new_manager()
    await fresh.set_desired(desired(slots, models))
    await fresh.recover()
    outcome = await fresh.restore()
    # Before: the restore loaded ga (swapping gb out, clearing its wish), then gb again.
    assert outcome["gb"] == "ready" and outcome["ga"].startswith("waiting: gb holds")
    assert fresh.view("gb").state is S.READY and fresh.view("gb").resident
    assert fresh.view("ga").state is S.OFFLINE
    assert h.runtime.starts == {"ga": 1, "gb": 1}


async def test_restore_does_not_wait_for_an_adopted_server_still_warming(tmp_path: Path) -> None:
    h = harness(tmp_path, budget_gb=8)
    spec = [slot_spec("a", autoload=True)]
    await h.manager.set_desired(desired(spec, [model_spec("a-m", 1)]))
    h.runtime.script("a", load_s=500.0)
    load = asyncio.create_task(h.manager.load("a"))
    while h.manager.view("a").state is not S.WARMING:
        await asyncio.sleep(0)
    load.cancel()  # the controller "dies" mid-warm-up; its server keeps loading
    await asyncio.gather(load, return_exceptions=True)
    h.manager.core.table.records["a"].state = S.WARMING  # as the state file says
    fresh = h.new_manager()
    await fresh.set_desired(desired(spec, [model_spec("a-m", 1)]))
    await fresh.recover()
    before = h.clock.monotonic()
    assert await fresh.restore(wait=False) == {"a": "warming"}
    assert h.clock.monotonic() == before  # returned at once: the warm-up goes on alone
    await fresh.close()


async def test_a_refused_user_load_keeps_the_pause(tmp_path: Path) -> None:
    h = harness(tmp_path, budget_gb=4)
    slots = [slot_spec("auto", autoload=True), slot_spec("big", autoload=False)]
    await h.manager.set_desired(desired(slots, [model_spec("auto-m", 1), model_spec("big-m", 1)]))
    await h.manager.load("auto")
    await h.manager.unload("auto", pause=True)
    h.manager.settings = h.manager.settings.model_copy(update={"memory_budget_gb": {"gpu": 0.5}})
    with pytest.raises(InsufficientMemory):
        await h.manager.load("auto")  # refused: nothing changes, the pause included
    assert h.manager.view("auto").paused
    assert h.manager.residency.read_paused()


async def test_a_failing_autoload_slot_is_said_once_per_distinct_failure(tmp_path: Path) -> None:
    h = harness(tmp_path, budget_gb=8)
    h.runtime.script("bad", start_error="bad flag")
    spec = slot_spec("bad", autoload=True, max_consecutive_failures=50)
    r = reconciler(h, _stack([spec], [model_spec("bad-m", 1)]))
    r.refresh()
    sub = h.manager.events.subscribe()
    for _ in range(8):  # every retry fails the same way (a pass as the worker runs it)
        await r._run_one("bad")
        await settle(h.manager)
        h.clock.advance(400.0)
    events = events_of(sub)
    assert len([e for e in events if e.kind == "error"]) == 1
    assert len([e for e in events if e.kind == "plan"]) <= 2  # create, then load
