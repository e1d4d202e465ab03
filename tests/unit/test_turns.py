"""Requests at a slot's ``max_concurrency`` wait for their turn (issue 23): served by
priority class weight, round-robin between keys of a class, FIFO inside a key, bounded
per class, given back when the waiter leaves, started over when the slot went away."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from controller.model.errors import SlotCrashLooping, SlotQueueFull
from controller.model.lifecycle import SlotState
from controller.slots.records import Lease, Requester
from controller.spec.schema import ControllerSettings, PriorityClass
from tests.unit.manager_fixtures import Harness, desired, model_spec, settle, slot_spec

S = SlotState
UI = Requester("chat-ui", "interactive", "id-chat-ui")
CI = Requester("ci", "batch", "id-ci")


async def _harness(tmp_path: Path, **slot: Any) -> Harness:
    h = Harness(tmp_path)
    await h.manager.set_desired(desired([slot_spec("s", "m", **slot)], [model_spec("m", 1)]))
    return h


async def _queued(h: Harness, count: int) -> None:
    for _ in range(1000):
        if h.manager.core.table.get("s").book.queued == count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not {count} waiting: {h.manager.core.table.get('s').queued}")


async def test_at_its_limit_the_interactive_key_goes_before_a_batch_flood(tmp_path: Path) -> None:
    h = await _harness(tmp_path, max_concurrency=2)
    m = h.manager
    first = [await m.acquire("s", CI), await m.acquire("s", CI)]
    assert m.try_acquire("s", UI) is None  # at its limit: no lease without a wait
    batch = [asyncio.ensure_future(m.acquire("s", CI)) for _ in range(5)]
    await _queued(h, 5)
    ui = asyncio.ensure_future(m.acquire("s", UI))
    await _queued(h, 6)
    m.release(first[0])
    await asyncio.sleep(0)
    assert ui.done() and not any(t.done() for t in batch)  # the interactive request first
    m.release(first[1])
    await asyncio.sleep(0)
    assert sum(t.done() for t in batch) == 1
    for lease in [ui.result(), *[t.result() for t in batch if t.done()]]:
        m.release(lease)
    await settle(m)
    for task in batch:
        m.release(await task)
    assert m.core.table.get("s").book.queued == 0 and m.view("s").state is S.READY


async def test_keys_of_one_class_take_turns_and_each_keeps_its_order(tmp_path: Path) -> None:
    h = await _harness(tmp_path, max_concurrency=1)
    m = h.manager
    holder = await m.acquire("s", CI)
    order: list[str] = []

    async def one(key: str, n: int) -> None:
        lease = await m.acquire("s", Requester(key, "batch", flow=key))
        order.append(f"{key}{n}")
        await asyncio.sleep(0)
        m.release(lease)

    tasks = [asyncio.ensure_future(one("flood", n)) for n in range(4)]
    await _queued(h, 4)
    tasks.append(asyncio.ensure_future(one("small", 0)))
    await _queued(h, 5)
    m.release(holder)
    await asyncio.gather(*tasks)
    assert order == ["flood0", "small0", "flood1", "flood2", "flood3"]


async def test_a_cold_slots_waiters_take_their_turns_by_class_once_it_is_loaded(
    tmp_path: Path,
) -> None:
    h = await _harness(tmp_path, max_concurrency=2)
    h.runtime.script("s", load_s=1.0)
    m = h.manager
    tasks = [asyncio.ensure_future(m.acquire("s", CI)) for _ in range(4)]
    tasks += [asyncio.ensure_future(m.acquire("s", UI)) for _ in range(2)]
    await _queued(h, 6)
    assert m.core.runtime.starts["s"] == 0 or m.view("s").state is not S.READY
    h.clock.advance(1.5)
    await settle(m)
    for _ in range(20):  # the granted waiters' tasks finish their acquire
        await asyncio.sleep(0)
    done = [t for t in tasks if t.done()]
    assert len(done) == 2 and set(done) == set(tasks[4:])  # the two interactive ones
    assert h.runtime.starts["s"] == 1  # one load for every waiter
    for task in done:
        m.release(task.result())
    await settle(m)
    for task in tasks[:4]:
        m.release(await task)


async def test_a_class_limit_and_max_queue_refuse_with_429(tmp_path: Path) -> None:
    classes = [
        PriorityClass(name="interactive", weight=8),
        PriorityClass(name="batch", weight=1, queue_limit=2),
    ]
    h = await _harness(tmp_path, max_concurrency=1, max_queue=4)
    h.manager.settings = ControllerSettings(priority_classes=classes, default_pinned=[])
    m = h.manager
    holder = await m.acquire("s", UI)
    waiting = [asyncio.ensure_future(m.acquire("s", CI)) for _ in range(2)]
    await _queued(h, 2)
    with pytest.raises(SlotQueueFull, match="queue_limit=2"):
        await m.acquire("s", CI)
    more = [asyncio.ensure_future(m.acquire("s", UI)) for _ in range(2)]
    await _queued(h, 4)
    with pytest.raises(SlotQueueFull, match="max_queue=4"):
        await m.acquire("s", UI)
    m.release(holder)
    for task in [*more, *waiting]:
        m.release(await task)


async def test_a_waiter_that_leaves_is_removed_and_a_granted_one_gives_its_lease_back(
    tmp_path: Path,
) -> None:
    h = await _harness(tmp_path, max_concurrency=1)
    m = h.manager
    holder = await m.acquire("s", UI)
    gone = asyncio.ensure_future(m.acquire("s", UI))
    stays = asyncio.ensure_future(m.acquire("s", UI))
    await _queued(h, 2)
    gone.cancel()
    await asyncio.sleep(0)
    assert m.core.table.get("s").book.queued == 1
    m.release(holder)
    lease: Lease = await stays
    assert m.view("s").leases == 1
    m.release(lease)
    assert m.view("s").state is S.READY and m.view("s").leases == 0


async def test_waiters_start_over_when_the_slot_crashes_under_them(tmp_path: Path) -> None:
    """The server crashes while a request holds the only place: the lease is revoked
    without a release; the waiter's turn comes at the next tick and it starts over: a
    load, here refused by the crash-loop breaker (a typed 503), never a hang."""
    h = await _harness(tmp_path, max_concurrency=1)
    m = h.manager
    holder = await m.acquire("s", UI)
    waiter = asyncio.ensure_future(m.acquire("s", UI))
    await _queued(h, 1)
    h.runtime.crash("s")
    await m.tick()  # the exit is seen, the lease revoked; the waiter's turn comes
    assert holder.revoked
    with pytest.raises(SlotCrashLooping):
        await asyncio.wait_for(waiter, 5)
    h.clock.advance(2.0)  # past the backoff: the next request loads it again
    lease = await m.acquire("s", UI)
    assert h.runtime.starts["s"] == 2 and m.view("s").state is S.SERVING
    m.release(lease)


async def test_no_limit_no_turns(tmp_path: Path) -> None:
    """Without max_concurrency every request gets its lease at once, as before."""
    h = await _harness(tmp_path)
    leases = [await h.manager.acquire("s", CI) for _ in range(50)]
    assert h.manager.view("s").leases == 50 and h.manager.core.table.get("s").book.turns is None
    for lease in leases:
        h.manager.release(lease)


async def test_a_removed_slots_waiters_get_its_typed_error_not_a_hang(tmp_path: Path) -> None:
    from controller.model.errors import SlotNotFound

    h = await _harness(tmp_path, max_concurrency=1)
    m = h.manager
    holder = await m.acquire("s", UI)
    waiter = asyncio.ensure_future(m.acquire("s", CI))
    await _queued(h, 1)
    m.core.table.forget("s")  # what a removal does last
    with pytest.raises(SlotNotFound):
        await asyncio.wait_for(waiter, 5)
    assert holder.slot == "s"


async def test_the_classes_changed_while_requests_wait(tmp_path: Path) -> None:
    h = await _harness(tmp_path, max_concurrency=1)
    m = h.manager
    holder = await m.acquire("s", UI)
    first = asyncio.ensure_future(m.acquire("s", CI))
    await _queued(h, 1)
    m.settings = ControllerSettings(
        priority_classes=[PriorityClass(name="gold", weight=4)],
        default_priority="gold",
        default_pinned=[],
    )
    second = asyncio.ensure_future(m.acquire("s", Requester("x", "gold")))
    await _queued(h, 2)  # waits in the queue's own classes until it empties (as the first)
    m.release(holder)
    m.release(await second)  # the queue's first class goes before its batch waiter
    m.release(await first)
    held = await m.acquire("s", Requester("x", "gold"))
    third = asyncio.ensure_future(m.acquire("s", Requester("x", "gold")))
    await _queued(h, 1)  # the empty queue made anew with the new classes
    assert set(m.core.table.get("s").book.turns.classes) == {"gold"}  # type: ignore[union-attr]
    m.release(held)
    m.release(await third)
