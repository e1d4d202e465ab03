"""The lifecycle state machine checked against SPEC §1, cell by cell and by random walks."""

from __future__ import annotations

import json
from itertools import product

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from controller.model.errors import IllegalSlotTransition, SlotctlError
from controller.model.lifecycle import (
    DISPATCHABLE_STATES,
    LEGAL_TRANSITIONS,
    Candidate,
    IdleReason,
    SlotState,
    can_dispatch,
    check_transition,
    is_legal,
    rank_candidates,
    selection_key,
    selection_rank,
)

# SPEC §1 "Legal transitions", copied literally from the table (not derived from the code).
SPEC_LEGAL: dict[str, set[str]] = {
    "offline": {"pulling", "starting"},
    "pulling": {"starting", "error", "offline"},
    "starting": {"warming", "error", "offline"},
    "warming": {"ready", "idle", "error", "offline"},
    "ready": {"serving", "idle", "unloading", "error"},
    "serving": {"ready", "idle", "error"},
    "idle": {"serving", "unloading", "ready"},
    "unloading": {"offline", "error"},
    "error": {"offline", "pulling", "starting"},
}
SPEC_STATES = [
    "offline",
    "pulling",
    "starting",
    "warming",
    "ready",
    "serving",
    "idle",
    "unloading",
    "error",
]
ALL_PAIRS = list(product(SPEC_STATES, SPEC_STATES))


# --- states -------------------------------------------------------------------------------


def test_slot_state_values_are_the_spec_states_in_lower_case() -> None:
    assert [s.value for s in SlotState] == SPEC_STATES
    for state in SlotState:
        assert state.value == state.value.lower()
        assert isinstance(state, str)
        assert str(state) == state.value
        assert json.dumps(state) == f'"{state.value}"'


def test_spec_table_covers_every_state() -> None:
    # Guards the literal table above against a typo.
    assert set(SPEC_LEGAL) == set(SPEC_STATES)
    for targets in SPEC_LEGAL.values():
        assert targets <= set(SPEC_STATES)


def test_code_table_has_exactly_the_spec_rows() -> None:
    assert {s.value for s in LEGAL_TRANSITIONS} == set(SPEC_STATES)
    for source, targets in LEGAL_TRANSITIONS.items():
        assert {t.value for t in targets} == SPEC_LEGAL[source.value], source


def test_legal_transitions_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        LEGAL_TRANSITIONS[SlotState.OFFLINE] = frozenset()  # type: ignore[index]


# --- the 81 cells ---------------------------------------------------------------------------


def test_the_grid_has_81_cells_with_27_legal() -> None:
    assert len(ALL_PAIRS) == 81
    assert sum(1 for a, b in ALL_PAIRS if b in SPEC_LEGAL[a]) == 27


@pytest.mark.parametrize(("source", "target"), ALL_PAIRS, ids=[f"{a}->{b}" for a, b in ALL_PAIRS])
def test_transition_cell(source: str, target: str) -> None:
    current, wanted = SlotState(source), SlotState(target)
    expected_legal = target in SPEC_LEGAL[source]

    assert is_legal(current, wanted) is expected_legal

    if expected_legal:
        check_transition(current, wanted)  # must not raise
        return

    with pytest.raises(IllegalSlotTransition) as info:
        check_transition(current, wanted)
    err = info.value
    assert isinstance(err, SlotctlError)
    assert err.http_status == 409
    assert err.code == "slot.illegal_transition"
    message = str(err)
    attempted = f"{source} -> {target}"
    assert attempted in message
    # Every legal alternative is named besides the attempted pair (no state name is a
    # substring of another, so a plain search is exact).
    rest = message.replace(attempted, "", 1)
    alternatives = sorted(SPEC_LEGAL[source])
    for alternative in alternatives:
        assert alternative in rest
    for other in set(SPEC_STATES) - set(alternatives) - {source, target}:
        assert other not in rest
    assert err.details["from_state"] == source
    assert err.details["to_state"] == target
    assert err.details["legal"] == alternatives
    body = err.to_dict()["error"]
    assert body["code"] == "slot.illegal_transition"
    assert body["legal"] == alternatives
    json.dumps(err.to_dict())  # renderable as-is


@pytest.mark.parametrize(
    ("source", "target"),
    [("serving", "unloading"), ("offline", "ready"), ("idle", "error"), ("error", "ready")],
)
def test_notable_illegal_transitions(source: str, target: str) -> None:
    # serving -> unloading must drain first; idle -> error and error -> ready are not in the
    # table; offline can not jump straight to ready.
    assert not is_legal(SlotState(source), SlotState(target))


