"""The residency tier (issue 22) on FakeRuntime + FakeSleeper + FakeClock: evictions that
sleep instead of unloading, wakes joined through the load path, the fallback of a failed
wake, host memory as the limit of sleepers, adoption of a sleeper, the dry run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from controller.api.dryrun import plan_json
from controller.model.errors import InsufficientMemory
from controller.model.lifecycle import IdleReason, SlotState
from controller.model.sizes import GIB
from controller.slots.manager import SlotManager
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


def sleepy(name: str, **kw: Any) -> SlotSpec:
    """A demo GPU slot whose server sleeps (the demo's sleep is opt-in)."""
    return slot_spec(name, sleep=True, **kw)


async def setup(
    tmp: Path,
    slots: list[SlotSpec],
    models: list[ModelSpec],
    *,
    host_gb: float = 64.0,
    host_margin_gb: float = 0.0,
    **kw: Any,
) -> tuple[Harness, SlotManager]:
    h = Harness(tmp, **kw)
    h.memory.totals["cpu"] = int(host_gb * GIB)
    h.manager.settings = ControllerSettings(safety_margin_gb=0.0, host_margin_gb=host_margin_gb)
    await h.manager.set_desired(desired(slots, models))
    return h, h.manager


def tier(m: SlotManager, name: str) -> tuple[str, str | None, str, int]:
    view = m.view(name)
    return view.state.value, view.idle_reason, view.residency, view.sleep_level


async def test_a_victim_that_can_sleep_sleeps_and_its_device_memory_is_released(
    tmp_path: Path,
) -> None:
    slots = [sleepy("a"), slot_spec("b")]
    h, m = await setup(tmp_path, slots, [model_spec("a-m", 6), model_spec("b-m", 6)], gpu_gb=8)
    await m.load("a")
    h.clock.advance(30)
    sub = m.events.subscribe()
    await m.load("b")
    assert tier(m, "a") == ("idle", "asleep", "asleep", 1)
    assert not m.view("a").dispatchable
    assert h.runtime.sleeping == {"a": 1} and h.runtime.stops["a"] == 0
    assert m.admitted_bytes("gpu:0") == 6 * GIB  # b only: a's device memory is released
    assert m.admitted_bytes("cpu") == 6 * GIB  # a's weights, held in host memory
    assert m.view("a").devices == ("cpu",) and m.view("a").gpus == (0,)  # wakes there
    record = m.store.read("a")
    assert record is not None and record.state is S.IDLE
    assert record.extra.residency == "asleep" and record.extra.sleep_level == 1
    assert record.extra.idle_reason == IdleReason.ASLEEP
    (eviction,) = events_of(sub, "eviction")
    assert eviction.slot == "a" and eviction.details["action"] == "sleep"
    assert "put to sleep to make room for b" in record.message
    assert_legal_history(m.transitions)


async def test_a_request_wakes_a_sleeper_once_for_a_hundred_concurrent_requests(
    tmp_path: Path,
) -> None:
    slots = [sleepy("a", max_queue=128), sleepy("b")]
    h, m = await setup(tmp_path, slots, [model_spec("a-m", 6), model_spec("b-m", 6)], gpu_gb=8)
    h.runtime.script("a", wake_s=0.3)
    await m.load("a")
    h.clock.advance(30)
    await m.load("b")  # a sleeps
    h.clock.advance(30)
    assert m.try_acquire("a") is None  # asleep: not dispatchable without a wake
    sub = m.events.subscribe()
    waiters = [asyncio.ensure_future(m.acquire("a")) for _ in range(100)]
    while not all(w.done() for w in waiters):
        await asyncio.sleep(0)
        h.clock.advance(0.05)
    leases = [w.result() for w in waiters]
    assert h.runtime.wakes["a"] == 1  # one /wake_up for the hundred
    assert h.runtime.starts["a"] == 1  # never restarted
    assert tier(m, "b") == ("idle", "asleep", "asleep", 1)  # made room by sleeping in turn
    assert m.view("a").state is S.SERVING and m.view("a").residency == "awake"
    for lease in leases:
        m.release(lease)
    woke = [e for e in events_of(sub, "residency") if e.details.get("residency") == "awake"]
    assert [e.details["reason"] for e in woke] == ["request"]
    assert woke[0].details["seconds"] >= 0.3
    record = m.store.read("a")
    assert record is not None and record.extra.reload is not None
    assert record.extra.reload.wake_s is not None and record.extra.reload.wake_s >= 0.3
    assert_legal_history(m.transitions)


async def test_a_wake_that_fails_restarts_the_server_once_with_one_event(tmp_path: Path) -> None:
    slots = [sleepy("a"), sleepy("b")]
    h, m = await setup(tmp_path, slots, [model_spec("a-m", 6), model_spec("b-m", 6)], gpu_gb=8)
    await m.load("a")
    h.clock.advance(30)
    await m.load("b")
    h.runtime.script("a", wake_error="POST /wake_up: HTTP 500")
    h.clock.advance(30)
    sub = m.events.subscribe()
    lease = await m.acquire("a")
    m.release(lease)
    assert h.runtime.wakes["a"] == 1 and h.runtime.starts["a"] == 2  # restarted, once
    assert m.view("a").state is S.READY and m.view("a").residency == "awake"
    failed = [e for e in events_of(sub) if e.error == "slot.wake_failed"]
    assert len(failed) == 1 and "did not wake" in failed[0].message
    assert_legal_history(m.transitions)


async def test_a_wake_past_its_timeout_restarts_the_server_once(tmp_path: Path) -> None:
    slots = [sleepy("a", wake_timeout_s=5.0), sleepy("b")]
    h, m = await setup(tmp_path, slots, [model_spec("a-m", 6), model_spec("b-m", 6)], gpu_gb=8)
    await m.load("a")
    h.clock.advance(30)
    await m.load("b")
    h.runtime.script("a", wake_s=20.0)  # longer than wake_timeout_s
    h.clock.advance(30)
    sub = m.events.subscribe()
    lease = await m.acquire("a")
    m.release(lease)
    assert h.runtime.wakes["a"] == 1 and h.runtime.starts["a"] == 2  # restarted, once
    failed = [e for e in events_of(sub) if e.error == "slot.wake_failed"]
    assert len(failed) == 1 and "TimeoutError" in failed[0].message
    assert m.view("a").state is S.READY and m.view("a").residency == "awake"
    assert_legal_history(m.transitions)


async def test_host_memory_that_cannot_hold_the_weights_turns_the_sleep_into_an_unload(
    tmp_path: Path,
) -> None:
    slots = [sleepy("a"), slot_spec("b")]
    models = [model_spec("a-m", 6), model_spec("b-m", 6)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8, host_gb=8, host_margin_gb=4)
    await m.load("a")
    h.clock.advance(30)
    plan = plan_json(m.explain_load("b"))
    assert [(v["slot"], v["action"]) for v in plan["evict"]] == [("a", "unload")]
    await m.load("b")
    assert m.view("a").state is S.OFFLINE and h.runtime.sleeps["a"] == 0


async def test_the_dry_run_shows_sleep_or_unload_per_victim_and_the_memory_freed(
    tmp_path: Path,
) -> None:
    slots = [sleepy("a", priority=10), slot_spec("c", priority=10), slot_spec("big")]
    models = [model_spec("a-m", 4), model_spec("c-m", 4), model_spec("big-m", 8)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8)
    await m.load("a")
    await m.load("c")
    h.clock.advance(60)
    before = (list(m.transitions), m.events.last_id)
    plan = plan_json(m.explain_load("big"))
    assert (list(m.transitions), m.events.last_id) == before  # changes nothing
    actions = {v["slot"]: v["action"] for v in plan["evict"]}
    assert actions == {"a": "sleep", "c": "unload"}
    assert plan["freed"] == {"gpu:0": 8 * GIB, "cpu": -4 * GIB}
    asleep = next(v for v in plan["evict"] if v["slot"] == "a")
    assert asleep["host"] == "cpu" and asleep["host_bytes"] == 4 * GIB and asleep["level"] == 1
    await m.load("big")  # the load does what its dry run said
    assert tier(m, "a") == ("idle", "asleep", "asleep", 1)
    assert m.view("c").state is S.OFFLINE


async def test_a_cpu_load_short_of_host_memory_unloads_sleepers(tmp_path: Path) -> None:
    slots = [sleepy("a"), slot_spec("b"), slot_spec("cpu", device="cpu")]
    models = [model_spec("a-m", 6), model_spec("b-m", 6), model_spec("cpu-m", 6)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8, host_gb=10)
    await m.load("a")
    h.clock.advance(30)
    await m.load("b")  # a sleeps: 6 GiB of the host's 10
    assert m.view("a").residency == "asleep"
    h.clock.advance(30)
    plan = plan_json(m.explain_load("cpu"))
    assert [(v["slot"], v["action"], v["devices"]) for v in plan["evict"]] == [
        ("a", "unload", ["cpu"])
    ]
    await m.load("cpu")
    assert m.view("a").state is S.OFFLINE and h.runtime.stops["a"] == 1
    assert m.view("cpu").state is S.READY


async def test_more_sleepers_than_host_memory_unload_the_one_that_matters_less(
    tmp_path: Path,
) -> None:
    # Room for one awake and one asleep: the third model's load must choose between
    # keeping the old sleeper and letting the new victim sleep.
    slots = [sleepy("a", priority=10), sleepy("b", priority=50), sleepy("c", priority=50)]
    models = [model_spec(f"{n}-m", 6) for n in "abc"]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8, host_gb=8)
    await m.load("a")
    h.clock.advance(10)
    await m.load("b")  # a sleeps (host: 6 of 8 GiB)
    h.clock.advance(10)
    plan = plan_json(m.explain_load("c"))
    # b (priority 50) may sleep only if a (priority 10, asleep) gives up its host memory
    assert [(v["slot"], v["action"]) for v in plan["evict"]] == [("a", "unload"), ("b", "sleep")]
    await m.load("c")
    assert m.view("a").state is S.OFFLINE
    assert tier(m, "b") == ("idle", "asleep", "asleep", 1)
    assert m.admitted_bytes("cpu") == 6 * GIB  # never more than the host holds


