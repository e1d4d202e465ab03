"""A Slot's status in a passing state waits a moment for the next (issue 41): with the
operator's loop no longer held by judgings, its status timers saw every step of a load and
patched each (``starting``, ``warming``, ``ready``: ~3 patches a Slot at 300 Slots where
the run before wrote ~1). A timer about to say a passing state waits for the slot's next
change, ``status_settle_s`` at most, or until kopf stops it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from controller.model.events import Event, EventKind, Op
from controller.operator.run import PASSING, Operator, OperatorOptions


class Stopped:
    """kopf's daemon stopper, as a status timer sees it."""

    def __init__(self) -> None:
        self.flag = asyncio.Event()

    def __bool__(self) -> bool:
        return self.flag.is_set()

    async def wait(self) -> None:
        await self.flag.wait()


def operator(tmp_path: Path, settle_s: float) -> Operator:
    opts = OperatorOptions(state_dir=tmp_path / "state", status_settle_s=settle_s)
    return Operator(opts)


def transition(slot: str, to_state: str) -> Event:
    return Event(
        id=1,
        kind=EventKind.TRANSITION,
        op=Op.LOAD,
        slot=slot,
        from_state="warming",
        to_state=to_state,
    )


async def test_a_passing_state_waits_for_the_slots_next_change(tmp_path: Path) -> None:
    op = operator(tmp_path, settle_s=30.0)
    key = ("Slot", "default", "a")
    settling = asyncio.ensure_future(op._settle(key, "a", Stopped()))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert not settling.done()
    op.board.on_event(transition("b", "ready"))  # another slot's change: still waiting
    await asyncio.sleep(0.01)
    assert not settling.done()
    op.board.on_event(transition("a", "ready"))  # its own: the status says ready at once
    await asyncio.wait_for(settling, 1.0)
    assert op._seen[key] == op.board.stamp("a")  # the change is not woken for again


async def test_it_waits_no_longer_than_the_settle_time_nor_past_a_stop(tmp_path: Path) -> None:
    op = operator(tmp_path, settle_s=0.05)
    started = time.monotonic()
    await asyncio.wait_for(op._settle(("Slot", "d", "a"), "a", Stopped()), 1.0)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    long = operator(tmp_path / "long", settle_s=30.0)
    stopped = Stopped()
    settling = asyncio.ensure_future(long._settle(("Slot", "d", "a"), "a", stopped))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    stopped.flag.set()  # the object is being deleted: its finalizer waits for the timer
    await asyncio.wait_for(settling, 1.0)
    assert {"starting", "warming", "pending"} <= PASSING and "ready" not in PASSING
