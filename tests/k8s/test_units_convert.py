"""Co-loaded units through the CRDs: a stack's ``[[unit]]`` and ``with`` become each
``Slot``'s ``spec.unit``, the CRD admits it, and TOML -> CR -> TOML gives the same units."""

from __future__ import annotations

from controller.operator.convert import resources_from_state, stacks_from_resources
from controller.spec.loader import load_stack_texts
from tests.k8s.crdcheck import admission_errors
from tests.k8s.test_crd import CRDS

TEXT = """
[stack]
name = "rag"
[[model]]
id = "m"
source = "demo://m"
[[unit]]
name = "pair"
slots = ["chat", "embed"]
[[slot]]
name = "chat"
provider = "demo"
model.default = "m"
with = ["draft"]
[[slot]]
name = "draft"
provider = "demo"
model.default = "m"
[[slot]]
name = "embed"
provider = "demo"
model.default = "m"
[[slot]]
name = "solo"
provider = "demo"
model.default = "m"
"""


def test_units_round_trip_through_slot_resources() -> None:
    before = load_stack_texts([("rag.toml", TEXT)])
    assert not before.ok  # chat is in two units: [[unit]] pair and its own `with`
    assert [p.code for p in before.errors] == ["unit.slot_in_two_units"]
    text = TEXT.replace('with = ["draft"]', "").replace(
        '"chat", "embed"', '"chat", "embed", "draft"'
    )
    before = load_stack_texts([("rag.toml", text)])
    assert before.ok and before.state is not None, before.errors
    objects = resources_from_state(before.state)
    slots = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Slot"}
    assert {n: s.get("unit") for n, s in slots.items()} == {
        "chat": "pair",
        "draft": "pair",
        "embed": "pair",
        "solo": None,
    }
    for obj in objects:
        assert admission_errors(CRDS[obj["kind"]], obj) == []
    result = stacks_from_resources(objects, "k8s")
    assert not result.problems
    after = load_stack_texts(list(result.texts.items()))
    assert after.ok and after.state is not None
    assert {n: s.spec for n, s in after.state.slots.items()} == {
        n: s.spec for n, s in before.state.slots.items()
    }


def test_the_crd_refuses_a_bad_unit_name() -> None:
    report = load_stack_texts([("rag.toml", TEXT.replace('with = ["draft"]', ""))])
    assert report.state is not None
    (chat,) = [o for o in resources_from_state(report.state) if o["metadata"]["name"] == "chat"]
    chat["spec"]["unit"] = "Not A Label"
    assert admission_errors(CRDS["Slot"], chat) != []
