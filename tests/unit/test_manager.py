"""SlotManager scenarios on FakeRuntime + FakeClock (no real sleeping, no processes).

SPEC §1 (lifecycle, breaker), §3 (state.json, residency, adoption), §6 (admission,
eviction, exclusive groups), §7 (leases, joining cold loads, cancellation, generations).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from controller.api.dryrun import plan_json
from controller.model.errors import (
    InsufficientMemory,
    SlotCrashLooping,
    SlotctlError,
    SlotHealthFailed,
    SlotNotReady,
    SlotPinned,
    SlotQueueFull,
    SlotSpawnFailed,
    SlotTerminateTimeout,
)
from controller.model.events import Op
from controller.model.lifecycle import IdleReason, SlotState
from controller.model.sizes import GIB
from controller.slots.manager import SlotManager
from controller.spec.schema import ModelSpec, SlotSpec
from tests.unit.manager_fixtures import (
    Harness,
    assert_legal_history,
    desired,
    events_of,
    model_spec,
    rebound,
    settle,
    slot_spec,
)

S = SlotState


async def setup(
    tmp: Path, slots: list[SlotSpec], models: list[ModelSpec], **kw: Any
) -> tuple[Harness, SlotManager]:
    h = Harness(tmp, **kw)
    await h.manager.set_desired(desired(slots, models))
    return h, h.manager


async def spin(rounds: int = 3) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def state_file(m: SlotManager, name: str) -> SlotState | None:
    record = m.store.read(name)
    return record.state if record else None


def written(m: SlotManager) -> SlotManager:
    """``m`` with the observations it still lags written (SPEC §3: within 250 ms, off
    the loop; a test reading state.json at once writes them first, as a stop does)."""
    m.core.table.flush_unpersisted()
    return m


# ================================================================= load / join


async def test_load_of_a_loaded_slot_is_a_no_op(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 2)])
    assert (await m.load("a")).state is S.READY
    before = list(m.transitions)
    sub = m.events.subscribe()
    view = await m.load("a")
    assert view.state is S.READY
    assert list(m.transitions) == before
    assert events_of(sub, "transition") == []
    assert h.runtime.starts["a"] == 1


async def test_concurrent_loads_join_one_start(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 2)])
    h.runtime.script("a", load_s=3.0)
    views = await asyncio.gather(*(m.load("a") for _ in range(5)))
    assert [v.state for v in views] == [S.READY] * 5
    assert h.runtime.starts["a"] == 1
    assert [t for t in m.transitions if t[0] == "a"] == [
        ("a", "offline", "starting"),
        ("a", "starting", "warming"),
        ("a", "warming", "ready"),
    ]


async def test_fifty_cold_acquires_cause_one_start(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 2)])
    h.runtime.script("a", load_s=2.0)
    leases = await asyncio.gather(*(m.acquire("a") for _ in range(50)))
    assert h.runtime.starts["a"] == 1
    assert len({lease.id for lease in leases}) == 50
    view = m.view("a")
    assert (view.state, view.leases, view.waiters) == (S.SERVING, 50, 0)
    for lease in leases[:-1]:
        m.release(lease)
        assert m.view("a").state is S.SERVING
    m.release(leases[-1])
    assert m.view("a").state is S.READY
    assert written(m).store.read("a").state is S.READY  # type: ignore[union-attr]


async def test_cancelling_49_of_50_cold_waiters_keeps_the_load(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", autoload=False)], [model_spec("a-m", 2)])
    h.runtime.script("a", load_s=5.0)
    tasks = [asyncio.create_task(m.acquire("a")) for _ in range(50)]
    await spin()
    assert m.view("a").waiters == 50
    assert m.view("a").state is S.WARMING  # the load is in flight
    for task in tasks[:49]:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results[:49])
    lease = results[49]
    assert not isinstance(lease, BaseException)
    await settle(m)
    assert m.view("a").state is S.SERVING
    assert m.view("a").leases == 1 and m.view("a").waiters == 0
    assert h.runtime.starts["a"] == 1
    lease.check()
    m.release(lease)
    await settle(m)
    assert m.view("a").state is S.READY  # nobody unloaded it


async def test_last_waiter_cancelling_unloads_after_the_load_settles(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", autoload=False)], [model_spec("a-m", 2)])
    h.runtime.script("a", load_s=5.0)
    started = h.clock.now
    waiter = asyncio.create_task(m.acquire("a"))
    await spin()
    assert m.view("a").state is S.WARMING
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert m.view("a").state is S.WARMING  # not cancelled: it settles first
    await settle(m)
    assert m.view("a").state is S.OFFLINE
    assert h.clock.now - started >= 5.0
    history = [(f, t) for n, f, t in m.transitions if n == "a"]
    assert history == [
        ("offline", "starting"),
        ("starting", "warming"),
        ("warming", "ready"),  # the load settled ...
        ("ready", "unloading"),  # ... then cleanup unloaded it
        ("unloading", "offline"),
    ]
    assert (h.runtime.starts["a"], h.runtime.stops["a"]) == (1, 1)
    assert "every waiter cancelled" in m.view("a").message


async def test_last_waiter_cancelling_a_failing_load_leaves_error(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", autoload=False)], [model_spec("a-m", 2)])
    h.runtime.script("a", load_s=5.0, outcome="exit")
    waiter = asyncio.create_task(m.acquire("a"))
    await spin()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await settle(m)
    assert m.view("a").state is S.ERROR
    assert m.view("a").failures == 1


@pytest.mark.parametrize("keep", ["autoload", "resident"])
async def test_last_waiter_cancelling_keeps_a_wanted_slot(tmp_path: Path, keep: str) -> None:
    spec = slot_spec("a", autoload=keep == "autoload")
    h, m = await setup(tmp_path, [spec], [model_spec("a-m", 2)])
    if keep == "resident":
        await m.load("a")  # records the residency wish
        await m.unload("a", clear_residency=False)
        assert m.view("a").resident and m.view("a").state is S.OFFLINE
    h.runtime.script("a", load_s=5.0)
    waiter = asyncio.create_task(m.acquire("a"))
    await spin()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await settle(m)
    assert m.view("a").state is S.READY


async def test_a_new_waiter_before_the_load_settles_cancels_the_cleanup(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", autoload=False)], [model_spec("a-m", 2)])
    h.runtime.script("a", load_s=5.0)
    first = asyncio.create_task(m.acquire("a"))
    await spin()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.create_task(m.acquire("a"))
    lease = await second
    await settle(m)
    assert m.view("a").state is S.SERVING
    lease.check()
    assert h.runtime.starts["a"] == 1


async def test_stale_cleanup_does_not_unload_a_replacement_load(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", autoload=False)], [model_spec("a-m", 2)])
    h.runtime.script("a", load_s=5.0)
    waiter = asyncio.create_task(m.acquire("a"))
    await spin()
    slot = m.core.table.records["a"]
    first_load = slot.flight.task
    assert first_load is not None
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await settle(m)
    assert m.view("a").state is S.OFFLINE and m.view("a").generation == 1
    # A replacement load (nobody holds it: not resident, no waiters, no leases).
    await m.load("a", resident=False)
    assert m.view("a").generation == 2
    # The cleanup of the first, cancelled load runs late: its generation is stale.
    await m.leasing.cleanup_after(slot, first_load)
    assert m.view("a").state is S.READY
    # The same cleanup for the current generation does unload (the check is the guard).
    current = slot.flight.task
    assert current is not None
    await m.leasing.cleanup_after(slot, current)
    assert m.view("a").state is S.OFFLINE


# ================================================================= leases


async def test_leases_keep_serving_and_release_is_idempotent(tmp_path: Path) -> None:
    _h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 2)])
    await m.load("a")
    one, two = await m.acquire("a"), await m.acquire("a")
    assert m.view("a").state is S.SERVING and m.view("a").leases == 2
    m.release(one)
    m.release(one)  # idempotent: does not drop the other lease
    assert m.view("a").state is S.SERVING and m.view("a").leases == 1
    m.release(two)
    assert m.view("a").state is S.READY and m.view("a").leases == 0
    m.release(two)
    assert m.view("a").state is S.READY
    assert [t for t in m.transitions if t[0] == "a"][-2:] == [
        ("a", "ready", "serving"),
        ("a", "serving", "ready"),
    ]


async def test_unload_drains_then_revokes_after_drain_timeout(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", drain_timeout_s=10)], [model_spec("a-m", 2)])
    await m.load("a")
    lease = await m.acquire("a")
    t0 = h.clock.now
    view = await m.unload("a")
    assert view.state is S.OFFLINE
    assert h.clock.now - t0 >= 10.0
    assert isinstance(lease.error, SlotNotReady)
    assert lease.lost.is_set()
    with pytest.raises(SlotNotReady, match="drain_timeout_s=10"):
        lease.check()
    m.release(lease)  # a revoked lease: nothing to undo
    assert m.view("a").state is S.OFFLINE
    history = [(f, t) for n, f, t in m.transitions if n == "a"][-3:]
    assert history == [("serving", "ready"), ("ready", "unloading"), ("unloading", "offline")]


async def test_unload_waits_for_a_lease_released_in_time(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", drain_timeout_s=10)], [model_spec("a-m", 2)])
    await m.load("a")
    lease = await m.acquire("a")
    unload = asyncio.create_task(m.unload("a"))
    await spin()
    assert m.view("a").state is S.SERVING  # draining: still serving the request
    # A request arriving during the drain does not get the draining server: it waits
    # and is served by a fresh load after the unload.
    late = asyncio.create_task(m.acquire("a"))
    await spin()
    assert not late.done()
    m.release(lease)
    assert (await unload).state is S.OFFLINE
    assert lease.error is None
    fresh = await late
    assert fresh.generation == lease.generation + 1
    assert m.view("a").state is S.SERVING
    assert h.runtime.starts["a"] == 2
    m.release(fresh)
    assert_legal_history(m.transitions)


async def test_pinned_unload_needs_force(tmp_path: Path) -> None:
    _h, m = await setup(tmp_path, [slot_spec("p", pinned=True)], [model_spec("p-m", 2)])
    await m.load("p")
    sub = m.events.subscribe()
    with pytest.raises(SlotPinned) as err:
        await m.unload("p")
    assert err.value.code == "slot.pinned"
    assert m.view("p").state is S.READY
    assert [e.error for e in events_of(sub, "refusal")] == ["slot.pinned"]
    assert (await m.unload("p", force=True)).state is S.OFFLINE


async def test_max_queue_refuses_extra_cold_waiters(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", max_queue=2)], [model_spec("a-m", 2)])
    h.runtime.script("a", load_s=5.0)
    waiting = [asyncio.create_task(m.acquire("a")) for _ in range(2)]
    await spin()
    with pytest.raises(SlotQueueFull) as err:
        await m.acquire("a")
    assert err.value.retry_after_s > 0
    assert err.value.http_status == 429
    leases = await asyncio.gather(*waiting)
    assert m.view("a").leases == 2
    # A warm slot has no queue: more leases than max_queue are fine.
    extra = await m.acquire("a")
    for lease in [*leases, extra]:
        m.release(lease)


# ================================================================= exclusive groups


async def test_exclusive_group_swap_unloads_the_loaded_member_first(tmp_path: Path) -> None:
    slots = [slot_spec("a", "ga"), slot_spec("b", "gb")]
    models = [model_spec("ga", 2, group="g"), model_spec("gb", 2, group="g")]
    _h, m = await setup(tmp_path, slots, models)
    await m.load("a")
    assert m.view("a").resident
    await m.load("b")
    assert m.view("a").state is S.OFFLINE
    assert m.view("b").state is S.READY
    assert not m.view("a").resident
    assert "a" not in m.residency.read()
    assert "exclusive group g" in m.view("a").message
    assert "exclusive group g" in m.store.read("a").message  # type: ignore[union-attr]
    t = list(m.transitions)
    assert t.index(("a", "unloading", "offline")) < t.index(("b", "offline", "starting"))
    assert_legal_history(m.transitions)


async def test_exclusive_group_pinned_member_refuses_the_swap(tmp_path: Path) -> None:
    slots = [slot_spec("a", "ga", pinned=True), slot_spec("b", "gb")]
    models = [model_spec("ga", 2, group="g"), model_spec("gb", 2, group="g")]
    _h, m = await setup(tmp_path, slots, models)
    await m.load("a")
    before = list(m.transitions)
    with pytest.raises(SlotPinned):
        await m.load("b")
    assert list(m.transitions) == before
    assert m.view("a").state is S.READY and m.view("b").state is S.OFFLINE


async def test_exclusive_swap_does_not_deadlock_on_a_queued_peer_load(tmp_path: Path) -> None:
    """A peer's own pending load queues on the group lock the swapping load holds.

    Found by this suite: loading ``a`` while ``p`` (same group) drains and a request for
    ``p`` is queued used to wait for ``p``'s queued load, which waited for ``a``'s group
    lock: a deadlock until ``exclusive_wait_s`` (120 s of real time).
    """
    slots = [slot_spec("a", "ga"), slot_spec("p", "gp")]
    models = [model_spec("ga", 2, group="g"), model_spec("gp", 2, group="g")]
    _h, m = await setup(tmp_path, slots, models)
    await m.load("p")
    held = await m.acquire("p")
    unload_p = asyncio.create_task(m.unload("p"))  # drains
    await asyncio.sleep(0)
    load_a = asyncio.create_task(m.load("a"))
    want_p = asyncio.create_task(m.acquire("p"))  # queued behind the drain
    done = await asyncio.wait_for(
        asyncio.gather(unload_p, load_a, want_p, return_exceptions=True), timeout=10
    )
    for result in done:
        assert not isinstance(result, BaseException), result
    assert isinstance(held.error, SlotNotReady)  # revoked by the drain timeout
    lease = done[2]
    assert m.view("p").state is S.SERVING  # the queued request swapped p back in
    assert m.view("a").state is S.OFFLINE
    assert_legal_history(m.transitions)
    m.release(lease)  # type: ignore[arg-type]


# ================================================================= admission / eviction


async def test_admission_refusal_changes_nothing(tmp_path: Path) -> None:
    slots = [slot_spec("pin", pinned=True), slot_spec("small"), slot_spec("big")]
    models = [model_spec("pin-m", 6), model_spec("small-m", 1), model_spec("big-m", 6)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=10)
    await m.load("pin")
    await m.load("small")
    before = (list(m.transitions), [v.state for v in m.views()], m.residency.read())
    files = {n: m.store.read(n) for n in m.names()}
    sub = m.events.subscribe()
    with pytest.raises(InsufficientMemory) as err:
        await m.load("big")
    d = err.value.details
    assert d["needed_bytes"] == 6 * GIB
    assert d["free_bytes"] == 3 * GIB  # 10 - 6 (pin) - 1 (small)
    assert d["evictable_bytes"] == 1 * GIB  # only "small": "pin" is pinned
    assert err.value.code == "model.insufficient_memory"
    after = (list(m.transitions), [v.state for v in m.views()], m.residency.read())
    assert after == before
    assert {n: m.store.read(n) for n in m.names()} == files
    events = events_of(sub)
    assert [e.kind for e in events if e.kind in ("transition", "eviction")] == []
    assert [(e.kind, e.op, e.error) for e in events] == [
        ("refusal", "admit", "model.insufficient_memory")
    ]
    assert h.runtime.starts["big"] == 0
    assert not m.view("big").resident


async def test_admission_respects_margin_and_budget(tmp_path: Path) -> None:
    slots = [slot_spec("a", pinned=True), slot_spec("b"), slot_spec("c")]
    models = [model_spec("a-m", 4), model_spec("b-m", 4), model_spec("c-m", 3.5)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=24, budget_gb=8.5, margin_gb=1)
    await m.load("a")
    with pytest.raises(InsufficientMemory) as err:
        await m.load("b")  # 4 + 4 > 8.5 - 1, though the device has 20 GiB free
    assert err.value.details["budget_bytes"] == int(8.5 * GIB)
    assert err.value.details["free_bytes"] == 20 * GIB
    assert (await m.load("c")).state is S.READY  # 4 + 3.5 == 8.5 - 1: exactly fits
    h.memory.external["gpu"] = 16 * GIB  # something else takes the device's memory
    await m.unload("c")
    with pytest.raises(InsufficientMemory) as err:
        await m.load("c")  # within budget, but 4 GiB free - 1 GiB margin < 3.5 GiB
    assert err.value.details["free_bytes"] == 4 * GIB


async def test_preload_eviction_lowest_priority_then_lru(tmp_path: Path) -> None:
    slots = [
        slot_spec("lo1", priority=10),
        slot_spec("lo2", priority=10),
        slot_spec("hi", priority=90),
        slot_spec("new", priority=50),
    ]
    models = [model_spec(f"{n}-m", 4) for n in ("lo1", "lo2", "hi", "new")]
    h, m = await setup(tmp_path, slots, models, gpu_gb=12)
    for name in ("hi", "lo1", "lo2"):  # hi is the least recently used overall
        await m.load(name)
        h.clock.advance(1)
    h.clock.advance(10)
    m.release(await m.acquire("lo1"))  # lo1 used recently: lo2 is LRU in the p10 tier
    h.clock.advance(5)
    sub = m.events.subscribe()
    await m.load("new")
    assert m.view("new").state is S.READY
    assert m.view("lo2").state is S.OFFLINE
    assert m.view("lo1").state is S.READY and m.view("hi").state is S.READY
    record = m.store.read("lo2")
    assert record is not None and record.state is S.OFFLINE
    assert "evicted to make room for new" in record.message
    assert "priority 10" in record.message
    evictions = events_of(sub, "eviction")
    assert [e.slot for e in evictions] == ["lo2"]
    assert "make room for new" in evictions[0].message
    assert evictions[0].details["bytes"] == 4 * GIB


async def test_explain_load_reports_the_plan_and_changes_nothing(tmp_path: Path) -> None:
    slots = [slot_spec("lo", priority=10), slot_spec("hi", priority=90), slot_spec("new")]
    models = [model_spec("lo-m", 4), model_spec("hi-m", 4), model_spec("new-m", 4)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=10)
    await m.load("lo")
    await m.load("hi")
    h.clock.advance(30)
    before = (list(m.transitions), m.events.last_id, [m.store.read(n) for n in m.names()])
    plan = plan_json(m.explain_load("new"))
    assert (list(m.transitions), m.events.last_id, [m.store.read(n) for n in m.names()]) == before
    assert plan["action"] == "evict-then-load"
    assert plan["needed_bytes"] == 4 * GIB and plan["free_bytes"] == 2 * GIB
    (victim,) = plan["evict"]
    assert victim["slot"] == "lo" and victim["priority"] == 10 and victim["bytes"] == 4 * GIB
    assert victim["idle_s"] == 30.0
    assert "priority 10" in victim["reason"]
    await m.load("new")  # the real load does what the dry run said
    assert m.view("lo").state is S.OFFLINE and m.view("hi").state is S.READY
    assert plan_json(m.explain_load("new"))["action"] == "none"
    # A refusal explained: nothing could free enough.
    slots2 = [*slots, slot_spec("huge")]
    await m.set_desired(desired(slots2, [*models, model_spec("huge-m", 40)]))
    refused = plan_json(m.explain_load("huge"))
    assert refused["action"] == "refuse"
    assert refused["error"]["code"] == "model.insufficient_memory"


async def test_pinned_and_leased_slots_are_never_evicted(tmp_path: Path) -> None:
    slots = [
        slot_spec("pin", priority=0, pinned=True),
        slot_spec("busy", priority=0),
        slot_spec("new"),
    ]
    models = [model_spec("pin-m", 4), model_spec("busy-m", 4), model_spec("new-m", 4)]
    _h, m = await setup(tmp_path, slots, models, gpu_gb=10)
    await m.load("pin")
    await m.load("busy")
    lease = await m.acquire("busy")
    with pytest.raises(InsufficientMemory) as err:
        await m.load("new")
    assert err.value.details["evictable_bytes"] == 0
    assert m.view("pin").state is S.READY and m.view("busy").state is S.SERVING
    m.release(lease)
    await m.load("new")
    assert m.view("busy").state is S.OFFLINE and m.view("pin").state is S.READY


# ================================================================= crash-loop breaker


async def test_crash_loop_backoff_block_and_reset(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("c")], [model_spec("c-m", 1)])
    h.runtime.script("c", outcome="exit")
    for attempt in range(1, 6):
        with pytest.raises(SlotSpawnFailed):
            await m.load("c")
        view = m.view("c")
        assert view.state is S.ERROR and view.failures == attempt
        expected = float(2 ** (attempt - 1)) if attempt < 5 else 300.0  # then open: the cap
        assert view.retry_after_s == expected
        if attempt < 5:
            with pytest.raises(SlotCrashLooping) as err:
                await m.load("c")
            assert err.value.retry_after_s == expected
            assert err.value.details["blocked"] is False
            h.clock.advance(expected)
    assert h.runtime.starts["c"] == 5
    assert "next try in 300s" in view.message and "slotctl slot reset c" in view.message
    h.clock.advance(299)
    with pytest.raises(SlotCrashLooping) as err:
        await m.load("c")
    assert err.value.details["blocked"] is True
    with pytest.raises(SlotCrashLooping):
        await m.acquire("c")
    assert h.runtime.starts["c"] == 5
    h.clock.advance(1)  # half-open: one more try, which fails and opens it again
    with pytest.raises(SlotSpawnFailed):
        await m.load("c")
    assert h.runtime.starts["c"] == 6
    with pytest.raises(SlotCrashLooping):
        await m.load("c")
    view = await m.reset("c")
    assert view.state is S.OFFLINE and view.failures == 0
    h.runtime.script("c", outcome="ready")
    assert (await m.load("c")).state is S.READY
    assert_legal_history(m.transitions)


@pytest.mark.parametrize("change", ["port", "extra_args"])
async def test_config_change_unblocks_the_breaker(tmp_path: Path, change: str) -> None:
    spec = slot_spec("c", max_consecutive_failures=2)
    h, m = await setup(tmp_path, [spec], [model_spec("c-m", 1)])
    h.runtime.script("c", start_error="bad flag")
    for _ in range(2):
        with pytest.raises(SlotSpawnFailed, match="bad flag"):
            await m.load("c")
        h.clock.advance(100)
    with pytest.raises(SlotCrashLooping):
        await m.load("c")
    # A scheduling knob is not a config change: still blocked.
    await m.set_desired(desired([spec.model_copy(update={"priority": 70})], [model_spec("c-m")]))
    with pytest.raises(SlotCrashLooping):
        await m.load("c")
    if change == "port":
        changed = spec.model_copy(update={"port": spec.port + 1})
    else:
        server = spec.server.model_copy(update={"extra_args": ["--ctx-size", "512"]})
        changed = spec.model_copy(update={"server": server})
    await m.set_desired(desired([changed], [model_spec("c-m", 1)]))
    assert m.view("c").failures == 0
    h.runtime.script("c", start_error=None)
    assert (await m.load("c")).state is S.READY


async def test_sixty_seconds_of_stable_ready_reset_the_count(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("c")], [model_spec("c-m", 1)])
    h.runtime.script("c", outcome="exit")
    for _ in range(2):
        with pytest.raises(SlotSpawnFailed):
            await m.load("c")
        h.clock.advance(10)
    h.runtime.script("c", outcome="ready")
    await m.load("c")
    assert m.view("c").failures == 2
    ready_at = h.clock.now
    h.clock.now = ready_at + 59.5
    await m.tick()
    assert m.view("c").failures == 2
    h.clock.now = ready_at + 60
    await m.tick()
    assert m.view("c").failures == 0
    assert m.view("c").state is S.READY


# ================================================================= idle / ttl / hold


async def test_idle_timeout_via_tick_and_idle_is_dispatchable(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", idle_timeout_s=30)], [model_spec("a-m", 1)])
    await m.load("a")
    h.clock.advance(29)
    await m.tick()
    assert m.view("a").state is S.READY
    h.clock.advance(1)
    await m.tick()
    view = m.view("a")
    assert view.state is S.IDLE and view.idle_reason == IdleReason.TIMEOUT
    assert view.dispatchable
    record = written(m).store.read("a")
    assert record is not None and record.extra.idle_reason == "timeout"
    lease = await m.acquire("a")
    assert m.view("a").state is S.SERVING
    assert h.runtime.starts["a"] == 1
    m.release(lease)
    assert m.view("a").state is S.READY
    assert m.view("a").idle_reason is None


async def test_ttl_unloads_an_idle_non_autoload_slot(tmp_path: Path) -> None:
    slots = [
        slot_spec("t", autoload=False, idle_timeout_s=30, ttl_s=100),
        slot_spec("keep", autoload=True, idle_timeout_s=30, ttl_s=100),
    ]
    h, m = await setup(tmp_path, slots, [model_spec("t-m", 1), model_spec("keep-m", 1)])
    await m.load("t")
    await m.load("keep")
    h.clock.advance(50)
    await m.tick()
    assert m.view("t").state is S.IDLE
    h.clock.advance(50)
    await m.tick()
    assert m.view("t").state is S.OFFLINE
    assert not m.view("t").resident
    assert "ttl" in m.view("t").message
    assert m.view("keep").state is S.IDLE  # autoload: keep it loaded


async def test_hold_keeps_a_slot_unevictable_until_its_ttl(tmp_path: Path) -> None:
    slots = [
        slot_spec("job", priority=0, autoload=False, ttl_s=10, idle_timeout_s=5),
        slot_spec("new", priority=90),
    ]
    h, m = await setup(tmp_path, slots, [model_spec("job-m", 6), model_spec("new-m", 6)], gpu_gb=10)
    lease = await m.hold("job", 3600)
    assert lease.expires_at == h.clock.now + 3600
    h.clock.advance(1800)
    await m.tick()  # neither idle nor ttl applies while held
    assert m.view("job").state is S.SERVING
    with pytest.raises(InsufficientMemory):
        await m.load("new")
    h.clock.advance(1800)
    await m.tick()  # the hold expires
    assert lease.released
    assert m.view("job").state in (S.READY, S.IDLE)
    await m.load("new")
    assert m.view("job").state is S.OFFLINE and m.view("new").state is S.READY


# ================================================================= health


async def test_liveness_failures_put_the_slot_in_error(tmp_path: Path) -> None:
    spec = slot_spec("a", liveness_interval_s=15, liveness_failures=3)
    h, m = await setup(tmp_path, [spec], [model_spec("a-m", 1)])
    await m.load("a")
    h.prober.liveness_down.add("a")
    for _ in range(2):
        h.clock.advance(15)
        await m.tick()
        assert m.view("a").state is S.READY
        h.clock.advance(5)
        await m.tick()  # not due: not counted
        h.clock.advance(-5)
    h.clock.advance(15)
    await m.tick()
    view = m.view("a")
    assert view.state is S.ERROR
    assert "liveness probe failed 3 times" in view.message
    assert h.runtime.stops["a"] == 1
    events = [e for e in m.events.since(0) if e.to_state == "error"]
    assert events[-1].error == SlotHealthFailed.code


async def test_liveness_recovers_between_misses(tmp_path: Path) -> None:
    spec = slot_spec("a", liveness_interval_s=15, liveness_failures=2)
    h, m = await setup(tmp_path, [spec], [model_spec("a-m", 1)])
    await m.load("a")
    for down in (True, False, True, False):
        (h.prober.liveness_down.add if down else h.prober.liveness_down.discard)("a")
        h.clock.advance(15)
        await m.tick()
    assert m.view("a").state is S.READY  # misses were not in a row


async def test_crash_while_leases_are_held(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 1)])
    await m.load("a")
    leases = [await m.acquire("a") for _ in range(3)]
    h.runtime.crash("a")
    await m.check_exits()
    assert m.view("a").state is S.ERROR and m.view("a").leases == 0
    for lease in leases:
        assert lease.lost.is_set()
        with pytest.raises(SlotHealthFailed, match="exited"):
            lease.check()
        m.release(lease)
    assert m.view("a").state is S.ERROR
    assert m.view("a").failures == 1
    assert_legal_history(m.transitions)


async def test_crash_of_an_idle_slot_goes_through_unloading(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", idle_timeout_s=10)], [model_spec("a-m", 1)])
    await m.load("a")
    h.clock.advance(10)
    await m.tick()
    assert m.view("a").state is S.IDLE
    h.runtime.crash("a")
    await m.tick()
    assert m.view("a").state is S.ERROR
    assert [(f, t) for n, f, t in m.transitions if n == "a"][-2:] == [
        ("idle", "unloading"),
        ("unloading", "error"),
    ]


@pytest.mark.parametrize("stagger", range(6))
async def test_exit_check_racing_an_unload_is_revalidated(tmp_path: Path, stagger: int) -> None:
    """Found with a yielding runtime: check_exits saw the exit, an unload ran while it read
    the logs, then it failed the (now offline) slot: IllegalSlotTransition offline -> error.
    """
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 1)])
    await m.load("a")
    h.runtime.turns = 1  # every runtime call suspends, like real I/O
    h.runtime.crash("a")

    async def unload_later() -> None:
        await spin(stagger)
        await m.unload("a", force=True)

    await asyncio.gather(m.check_exits(), unload_later())
    assert m.view("a").state in (S.OFFLINE, S.ERROR)
    assert_legal_history(m.transitions)


@pytest.mark.parametrize("stagger", range(4))
async def test_slow_liveness_probe_racing_an_unload(tmp_path: Path, stagger: int) -> None:
    spec = slot_spec("a", liveness_interval_s=5, liveness_failures=1)
    h, m = await setup(tmp_path, [spec], [model_spec("a-m", 1)])
    await m.load("a")
    h.runtime.turns = 1
    h.prober.liveness_turns = 20  # the probe answers after the unload finished
    h.prober.liveness_down.add("a")
    h.clock.advance(5)

    async def unload_later() -> None:
        await spin(stagger)
        await m.unload("a", force=True)

    await asyncio.gather(m.tick(), unload_later())
    assert m.view("a").state is S.OFFLINE
    assert m.view("a").failures == 0  # a stale probe answer is not counted
    assert_legal_history(m.transitions)


async def test_stale_liveness_miss_is_not_counted_against_a_new_server(tmp_path: Path) -> None:
    spec = slot_spec("a", liveness_interval_s=5, liveness_failures=2)
    h, m = await setup(tmp_path, [spec], [model_spec("a-m", 1)])
    await m.load("a")
    h.runtime.turns = 1
    h.prober.liveness_turns = 30
    h.prober.liveness_down.add("a")
    h.clock.advance(5)

    async def reload() -> None:
        while m.core.table.records["a"].last_liveness != h.clock.now:  # the probe is in flight
            await asyncio.sleep(0)
        await m.unload("a", force=True)
        await m.load("a")  # a new server (its own liveness is probed on its own schedule)

    await asyncio.gather(m.tick(), reload())
    assert m.view("a").state is S.READY
    assert m.view("a").generation == 2
    assert (
        m.core.table.records["a"].liveness_misses == 0
    )  # the old server's miss is not the new one's


async def test_no_model_is_idle_and_not_dispatchable(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 1)])
    h.runtime.script("a", outcome="no_model")
    view = await m.load("a")
    assert view.state is S.IDLE and view.idle_reason == IdleReason.NO_MODEL
    assert not view.dispatchable
    record = written(m).store.read("a")
    assert record is not None and record.extra.idle_reason == "no_model"
    with pytest.raises(SlotNotReady, match="serves no model"):
        await m.acquire("a")
    assert [t for t in m.transitions if t[0] == "a"][-1] == ("a", "warming", "idle")
    assert (await m.unload("a")).state is S.OFFLINE


async def test_hang_fails_after_warmup_timeout(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a", warmup_timeout_s=30)], [model_spec("a-m", 1)])
    h.runtime.script("a", outcome="hang")
    t0 = h.clock.now
    with pytest.raises(SlotHealthFailed, match="still warming after 30s"):
        await m.load("a")
    assert h.clock.now - t0 >= 30
    assert m.view("a").state is S.ERROR
    assert h.runtime.stops["a"] == 1 and "a" not in h.runtime.objects


async def test_hang_times_out_at_any_clock_value(tmp_path: Path) -> None:
    """Found by the state machine: at this FakeClock value the probe loop's last sleep
    (the remaining ~1e-13 s of the warmup) was below the float resolution of ``now``, so
    the fake clock never reached the deadline and the load spun forever."""
    h, m = await setup(tmp_path, [slot_spec("a", warmup_timeout_s=20)], [model_spec("a-m", 1)])
    h.runtime.script("a", outcome="hang")
    h.clock.now = 1004.2121067022214
    with pytest.raises(SlotHealthFailed):
        await asyncio.wait_for(m.load("a"), timeout=10)
    assert h.clock.now >= 1004.2121067022214 + 20


async def test_start_failure_goes_to_error(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 1)])
    h.runtime.script("a", start_error="no such binary")
    with pytest.raises(SlotSpawnFailed, match="no such binary"):
        await m.load("a")
    assert m.view("a").state is S.ERROR
    assert m.store.read("a").message == "no such binary"  # type: ignore[union-attr]


async def test_unkillable_server_stays_in_error_until_it_is_gone(tmp_path: Path) -> None:
    """Found by the state machine: reset() used to mark a slot whose server survived
    SIGKILL ``offline`` (state.json said offline, its memory was no longer counted)."""
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 1)])
    await m.load("a")
    h.runtime.script("a", unkillable=True)
    with pytest.raises(SlotTerminateTimeout):
        await m.unload("a")
    assert m.view("a").state is S.ERROR
    with pytest.raises(SlotTerminateTimeout):
        await m.reset("a")
    assert m.view("a").state is S.ERROR and "a" in h.runtime.objects
    assert state_file(m, "a") is S.ERROR
    h.runtime.script("a", unkillable=False)  # e.g. the stuck process finally died
    assert (await m.reset("a")).state is S.OFFLINE
    assert "a" not in h.runtime.objects
    assert_legal_history(m.transitions)


# ================================================================= restart safety


async def test_restart_adopts_running_servers_and_marks_vanished_ones(tmp_path: Path) -> None:
    slots = [slot_spec(n, idle_timeout_s=10) for n in ("a", "b", "c", "d")]
    models = [model_spec(f"{n}-m", 1) for n in ("a", "b", "c", "d")]
    h, m = await setup(tmp_path, slots, models)
    for name in ("a", "b", "c"):
        await m.load(name)
    h.clock.advance(10)
    await m.tick()  # a, b, c idle
    m.release(await m.acquire("a"))  # a ready again
    assert [m.view(n).state for n in "abcd"] == [S.READY, S.IDLE, S.IDLE, S.OFFLINE]
    del h.runtime.objects["b"]  # vanished while the controller was down
    starts = dict(h.runtime.starts)
    written(m)  # a stop writes what lags (a crash: test_crash_consistency)

    m2 = h.new_manager()
    await m2.set_desired(desired(slots, models))
    assert [m2.view(n).state for n in "abcd"] == [S.READY, S.IDLE, S.IDLE, S.OFFLINE]
    await m2.recover()
    assert m2.view("a").state is S.READY
    assert m2.view("b").state is S.ERROR
    assert "vanished" in m2.view("b").message
    assert m2.view("c").state is S.IDLE
    assert m2.view("d").state is S.OFFLINE
    assert dict(h.runtime.starts) == starts  # no duplicate servers
    assert_legal_history(m2.transitions)
    assert [t for t in m2.transitions if t[0] == "b"] == [
        ("b", "idle", "unloading"),
        ("b", "unloading", "error"),
    ]
    for name in "abc":
        assert state_file(m2, name) is m2.view(name).state
    assert state_file(m2, "d") is None  # never loaded: no state file, offline
    lease = await m2.acquire("a")  # the adopted server serves
    assert h.runtime.starts["a"] == starts["a"]
    m2.release(lease)


async def test_restart_adopts_a_server_whose_state_file_says_offline(tmp_path: Path) -> None:
    slots, models = [slot_spec("a")], [model_spec("a-m", 1)]
    h, m = await setup(tmp_path, slots, models)
    await m.load("a")
    m.store.write(m.store.read("a").model_copy(update={"state": S.OFFLINE}))  # type: ignore[union-attr]
    m2 = h.new_manager()
    await m2.set_desired(desired(slots, models))
    await m2.recover()
    assert m2.view("a").state is S.READY
    assert h.runtime.starts["a"] == 1
    assert_legal_history(m2.transitions)


async def test_restore_in_catalogue_order_with_refusals(tmp_path: Path) -> None:
    slots = [
        slot_spec("one", autoload=True),
        slot_spec("two", autoload=False),  # resident
        slot_spec("big", autoload=True),  # does not fit
        slot_spec("three", autoload=False),  # neither: not loaded
        slot_spec("four", autoload=True),
    ]
    models = [
        model_spec("one-m", 4),
        model_spec("two-m", 4),
        model_spec("big-m", 40),
        model_spec("three-m", 4),
        model_spec("four-m", 4),
    ]
    h = Harness(tmp_path)
    h.manager.residency.set("two", "two-m")
    h.manager.residency.set("ghost", "ghost-m")
    m = h.new_manager()
    await m.set_desired(desired(slots, models))
    sub = m.events.subscribe()
    outcome = await m.restore()
    assert outcome == {
        "one": "ready",
        "two": "ready",
        "big": "model.insufficient_memory",
        "four": "ready",
    }
    assert list(outcome) == ["one", "two", "big", "four"]
    events = events_of(sub)
    admitted = [e.slot for e in events if e.kind == "admission"]
    assert admitted == ["one", "two", "four"]
    ghost = [e for e in events if e.slot == "ghost"]
    assert len(ghost) == 1
    assert ghost[0].kind == "refusal" and ghost[0].op == "restore"
    assert "not in the desired state" in ghost[0].message
    assert m.view("three").state is S.OFFLINE
    assert m.view("big").state is S.OFFLINE


# ================================================================= events


async def test_every_transition_is_an_event(tmp_path: Path) -> None:
    slots = [slot_spec("a", idle_timeout_s=5, drain_timeout_s=1), slot_spec("b")]
    h, m = await setup(tmp_path, slots, [model_spec("a-m", 1), model_spec("b-m", 1)])
    sub = m.events.subscribe()
    await m.load("a")
    lease = await m.acquire("a")
    m.release(lease)
    h.clock.advance(5)
    await m.tick()
    held = await m.acquire("a")
    await m.unload("a")
    h.runtime.script("b", outcome="exit")
    with pytest.raises(SlotSpawnFailed):
        await m.load("b")
    await m.reset("b")
    events = events_of(sub, "transition")
    assert [(e.slot, e.from_state, e.to_state) for e in events] == list(m.transitions)
    assert len(events) >= 12
    assert all(e.op for e in events)
    assert isinstance(held.error, SlotNotReady)
    failed = [e for e in events if e.slot == "b" and e.to_state == "error"]
    assert failed and failed[0].error == "slot.spawn_failed"
    assert_legal_history(m.transitions)


async def test_swap_rebinds_and_loads(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 1), model_spec("x-m", 1)])
    await m.load("a")
    spec = m.known("a")
    assert spec is not None
    view = await m.swap(rebound(spec, "x-m"))
    assert view.state is S.READY and view.model_id == "x-m"
    assert m.store.read("a").model_id == "x-m"  # type: ignore[union-attr]
    assert h.runtime.starts["a"] == 2


async def test_a_device_admission_filled_is_not_under_pressure(tmp_path: Path) -> None:
    """Admission may fill a GPU up to the safety margin; the reaper must not undo that.

    Only memory taken beyond what slotctl admitted (another process, servers above their
    estimates) is pressure.
    """
    slots = [slot_spec("a", autoload=True), slot_spec("b", autoload=True)]
    models = [model_spec("a-m", 12), model_spec("b-m", 11)]
    h, m = await setup(tmp_path, slots, models, gpu_gb=24, margin_gb=0.5)
    await m.load("a")
    await m.load("b")  # 1 GiB free: under 5 % of 24 GiB, yet exactly what admission allowed
    assert await m.reap_pressure() == []
    assert m.view("a").state is S.READY and m.view("b").state is S.READY
    h.memory.external["gpu"] = int(0.8 * GIB)  # someone else takes memory: real pressure
    assert await m.reap_pressure() == ["a", "b"]  # critical: every eligible slot, priority/LRU
    assert m.view("a").state is S.OFFLINE and m.view("b").state is S.OFFLINE


async def test_restart_finishes_an_interrupted_unload(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("a")], [model_spec("a-m", 2)])
    await m.load("a")
    m.core.table.set(
        m.core.table.records["a"], S.UNLOADING, op=Op.UNLOAD, message="controller killed here"
    )
    fresh = h.new_manager()
    await fresh.set_desired(desired([slot_spec("a")], [model_spec("a-m", 2)]))
    await fresh.recover()
    assert fresh.view("a").state is S.OFFLINE
    assert (await h.runtime.inspect("a")).status.value == "missing"
    assert_legal_history(fresh.transitions)


async def test_crash_loop_breaker_survives_a_controller_restart(tmp_path: Path) -> None:
    h, m = await setup(tmp_path, [slot_spec("c", max_consecutive_failures=2)], [model_spec("c-m")])
    h.runtime.script("c", outcome="exit")
    for attempt in range(2):
        with pytest.raises(SlotctlError):
            await m.load("c")
        if attempt == 0:
            h.clock.advance(600)
    fresh = h.new_manager()
    await fresh.set_desired(
        desired([slot_spec("c", max_consecutive_failures=2)], [model_spec("c-m")])
    )
    assert fresh.view("c").failures == 2
    with pytest.raises(SlotCrashLooping) as err:
        await fresh.load("c")
    assert err.value.details["blocked"] is True


async def test_dry_run_refuses_like_the_load_when_a_pinned_peer_holds_the_group(
    tmp_path: Path,
) -> None:
    slots = [slot_spec("a", "ga"), slot_spec("p", "gp", pinned=True)]
    models = [model_spec("ga", 2, group="g"), model_spec("gp", 2, group="g")]
    _h, m = await setup(tmp_path, slots, models)
    await m.load("p")
    plan = plan_json(m.explain_load("a"))
    assert plan["action"] == "refuse" and plan["error"]["code"] == "slot.pinned"
    with pytest.raises(SlotPinned):
        await m.load("a")
    assert m.view("p").state is S.READY
