"""The dry run as data (docs/design/0016): ``explain_load`` returns a frozen
:class:`~controller.slots.dryrun.LoadPlan` built from the load's own decision; the API
renders it (:func:`controller.api.dryrun.plan_json`; the wire shape is the other tests'
assertions, test_manager's, test_sleep_tier's, test_coload's ...)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from controller.api.dryrun import plan_json
from controller.model.errors import InsufficientMemory
from controller.model.sizes import GIB
from controller.slots.dryrun import LoadPlan, PlanVictim, Refusal
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec


async def test_the_plan_is_typed_frozen_and_what_the_load_then_does(tmp_path: Path) -> None:
    h = Harness(tmp_path, gpu_gb=10)
    m = h.manager
    slots = [slot_spec("lo", priority=10), slot_spec("hi", priority=90), slot_spec("new")]
    models = [model_spec("lo-m", 4), model_spec("hi-m", 4), model_spec("new-m", 4)]
    await m.set_desired(desired(slots, models))
    await m.load("lo")
    await m.load("hi")
    h.clock.advance(30)
    plan = m.explain_load("new")
    assert isinstance(plan, LoadPlan) and plan.action == "evict-then-load"
    assert plan.target is not None and plan.target.devices == ("gpu:0",)
    assert plan.target.needed_bytes == 4 * GIB and plan.target.free_bytes == 2 * GIB
    (victim,) = plan.victims
    assert isinstance(victim, PlanVictim)
    assert (victim.slot, victim.action, victim.priority, victim.idle_s) == (
        "lo",
        "unload",
        10,
        30.0,
    )
    assert victim.bytes == 4 * GIB and "priority 10" in victim.reason
    assert plan.freed == {"gpu:0": 4 * GIB} and plan.refusal is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.action = "load"  # type: ignore[misc]
    await m.load("new")
    assert m.view("lo").state.value == "offline"  # what the plan said
    done = m.explain_load("new")
    assert (done.action, done.reason, done.reload) == ("none", "already ready", None)
    await m.close()


async def test_a_refusal_carries_its_typed_error_and_the_bytes(tmp_path: Path) -> None:
    h = Harness(tmp_path, gpu_gb=10)
    m = h.manager
    await m.set_desired(desired([slot_spec("huge")], [model_spec("huge-m", 40)]))
    plan = m.explain_load("huge")
    assert plan.action == "refuse" and isinstance(plan.refusal, Refusal)
    assert isinstance(plan.refusal.error, InsufficientMemory)
    assert plan.refusal.needed_bytes == 40 * GIB
    assert plan.refusal.free_bytes == 10 * GIB and plan.refusal.evictable_bytes == 0
    wire = plan_json(plan)
    assert wire["error"] == plan.refusal.error.to_dict()["error"]
    assert "evict" not in wire and "freed" not in wire
    with pytest.raises(InsufficientMemory) as refused:
        await m.load("huge")
    assert refused.value.details["needed_bytes"] == plan.refusal.needed_bytes
    await m.close()
