"""Eviction planning (SPEC §6): victims, order, fewest victims, pressure levels."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controller.model.lifecycle import SlotState
from controller.scheduling.eviction import (
    EvictionCandidate,
    Pressure,
    is_eligible,
    plan_eviction,
    pressure_level,
    pressure_victims,
)

G = 1024**3
NOW = 10_000.0


def cand(
    name: str, gb: float, priority: int = 50, last_used: float = 0.0, **kw: Any
) -> EvictionCandidate:
    data: dict[str, Any] = {
        "name": name,
        "devices": ("gpu",),
        "bytes": int(gb * G),
        "priority": priority,
        "last_used": last_used,
        "state": SlotState.READY,
    }
    data.update(kw)
    return EvictionCandidate(**data)


def names(plan_victims: Any) -> list[str]:
    return [v.name for v in plan_victims]


# ----------------------------------------------------------------- plan_eviction


def test_lowest_priority_first() -> None:
    cs = [cand("hi", 4, priority=90), cand("lo", 4, priority=10), cand("mid", 4, priority=50)]
    plan = plan_eviction(cs, "gpu", 3 * G, NOW)
    assert names(plan.victims) == ["lo"]
    assert plan.sufficient
    assert plan.freed_bytes == 4 * G
    assert plan.evictable_bytes == 12 * G


def test_lru_inside_a_priority_tier() -> None:
    cs = [cand("recent", 4, last_used=900.0), cand("old", 4, last_used=100.0)]
    plan = plan_eviction(cs, "gpu", 2 * G, NOW)
    assert names(plan.victims) == ["old"]
    assert plan.victims[0].idle_s == NOW - 100.0


def test_fewest_victims_that_free_enough() -> None:
    cs = [cand("a", 1, priority=10), cand("b", 2, priority=10), cand("c", 10, priority=50)]
    plan = plan_eviction(cs, "gpu", 10 * G, NOW)
    assert names(plan.victims) == ["c"]
    assert plan.freed_bytes == 10 * G


def test_prefix_in_order_when_every_victim_is_needed() -> None:
    cs = [
        cand("a", 2, priority=10, last_used=1),
        cand("b", 2, priority=10, last_used=2),
        cand("c", 2, priority=20),
    ]
    plan = plan_eviction(cs, "gpu", 5 * G, NOW)
    assert names(plan.victims) == ["a", "b", "c"]
    plan = plan_eviction(cs, "gpu", 3 * G, NOW)
    assert names(plan.victims) == ["a", "b"]


def test_more_valuable_chosen_slot_is_spared_first() -> None:
    # Prefix a(1), b(4) frees 5 >= 4; a is not needed after all.
    cs = [cand("a", 1, priority=10), cand("b", 4, priority=20)]
    plan = plan_eviction(cs, "gpu", 4 * G, NOW)
    assert names(plan.victims) == ["b"]


def test_ineligible_slots_are_never_chosen() -> None:
    cs = [
        cand("pinned", 8, priority=0, pinned=True),
        cand("leased", 8, priority=0, leases=1),
        cand("busy", 8, priority=0, busy=True),
        cand("loading", 8, priority=0, state=SlotState.WARMING),
        cand("starting", 8, priority=0, state=SlotState.STARTING),
        cand("serving", 8, priority=0, state=SlotState.SERVING),
        cand("unloading", 8, priority=0, state=SlotState.UNLOADING),
        cand("error", 8, priority=0, state=SlotState.ERROR),
        cand("offline", 8, priority=0, state=SlotState.OFFLINE),
        cand("other-device", 8, priority=0, devices=("cpu",)),
        cand("idle", 2, priority=99, state=SlotState.IDLE),
        cand("ok", 2, priority=99),
    ]
    plan = plan_eviction(cs, "gpu", 3 * G, NOW)
    assert sorted(names(plan.victims)) == ["idle", "ok"]
    assert plan.evictable_bytes == 4 * G


def test_priority_100_is_evicted_last_but_is_evictable() -> None:
    cs = [cand("top", 4, priority=100), cand("low", 4, priority=0)]
    assert names(plan_eviction(cs, "gpu", G, NOW).victims) == ["low"]
    assert names(plan_eviction(cs, "gpu", 8 * G, NOW).victims) == ["low", "top"]


def test_insufficient_gives_an_empty_plan_with_evictable_bytes() -> None:
    cs = [cand("a", 2), cand("b", 3), cand("p", 50, pinned=True)]
    plan = plan_eviction(cs, "gpu", 6 * G, NOW)
    assert plan.victims == ()
    assert not plan.sufficient
    assert plan.freed_bytes == 0
    assert plan.evictable_bytes == 5 * G
    assert plan.need_bytes == 6 * G


def test_need_zero_or_less_is_an_empty_sufficient_plan() -> None:
    cs = [cand("a", 2)]
    for need in (0, -5):
        plan = plan_eviction(cs, "gpu", need, NOW)
        assert plan.victims == ()
        assert plan.sufficient
        assert plan.evictable_bytes == 2 * G


def test_no_candidates() -> None:
    plan = plan_eviction([], "gpu", G, NOW)
    assert plan.victims == () and not plan.sufficient and plan.evictable_bytes == 0


def test_victim_reason_names_priority_idle_bytes_and_the_slot() -> None:
    plan = plan_eviction(
        [cand("a", 1, priority=7, last_used=NOW - 42)], "gpu", 1, NOW, for_slot="big"
    )
    (victim,) = plan.victims
    assert "make room for big" in victim.reason
    assert "priority 7" in victim.reason
    assert "idle 42s" in victim.reason
    assert "frees 1.00 GiB" in victim.reason  # one memory format (controller.model.sizes)


def test_victim_carries_the_access_counter_for_revalidation() -> None:
    plan = plan_eviction([cand("a", 1, access=17)], "gpu", 1, NOW)
    assert plan.victims[0].access == 17


def test_is_eligible() -> None:
    assert is_eligible(cand("a", 1))
    assert is_eligible(cand("a", 1, state=SlotState.IDLE))
    assert not is_eligible(cand("a", 1, pinned=True))
    assert not is_eligible(cand("a", 1, leases=2))
    assert not is_eligible(cand("a", 1, busy=True))
    for state in SlotState:
        if state not in (SlotState.READY, SlotState.IDLE):
            assert not is_eligible(cand("a", 1, state=state))


# ----------------------------------------------------------------- pressure


def test_pressure_level_thresholds() -> None:
    assert pressure_level(100, 50) is Pressure.NORMAL
    assert pressure_level(100, 10) is Pressure.NORMAL  # exactly 10 % free: not below
    assert pressure_level(100, 9) is Pressure.ELEVATED
    assert pressure_level(100, 5) is Pressure.ELEVATED  # exactly 5 %: not below
    assert pressure_level(100, 4) is Pressure.CRITICAL
    assert pressure_level(100, 0) is Pressure.CRITICAL
    assert pressure_level(0, 0) is Pressure.NORMAL  # unknown total: no pressure
    assert pressure_level(100, 30, elevated_frac=0.5, critical_frac=0.2) is Pressure.ELEVATED
    assert pressure_level(100, 10, elevated_frac=0.5, critical_frac=0.2) is Pressure.CRITICAL


def test_pressure_victims_elevated_one_critical_all() -> None:
    cs = [
        cand("a", 1, priority=50, last_used=5),
        cand("b", 1, priority=10, last_used=9),
        cand("c", 1, priority=10, last_used=1),
        cand("pinned", 1, priority=0, pinned=True),
        cand("leased", 1, priority=0, leases=1),
        cand("cpu", 1, priority=0, devices=("cpu",)),
    ]
    assert pressure_victims(cs, "gpu", Pressure.NORMAL, NOW) == []
    elevated = pressure_victims(cs, "gpu", Pressure.ELEVATED, NOW)
    assert names(elevated) == ["c"]
    assert "memory pressure elevated" in elevated[0].reason
    critical = pressure_victims(cs, "gpu", Pressure.CRITICAL, NOW)
    assert names(critical) == ["c", "b", "a"]
    assert pressure_victims([cand("p", 1, pinned=True)], "gpu", Pressure.CRITICAL, NOW) == []


# ----------------------------------------------------------------- property

_states = st.sampled_from(list(SlotState))
_candidate = st.builds(
    EvictionCandidate,
    name=st.text(alphabet="abcdefgh", min_size=1, max_size=3),
    devices=st.sampled_from([("gpu",), ("cpu",)]),
    bytes=st.integers(min_value=0, max_value=40),
    priority=st.integers(min_value=0, max_value=100),
    last_used=st.floats(min_value=0, max_value=1000, allow_nan=False),
    state=_states,
    pinned=st.booleans(),
    leases=st.integers(min_value=0, max_value=2),
    busy=st.booleans(),
)


@given(
    candidates=st.lists(_candidate, max_size=10, unique_by=lambda c: c.name),
    need=st.integers(min_value=-5, max_value=120),
)
def test_plan_property(candidates: list[EvictionCandidate], need: int) -> None:
    plan = plan_eviction(candidates, "gpu", need, NOW)
    by_name = {c.name: c for c in candidates}
    eligible = [c for c in candidates if c.devices == ("gpu",) and is_eligible(c)]
    assert plan.evictable_bytes == sum(c.bytes for c in eligible)
    chosen = [by_name[v.name] for v in plan.victims]
    assert len({c.name for c in chosen}) == len(chosen)  # no duplicates
    for c in chosen:
        assert c.devices == ("gpu",) and is_eligible(c), c
        assert c.state in (SlotState.READY, SlotState.IDLE)
        assert not c.pinned and c.leases == 0 and not c.busy
    assert plan.freed_bytes == sum(c.bytes for c in chosen)
    if need <= 0:
        assert plan.victims == ()
        return
    if plan.evictable_bytes < need:
        assert plan.victims == () and not plan.sufficient
        return
    assert plan.sufficient
    assert plan.freed_bytes >= need
    for c in chosen:  # fewest: no single victim is superfluous
        assert plan.freed_bytes - c.bytes < need, (c.name, plan)


def test_load_decision_lists_candidates_only_when_the_load_does_not_fit() -> None:
    # decide_load takes the candidate list as a callable: a load that fits never builds
    # it (O(slots) at every load); one that does not fit evicts from it as before.
    from controller.scheduling.breaker import Breaker
    from controller.scheduling.decision import DeviceFacts, LoadRequest, decide_load
    from controller.scheduling.fit import DeviceMemory

    asked: list[int] = []

    def candidates() -> list[EvictionCandidate]:
        asked.append(1)
        return [cand("old", 4, priority=10, last_used=NOW - 600)]

    def decide(needed_gb: float) -> Any:
        request = LoadRequest(
            slot="new",
            priority=50,
            needed=int(needed_gb * G),
            activated=True,
            model_id="m",
            model_known=True,
            breaker=Breaker(),
            max_failures=3,
        )
        sample = DeviceMemory("gpu", total_bytes=8 * G, free_bytes=2 * G, source="fake")
        device = DeviceFacts("gpu", admitted=4 * G, sample=sample, budget=None, margin=0)
        return decide_load(request, [device], candidates, NOW)

    fits = decide(1)
    assert fits.verdict == "load" and asked == []
    tight = decide(5)
    assert tight.verdict == "evict-then-load" and names(tight.victims) == ["old"]
    assert asked == [1]


# ----------------------------------------------------------------- replicas (issue 38)

replica_st = st.builds(
    lambda name, group, gb, prio, used, leases: cand(
        name, gb, priority=prio, last_used=used, leases=leases, replica_group=group
    ),
    name=st.sampled_from([f"s{i}" for i in range(10)]),
    group=st.sampled_from(["", "a", "b"]),
    gb=st.integers(1, 8),
    prio=st.sampled_from([10, 50]),
    used=st.floats(0, 9_000),
    leases=st.sampled_from([0, 0, 0, 1]),
)


@given(st.lists(replica_st, max_size=10, unique_by=lambda c: c.name), st.integers(1, 40))
def test_extra_replicas_go_before_any_last_copy_of_their_priority(
    candidates: list[EvictionCandidate], need_gb: int
) -> None:
    from controller.scheduling.eviction import with_replicas

    said = {c.name: c for c in with_replicas(candidates, NOW)}
    groups: dict[str, list[EvictionCandidate]] = {}
    for c in said.values():
        if c.replica_group:
            groups.setdefault(c.replica_group, []).append(c)
    for members in groups.values():  # some replica of each group is never an extra
        assert any(not m.extra for m in members)
    plan = plan_eviction(candidates, "gpu", need_gb * G, NOW)
    if not plan.sufficient:
        return
    victims = {v.name for v in plan.victims}
    for v in plan.victims:
        c = said[v.name]
        if c.extra:
            continue
        # a last copy (or a slot without replicas) was evicted: every eligible extra of
        # its priority went too, or was not needed (it was spared as the more valuable)
        spare = [
            e
            for e in said.values()
            if e.extra and e.priority == c.priority and is_eligible(e) and e.name not in victims
        ]
        freed_without_c = sum(x.bytes for x in plan.victims if x.name != c.name)
        assert not spare or freed_without_c + sum(e.bytes for e in spare) < need_gb * G


def test_an_extra_replica_goes_before_an_older_only_copy() -> None:
    cs = [
        cand("b", 8, last_used=100.0),
        cand("a", 8, last_used=5_000.0, replica_group="a"),
        cand("a-r1", 8, last_used=6_000.0, replica_group="a"),
    ]
    plan = plan_eviction(cs, "gpu", 8 * G, NOW)
    assert names(plan.victims) == ["a"]
    assert "an extra replica of a" in plan.victims[0].reason


def test_a_busy_replica_keeps_its_model_so_its_idle_siblings_are_extras() -> None:
    cs = [
        cand("a", 8, last_used=9_000.0, replica_group="a"),
        cand("a-r1", 8, leases=1, replica_group="a"),
        cand("b", 8, last_used=0.0),
    ]
    plan = plan_eviction(cs, "gpu", 8 * G, NOW)
    assert names(plan.victims) == ["a"]


def test_a_lower_priority_last_copy_still_goes_before_a_higher_priority_extra() -> None:
    cs = [
        cand("a", 8, priority=80, replica_group="a"),
        cand("a-r1", 8, priority=80, replica_group="a"),
        cand("b", 8, priority=10),
    ]
    assert names(plan_eviction(cs, "gpu", 8 * G, NOW).victims) == ["b"]