def test_self_transitions_are_all_illegal() -> None:
    for state in SlotState:
        assert not is_legal(state, state)


# --- random walks ---------------------------------------------------------------------------


class _Holder:
    """A tiny stand-in for the slot manager: guards every change with check_transition."""

    def __init__(self) -> None:
        self.state = SlotState.OFFLINE

    def transition(self, target: SlotState) -> None:
        check_transition(self.state, target)
        self.state = target


class TransitionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.holder = _Holder()
        self.model_state = "offline"  # tracked independently, from the SPEC table

    @rule(wanted=st.sampled_from(SlotState))
    def attempt(self, wanted: SlotState) -> None:
        before = self.holder.state
        if wanted.value in SPEC_LEGAL[self.model_state]:
            self.holder.transition(wanted)
            assert self.holder.state is wanted
            assert self.holder.state != before
            self.model_state = wanted.value
        else:
            with pytest.raises(IllegalSlotTransition) as info:
                self.holder.transition(wanted)
            assert self.holder.state is before
            assert info.value.details["from_state"] == before.value
            assert info.value.details["to_state"] == wanted.value

    @rule(pick=st.integers(min_value=0, max_value=8))
    def attempt_legal_only(self, pick: int) -> None:
        # Biases walks towards the legal graph so deep states (serving, unloading) are reached.
        options = sorted(SPEC_LEGAL[self.model_state])
        choice = SlotState(options[pick % len(options)])
        self.holder.transition(choice)
        assert self.holder.state is choice
        self.model_state = choice.value

    @invariant()
    def holder_matches_model(self) -> None:
        assert self.holder.state.value == self.model_state


TransitionMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None
)
TestTransitionMachine = TransitionMachine.TestCase


# --- dispatchability ------------------------------------------------------------------------


def test_dispatchable_states_are_ready_serving_idle() -> None:
    assert {s.value for s in DISPATCHABLE_STATES} == {"ready", "serving", "idle"}
    assert isinstance(DISPATCHABLE_STATES, frozenset)


@pytest.mark.parametrize("state", SPEC_STATES)
def test_can_dispatch_by_state(state: str) -> None:
    expected = state in {"ready", "serving", "idle"}
    assert can_dispatch(SlotState(state)) is expected
    assert can_dispatch(state) is expected  # plain wire strings work too


@pytest.mark.parametrize("reason", [IdleReason.NO_MODEL, "no_model"])
def test_idle_without_model_is_not_dispatchable(reason: str) -> None:
    assert can_dispatch(SlotState.IDLE, reason) is False
    assert can_dispatch("idle", reason) is False


@pytest.mark.parametrize("reason", [IdleReason.TIMEOUT, "timeout"])
def test_idle_after_timeout_is_dispatchable(reason: str) -> None:
    assert can_dispatch(SlotState.IDLE, reason) is True
    assert can_dispatch("idle", reason) is True


def test_idle_reason_only_matters_for_idle() -> None:
    # A stale idle_reason on a ready/serving slot does not block it; on a non-dispatchable
    # state no reason makes it dispatchable.
    assert can_dispatch(SlotState.READY, IdleReason.NO_MODEL) is True
    assert can_dispatch(SlotState.SERVING, IdleReason.NO_MODEL) is True
    assert can_dispatch(SlotState.WARMING, IdleReason.TIMEOUT) is False
    assert can_dispatch(SlotState.ERROR, IdleReason.TIMEOUT) is False


def test_idle_reason_values() -> None:
    # asleep: the residency tier of idle (issue 22), not a tenth state
    assert {r.value for r in IdleReason} == {"no_model", "timeout", "asleep"}
    assert {s.value for s in SlotState} == set(SPEC_STATES)


def test_an_asleep_slot_is_idle_and_not_dispatchable() -> None:
    assert can_dispatch(SlotState.IDLE, IdleReason.ASLEEP) is False
    assert can_dispatch(SlotState.IDLE, "asleep") is False
    assert can_dispatch(SlotState.READY, IdleReason.ASLEEP) is True  # only idle has a reason
    # waking it is idle -> ready, a transition the table already has
    assert is_legal(SlotState.IDLE, SlotState.READY)


