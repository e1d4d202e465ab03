"""Event subscriptions that take only what they look at (controller/model/events.py ``accept``).

Two lease flips a request reach every subscriber of the bus; the reconciler's event
follower and ``slotctl up``'s printer look at neither, so their subscriptions do not take
them (the task is not woken twice a request). What they do take is unchanged.
"""

from __future__ import annotations

import io
from pathlib import Path

from controller.daemon.main import Controller, DaemonOptions
from controller.kit.eventbus import EventBus
from controller.model.events import Event, EventKind, Op
from controller.reconcile.triggers import _gone


def flip(bus: EventBus) -> Event:
    return bus.emit(
        EventKind.TRANSITION, Op.LEASE, slot="a", from_state="ready", to_state="serving"
    )


def crash(bus: EventBus) -> Event:
    return bus.emit(
        EventKind.TRANSITION, Op.PROBE, slot="a", from_state="serving", to_state="error"
    )


def drain(sub: object) -> list[Event]:
    got = []
    while (event := sub.get_nowait()) is not None:  # type: ignore[attr-defined]
        got.append(event)
    return got


def test_a_subscription_takes_only_what_it_accepts() -> None:
    bus = EventBus()
    with bus.subscribe() as everything, bus.subscribe(accept=_gone) as gone:
        events = [flip(bus), crash(bus), flip(bus)]
        assert drain(everything) == events
        assert drain(gone) == [events[1]]
    assert bus.since(0) == events  # the buffer (SSE replay) keeps every event


def test_the_reconciler_follower_takes_slots_that_went_offline_or_into_error() -> None:
    bus = EventBus()
    offline = bus.emit(EventKind.TRANSITION, Op.UNLOAD, slot="a", to_state="offline")
    error = crash(bus)
    assert _gone(offline) and _gone(error)
    assert not _gone(flip(bus))
    assert not _gone(bus.emit(EventKind.ERROR, Op.LOAD, slot="a", to_state="error"))


def test_up_prints_what_its_subscription_takes_and_nothing_else() -> None:
    out = io.StringIO()
    daemon = Controller(DaemonOptions(config_dir=Path("c"), state_dir=Path("s"), out=out))
    bus = EventBus()
    with bus.subscribe(accept=daemon._printable) as sub:
        for event in (flip(bus), crash(bus), bus.emit(EventKind.ADMISSION, Op.LOAD, slot="a")):
            daemon._print_event(event)
        printed = out.getvalue().splitlines()
        taken = drain(sub)
    assert len(printed) == len(taken) == 1 and taken[0].to_state == "error"
    quiet = Controller(DaemonOptions(config_dir=Path("c"), state_dir=Path("s"), quiet=True))
    assert not quiet._printable(crash(bus))