async def test_a_slot_that_opts_out_and_a_provider_without_sleep_are_unloaded(
    tmp_path: Path,
) -> None:
    slots = [slot_spec("optout", sleep=False), slot_spec("nosleep"), slot_spec("b")]
    models = [model_spec(f"{n}-m", 4) for n in ("optout", "nosleep", "b")]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8)
    await m.load("optout")
    await m.load("nosleep")
    h.clock.advance(30)
    await m.load("b")
    views = {n: m.view(n) for n in ("optout", "nosleep")}
    assert sorted(n for n, v in views.items() if v.state is S.OFFLINE) in (["nosleep"], ["optout"])
    assert h.runtime.sleeps == {}


async def test_level_two_holds_nothing_in_host_memory(tmp_path: Path) -> None:
    slots = [sleepy("a", sleep_level=2), slot_spec("b")]
    models = [model_spec("a-m", 6), model_spec("b-m", 6)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8, host_gb=1)
    await m.load("a")
    h.clock.advance(30)
    await m.load("b")  # host memory could not hold level 1: level 2 needs none
    assert tier(m, "a") == ("idle", "asleep", "asleep", 2)
    assert m.admitted_bytes("cpu") == 0 and m.view("a").devices == ()


async def test_a_restarted_controller_adopts_a_sleeper_and_counts_it_once(tmp_path: Path) -> None:
    slots = [sleepy("a"), slot_spec("b")]
    models = [model_spec("a-m", 6), model_spec("b-m", 6)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8)
    await m.load("a")
    h.clock.advance(30)
    await m.load("b")
    await m.core.table.close()
    m2 = h.new_manager()
    m2.settings = m.settings
    await m2.set_desired(desired(slots, models))
    await m2.recover()
    assert tier(m2, "a") == ("idle", "asleep", "asleep", 1)
    assert m2.admitted_bytes("gpu:0") == 6 * GIB and m2.admitted_bytes("cpu") == 6 * GIB
    assert h.runtime.starts["a"] == 1  # adopted, not restarted
    # A server that fell asleep unrecorded (the controller died between /sleep and the
    # write) is adopted asleep at the slot's level: it says so itself (/is_sleeping).
    record = m2.store.read("a")
    assert record is not None
    m2.core.table.records["a"].asleep = 0
    await m2.core.table.close()
    m3 = h.new_manager()
    await m3.set_desired(desired(slots, models))
    m3.core.table.records["a"].asleep = 0  # as if state.json said awake
    m3.core.table.records["a"].idle_reason = None
    await m3.recover()
    assert tier(m3, "a") == ("idle", "asleep", "asleep", 1)
    lease = await m3.acquire("a")  # and wakes on request
    assert m3.view("a").state is S.SERVING and h.runtime.wakes["a"] == 1
    m3.release(lease)