def test_an_asleep_slot_ranks_after_the_dispatchable_ones_and_before_warming() -> None:
    cands = [
        Candidate("w", SlotState.WARMING, priority=100, last_used=99),
        Candidate("n", SlotState.IDLE, priority=100, last_used=99, idle_reason="no_model"),
        Candidate("z", SlotState.IDLE, priority=0, last_used=0, idle_reason="asleep"),
        Candidate("i", SlotState.IDLE, priority=0, last_used=0, idle_reason="timeout"),
        Candidate("o", SlotState.OFFLINE, priority=100, last_used=99),
    ]
    assert [c.name for c in rank_candidates(cands)] == ["i", "z", "n", "w", "o"]
    key = selection_key
    assert key(SlotState.READY) < key(SlotState.IDLE, "asleep") < key(SlotState.WARMING)
    assert selection_rank(SlotState.IDLE, "asleep") == SPEC_TIER["warming"]  # SPEC's tiers


def test_unknown_state_is_not_dispatchable() -> None:
    assert can_dispatch("bogus") is False
    assert can_dispatch("READY") is False  # wire values are lower-case


# --- selection ranking ----------------------------------------------------------------------

SPEC_TIER = {
    "ready": 0,
    "serving": 0,
    "idle": 0,
    "warming": 1,
    "starting": 1,
    "pulling": 1,
    "offline": 2,
    "unloading": 2,
    "error": 3,
}


@pytest.mark.parametrize("state", SPEC_STATES)
def test_selection_rank_tiers(state: str) -> None:
    assert set(SPEC_TIER) == set(SPEC_STATES)
    assert selection_rank(SlotState(state)) == SPEC_TIER[state]
    assert selection_rank(state) == SPEC_TIER[state]


@pytest.mark.parametrize("unknown", ["bogus", "", "Ready", "crashed"])
def test_unknown_state_ranks_as_error(unknown: str) -> None:
    assert selection_rank(unknown) == selection_rank(SlotState.ERROR)
    assert selection_rank(unknown) > selection_rank(SlotState.OFFLINE)


def test_idle_no_model_ranks_below_dispatchable_above_offline() -> None:
    rank = selection_rank(SlotState.IDLE, IdleReason.NO_MODEL)
    assert rank > selection_rank(SlotState.IDLE, IdleReason.TIMEOUT)
    assert rank > selection_rank(SlotState.READY)
    assert rank < selection_rank(SlotState.OFFLINE)
    assert rank == selection_rank(SlotState.WARMING)


def _names(candidates: list[Candidate]) -> list[str]:
    return [c.name for c in rank_candidates(candidates)]


def test_rank_candidates_by_tier_first() -> None:
    cands = [
        Candidate("e", "error", priority=100, last_used=9),
        Candidate("u", "bogus", priority=100, last_used=9),
        Candidate("o", SlotState.OFFLINE, priority=100, last_used=9),
        Candidate("w", SlotState.WARMING, priority=100, last_used=9),
        Candidate("r", SlotState.READY, priority=0, last_used=0),
    ]
    order = _names(cands)
    assert order[:3] == ["r", "w", "o"]
    assert set(order[3:]) == {"e", "u"}


def test_rank_candidates_tie_break_priority_then_recency_then_name() -> None:
    cands = [
        Candidate("d", SlotState.IDLE, priority=50, last_used=10.0, idle_reason="timeout"),
        Candidate("c", SlotState.READY, priority=50, last_used=10.0),
        Candidate("b", SlotState.SERVING, priority=50, last_used=20.0),
        Candidate("a", SlotState.READY, priority=10, last_used=99.0),
        Candidate("z", SlotState.READY, priority=90, last_used=0.0),
    ]
    # z: highest priority; b: most recent among priority 50; c/d: equal, name order; a last.
    assert _names(cands) == ["z", "b", "c", "d", "a"]


def test_rank_candidates_idle_no_model_behind_dispatchable() -> None:
    cands = [
        Candidate("a", SlotState.IDLE, priority=99, last_used=99, idle_reason="no_model"),
        Candidate("b", SlotState.IDLE, priority=1, last_used=0, idle_reason="timeout"),
        Candidate("c", SlotState.OFFLINE, priority=99, last_used=99),
    ]
    assert _names(cands) == ["b", "a", "c"]


def test_rank_candidates_is_deterministic_for_any_input_order() -> None:
    cands = [
        Candidate("x", SlotState.READY),
        Candidate("y", SlotState.READY),
        Candidate("w", SlotState.READY),
    ]
    assert _names(cands) == ["w", "x", "y"]
    assert _names(list(reversed(cands))) == ["w", "x", "y"]
    assert _names([]) == []
    # Accepts any iterable, e.g. a generator.
    assert [c.name for c in rank_candidates(c for c in cands)] == ["w", "x", "y"]


def test_slot_get_says_an_asleep_server_sleeps() -> None:
    from controller.model.lifecycle import describe

    server, meaning = describe("idle", "asleep")
    assert server == "asleep" and "wakes it" in meaning
    assert describe("idle", "timeout")[0] == "up"
