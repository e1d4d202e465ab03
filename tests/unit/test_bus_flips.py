"""A request's lease flips, the lean way (issue 41 item 4): ``SlotTable.flip`` and
``EventBus.flip`` do what ``SlotTable.set(..., op=Op.LEASE, durable=False)`` and
``EventBus.emit`` did for ``ready``<->``serving`` — the same record, history, lag write and
event, seen by every consumer as before — and build the event only for whoever takes it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from controller.kit.eventbus import EventBus
from controller.model.events import Event, EventKind, Op, is_lease_flip
from controller.model.lifecycle import SlotState
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec

S = SlotState


def emitted(bus: EventBus, requests: int, at: float) -> Event:
    """The event ``emit`` made for a flip before."""
    return bus.emit(
        EventKind.TRANSITION,
        Op.LEASE,
        slot="a",
        model="a-m",
        from_state="ready",
        to_state="serving",
        message="request in flight",
        time=at,
        details={"requests": requests},
    )


def test_a_flip_is_the_event_emit_made_for_every_reader() -> None:
    bus, before = EventBus(), EventBus()
    taken: list[Event] = []
    counted: list[tuple[str, str, str]] = []
    with bus.subscribe() as everything, bus.subscribe(flips=False) as none:
        bus.add_listener(taken.append)  # a listener that takes events: built for it
        bus.add_listener(lambda e: None, on_flip=lambda *c: counted.append(c))
        load = bus.emit(EventKind.TRANSITION, Op.LOAD, slot="a", to_state="ready")
        bus.flip("a", "a-m", "ready", "serving", "request in flight", 7)
        got = everything.get_nowait()
        assert got == load
        flip = everything.get_nowait()
        assert flip is not None and none.get_nowait() == load and none.get_nowait() is None
    emitted(before, 0, 0.0)  # id 1, as the load's
    expected = emitted(before, 7, flip.time)
    assert flip == expected and is_lease_flip(flip)
    assert taken == [load, flip]
    assert counted == [("a", "ready", "serving")]  # on_flip: told, no event
    assert bus.since(0) == [load, flip] and bus.since(1) == [flip]  # the replay, built again
    assert bus.last_id == 2


def test_a_subscriber_that_takes_no_flips_is_not_asked() -> None:
    bus = EventBus()

    def no_flips(event: Event) -> bool:
        assert not is_lease_flip(event), "asked of a flip"
        return True

    with bus.subscribe(accept=no_flips, flips=False) as sub:
        bus.flip("a", None, "ready", "serving", "", 0)
        crash = bus.emit(EventKind.TRANSITION, Op.PROBE, slot="a", to_state="error")
        assert sub.get_nowait() == crash and sub.get_nowait() is None


def test_the_flips_ring_keeps_flip_and_emitted_flips_in_order() -> None:
    bus = EventBus(buffer_size=5, flip_buffer_size=3)
    for n in range(5):
        if n % 2:
            bus.flip("a", None, "serving", "ready", "", n)
        else:
            bus.emit(
                EventKind.TRANSITION, Op.LEASE, slot="a", from_state="idle", to_state="serving"
            )
    kept = bus.since(0)
    assert [e.id for e in kept] == [3, 4, 5]
    assert [e.from_state for e in kept] == ["idle", "serving", "idle"]
    assert kept[1].details == {"requests": 3}


def test_a_flip_is_logged_as_an_emitted_event_is(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    with caplog.at_level(logging.INFO, logger="slotctl.lifecycle"):
        bus.flip("a", "a-m", "ready", "serving", "request in flight", 1)
    (line,) = [r for r in caplog.records if r.name == "slotctl.lifecycle"]
    assert line.getMessage() == "lease slot=a model=a-m ready -> serving: request in flight"


async def test_the_table_flip_is_set_for_its_two_edges(tmp_path: Path) -> None:
    """The same slot fields, history, lag-writer mark and event as ``set`` makes."""
    outcomes = []
    for lean in (False, True):
        h = Harness(tmp_path / str(lean))
        m = h.manager
        await m.set_desired(desired([slot_spec("a")], [model_spec("a-m", 1)]))
        await m.load("a")
        table, slot = m.core.table, m.core.table.get("a")
        first = m.events.last_id
        for to, message in ((S.SERVING, "request in flight"), (S.READY, "no request in flight")):
            if lean:
                table.flip(slot, to, message)
            else:
                table.set(slot, to, op=Op.LEASE, message=message, durable=False)
        fields = (slot.state, slot.idle_reason, slot.message, slot.waiting, slot.asleep)
        events = [dataclasses.replace(e, time=0.0) for e in m.events.since(first)]
        history = list(table.transitions)[-2:]
        outcomes.append((fields, events, history, "a" in table.unpersisted))
        await m.close()
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][2] == [("a", "ready", "serving"), ("a", "serving", "ready")]


async def test_another_edge_goes_through_set(tmp_path: Path) -> None:
    """``flip`` takes ready <-> serving only: any other edge is ``set``'s (checked)."""
    h = Harness(tmp_path)
    m = h.manager
    await m.set_desired(desired([slot_spec("a")], [model_spec("a-m", 1)]))
    table = m.core.table
    slot = table.get("a")
    with pytest.raises(Exception, match="offline"):
        table.flip(slot, S.SERVING, "request in flight")  # offline -> serving: illegal
    assert slot.state is S.OFFLINE
    await m.close()
