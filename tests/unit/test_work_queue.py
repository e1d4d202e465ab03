"""The generic keyed work queue (issue 41, item 6), after client-go's: a key waits once,
is held by one worker at a time, is marked dirty when added while held and queued again
when that worker is done; a delayed add keeps the sooner of two delays; rate-limited
retries back off per key until forgotten. Tests wait on the queue's state, not on time
(the delays are milliseconds)."""

from __future__ import annotations

import asyncio

import pytest

from controller.reconcile.queue import Backoff, QueueShutDown, WorkQueue


async def test_a_key_waits_once_and_comes_out_in_order() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ("a", "b", "a", "c", "b"):
        queue.add(key)
    assert len(queue) == 3 and not queue.idle
    got = [await queue.get() for _ in range(3)]
    assert got == ["a", "b", "c"]
    for key in got:
        queue.done(key)
    assert queue.idle
    await asyncio.wait_for(queue.wait_idle(), 1)


async def test_a_held_key_is_never_handed_out_twice_and_a_re_add_runs_once_more() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    held = await queue.get()
    for _ in range(5):
        queue.add("a")  # while held: marked dirty, not queued
    assert queue.is_processing("a") and queue.is_dirty("a") and len(queue) == 0
    second = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    assert not second.done()  # nothing else to hand out: "a" is held
    queue.done(held)  # the dirty mark: queued again, for one more pass
    assert await asyncio.wait_for(second, 1) == "a"
    assert not queue.is_dirty("a")
    queue.done("a")
    assert queue.idle


async def test_add_after_keeps_the_sooner_delay() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add_after("a", 60.0)
    queue.add_after("a", 0.01)  # sooner: replaces the pending one
    queue.add_after("a", 30.0)  # later: the sooner stands
    assert queue.delayed == 1 and len(queue) == 0
    assert await asyncio.wait_for(queue.get(), 1) == "a"
    assert queue.delayed == 0
    queue.add_after("b", 0)  # no delay: now
    assert len(queue) == 1


async def test_rate_limited_retries_back_off_per_key_until_forgotten() -> None:
    queue: WorkQueue[str] = WorkQueue()
    backoff = Backoff(base=0.001, cap=0.004)
    delays = [queue.add_rate_limited("a", backoff) for _ in range(5)]
    assert delays == [0.001, 0.002, 0.004, 0.004, 0.004]
    assert queue.retries("a") == 5 and queue.retries("b") == 0
    assert await asyncio.wait_for(queue.get(), 1) == "a"
    queue.forget("a")
    assert queue.retries("a") == 0
    assert queue.add_rate_limited("a", backoff) == 0.001


def test_the_backoff_is_capped_and_never_overflows() -> None:
    assert Backoff(base=1.0, cap=300.0).delay(0) == 1.0
    assert Backoff(base=1.0, cap=300.0).delay(8) == 256.0
    assert Backoff(base=1.0, cap=300.0).delay(9) == 300.0
    assert Backoff(base=2.0, cap=60.0).delay(10_000) == 60.0


async def test_a_shut_down_queue_ends_its_workers_and_takes_nothing() -> None:
    queue: WorkQueue[str] = WorkQueue()
    waiting = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    queue.add_after("late", 60.0)
    queue.shutdown()
    with pytest.raises(QueueShutDown):
        await asyncio.wait_for(waiting, 1)
    queue.add("a")
    assert len(queue) == 0 and queue.delayed == 0


async def test_workers_share_keys_but_never_one_key() -> None:
    """Many workers, many adds of few keys: each key is held by one worker at a time,
    different keys run at once, and every add while held gets its pass after."""
    queue: WorkQueue[int] = WorkQueue()
    holding: set[int] = set()
    passes: dict[int, int] = {}
    overlap = {"now": 0, "peak": 0}

    async def worker() -> None:
        while True:
            try:
                key = await queue.get()
            except QueueShutDown:
                return
            assert key not in holding
            holding.add(key)
            overlap["now"] += 1
            overlap["peak"] = max(overlap["peak"], overlap["now"])
            await asyncio.sleep(0.001)
            passes[key] = passes.get(key, 0) + 1
            overlap["now"] -= 1
            holding.discard(key)
            queue.done(key)

    workers = [asyncio.ensure_future(worker()) for _ in range(8)]
    for _ in range(20):
        for key in range(4):
            queue.add(key)
        await asyncio.sleep(0)
    await asyncio.wait_for(queue.wait_idle(), 5)
    queue.shutdown()
    await asyncio.gather(*workers)
    assert set(passes) == {0, 1, 2, 3}
    assert overlap["peak"] > 1
