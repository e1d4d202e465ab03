"""Plan lines in plain words (issue 40, item 14): no Python ``None`` in a reason, and a
change that rolls out by surge is shown as a surge, not as "recreate"."""

from __future__ import annotations

from controller.reconcile.plan import Action, plan_slot, with_rollout
from controller.scheduling.rollout import RolloutDecision
from controller.spec.loader import DesiredSlot
from controller.spec.schema import SlotSpec


def spec(**extra: object) -> SlotSpec:
    base = {"name": "chat", "provider": "demo", "model": {"default": "m"}, "device": "cpu"}
    return SlotSpec.model_validate({**base, **extra})


def test_a_key_set_or_unset_reads_as_words() -> None:
    have, want = spec(), spec(memory_gb=2.0)
    action = plan_slot("chat", DesiredSlot(spec=want, stack="s"), have, None, want_hash=None)
    assert action.kind == "update"
    assert "None" not in action.reason and "memory_gb unset -> 2.0" in action.reason


def test_a_surge_is_shown_as_a_surge() -> None:
    recreate = Action("recreate", "chat", "config hash a -> b: extra_args changed")
    surge = with_rollout(recreate, RolloutDecision("surge", "a new server beside the old"))
    assert surge.kind == "recreate"  # what the reconciler acts on is unchanged
    assert surge.shown_kind == "surge"
    plain = with_rollout(recreate, RolloutDecision("recreate", 'rollout = "recreate"'))
    assert plain.shown_kind == "recreate"
    assert Action("update", "chat", "x").shown_kind == "update"
