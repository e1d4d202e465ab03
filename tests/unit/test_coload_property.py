"""Properties of co-loaded units on the manager (FakeRuntime + FakeSleeper, docs/design/0013).

Random slots (sizes, priorities, units, servers that can sleep or not) on one 8 GiB GPU, and
random sequences of loads and unloads. After every operation:

- a load that succeeded for a member that was not loaded left every member of its unit
  loaded; a load that was refused left every member that was not loaded still not loaded
  (all or nothing);
- no eviction took a member of the unit being loaded;
- a unit member evicted took every loaded mate with it (none of its mates stays loaded);
- the GPU's admitted memory stays within its size.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.model.errors import SlotctlError
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.slots.manager import SlotManager
from controller.spec.schema import ControllerSettings
from tests.unit.manager_fixtures import Harness, desired, events_of, model_spec, settle, slot_spec

S = SlotState

_slot = st.fixed_dictionaries(
    {
        "gb": st.sampled_from([1, 2, 3, 4]),
        "priority": st.sampled_from([10, 50, 90]),
        "unit": st.sampled_from([None, "u1", "u1", "u2", "u2"]),
        "sleep": st.sampled_from([False, False, True]),
    }
)


def _loaded(m: SlotManager, name: str) -> bool:
    view = m.view(name)
    return view.dispatchable and view.residency == "awake"


async def _run(tmp: Path, specs: list[dict[str, Any]], ops: list[tuple[int, int, bool]]) -> None:
    h = Harness(tmp, gpu_gb=8)
    h.manager.settings = ControllerSettings(safety_margin_gb=0.0, host_margin_gb=0.0)
    names = [f"s{i}" for i in range(len(specs))]
    unit = {n: o["unit"] for n, o in zip(names, specs, strict=True)}
    slots = [
        slot_spec(n, priority=o["priority"], unit=o["unit"], sleep=o["sleep"])
        for n, o in zip(names, specs, strict=True)
    ]
    models = [model_spec(f"{n}-m", o["gb"]) for n, o in zip(names, specs, strict=True)]
    m = h.manager
    await m.set_desired(desired(slots, models))
    for index, advance, unload in ops:
        name = names[index % len(names)]
        h.clock.advance(advance)
        mates = [n for n in names if unit[name] is not None and unit[n] == unit[name]]
        members = mates or [name]
        before = {n: _loaded(m, n) for n in names}
        sub = m.events.subscribe()
        if unload:
            await m.unload(name)
        else:
            try:
                await m.load(name, resident=False)
            except SlotctlError:
                for n in members:
                    if not before[n]:
                        assert not _loaded(m, n), (name, n, m.views())
            else:
                if not before[name]:
                    assert all(_loaded(m, n) for n in members), (name, m.views())
        await settle(m)
        evicted = [str(e.slot) for e in events_of(sub, "eviction")]
        sub.close()
        if not unload:
            assert not set(evicted) & set(mates), (name, evicted)
        for victim in evicted:
            if unit[victim] is not None:
                left = [n for n in names if unit[n] == unit[victim] and _loaded(m, n)]
                assert left == [], (victim, left)
        assert m.admitted_bytes("gpu:0") <= 8 * GIB
    await m.stop_all()
    await m.close()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    specs=st.lists(_slot, min_size=2, max_size=6),
    ops=st.lists(
        st.tuples(
            st.integers(0, 9), st.sampled_from([0, 5, 600]), st.sampled_from([False] * 4 + [True])
        ),
        min_size=1,
        max_size=14,
    ),
)
def test_units_load_all_or_nothing_and_are_evicted_whole(
    tmp_path_factory: Any, specs: list[dict[str, Any]], ops: list[tuple[int, int, bool]]
) -> None:
    asyncio.run(_run(tmp_path_factory.mktemp("units"), specs, ops))
