"""``rollout`` in TOML and as a Slot CR field: the round trip is lossless, the CRD admits
the two values and refuses others, and a TOML typo is a typed problem."""

from __future__ import annotations

import pytest

from controller.operator.convert import resources_from_state, stacks_from_resources
from controller.spec.loader import load_stack_texts
from tests.k8s.crdcheck import admission_errors
from tests.k8s.test_crd import CRDS

STACK = """
[stack]
name = "roll"

[[model]]
id = "m"
source = "demo://m"

[[slot]]
name = "a"
provider = "demo"
model.default = "m"
rollout = "recreate"

[[slot]]
name = "b"
provider = "demo"
model.default = "m"
"""


def test_toml_to_cr_to_toml_keeps_rollout() -> None:
    report = load_stack_texts([("roll.toml", STACK)])
    assert report.ok and report.state is not None
    assert report.state.slots["a"].spec.rollout == "recreate"
    assert report.state.slots["b"].spec.rollout == "surge"
    resources = resources_from_state(report.state)
    slot_a = next(r for r in resources if r["kind"] == "Slot" and r["metadata"]["name"] == "a")
    assert slot_a["spec"]["rollout"] == "recreate"
    slot_b = next(r for r in resources if r["kind"] == "Slot" and r["metadata"]["name"] == "b")
    assert "rollout" not in slot_b["spec"]  # the default stays implicit
    back = stacks_from_resources(resources, "roll")
    assert not back.problems
    again = load_stack_texts(list(back.texts.items()))
    assert again.ok and again.state is not None
    assert {n: s.spec for n, s in again.state.slots.items()} == {
        n: s.spec for n, s in report.state.slots.items()
    }


@pytest.mark.parametrize(("value", "ok"), [("surge", True), ("recreate", True), ("rolling", False)])
def test_the_crd_admits_only_the_two_ways(value: str, ok: bool) -> None:
    obj = {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Slot",
        "metadata": {"name": "a"},
        "spec": {"provider": "demo", "model": {"default": "m"}, "rollout": value},
    }
    errors = admission_errors(CRDS["Slot"], obj)
    assert (not errors) is ok, errors


def test_a_typo_is_a_located_problem() -> None:
    report = load_stack_texts([("roll.toml", STACK.replace('"recreate"', '"rolling"'))])
    assert not report.ok
    assert any("rollout" in str(p) for p in report.errors), report.errors
