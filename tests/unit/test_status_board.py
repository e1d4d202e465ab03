"""The operator's status board: which status timers a manager event wakes (issue 28: at
1,000 Slots, every event woke every timer)."""

from __future__ import annotations

import asyncio

from controller.model.events import Event, EventKind, Op
from controller.operator.board import StatusBoard


def transition(slot: str | None, to: str = "ready") -> Event:
    return Event(0, EventKind.TRANSITION, Op.LOAD, slot=slot, from_state="warming", to_state=to)


async def waiting(board: StatusBoard) -> tuple[dict[str, asyncio.Future[object]], object, object]:
    """Timers of slots a and b and one reading every slot, waiting; (their waits, the
    stamps a and every started from)."""
    a, b, every = board.stamp("a"), board.stamp("b"), board.stamp(None)
    waits = {
        "a": asyncio.ensure_future(board.wait(a, 5.0, "a")),
        "b": asyncio.ensure_future(board.wait(b, 5.0, "b")),
        "every": asyncio.ensure_future(board.wait(every, 5.0)),
    }
    await asyncio.sleep(0.01)
    return waits, a, every


async def test_a_slots_event_wakes_its_own_timer_and_the_ones_reading_every_slot() -> None:
    board = StatusBoard()
    b = board.stamp("b")
    waits, a, every = await waiting(board)
    board.on_event(transition("a"))
    done, _ = await asyncio.wait(waits.values(), timeout=1.0)
    assert {name for name, task in waits.items() if task in done} == {"a", "every"}
    assert waits["a"].result() != a and waits["every"].result() != every
    assert board.stamp("b") == b  # b's timer has nothing new to say
    # A sync (a CR changed) or an event of no slot wakes every timer.
    board.poke()
    assert (await asyncio.wait_for(waits["b"], 1.0)) != b
    b2 = board.stamp("b")
    later = asyncio.ensure_future(board.wait(b2, 5.0, "b"))
    await asyncio.sleep(0.01)
    board.on_event(transition(None))
    assert (await asyncio.wait_for(later, 1.0)) != b2


async def test_a_change_before_the_wait_is_not_missed_and_a_quiet_slot_times_out() -> None:
    board = StatusBoard()
    seen = board.stamp("a")
    board.on_event(transition("a", "idle"))  # between the timer's run and its next wait
    assert await asyncio.wait_for(board.wait(seen, 5.0, "a"), 0.5) == board.stamp("a")
    quiet = board.stamp("a")
    board.on_event(transition("b"))
    assert await board.wait(quiet, 0.05, "a") == quiet  # the resync period: no change
    assert board.pending["a"][0][2] == "warming -> idle"


async def test_a_sync_wakes_only_the_slots_it_changed_and_the_timers_of_every_slot() -> None:
    """A burst's syncs (issue 28): each woke all 1,000 Slot timers; now the ones whose
    verdict or slot moved, and the Models' and Aliases' (which read every slot)."""
    board = StatusBoard()
    b = board.stamp("b")
    waits, _, _ = await waiting(board)
    board.wake(["a", "a"])
    done, _ = await asyncio.wait(waits.values(), timeout=1.0)
    assert {name for name, task in waits.items() if task in done} == {"a", "every"}
    assert board.stamp("b") == b
    seen = board.stamp("b")
    board.wake(["b"])  # before b's timer waits again: not missed
    assert await asyncio.wait_for(board.wait(seen, 5.0, "b"), 0.5) != seen
    waits["b"].cancel()


def test_a_rollout_decided_is_kept_and_posted_as_an_event() -> None:
    """A plan's rollout (surge or recreate, and why) is the Slot's last rollout and an
    Event; a rollout's own steps keep it too (an operator's first plans come before the
    board listens); its end is an Event of its own."""
    board = StatusBoard()
    details = {"action": "recreate", "rollout": "recreate", "rollout_reason": "no room to surge"}
    board.on_event(Event(0, EventKind.PLAN, Op.RECONCILE, slot="a", details=details))
    assert board.rollouts["a"] == ("recreate", "no room to surge")
    assert board.take_events("a") == [("Normal", "RolloutRecreate", "recreate: no room to surge")]
    step = {"phase": "done", "rollout": "surge", "rollout_reason": "fits"}
    board.on_event(Event(0, EventKind.ROLLOUT, Op.ROLLOUT, slot="b", message="done", details=step))
    assert board.rollouts["b"] == ("surge", "fits")
    assert board.take_events("b") == [("Normal", "RolloutDone", "done")]
    failed = {"phase": "failed"}
    board.on_event(Event(0, EventKind.ROLLOUT, Op.ROLLOUT, slot="b", message="x", details=failed))
    assert board.take_events("b") == [("Warning", "RolloutFailed", "x")]