async def test_a_background_wake_follows_the_background_rules(tmp_path: Path) -> None:
    slots = [sleepy("auto", autoload=True), slot_spec("user")]
    models = [model_spec("auto-m", 6), model_spec("user-m", 6)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8)
    await m.load("auto", resident=False, background=True)
    h.clock.advance(120)
    await m.load("user")  # a user's load: auto sleeps
    assert m.view("auto").residency == "asleep"
    h.clock.advance(120)
    with pytest.raises(InsufficientMemory) as err:  # equal priority: it waits, no thrash
        await m.load("auto", resident=False, background=True)
    assert err.value.details.get("waiting") is True
    assert m.view("user").state is S.READY and m.view("auto").waiting == "waiting_for_memory"
    assert m.view("auto").residency == "asleep"
    await m.unload("user")
    assert m.waiting_with_room() == ["auto"]
    await m.load("auto", resident=False, background=True)
    await settle(m)
    assert m.view("auto").state is S.READY and h.runtime.starts["auto"] == 1


async def test_the_order_divides_idle_time_by_the_cost_to_bring_back(tmp_path: Path) -> None:
    # Both idle; "big" took 120 s to load, "small" 2 s: small goes although it is used
    # more recently, because bringing it back is 60x cheaper.
    slots = [slot_spec("big"), slot_spec("small"), slot_spec("new")]
    models = [model_spec("big-m", 4), model_spec("small-m", 4), model_spec("new-m", 4)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=8)
    h.runtime.script("big", load_s=120)
    h.runtime.script("small", load_s=2)
    for name in ("big", "small"):
        task = asyncio.ensure_future(m.load(name))
        while not task.done():
            await asyncio.sleep(0)
            h.clock.advance(1)
        await task
    h.clock.advance(100)
    plan = plan_json(m.explain_load("new"))
    (victim,) = plan["evict"]
    assert victim["slot"] == "small", plan
    assert victim["load_s"] == pytest.approx(2, abs=1.5)
    costs = {v["slot"]: v for v in plan["evict"]}
    assert costs["small"]["score"] > 0
    m.core.table.flush_unpersisted()  # `ready` is an observation: it lags (SPEC §3)
    big = m.store.read("big")
    assert big is not None and big.extra.reload is not None
    assert big.extra.reload.load_s is not None and big.extra.reload.load_s >= 119


