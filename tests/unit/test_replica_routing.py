"""The routing among a slot's replicas (issue 38, item 4): the pure function
(:mod:`controller.router.prefix`) and its properties — the same prefix goes to the same
replica while that replica is under the bound, no replica above the bound is chosen while
another is below, warm before cold — and the prefix key a conversation keeps."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from controller.router.prefix import (
    ReplicaLoad,
    bound,
    prefix_key,
    rank_replicas,
    ring_order,
)

NAMES = [f"chat-r{i}" if i else "chat" for i in range(8)]

loads_st = st.lists(
    st.builds(
        ReplicaLoad,
        name=st.sampled_from(NAMES),
        in_flight=st.integers(0, 40),
        warm=st.booleans(),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda r: r.name,
)
keys_st = st.text(min_size=0, max_size=40)
factors_st = st.floats(1.0, 3.0)


@given(loads_st, keys_st, factors_st)
def test_every_replica_once_and_warm_before_cold(
    loads: list[ReplicaLoad], key: str, factor: float
) -> None:
    for routing in ("prefix", "least-loaded", "round-robin"):
        order = rank_replicas(loads, key, routing=routing, load_factor=factor, turn=3)
        assert sorted(order) == sorted(r.name for r in loads)
        warm = {r.name for r in loads if r.warm}
        assert [n in warm for n in order] == sorted((n in warm for n in order), reverse=True)


@given(loads_st, keys_st, factors_st)
def test_none_above_the_bound_while_another_is_below(
    loads: list[ReplicaLoad], key: str, factor: float
) -> None:
    warm = [r for r in loads if r.warm] or loads
    chosen = rank_replicas(loads, key, load_factor=factor)[0]
    cap = bound(warm, factor)
    by_name = {r.name: r for r in loads}
    # the least loaded is always under the bound, so the chosen one is too
    assert min(r.in_flight for r in warm) < cap
    assert by_name[chosen].in_flight < cap


@given(loads_st, keys_st, factors_st)
def test_the_same_prefix_goes_to_the_same_replica_while_under_the_bound(
    loads: list[ReplicaLoad], key: str, factor: float
) -> None:
    warm = [r for r in loads if r.warm]
    if not warm:
        return
    home = ring_order([r.name for r in warm], key)[0]
    home_load = next(r for r in warm if r.name == home)
    chosen = rank_replicas(loads, key, load_factor=factor)[0]
    if home_load.in_flight < bound(warm, factor):
        assert chosen == home
    else:
        assert chosen != home
    # and it does not depend on the order the replicas are listed in
    assert rank_replicas(list(reversed(loads)), key, load_factor=factor)[0] == chosen


@given(st.lists(st.sampled_from(NAMES), min_size=2, max_size=8, unique=True), keys_st)
def test_a_replica_going_away_moves_only_its_own_keys(names: list[str], key: str) -> None:
    """Consistent hashing: a key whose replica stays keeps it."""
    before = ring_order(names, key)[0]
    gone = names[-1]
    after = ring_order(names[:-1], key)[0]
    assert after == before or before == gone


def test_keys_spread_evenly_over_the_replicas() -> None:
    loads = [ReplicaLoad(n) for n in NAMES[:4]]
    counts = Counter(rank_replicas(loads, f"conversation {i}")[0] for i in range(4000))
    assert set(counts) == set(NAMES[:4])
    assert max(counts.values()) < 1.5 * 1000  # 64 virtual points each: within 50 %


def test_least_loaded_and_round_robin() -> None:
    loads = [ReplicaLoad("a", 3), ReplicaLoad("b", 1), ReplicaLoad("c", 2)]
    assert rank_replicas(loads, "k", routing="least-loaded") == ["b", "c", "a"]
    turns = [rank_replicas(loads, "k", routing="round-robin", turn=t)[0] for t in range(4)]
    assert turns == ["a", "b", "c", "a"]


def test_a_cold_replica_only_when_none_is_warm() -> None:
    loads = [ReplicaLoad("a", 9, warm=True), ReplicaLoad("b", 0, warm=False)]
    assert rank_replicas(loads, "k")[0] == "a"
    assert rank_replicas([ReplicaLoad("b", 0, warm=False)], "k") == ["b"]


def test_a_conversation_keeps_its_prefix_key_from_turn_to_turn() -> None:
    system = {"role": "system", "content": "You are terse."}
    first = {"role": "user", "content": "Plan a trip to Lyon."}
    turn1 = {"messages": [system, first]}
    turn2 = {
        "messages": [
            system,
            first,
            {"role": "assistant", "content": "Sure: day one..."},
            {"role": "user", "content": "And day two?"},
        ]
    }
    other = {"messages": [system, {"role": "user", "content": "Plan a trip to Oslo."}]}
    assert prefix_key(turn1, "m") == prefix_key(turn2, "m")
    assert prefix_key(turn1, "m") != prefix_key(other, "m")
    assert prefix_key(turn1, "m") != prefix_key(turn1, "m-lora")  # an adapter's own
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prefix_key(parts, "m") == prefix_key(
        {"messages": [{"role": "user", "content": "hi"}]}, "m"
    )
    assert prefix_key({"prompt": "abc"}, "m") == prefix_key({"prompt": ["abc", "x"]}, "m")
    assert prefix_key({"input": "abc"}, "m") == prefix_key({"prompt": "abc"}, "m")


# ----------------------------------------------------------------- over the manager


async def test_the_routed_call_orders_a_slots_replicas_by_its_routing(tmp_path: Path) -> None:
    from controller.router.replicas import route_replicas
    from controller.router.selection import serving
    from controller.spec.replicas import replica_specs
    from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec

    h = Harness(tmp_path, gpu_gb=48)
    m = h.manager
    base = slot_spec("chat", "m", replicas=3)
    other = slot_spec("solo", "s")
    await m.set_desired(
        desired([base, *replica_specs(base), other], [model_spec("m"), model_spec("s")])
    )
    for name in ("chat", "chat-r1", "chat-r2", "solo"):
        await m.load(name)

    def body(first: str, *more: str) -> bytes:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": first}]
        messages += [{"role": "user", "content": x} for x in more]
        return json.dumps({"model": "m", "messages": messages}).encode()

    def route(data: bytes, content_type: str = "application/json") -> list[str]:
        return route_replicas(m, serving(m, "m"), "m", content_type, data)

    first = route(body("plan Lyon"))
    assert sorted(first) == ["chat", "chat-r1", "chat-r2"]
    assert route(body("plan Lyon", "and day two?", "and three?"))[0] == first[0]  # sticky
    homes = {route(body(f"plan trip {i}"))[0] for i in range(30)}
    assert homes == {"chat", "chat-r1", "chat-r2"}  # conversations spread
    # the home replica past the bound: the next one under it takes the request
    held = [await m.acquire(first[0]) for _ in range(3)]
    assert route(body("plan Lyon"))[0] != first[0]
    for lease in held:
        m.release(lease)
    # nothing to hash (a form upload): the least loaded
    lease = await m.acquire("chat")
    assert route(b"--x--", "multipart/form-data; boundary=x")[0] != "chat"
    m.release(lease)
    # a model served by one slot: left as ranked
    assert route_replicas(m, ["solo"], "s", "application/json", b"{}") == ["solo"]
