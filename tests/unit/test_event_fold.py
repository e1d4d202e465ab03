"""Lease flips (issue 24): kept in a ring of their own by the bus, so a burst of requests
does not push loads and evictions out of the replay; folded by readers into one
``requests`` event a slot and burst, counted from the flips' ``details["requests"]``."""

from __future__ import annotations

from pathlib import Path

from controller.kit.eventbus import EventBus
from controller.model.events import Event, EventKind, LeaseFold, Op, is_lease_flip
from controller.model.lifecycle import SlotState
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec

S = SlotState


def flip(slot: str, frm: str, to: str, requests: int, at: float) -> Event:
    return Event(
        id=0,
        kind=EventKind.TRANSITION,
        op=Op.LEASE,
        slot=slot,
        from_state=frm,
        to_state=to,
        time=at,
        details={"requests": requests},
    )


def other(slot: str, at: float) -> Event:
    return Event(id=0, kind=EventKind.EVICTION, op=Op.EVICT, slot=slot, time=at)


def test_is_lease_flip_takes_the_flips_of_requests_only() -> None:
    assert is_lease_flip(flip("a", "ready", "serving", 0, 1.0))
    assert is_lease_flip(flip("a", "idle", "serving", 0, 1.0))
    load = Event(
        id=1,
        kind=EventKind.TRANSITION,
        op=Op.LOAD,
        slot="a",
        from_state="warming",
        to_state="ready",
    )
    assert not is_lease_flip(load)
    idle = Event(
        id=1, kind=EventKind.TRANSITION, op=Op.IDLE, slot="a", from_state="ready", to_state="idle"
    )
    assert not is_lease_flip(idle)


def test_a_burst_is_one_requests_event_before_the_slots_next_event() -> None:
    fold = LeaseFold(quiet_s=2.0)
    shown: list[Event] = []
    # 3 busy periods of a, 5 requests in all (two overlapped in the second)
    for ev in [
        flip("a", "ready", "serving", 10, 1.0),
        flip("a", "serving", "ready", 11, 1.1),
        flip("b", "ready", "serving", 0, 1.2),
        flip("a", "ready", "serving", 11, 1.3),
        flip("a", "serving", "ready", 13, 1.5),
        flip("a", "ready", "serving", 13, 1.6),
        flip("a", "serving", "ready", 15, 1.7),
    ]:
        shown += fold.feed(ev)
    assert shown == []  # all folded
    evicted = other("a", 1.8)
    shown = fold.feed(evicted)
    assert [e.kind for e in shown] == [EventKind.REQUESTS, EventKind.EVICTION]
    folded = shown[0]
    assert folded.slot == "a" and folded.id == 0 and folded.time == 1.7
    assert folded.details["requests"] == 5 and folded.details["total"] == 15
    assert folded.message.startswith("5 requests since ")
    # b is still serving: not quiet, however long; flushed at the end
    assert fold.quiet(100.0) == []
    (b,) = fold.flush()
    assert b.slot == "b" and b.details["requests"] == 0 and "serving" in b.message


def test_a_burst_that_went_quiet_is_shown_by_quiet() -> None:
    fold = LeaseFold(quiet_s=2.0)
    fold.feed(flip("a", "ready", "serving", 0, 10.0))
    fold.feed(flip("a", "serving", "ready", 1, 10.5))
    assert fold.quiet(12.0) == []
    (a,) = fold.quiet(12.5)
    assert a.details["requests"] == 1 and a.message.startswith("1 request since ")
    assert fold.flush() == []


def test_the_flips_have_a_ring_of_their_own() -> None:
    bus = EventBus(buffer_size=5, flip_buffer_size=3)
    load = bus.emit(EventKind.TRANSITION, Op.LOAD, slot="a", from_state="warming", to_state="ready")
    for n in range(50):
        bus.emit(
            EventKind.TRANSITION,
            Op.LEASE,
            slot="a",
            from_state="ready" if n % 2 == 0 else "serving",
            to_state="serving" if n % 2 == 0 else "ready",
        )
    kept = bus.since(0)
    assert kept[0] == load  # the load is still there after 50 flips
    assert [e.id for e in kept] == [1, 49, 50, 51]
    assert bus.last_id - 0 - len(kept) == 47  # what a replay from 0 misses


async def test_the_manager_counts_requests_and_the_flips_carry_the_count(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    m = h.manager
    await m.set_desired(desired([slot_spec("a")], [model_spec("a-m", 1)]))
    await m.load("a")
    first = m.events.last_id
    for _ in range(3):
        lease = await m.acquire("a")
        m.release(lease)
    hold = await m.hold("a", 60)
    m.release(hold)  # a batch hold is no request
    view = m.view("a")
    assert view.requests == 3
    flips = [e for e in m.events.since(first) if is_lease_flip(e)]
    assert [e.details["requests"] for e in flips] == [0, 1, 1, 2, 2, 3, 3, 3]
    fold = LeaseFold()
    for e in flips:
        assert fold.feed(e) == []
    (folded,) = fold.flush()
    assert folded.details["requests"] == 3
