"""Properties of the one eviction plan that chooses per victim (issue 22).

Two levels: the pure placement with host memory for sleepers (random GPUs, residents with
and without sleep, sleepers in host memory, host budgets), and the manager on FakeRuntime
+ FakeSleeper (random slots, priorities, providers that can sleep or not, pinned slots and
holds, host budgets), where every load's dry run is compared with what the load did.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.api.dryrun import plan_json
from controller.model.devices import GpuRef, share
from controller.model.errors import SlotctlError
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.scheduling.eviction import SLEEP, UNLOAD, EvictionCandidate, is_eligible
from controller.scheduling.fit import DeviceMemory
from controller.scheduling.placement import DeviceFacts, Need, place
from controller.spec.schema import ControllerSettings
from tests.unit.manager_fixtures import Harness, desired, events_of, model_spec, slot_spec

G = GIB
NOW = 10_000.0


@st.composite
def _hosts(
    draw: st.DrawFn,
) -> tuple[list[DeviceFacts], list[EvictionCandidate], Need, dict[str, int]]:
    sizes = draw(st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=3))
    keys = [f"gpu:{i}" for i in range(len(sizes))]
    admitted = dict.fromkeys(keys, 0)
    cands = []
    for n in range(draw(st.integers(0, 7))):
        gb = draw(st.integers(1, 12))
        asleep = draw(st.sampled_from([0, 0, 0, 1, 2]))
        common: dict[str, Any] = {
            "name": f"r{n}",
            "bytes": gb * G,
            "priority": draw(st.integers(0, 100)),
            "last_used": NOW - draw(st.integers(0, 1000)),
            "state": SlotState.IDLE
            if asleep
            else draw(st.sampled_from([SlotState.READY, SlotState.IDLE, SlotState.SERVING])),
            "pinned": draw(st.booleans()),
            "leases": draw(st.sampled_from([0, 0, 0, 1])),
            "busy": draw(st.sampled_from([False, False, True])),
            "load_s": draw(st.sampled_from([1.0, 5.0, 60.0])),
            "wake_s": draw(st.sampled_from([0.1, 0.5])),
        }
        if asleep:
            devices: tuple[str, ...] = ("cpu",) if asleep == 1 else ()
            cands.append(EvictionCandidate(devices=devices, asleep=asleep, **common))
            continue
        key = keys[draw(st.integers(0, len(keys) - 1))]
        level = draw(st.sampled_from([0, 1, 2]))
        cands.append(EvictionCandidate(devices=(key,), sleep_level=level, **common))
        admitted[key] += gb * G
    devices = [
        DeviceFacts(
            key,
            admitted[key],
            DeviceMemory(key, size * G, max(0, size * G - admitted[key]), "fake", i),
            None,
            0,
            gpu=GpuRef(i),
        )
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True))
    ]
    host = {"cpu": draw(st.integers(0, 40)) * G}
    need = Need("new", draw(st.integers(1, 24)) * G)
    return devices, cands, need, host


@settings(max_examples=400, deadline=None)
@given(host=_hosts())
def test_the_plan_never_overfills_a_device_or_the_host_and_spares_what_it_must(
    host: tuple[list[DeviceFacts], list[EvictionCandidate], Need, dict[str, int]],
) -> None:
    devices, cands, need, room = host
    placement = place(need, devices, lambda: cands, NOW, host=lambda: room)
    option = placement.option
    assert option is not None
    by_name = {c.name: c for c in cands}
    victims = option.victims
    assert len({v.name for v in victims}) == len(victims)
    for v in victims:  # pinned, leased and in-flight slots are never chosen
        c = by_name[v.name]
        assert is_eligible(c) and not c.pinned and c.leases == 0 and not c.busy, c
        assert v.action in (SLEEP, UNLOAD)
        if v.action == SLEEP:
            assert c.sleep_level and not c.asleep and v.level == c.sleep_level
    if not option.fits:
        assert victims == ()
        return
    # the device: the load fits once its victims are gone (asleep or unloaded alike)
    (facts,), (admission,) = option.devices, option.admissions
    freed = sum(by_name[v.name].on(facts.key) for v in victims)
    assert admission.needed <= min(admission.budget_room, admission.free_room) + freed
    # the host: never more held than it has room for; walk the victims in their order
    left = room["cpu"]
    for v in victims:
        c = by_name[v.name]
        if v.action == UNLOAD and c.asleep:
            left += c.host_bytes  # a sleeper unloaded: its host memory back
        elif v.action == SLEEP:
            assert c.host_bytes <= left, (v, left)
            left -= c.host_bytes
        elif c.sleep_level:  # could sleep, but host memory did not hold it then
            assert c.host_bytes > left, (v, left)
        assert left >= 0
    plan = option.plan  # None: it fits as it is
    assert plan is None or sum((plan.host or {}).values()) <= room["cpu"]


# ----------------------------------------------------------------- the manager


_slot = st.fixed_dictionaries(
    {
        "gb": st.sampled_from([2, 3, 4, 6]),
        "priority": st.sampled_from([10, 50, 90]),
        "sleep": st.sampled_from([True, True, False]),
        "level": st.sampled_from([1, 1, 2]),
        "pinned": st.sampled_from([False, False, False, True]),
        "cpu": st.sampled_from([False, False, False, True]),
    }
)


async def _run(
    tmp: Path, specs: list[dict[str, Any]], host_gb: int, ops: list[tuple[int, int]]
) -> None:
    h = Harness(tmp, gpu_gb=8)
    h.memory.totals["cpu"] = host_gb * G
    h.manager.settings = ControllerSettings(safety_margin_gb=0.0, host_margin_gb=0.0)
    names = [f"s{i}" for i in range(len(specs))]
    slots = [
        slot_spec(
            n,
            sleep=o["sleep"],
            sleep_level=o["level"],
            priority=o["priority"],
            pinned=o["pinned"],
            device="cpu" if o["cpu"] else "gpu",
        )
        for n, o in zip(names, specs, strict=True)
    ]
    models = [model_spec(f"{n}-m", o["gb"]) for n, o in zip(names, specs, strict=True)]
    m = h.manager
    await m.set_desired(desired(slots, models))
    held = set()
    for index, advance in ops:
        name = names[index % len(names)]
        h.clock.advance(advance)
        plan = plan_json(m.explain_load(name))
        sub = m.events.subscribe()
        try:
            await m.load(name, resident=False)
        except SlotctlError:
            assert plan["action"] in ("refuse", "none") or plan.get("wake"), plan
        else:
            if index == 7 and name not in held:  # a hold: in flight from now on
                await m.hold(name, 1e6)
                held.add(name)
        done = [(e.slot, e.details.get("action")) for e in events_of(sub, "eviction")]
        sub.close()
        if plan.get("action") in ("load", "evict-then-load"):
            assert done == [(v["slot"], v["action"]) for v in plan["evict"]], (plan, done)
        for e in done:
            assert e[0] not in held and not m.known(str(e[0])).pinned  # type: ignore[union-attr]
        for device in ("gpu:0", "cpu"):
            limit = 8 * G if device == "gpu:0" else host_gb * G
            assert m.admitted_bytes(device) <= limit, (device, [v for v in m.views()])
        for view in m.views():
            if view.residency == "asleep":
                assert view.state is SlotState.IDLE and not view.dispatchable
                assert h.runtime.sleeping.get(view.name) == view.sleep_level
    await m.stop_all()
    await m.close()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    specs=st.lists(_slot, min_size=2, max_size=6),
    host_gb=st.integers(0, 12),
    ops=st.lists(
        st.tuples(st.integers(0, 9), st.sampled_from([0, 5, 60])), min_size=1, max_size=16
    ),
)
def test_every_load_does_what_its_dry_run_said_within_both_budgets(
    tmp_path_factory: Any, specs: list[dict[str, Any]], host_gb: int, ops: list[tuple[int, int]]
) -> None:
    asyncio.run(_run(tmp_path_factory.mktemp("tier"), specs, host_gb, ops))


def test_share_of_a_spanning_sleeper_is_its_whole_memory_on_the_host() -> None:
    # A level-1 sleeper holds its weights once on its host, whatever it spans on GPUs.
    c = EvictionCandidate("tp", ("gpu:0", "gpu:1"), 8 * G, 50, 0.0, SlotState.READY, sleep_level=1)
    assert c.on("gpu:0") == share(8 * G, 2) and c.host_bytes == 8 * G
