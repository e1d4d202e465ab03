"""Replicas of one model on one box (issue 38): the schema's typed checks, the desired
state's expansion into replica slots (named ``<slot>-r<i>``), their placement across GPUs,
residency that knows replicas, and the manager's view of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from controller.model.errors import SlotctlError
from controller.model.events import EventKind
from controller.model.lifecycle import SlotState
from controller.reconcile.apply import apply_to_config
from controller.spec.desired import DesiredCache
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.replicas import replica_name, replica_specs
from controller.spec.rules import SlotEntry, check_slot_payload, cross_slot_problems
from controller.spec.schema import SlotSpec
from controller.spec.sources import DesiredChange
from tests.unit.manager_fixtures import events_of, model_spec, settle, slot_spec
from tests.unit.test_multigpu import Host

S = SlotState


def spec(**kw: Any) -> SlotSpec:
    data: dict[str, Any] = {"name": "chat", "provider": "demo", "model": {"default": "m"}}
    data.update(kw)
    return SlotSpec.model_validate(data)


# ----------------------------------------------------------------- the schema


def test_replicas_set_both_bounds_and_min_max_scale_between() -> None:
    assert (spec().min_count, spec().max_count, spec().replica_group) == (1, 1, "")
    fixed = spec(replicas=3)
    assert (fixed.min_count, fixed.max_count, fixed.replica_group) == (3, 3, "chat")
    ranged = spec(min_replicas=1, max_replicas=4, max_concurrency=2)
    assert (ranged.min_count, ranged.max_count) == (1, 4)
    assert (ranged.routing, ranged.load_factor, ranged.replica_placement) == (
        "prefix",
        1.25,
        "spread",
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"replicas": 2, "max_replicas": 3}, "not both"),
        ({"min_replicas": 3, "max_replicas": 2, "max_concurrency": 1}, "above max_replicas"),
        ({"min_replicas": 1, "max_replicas": 2}, "max_concurrency"),
        ({"replicas": 2, "device": "gpu:0"}, 'replica_placement = "share"'),
        ({"replicas": 2, "device": "npu"}, "npu"),
        ({"replicas": 2, "unit": "u"}, "unit"),
        ({"name": "a" * 61, "replicas": 2}, "too long"),
        ({"replicas": 17}, "less than or equal to 16"),
        ({"routing": "random"}, "prefix"),
        ({"load_factor": 0.5}, "greater than or equal to 1"),
    ],
)
def test_bad_replica_settings_are_refused_with_their_reason(
    extra: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError, match=says.replace("(", r"\(")):
        spec(**extra)


def test_a_pinned_gpu_is_shared_by_replicas_only_when_asked() -> None:
    shared = spec(replicas=2, device="gpu:0", replica_placement="share")
    assert [r.device for r in replica_specs(shared)] == ["gpu:0"]


def test_a_source_cannot_set_what_the_expansion_sets() -> None:
    check = check_slot_payload(
        {"name": "x", "provider": "demo", "model": {"default": "m"}, "replica_of": "chat"}
    )
    assert check.spec is None
    assert [p.code for p, _ in check.errors] == ["slot.replica_internal"]


def test_a_declared_slot_may_not_take_a_replicas_name() -> None:
    entries = [SlotEntry(spec(replicas=3, port=9000)), SlotEntry(spec(name="chat-r2"))]
    problems = cross_slot_problems(entries, None)
    assert [p.code for p in problems] == ["slot.replica_name_taken"]
    assert problems[0].slot == "chat-r2" and "replica 2 of slot 'chat'" in problems[0].message


# ----------------------------------------------------------------- the expansion


def test_replica_names_are_dns_labels_and_the_first_keeps_the_slots_name() -> None:
    assert [replica_name("chat", i) for i in range(3)] == ["chat", "chat-r1", "chat-r2"]
    base = spec(min_replicas=2, max_replicas=3, max_concurrency=1, autoload=True, pinned=True)
    base = base.model_copy(update={"port": 9000})
    out = replica_specs(base)
    assert [(r.name, r.replica_of, r.replica_index) for r in out] == [
        ("chat-r1", "chat", 1),
        ("chat-r2", "chat", 2),
    ]
    # below the minimum: the slot's autoload and pinned (a pinned slot pins its minimum);
    # above it: loaded by demand, never pinned; every replica after the first: its own port
    assert [(r.autoload, r.pinned, r.port) for r in out] == [
        (True, True, None),
        (False, False, None),
    ]
    assert all(r.replica_group == "chat" for r in out) and not replica_specs(out[0])
    assert "replica_of" not in out[0].model_dump()  # never written to a stack file


def declare(config: Path, *slots: SlotSpec) -> None:
    models = {s.model_id for s in slots}
    apply_to_config(
        DesiredState(
            stacks=("t",),
            models={m: model_spec(m) for m in models},
            slots={s.name: DesiredSlot(spec=s, stack="t") for s in slots},
        ),
        config,
        prune=True,
    )


def test_the_desired_state_publishes_a_slots_replicas_and_takes_them_back(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config"
    declare(config, slot_spec("chat", "m", replicas=3, autoload=False, port=18901))
    cache = DesiredCache(config)
    assert set(cache.snapshot.slots) == {"chat", "chat-r1", "chat-r2"}
    assert cache.snapshot.slots["chat-r2"].spec.replica_of == "chat"
    assert cache.snapshot.slots["chat-r2"].stack == "t"
    heard: list[DesiredChange] = []
    cache.subscribe(heard.append)
    declare(config, slot_spec("chat", "m", replicas=2, autoload=False, port=18901))
    cache.refresh()
    assert set(cache.snapshot.slots) == {"chat", "chat-r1"}
    # the change names the slot and every replica it had or has: the reconciler removes
    # chat-r2 and applies the new spec to chat-r1
    assert heard[-1].slots == {"chat", "chat-r1", "chat-r2"}
    declare(config, slot_spec("chat", "m", autoload=False, port=18901))
    cache.refresh()
    assert set(cache.snapshot.slots) == {"chat"} and heard[-1].slots == {"chat", "chat-r1"}


# ----------------------------------------------------------------- placement


def _group(base: SlotSpec) -> list[SlotSpec]:
    return [base, *replica_specs(base)]


async def test_replicas_spread_across_gpus_before_sharing_one(tmp_path: Path) -> None:
    """Best fit alone would stack both 8 GiB replicas on GPU 0 (the least room left);
    spread puts the sibling on GPU 1, and a third (two GPUs, both hold one) shares."""
    host = Host(tmp_path, [24, 24])
    await host.declare(_group(slot_spec("chat", "m", replicas=3)), [model_spec("m", 8)])
    for name in ("chat", "chat-r1", "chat-r2"):
        await host.manager.load(name)
    assert (host.gpus_of("chat"), host.gpus_of("chat-r1")) == ((0,), (1,))
    assert host.gpus_of("chat-r2") in ((0,), (1,))  # nothing else fits: a sibling's GPU
    assert [g.index for g in host.visible("chat-r1")] == [1]
    views = {v.name: v for v in host.manager.views()}
    assert (views["chat-r1"].replica_of, views["chat-r1"].replica_index) == ("chat", 1)
    assert (views["chat"].replica_of, views["chat"].replica_index) == ("chat", 0)


async def test_replicas_share_a_gpu_when_asked(tmp_path: Path) -> None:
    host = Host(tmp_path, [24, 24])
    base = slot_spec("chat", "m", replicas=2, replica_placement="share")
    await host.declare(_group(base), [model_spec("m", 8)])
    await host.manager.load("chat")
    await host.manager.load("chat-r1")
    assert host.gpus_of("chat") == host.gpus_of("chat-r1") == (0,)  # best fit


async def test_a_sibling_shares_a_gpu_rather_than_evict_another_model(tmp_path: Path) -> None:
    host = Host(tmp_path, [24, 24])
    slots = [*_group(slot_spec("chat", "m", replicas=2)), slot_spec("other", "o")]
    await host.declare(slots, [model_spec("m", 8), model_spec("o", 20)])
    await host.manager.load("chat")
    await host.manager.load("other")  # GPU 1: GPU 0 has 16 GiB left
    await host.manager.load("chat-r1")
    assert host.gpus_of("other") == (1,) and host.gpus_of("chat-r1") == (0,)
    assert host.manager.view("other").state is S.READY  # nothing evicted for a sibling


# ----------------------------------------------------------------- residency


async def test_a_second_copy_goes_before_another_models_only_copy(tmp_path: Path) -> None:
    """One 24 GiB GPU: two replicas of A (8 GiB each) and one B (8 GiB) fill it; C needs
    8 GiB. Every slot has the same priority and B is the least recently used: plain LRU
    would evict B, the only copy of its model; an extra replica of A goes instead, and
    the dry run says which and why."""
    host = Host(tmp_path, [24])
    slots = [*_group(slot_spec("a", "ma", replicas=2)), slot_spec("b", "mb"), slot_spec("c", "mc")]
    await host.declare(slots, [model_spec(m, 8) for m in ("ma", "mb", "mc")])
    await host.manager.load("b")
    host.clock.advance(10)
    await host.manager.load("a")
    await host.manager.load("a-r1")
    host.clock.advance(10)
    plan = await host.manager.explain("c")
    assert [v.slot for v in plan.victims] in (["a"], ["a-r1"])
    assert "an extra replica of a" in plan.victims[0].reason
    sub = host.manager.events.subscribe()
    await host.manager.load("c")
    await settle(host.manager)
    evicted = [e.slot for e in events_of(sub, EventKind.EVICTION)]
    assert evicted in (["a"], ["a-r1"]) and host.manager.view("b").state is S.READY
    assert {host.manager.view(n).state for n in ("a", "a-r1")} == {S.READY, S.OFFLINE}


async def test_a_pinned_slot_pins_its_minimum_not_its_maximum(tmp_path: Path) -> None:
    host = Host(tmp_path, [24])
    base = slot_spec("a", "ma", min_replicas=1, max_replicas=2, max_concurrency=1, pinned=True)
    await host.declare(
        [*_group(base), slot_spec("c", "mc")], [model_spec(m, 12) for m in ("ma", "mc")]
    )
    await host.manager.load("a")
    await host.manager.load("a-r1")
    plan = await host.manager.explain("c")
    assert [v.slot for v in plan.victims] == ["a-r1"]  # replica 0 is pinned, 1 is not
    await host.manager.load("c")
    assert host.manager.view("a").state is S.READY
    assert host.manager.view("a-r1").state is S.OFFLINE


async def test_a_load_that_would_evict_the_pinned_minimum_is_refused(tmp_path: Path) -> None:
    host = Host(tmp_path, [24])
    base = slot_spec("a", "ma", replicas=2, pinned=True)
    await host.declare(
        [*_group(base), slot_spec("c", "mc")], [model_spec(m, 12) for m in ("ma", "mc")]
    )
    await host.manager.load("a")
    await host.manager.load("a-r1")
    with pytest.raises(SlotctlError):
        await host.manager.load("c")


# ----------------------------------------------------------------- the reconciler


async def test_the_reconciler_runs_each_replica_through_the_lifecycle(tmp_path: Path) -> None:
    from controller.reconcile.reconciler import Reconciler
    from tests.unit.manager_fixtures import Harness

    config = tmp_path / "config"
    declare(config, slot_spec("chat", "m", replicas=2, autoload=True, port=18911))
    h = Harness(tmp_path)
    reconciler = Reconciler(h.manager, config, desired=DesiredCache(config))
    await reconciler.refresh_async()
    for name in sorted(reconciler.snapshot.slots):
        await reconciler.reconcile(name)
    await settle(h.manager)
    m = h.manager
    assert {n: m.view(n).state for n in ("chat", "chat-r1")} == {
        "chat": S.READY,
        "chat-r1": S.READY,
    }
    assert m.view("chat").endpoint != m.view("chat-r1").endpoint  # each its own port
    declare(config, slot_spec("chat", "m", autoload=True, port=18911))
    await reconciler.refresh_async()
    assert reconciler.queue.is_dirty("chat-r1")
    await reconciler.reconcile("chat-r1")
    await reconciler.reconcile("chat")
    assert m.known("chat-r1") is None and m.view("chat").state is S.READY


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=5))
def test_the_cache_kept_key_by_key_equals_a_fresh_read(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[int, int]]
) -> None:
    """However the replica counts change, the snapshot kept up to date change by change
    is the one a fresh read builds, and each change names every replica that came or
    went."""
    config = tmp_path_factory.mktemp("cache") / "config"
    declare(config, slot_spec("a", "m", autoload=False, port=18921))
    cache = DesiredCache(config)
    heard: list[DesiredChange] = []
    cache.subscribe(heard.append)
    for a, b in steps:
        before = set(cache.snapshot.slots)
        declare(
            config,
            slot_spec("a", "m", replicas=a, autoload=False, port=18921),
            slot_spec("b", "m", replicas=b, autoload=False, port=18922),
        )
        heard.clear()
        cache.refresh()
        after = set(cache.snapshot.slots)
        assert after == set(DesiredCache(config).snapshot.slots)
        named = set().union(*(c.slots for c in heard)) if heard else set()
        assert before ^ after <= named
