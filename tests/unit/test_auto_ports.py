"""Ports the controller chooses (issue 24): a slot without ``port`` (or ``port = "auto"``)
gets a free one, recorded in its state dir before its server starts, the same after a
restart (so its config hash, too: no drift), never one another slot declares or was
given; chosen again only when a slot now declares it or, at a start, it is taken.

SlotManager on FakeRuntime + FakeClock with the real StateStore in a temp dir; the
host's ports are real (a bound socket takes one).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from controller.model.lifecycle import SlotState
from controller.spec.loader import DesiredSlot
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec

S = SlotState


def port_of(h: Harness, name: str) -> int:
    endpoint = h.manager.view(name).endpoint
    assert endpoint is not None
    return int(endpoint.rsplit(":", 1)[1])


async def test_an_auto_port_is_chosen_recorded_and_the_same_after_a_restart(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path)
    a, b, c = slot_spec("a", port=None), slot_spec("b", port="auto"), slot_spec("c")
    want = desired([a, b, c], [model_spec(f"{n}-m", 1) for n in "abc"])
    await h.manager.set_desired(want)
    for name in "abc":
        await h.manager.load(name)
    pa, pb = port_of(h, "a"), port_of(h, "b")
    assert len({pa, pb, c.port}) == 3
    assert h.manager.store.read_port("a") == pa  # recorded beside its state
    h.manager.core.table.flush_unpersisted()  # `ready` is an observation: it lags (SPEC §3)
    state = json.loads((tmp_path / "state/slots/a/state.json").read_text())
    assert state["port"] == pa
    hash_a = h.manager.launch_hash(DesiredSlot(spec=a, stack="t"))
    assert hash_a == h.manager.view("a").config_hash  # what runs is what is desired

    again = h.new_manager()  # a restart: the same state dir
    await again.set_desired(want)
    assert again.launch_hash(DesiredSlot(spec=a, stack="t")) == hash_a  # no drift
    assert again.core.build_launch(again.core.table.get("b")).port == pb


async def test_a_port_another_slot_now_declares_or_someone_holds_is_chosen_again(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path)
    a = slot_spec("a", port=None)
    models = [model_spec("a-m", 1), model_spec("d-m", 1)]
    await h.manager.set_desired(desired([a], models))
    await h.manager.load("a")
    first = port_of(h, "a")
    await h.manager.unload("a")

    # someone else listens on it meanwhile: the next start takes another free port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first))
        squatter.listen()
        await h.manager.load("a")
        second = port_of(h, "a")
    assert second != first and h.manager.store.read_port("a") == second
    await h.manager.unload("a")

    # a new slot declares that port: a gives it up at once (its hash changes)
    before = h.manager.launch_hash(DesiredSlot(spec=a, stack="t"))
    d = slot_spec("d", port=second)
    await h.manager.set_desired(desired([a, d], models))
    after = h.manager.launch_hash(DesiredSlot(spec=a, stack="t"))
    assert after != before
    assert h.manager.store.read_port("a") not in (first, second)


async def test_a_removed_slot_takes_its_chosen_port_along(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    a = slot_spec("a", port=None)
    await h.manager.set_desired(desired([a], [model_spec("a-m", 1)]))
    await h.manager.load("a")
    assert (tmp_path / "state/slots/a/port.json").exists()
    await h.manager.set_desired(desired([], [model_spec("a-m", 1)]))
    await h.manager.remove("a")
    assert not (tmp_path / "state/slots/a/port.json").exists()
