"""Autoload thrash: cold starts per minute with two autoload slots that do not fit together.

Runs the real Reconciler and SlotManager loops (FakeRuntime with 0.2 s loads, the system
clock) for a few seconds, twice side by side:

* before — every reconciler load is an ordinary (user) load that evicts whatever is
  eligible, as before issue 10: the two slots evict each other about once a second;
* after — reconciler loads are background loads: they evict only lower-priority slots
  idle for ``min_resident_s``, so one slot loads and the other waits for memory.

Also the mixed case of the issue: a priority-10 autoload slot next to a priority-90 slot a
request just used. Prints a table; never fails on timing.

    python bench/thrash.py [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.reconcile.apply import apply_to_config
from controller.reconcile.reconciler import Reconciler
from controller.runtime.fake import FakeProber, FakeRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig, SlotView
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec

WARMUP_S = 2.0


class UserLoadsManager(SlotManager):
    """The behaviour before issue 10: the reconciler's loads evict like a user's."""

    async def load(self, name: str, *, resident: bool = True, background: bool = False) -> SlotView:
        return await super().load(name, resident=resident, background=False)


def _state(specs: list[dict[str, Any]]) -> DesiredState:
    settings = ControllerSettings()
    slots = {}
    models = {}
    for i, data in enumerate(specs):
        name = data["name"]
        models[f"{name}-m"] = ModelSpec(id=f"{name}-m", source=f"demo://{name}", memory_gb=4)
        spec = SlotSpec.model_validate(
            {"provider": "demo", "port": 41000 + i, "model": {"default": f"{name}-m"}, **data}
        )
        slots[name] = DesiredSlot(spec=normalise(spec, settings), stack="bench")
    return DesiredState(stacks=("bench",), models=models, slots=slots)


async def scenario(
    kind: type[SlotManager], specs: list[dict[str, Any]], seconds: float
) -> tuple[int, int]:
    """Cold starts in ``seconds`` of the real loops (6 GiB budget, 4 GiB per slot):
    (all of them, those after the first two seconds — the steady state)."""
    with tempfile.TemporaryDirectory() as tmp:
        runtime = FakeRuntime()
        for data in specs:
            runtime.script(data["name"], load_s=0.2)
        settings = ControllerSettings(memory_budget_gb={"gpu": 6.0}, safety_margin_gb=0.0)
        manager = kind(
            runtime=runtime,
            state_dir=Path(tmp) / "state",
            config_dir=Path(tmp) / "config",
            settings=settings,
            prober=FakeProber(runtime),
            memory=FakeMemoryProbe({"gpu": 100 * GIB}),
            config=ManagerConfig(stop_timeout_s=1.0, monitor_interval_s=0.05),
        )
        apply_to_config(_state(specs), Path(tmp) / "config", prune=True)
        reconciler = Reconciler(manager, Path(tmp) / "config", resync_s=1.0)
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(reconciler.run(stop)),
            asyncio.create_task(manager.run(stop)),
        ]
        if any(not d.get("autoload", True) for d in specs):  # the mixed case: a request
            await asyncio.sleep(0.5)
            lease = await manager.acquire("high")
            manager.release(lease)
        await asyncio.sleep(WARMUP_S)
        settled = sum(runtime.starts.values())
        await asyncio.sleep(seconds - WARMUP_S)
        stop.set()
        await asyncio.gather(*tasks)
        await manager.stop_all()
        await manager.close()
        total = sum(runtime.starts.values())
        return total, total - settled


async def main(seconds: float) -> None:
    equal = [{"name": "a", "autoload": True}, {"name": "b", "autoload": True}]
    mixed = [
        {"name": "low", "autoload": True, "priority": 10},
        {"name": "high", "autoload": False, "priority": 90},
    ]
    print(f"cold starts over {seconds:g} s of the real loops (0.2 s loads); per minute: the")
    print(f"steady state after the first {WARMUP_S:g} s (the initial loads left out)")
    print(f"  {'scenario':40s} {'before':>7s} {'after':>7s} {'before/min':>11s} {'after/min':>10s}")
    for label, specs in (
        ("two equal autoload slots, room for one", equal),
        ("autoload p10 vs p90 used by a request", mixed),
    ):
        before, before_steady = await scenario(UserLoadsManager, specs, seconds)
        after, after_steady = await scenario(SlotManager, specs, seconds)
        per_min = 60.0 / (seconds - WARMUP_S)
        print(
            f"  {label:40s} {before:7d} {after:7d} {before_steady * per_min:11.1f} "
            f"{after_steady * per_min:10.1f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    logging.basicConfig(level=logging.ERROR)  # the refusals' log lines are not the output
    asyncio.run(main(max(WARMUP_S + 1.0, parser.parse_args().seconds)))
