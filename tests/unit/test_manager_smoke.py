from __future__ import annotations

from pathlib import Path

import pytest

from controller.api.dryrun import plan_json
from controller.model.errors import InsufficientMemory, SlotCrashLooping, SlotSpawnFailed
from controller.model.lifecycle import SlotState
from tests.unit.manager_fixtures import Harness, desired, model_spec, slot_spec


async def test_load_acquire_release_unload(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    m = h.manager
    await m.set_desired(desired([slot_spec("a")], [model_spec("a-m", 4)]))
    h.runtime.script("a", load_s=2.0)
    view = await m.load("a")
    assert view.state is SlotState.READY
    lease = await m.acquire("a")
    assert m.view("a").state is SlotState.SERVING
    m.release(lease)
    assert m.view("a").state is SlotState.READY
    await m.unload("a")
    assert m.view("a").state is SlotState.OFFLINE
    assert m.store.read("a").state is SlotState.OFFLINE
    assert h.runtime.starts["a"] == 1


async def test_refusal_and_eviction(tmp_path: Path) -> None:
    h = Harness(tmp_path, gpu_gb=10)
    m = h.manager
    slots = [slot_spec("low", priority=10), slot_spec("high", priority=90), slot_spec("big")]
    models = [model_spec("low-m", 4), model_spec("high-m", 4), model_spec("big-m", 5)]
    await m.set_desired(desired(slots, models))
    await m.load("low")
    await m.load("high")
    plan = plan_json(m.explain_load("big"))
    assert plan["action"] == "evict-then-load"
    assert [v["slot"] for v in plan["evict"]] == ["low"]
    await m.load("big")
    assert m.view("low").state is SlotState.OFFLINE
    assert "evicted" in m.view("low").message
    slots2 = [*slots, slot_spec("huge")]
    await m.set_desired(desired(slots2, [*models, model_spec("huge-m", 50)]))
    with pytest.raises(InsufficientMemory) as err:
        await m.load("huge")
    assert err.value.details["needed_bytes"] == 50 * 1024**3


async def test_crash_loop(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    m = h.manager
    await m.set_desired(desired([slot_spec("c")], [model_spec("c-m")]))
    h.runtime.script("c", outcome="exit")
    with pytest.raises(SlotSpawnFailed):
        await m.load("c")
    assert m.view("c").state is SlotState.ERROR
    with pytest.raises(SlotCrashLooping) as err:
        await m.load("c")
    assert err.value.retry_after_s > 0
