"""decide_rollout: surge when it may and fits beside the running server, else recreate
with the reason the plan shows."""

from __future__ import annotations

from typing import Any

from controller.model.errors import InsufficientMemory
from controller.model.sizes import GIB
from controller.reconcile.plan import Action, with_rollout
from controller.runtime.kubernetes.runtime import KubernetesRuntime
from controller.runtime.surging import cannot_surge
from controller.scheduling.decision import LoadDecision
from controller.scheduling.fit import Admission
from controller.scheduling.rollout import decide_rollout
from controller.spec.schema import SlotSpec


def _spec(**kw: Any) -> SlotSpec:
    return SlotSpec.model_validate(
        {"name": "chat", "provider": "demo", "model": {"default": "m"}, "device": "gpu", **kw}
    )


def _figures(needed_gb: float, admitted_gb: float, budget_gb: float) -> Admission:
    return Admission(
        device="gpu:0",
        needed=int(needed_gb * GIB),
        admitted=int(admitted_gb * GIB),
        budget=int(budget_gb * GIB),
        free=int(budget_gb * GIB),
        margin=0,
        source="test",
    )


def _fits(needed_gb: float = 4, admitted_gb: float = 4, budget_gb: float = 16) -> LoadDecision:
    return LoadDecision("load", admission=_figures(needed_gb, admitted_gb, budget_gb))


def _refused(needed_gb: float = 12, admitted_gb: float = 12, budget_gb: float = 16) -> LoadDecision:
    figures = _figures(needed_gb, admitted_gb, budget_gb)
    error = InsufficientMemory(
        "no room",
        needed_bytes=int(needed_gb * GIB),
        free_bytes=figures.budget_room,
        evictable_bytes=0,
    )
    return LoadDecision("refuse", error=error, admission=figures)


def test_surge_when_it_fits_beside_the_running_server() -> None:
    decision = decide_rollout(
        _spec(), running=True, cannot_surge=None, load=_fits(), needed=4 * GIB
    )
    assert decision.surge
    assert decision.text.startswith("surge: 4.00 GiB fits")
    assert "12.00 GiB free" in decision.text


def test_no_room_is_a_recreate_that_says_how_much() -> None:
    decision = decide_rollout(
        _spec(), running=True, cannot_surge=None, load=_refused(), needed=12 * GIB
    )
    assert not decision.surge
    assert decision.text == "recreate: no room to surge, needs 12.00 GiB, 4.00 GiB free"


def test_each_reason_to_recreate_in_order() -> None:
    ok = _fits()
    cases = [
        (_spec(rollout="recreate"), True, None, ok, 'rollout = "recreate"'),
        (_spec(), False, None, ok, "no server runs"),
        (_spec(), True, "the docker runtime cannot", ok, "the docker runtime cannot"),
        (_spec(port=8080), True, None, ok, "port 8080 is declared"),
    ]
    for spec, running, why_not, load, said in cases:
        decision = decide_rollout(
            spec, running=running, cannot_surge=why_not, load=load, needed=4 * GIB
        )
        assert decision.way == "recreate", (said, decision)
        assert said in decision.reason, (said, decision)


class SurgeAll:
    """Satisfies the surge protocol (what ``cannot_surge`` asks of a runtime)."""

    async def start_instance(self, launch: Any) -> Any: ...
    async def inspect_instance(self, slot: str) -> Any: ...
    async def stop_instance(self, slot: str, timeout: float) -> None: ...
    async def promote(self, slot: str) -> None: ...
    async def stop_retiring(self, slot: str, timeout: float) -> None: ...


def test_without_memory_figures_the_plan_leaves_it_to_the_controller() -> None:
    decision = decide_rollout(_spec(), running=True, cannot_surge=None, load=None, needed=0)
    assert not decision.surge
    assert decision.text.startswith("surge-or-recreate: memory not known here")


def test_runtimes_that_cannot_surge_say_why() -> None:
    class Surging:
        kind = "kubernetes"
        surge = SurgeAll()

    class OneServer:
        kind = "process"

    assert cannot_surge(Surging()) is None
    assert cannot_surge(KubernetesRuntime(namespace="default")) is None  # issue 39: it surges
    assert "runs one server per slot" in (cannot_surge(OneServer()) or "")

    class SurgeSome(SurgeAll):
        def cannot_surge_slot(self, slot: str) -> str | None:
            return "its objects predate instance labels" if slot == "old" else None

    class Some:
        kind = "kubernetes"
        surge = SurgeSome()

    # a runtime that refuses some slots (kubernetes: pods from before instance labels)
    assert cannot_surge(Some()) is None and cannot_surge(Some(), "new") is None
    assert cannot_surge(Some(), "old") == "its objects predate instance labels"
    decision = decide_rollout(
        _spec(), running=True, cannot_surge=cannot_surge(Some(), "old"), load=None, needed=0
    )
    assert decision.way == "recreate" and "predate instance labels" in decision.reason


def test_the_plan_carries_the_way() -> None:
    decision = decide_rollout(
        _spec(), running=True, cannot_surge=None, load=_refused(), needed=12 * GIB
    )
    action = with_rollout(Action("recreate", "chat", "config hash a -> b: args changed"), decision)
    assert action.reason.endswith("recreate: no room to surge, needs 12.00 GiB, 4.00 GiB free")
    assert action.details["rollout"] == "recreate"
    noop = Action("noop", "chat", "in sync")
    assert with_rollout(noop, decision) is noop


def test_rollout_is_a_scheduling_key_and_defaults_to_surge() -> None:
    from controller.reconcile.plan import SCHEDULING_KEYS

    assert "rollout" in SCHEDULING_KEYS
    assert _spec().rollout == "surge"
