"""Load decisions see the queue (issue 23): the loads, wakes and swaps that wait for a
lock go by the best class among their waiters (:class:`PriorityLock`), and inside a
priority tier the eviction plan takes a slot used only by batch keys before one a person
used — while a request in flight is never cut, whatever its class."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.scheduling.eviction import EvictionCandidate, plan_room
from controller.slots.locks import PriorityLock
from controller.slots.records import Requester
from tests.unit.manager_fixtures import Harness, desired, model_spec, settle, slot_spec

S = SlotState


async def test_the_lock_grants_the_best_rank_then_first_come() -> None:
    lock = PriorityLock()
    await lock.acquire()
    order: list[str] = []
    ranks = {"batch-1": 1.0, "ui": 8.0, "batch-2": 1.0, "restore": 0.0}

    async def take(name: str) -> None:
        async with lock.hold(lambda: ranks[name]):
            order.append(name)
            await asyncio.sleep(0)

    tasks = [asyncio.ensure_future(take(n)) for n in ranks]
    for _ in range(5):
        await asyncio.sleep(0)
    ranks["restore"] = 9.0  # the rank is asked when the lock frees: a request came
    lock.release()
    await asyncio.gather(*tasks)
    assert order == ["restore", "ui", "batch-1", "batch-2"]
    assert not lock.locked()


async def test_a_waiter_cancelled_after_its_grant_passes_the_lock_on() -> None:
    lock = PriorityLock()
    await lock.acquire()
    first = asyncio.ensure_future(lock.acquire(lambda: 5.0))
    second = asyncio.ensure_future(lock.acquire(lambda: 1.0))
    await asyncio.sleep(0)
    lock.release()  # granted to ``first``...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the next one got it, nothing stuck
    assert lock.locked()
    lock.release()
    assert not lock.locked()


def _cand(name: str, last_used: float, weight: float, priority: int = 50) -> EvictionCandidate:
    return EvictionCandidate(
        name=name,
        devices=("gpu:0",),
        bytes=8 * GIB,
        priority=priority,
        last_used=last_used,
        state=S.READY,
        recent_weight=weight,
    )


def test_inside_a_tier_the_plan_takes_the_batch_only_slot_first() -> None:
    batch_recent = _cand("batch-used", last_used=990.0, weight=1.0)
    person_older = _cand("person-used", last_used=900.0, weight=8.0)
    plan = plan_room([person_older, batch_recent], {"gpu:0": 8 * GIB}, now=1000.0)
    assert [v.name for v in plan.victims] == ["batch-used"]  # not LRU's pick
    # a lower priority tier still goes first, whoever used it
    low = _cand("low-tier", last_used=999.0, weight=8.0, priority=10)
    plan = plan_room([person_older, batch_recent, low], {"gpu:0": 8 * GIB}, now=1000.0)
    assert [v.name for v in plan.victims] == ["low-tier"]
    # without classes (every weight 0, or equal) it is plain LRU
    a, b = _cand("a", 900.0, 8.0), _cand("b", 990.0, 8.0)
    assert [v.name for v in plan_room([b, a], {"gpu:0": 8 * GIB}, 1000.0).victims] == ["a"]


async def test_the_manager_records_who_used_a_slot_and_evicts_the_batch_one(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, gpu_gb=16.0)
    m = h.manager
    slots = [slot_spec(n, f"{n}-m", autoload=False, pinned=False) for n in ("ui", "ci", "new")]
    await m.set_desired(desired(slots, [model_spec(f"{n}-m", 8) for n in ("ui", "ci", "new")]))
    m.release(await m.acquire("ui", Requester("chat", "interactive")))
    h.clock.advance(5)
    m.release(await m.acquire("ci", Requester("nightly", "batch")))  # the more recent one
    h.clock.advance(5)
    lease = await m.acquire("new", Requester("chat", "interactive"))  # needs one of them out
    await settle(m)
    assert m.view("ci").state is S.OFFLINE and m.view("ui").state is S.READY
    m.release(lease)


async def test_swaps_waiting_for_the_group_go_by_class_not_arrival(tmp_path: Path) -> None:
    """Four members of one exclusive group. ``a`` serves a request; ``b`` (batch) takes
    the group's lock and waits for ``a`` to drain; then ``d`` (batch) and ``c``
    (interactive) queue for the lock: ``c``'s swap goes before ``d``'s, which came first."""
    h = Harness(tmp_path, gpu_gb=16.0)
    m = h.manager
    names = ("a", "b", "c", "d")
    slots = [slot_spec(n, f"{n}-m", autoload=False, pinned=False) for n in names]
    await m.set_desired(desired(slots, [model_spec(f"{n}-m", 8, group="g") for n in names]))

    async def turns() -> None:
        for _ in range(200):
            await asyncio.sleep(0)

    held = await m.acquire("a", Requester("x", "interactive"))
    b = asyncio.ensure_future(m.acquire("b", Requester("ci", "batch")))
    await turns()
    d = asyncio.ensure_future(m.acquire("d", Requester("ci", "batch")))
    await turns()
    c = asyncio.ensure_future(m.acquire("c", Requester("ui", "interactive")))
    await turns()
    m.release(held)
    m.release(await asyncio.wait_for(b, 5))
    m.release(await asyncio.wait_for(c, 5))
    m.release(await asyncio.wait_for(d, 5))
    await settle(m)
    starts = [
        e.slot for e in m.events.since(0) if e.kind == "transition" and e.to_state == "starting"
    ]
    assert starts == ["a", "b", "c", "d"]