async def test_a_sleeper_whose_gpu_cannot_be_freed_is_loaded_cold_on_another(
    tmp_path: Path,
) -> None:
    """Multi-GPU: a wake is pinned to the GPUs its server sleeps on. When a pinned slot
    holds them and another GPU has room, the request is not refused: the sleeper's wake
    fails over to a cold load there (one wake_failed event, no wake call)."""
    h, m = await setup(
        tmp_path,
        [sleepy("a"), slot_spec("p", device="gpu:0", pinned=True)],
        [model_spec("a-m", 6), model_spec("p-m", 6)],
        gpu_gb=8,
    )
    h.memory.totals.pop("gpu")
    h.memory.totals.update({"gpu:0": 8 * GIB, "gpu:1": 8 * GIB})
    await m.load("a")
    assert m.view("a").gpus == (0,)
    h.clock.advance(30)
    await m.load("p")  # pinned to GPU 0: a sleeps there
    assert tier(m, "a") == ("idle", "asleep", "asleep", 1)
    h.clock.advance(30)
    plan = plan_json(m.explain_load("a"))  # the dry run says what the load will do
    assert (plan["action"], plan["wake"], plan["devices"]) == ("load", False, ["gpu:1"]), plan
    assert "no room on gpu:0" in plan["fallback"]
    sub = m.events.subscribe()
    lease = await m.acquire("a")
    m.release(lease)
    assert m.view("a").gpus == (1,) and m.view("a").residency == "awake"
    assert h.runtime.wakes["a"] == 0 and h.runtime.starts["a"] == 2
    assert m.view("p").state is S.READY and m.view("p").gpus == (0,)
    failed = [e for e in events_of(sub) if e.error == "slot.wake_failed"]
    assert len(failed) == 1 and "gpu:0" in failed[0].message, failed
    assert m.admitted_bytes("cpu") == 0  # its host memory went with the old server
    assert_legal_history(m.transitions)
