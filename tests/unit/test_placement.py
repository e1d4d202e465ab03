"""Placement on a multi-GPU host (the pure filter -> score -> choose, and decide_load).

Each GPU is its own device: a load goes where it fits without evicting anything, best fit
first (the least room left), ties to the lower index; a slot spanning K GPUs needs its
share on each of K; a pinned slot goes where it is pinned or is refused with the reason;
evictions free memory only on the GPUs the load will use.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.model.devices import GpuRef, share
from controller.model.errors import DeviceUnavailable, InsufficientMemory, SlotConfigError
from controller.model.lifecycle import SlotState
from controller.scheduling.breaker import Breaker
from controller.scheduling.decision import LoadRequest, decide_load
from controller.scheduling.eviction import EvictionCandidate, is_eligible
from controller.scheduling.fit import DeviceMemory
from controller.scheduling.placement import DeviceFacts, Need, place

G = 1024**3
NOW = 10_000.0


def gpu(index: int, total_gb: float, *, admitted_gb: float = 0.0, **kw: Any) -> DeviceFacts:
    """A probed GPU whose free memory is what slotctl has not admitted."""
    total, admitted = int(total_gb * G), int(admitted_gb * G)
    sample = DeviceMemory(f"gpu:{index}", total, total - admitted, "fake", index, f"GPU-{index}")
    data: dict[str, Any] = {
        "key": f"gpu:{index}",
        "admitted": admitted,
        "sample": sample,
        "budget": None,
        "margin": 0,
        "gpu": GpuRef(index, f"GPU-{index}", "nvidia"),
    }
    data.update(kw)
    return DeviceFacts(**data)


def resident(name: str, gb: float, devices: tuple[str, ...], **kw: Any) -> EvictionCandidate:
    data: dict[str, Any] = {
        "name": name,
        "devices": devices,
        "bytes": int(gb * G),
        "priority": 50,
        "last_used": NOW - 600,
        "state": SlotState.READY,
    }
    data.update(kw)
    return EvictionCandidate(**data)


def chosen(placement: Any) -> list[str]:
    return list(placement.devices)


def test_best_fit_picks_the_gpu_left_with_the_least_room() -> None:
    devices = [gpu(0, 24, admitted_gb=4), gpu(1, 24, admitted_gb=12)]  # 20 and 12 free
    placement = place(Need("s", 10 * G), devices, lambda: (), NOW)
    assert chosen(placement) == ["gpu:1"]  # 2 GiB left there against 10 on gpu:0


def test_ties_go_to_the_lower_index() -> None:
    devices = [gpu(0, 24), gpu(1, 24), gpu(2, 24)]
    assert chosen(place(Need("s", 8 * G), devices, lambda: (), NOW)) == ["gpu:0"]


def test_best_fit_keeps_the_big_hole_for_the_big_model() -> None:
    """Two 8 GiB loads then a 20 GiB one on 2 x 24 GiB: best fit stacks the small ones on
    one GPU, so the big one still fits on the other (first fit by free memory would have
    spread them and refused it)."""
    devices = [gpu(0, 24), gpu(1, 24)]
    admitted = {0: 0.0, 1: 0.0}
    for _ in range(2):
        facts = [gpu(i, 24, admitted_gb=admitted[i]) for i in (0, 1)]
        (key,) = chosen(place(Need("small", 8 * G), facts, lambda: (), NOW))
        admitted[int(key[4:])] += 8
    assert sorted(admitted.values()) == [0.0, 16.0]
    facts = [gpu(i, 24, admitted_gb=admitted[i]) for i in (0, 1)]
    assert place(Need("big", 20 * G), facts, lambda: (), NOW).option.fits  # type: ignore[union-attr]
    first_fit_spread = [gpu(0, 24, admitted_gb=8), gpu(1, 24, admitted_gb=8)]
    assert not place(Need("big", 20 * G), first_fit_spread, lambda: (), NOW).option.fits  # type: ignore[union-attr]
    assert len(devices) == 2


def test_a_load_that_fits_somewhere_never_evicts() -> None:
    devices = [gpu(0, 24, admitted_gb=20), gpu(1, 24, admitted_gb=16)]
    asked: list[int] = []

    def candidates() -> list[EvictionCandidate]:
        asked.append(1)
        return [resident("old", 20, ("gpu:0",), priority=0)]

    placement = place(Need("s", 6 * G), devices, candidates, NOW)
    assert chosen(placement) == ["gpu:1"] and placement.option is not None
    assert placement.option.victims == () and asked == []  # the list is not even built


def test_eviction_frees_memory_only_on_the_gpu_the_load_uses() -> None:
    """gpu:0 holds a priority-10 slot, gpu:1 a priority-40 one: the load goes to gpu:0 and
    evicts there; the slot on gpu:1 is never touched."""
    devices = [gpu(0, 24, admitted_gb=20), gpu(1, 24, admitted_gb=20)]
    cands = [
        resident("low", 20, ("gpu:0",), priority=10),
        resident("mid", 20, ("gpu:1",), priority=40),
    ]
    placement = place(Need("s", 16 * G), devices, lambda: cands, NOW)
    assert chosen(placement) == ["gpu:0"]
    assert placement.option is not None
    assert [v.name for v in placement.option.victims] == ["low"]
    assert placement.option.victims[0].devices == ("gpu:0",)


def test_a_span_needs_its_share_on_each_gpu() -> None:
    devices = [gpu(0, 24, admitted_gb=15), gpu(1, 24, admitted_gb=2), gpu(2, 24, admitted_gb=4)]
    placement = place(Need("tp", 20 * G, span=2), devices, lambda: (), NOW)
    assert chosen(placement) == ["gpu:1", "gpu:2"]  # 10 GiB each; gpu:0 has only 9 free
    assert placement.option is not None
    assert [a.needed for a in placement.option.admissions] == [10 * G, 10 * G]
    assert [g.index for g in placement.gpus] == [1, 2]


def test_a_span_evicts_on_its_gpus_only_and_counts_a_spanning_victim_on_both() -> None:
    devices = [gpu(0, 16, admitted_gb=16), gpu(1, 16, admitted_gb=16), gpu(2, 16, admitted_gb=8)]
    cands = [
        resident("pair", 32, ("gpu:0", "gpu:1"), priority=10),  # 16 GiB on each
        resident("third", 8, ("gpu:2",), priority=60),
    ]
    placement = place(Need("tp", 24 * G, span=2), devices, lambda: cands, NOW)
    assert chosen(placement) == ["gpu:0", "gpu:1"]
    assert placement.option is not None
    assert [v.name for v in placement.option.victims] == ["pair"]


def test_pins_by_index_and_by_uuid() -> None:
    devices = [gpu(0, 24), gpu(1, 24), gpu(2, 24)]
    assert chosen(place(Need("s", G, pins=("2",)), devices, lambda: (), NOW)) == ["gpu:2"]
    by_uuid = place(Need("s", 2 * G, span=2, pins=("GPU-1", "0")), devices, lambda: (), NOW)
    assert chosen(by_uuid) == ["gpu:1", "gpu:0"]


def test_a_pin_to_a_gpu_the_host_does_not_have_is_refused_with_the_figures() -> None:
    placement = place(Need("s", G, pins=("5",)), [gpu(0, 24), gpu(1, 12)], lambda: (), NOW)
    error = placement.error
    assert isinstance(error, DeviceUnavailable) and placement.option is None
    assert error.details["reason"] == "not_found" and error.details["device"] == "5"
    assert "gpu:0, gpu:1" in error.message
    assert [g["total_bytes"] for g in error.details["gpus"]] == [24 * G, 12 * G]


def test_a_lost_gpu_is_never_chosen_and_a_pin_to_it_says_why() -> None:
    lost = gpu(1, 0, sample=None, lost="NVML: GPU is lost")
    devices = [gpu(0, 24, admitted_gb=20), lost, gpu(2, 24)]
    assert chosen(place(Need("s", 8 * G), devices, lambda: (), NOW)) == ["gpu:2"]
    refused = place(Need("s", G, pins=("1",)), devices, lambda: (), NOW)
    assert isinstance(refused.error, DeviceUnavailable)
    assert refused.error.details["reason"] == "lost" and "GPU is lost" in refused.error.message
    too_many = place(Need("s", G, span=3), devices, lambda: (), NOW)
    assert isinstance(too_many.error, DeviceUnavailable)
    assert too_many.error.details["reason"] == "too_few"
    assert "the host has 2" in too_many.error.message


def test_one_gpu_pinned_twice_by_index_and_uuid_is_a_config_error() -> None:
    devices = [gpu(0, 24), gpu(1, 24, admitted_gb=14)]
    placement = place(Need("s", 16 * G, span=2, pins=("1", "GPU-1")), devices, lambda: (), NOW)
    assert isinstance(placement.error, SlotConfigError) and placement.option is None
    assert placement.error.keys == ["device"] and "gpu:1 twice" in placement.error.message


def test_a_big_host_never_leaves_its_empty_gpus_out() -> None:
    """12 GPUs, the first two full, a span of 4: C(12, 4) = 495 sets are more than are
    scored, but the sets scored are those of the GPUs that suit the load best."""
    devices = [gpu(i, 24, admitted_gb=24 if i < 2 else 0) for i in range(12)]
    placement = place(Need("tp", 40 * G, span=4), devices, lambda: (), NOW)
    assert placement.option is not None and placement.option.fits
    assert chosen(placement) == ["gpu:2", "gpu:3", "gpu:4", "gpu:5"]
    sixteen = [gpu(i, 80, admitted_gb=70 if i == 0 else 0) for i in range(16)]
    assert chosen(place(Need("tp", 4 * 30 * G, span=4), sixteen, lambda: (), NOW)) == [
        "gpu:1",
        "gpu:2",
        "gpu:3",
        "gpu:4",
    ]


def test_the_chosen_gpus_carry_their_memory() -> None:
    devices = [gpu(0, 24), gpu(1, 48, budget=40 * G)]
    placement = place(Need("s", 30 * G), devices, lambda: (), NOW)
    (only,) = placement.gpus
    assert (only.index, only.total_bytes) == (1, 40 * G)  # the budget is what is admitted


def test_more_gpus_than_the_host_has_is_refused() -> None:
    placement = place(Need("s", G, span=4), [gpu(0, 24), gpu(1, 24)], lambda: (), NOW)
    assert isinstance(placement.error, DeviceUnavailable)
    assert placement.error.details["reason"] == "too_few"


def _request(slot: str, gb: float, **kw: Any) -> LoadRequest:
    data: dict[str, Any] = {
        "slot": slot,
        "priority": 50,
        "needed": int(gb * G),
        "activated": True,
        "model_id": "m",
        "model_known": True,
        "breaker": Breaker(),
        "max_failures": 3,
    }
    data.update(kw)
    return LoadRequest(**data)


def test_gpus_all_taken_by_pinned_slots_is_refused_with_figures_per_gpu() -> None:
    devices = [gpu(0, 24, admitted_gb=20), gpu(1, 24, admitted_gb=22)]
    cands = [
        resident("a", 20, ("gpu:0",), pinned=True),
        resident("b", 22, ("gpu:1",), pinned=True),
    ]
    decision = decide_load(_request("new", 8), devices, lambda: cands, NOW)
    error = decision.error
    assert decision.verdict == "refuse" and isinstance(error, InsufficientMemory)
    figures = {f["device"]: f for f in error.details["gpus"]}
    assert figures["gpu:0"]["free_bytes"] == 4 * G and figures["gpu:1"]["free_bytes"] == 2 * G
    assert figures["gpu:0"]["evictable_bytes"] == 0 == figures["gpu:1"]["evictable_bytes"]
    assert "gpu:0 4.00 GiB free" in error.message and "on one GPU" in error.message


def test_one_gpu_box_decides_as_before() -> None:
    """A host with one GPU: the same verdicts, victims and figures as one ``gpu`` device."""
    devices = [gpu(0, 24, admitted_gb=20)]
    cands = [resident("old", 20, ("gpu:0",), priority=10)]
    fits = decide_load(_request("s", 4), devices, lambda: cands, NOW)
    assert fits.verdict == "load" and fits.devices == ("gpu:0",)
    tight = decide_load(_request("s", 8), devices, lambda: cands, NOW)
    assert tight.verdict == "evict-then-load" and [v.name for v in tight.victims] == ["old"]
    big = decide_load(_request("s", 30), devices, lambda: cands, NOW)
    assert isinstance(big.error, InsufficientMemory)
    assert big.error.details["needed_bytes"] == 30 * G
    assert big.error.details["evictable_bytes"] == 20 * G
    assert "gpus" not in big.error.details  # one device: the one-device message and figures


# ----------------------------------------------------------------- properties

_gpu_sizes = st.lists(st.sampled_from([8, 12, 16, 24, 48, 80]), min_size=1, max_size=4)


@st.composite
def _hosts(draw: st.DrawFn) -> tuple[list[DeviceFacts], list[EvictionCandidate], Need]:
    sizes = draw(_gpu_sizes)
    margin = int(draw(st.sampled_from([0.0, 0.5])) * G)
    budgets = [draw(st.sampled_from([None, int(s * 0.75) * G])) for s in sizes]
    keys = [f"gpu:{i}" for i in range(len(sizes))]
    admitted = dict.fromkeys(keys, 0)
    cands = []
    for n in range(draw(st.integers(0, 6))):
        span = draw(st.integers(1, len(keys)))
        start = draw(st.integers(0, len(keys) - span))
        on = tuple(keys[start : start + span])
        gb = draw(st.integers(1, 20))
        cands.append(
            resident(
                f"r{n}",
                gb,
                on,
                priority=draw(st.integers(0, 100)),
                last_used=NOW - draw(st.integers(0, 1000)),
                pinned=draw(st.booleans()),
                leases=draw(st.sampled_from([0, 0, 1])),
            )
        )
        for key in on:
            admitted[key] += share(gb * G, span)
    devices = [
        DeviceFacts(
            key,
            admitted[key],
            DeviceMemory(key, size * G, max(0, size * G - admitted[key]), "fake", i),
            budgets[i],
            margin,
            gpu=GpuRef(i),
        )
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True))
    ]
    span = draw(st.integers(1, len(keys) + 1))
    need = Need("new", draw(st.integers(1, 40)) * G, span=span)
    return devices, cands, need


@settings(max_examples=300, deadline=None)
@given(host=_hosts())
def test_placement_properties(
    host: tuple[list[DeviceFacts], list[EvictionCandidate], Need],
) -> None:
    """Whatever the host: a chosen set fits on every GPU once its victims are gone, every
    victim holds memory on the chosen GPUs and is eligible (never pinned, never leased), a
    set that fits without eviction is preferred, and a refusal means no set fits."""
    devices, cands, need = host
    placement = place(need, devices, lambda: cands, NOW)
    if need.span > len(devices):
        assert isinstance(placement.error, DeviceUnavailable)
        return
    option = placement.option
    assert option is not None and len(option.devices) == need.span
    by_name = {c.name: c for c in cands}
    victims = [by_name[v.name] for v in option.victims]
    keys = {d.key for d in option.devices}
    for victim in victims:
        assert is_eligible(victim) and not victim.pinned and victim.leases == 0
        assert keys & set(victim.devices), (victim, keys)
    if not option.fits:
        assert all(not o.fits for o in placement.tried)
        return
    for facts, admission in zip(option.devices, option.admissions, strict=True):
        freed = sum(v.on(facts.key) for v in victims)
        room = min(admission.budget_room, admission.free_room) + freed
        assert admission.needed <= room, (facts.key, admission, freed)
        assert admission.needed == share(need.bytes, need.span)
    if option.victims:  # it evicts only when no set fits as it is
        assert not any(all(a.ok for a in o.admissions) for o in placement.tried)


@pytest.mark.parametrize("span", [1, 2, 3])
def test_placement_is_deterministic(span: int) -> None:
    devices = [gpu(0, 24, admitted_gb=3), gpu(1, 24, admitted_gb=3), gpu(2, 24, admitted_gb=3)]
    first = chosen(place(Need("s", 6 * G, span=span), devices, lambda: (), NOW))
    for _ in range(5):
        assert chosen(place(Need("s", 6 * G, span=span), devices, lambda: (), NOW)) == first
    assert first == [f"gpu:{i}" for i in range(span)]
