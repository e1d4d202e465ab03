"""The router's candidates by model (``SlotTable.routes``, issue 41 item 4): remembered per
model, and always what a scan of every record says (the precedence of SPEC §1: a catalogue
model's slots, else a slot by its name, else a self-managed provider's model-less slots;
activated slots only), through every change of what a model names: a slot added, rebound
to another model, deactivated, given another catalogue, removed.
"""

from __future__ import annotations

from pathlib import Path

from controller.router.selection import route
from controller.slots.manager import SlotManager
from controller.spec.loader import DesiredSlot
from tests.unit.manager_fixtures import Harness, desired, model_spec, rebound, slot_spec


def scanned(m: SlotManager, model: str) -> tuple[str, ...]:
    """What a scan of every record says (the table's own rule, without the memo)."""
    return tuple(s.spec.name for s in m.core.table._serving(model))


def check(m: SlotManager, *models: str) -> None:
    for model in models:
        assert m.routes(model) == scanned(m, model), model
        assert [c.name for c in m.routable(model)] == list(m.routes(model)), model


async def test_routes_follow_every_change_of_what_a_model_names(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    m = h.manager
    asked = ("a-m", "b-m", "c-m", "a", "b", "demo", "nobody")
    a, b = slot_spec("a"), slot_spec("b", model="a-m")
    await m.set_desired(desired([a, b], [model_spec("a-m"), model_spec("b-m")]))
    assert m.routes("a-m") == ("a", "b")
    assert m.routes("b-m") == ()
    assert m.routes("a") == ("a",)  # a slot by its name
    check(m, *asked)
    first = m.routes("a-m")
    assert m.routes("a-m") is first  # remembered: no scan a request

    m.upsert(rebound(b, "b-m"))  # b now serves another model
    assert m.routes("a-m") == ("a",) and m.routes("b-m") == ("b",)
    check(m, *asked)

    m.upsert(DesiredSlot(spec=slot_spec("c", model="c-m"), stack="t"))  # a new slot
    m.set_models({"a-m": model_spec("a-m"), "b-m": model_spec("b-m"), "c-m": model_spec("c-m")})
    assert m.routes("c-m") == ("c",)
    check(m, *asked)

    m.upsert(rebound(a, ""))  # a deactivated (no model): routes nowhere, not even by name
    assert m.routes("a-m") == () and m.routes("a") == ()
    check(m, *asked)

    await m.remove("b")
    assert m.routes("b-m") == () and m.routes("b") == ()
    check(m, *asked)


async def test_route_answers_as_serving_and_fitting_do(tmp_path: Path) -> None:
    """The one-slot memo of ``route`` is dropped with the table's: a slot whose type
    changes (an embedding slot for a chat model) is refused for chat at once."""
    h = Harness(tmp_path)
    m = h.manager
    a = slot_spec("a")
    await m.set_desired(desired([a], [model_spec("a-m")]))
    assert route(m, "a-m", "chat") == (("a",), ("a",), "")
    m.upsert(DesiredSlot(spec=a.model_copy(update={"type": "embedding"}), stack="t"))
    assert route(m, "a-m", "chat") == (("a",), (), "embedding")
    assert route(m, "a-m", "embeddings") == (("a",), ("a",), "")
    assert route(m, "nobody", "chat") == ([], [], "")
