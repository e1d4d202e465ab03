"""One key's flood against other keys' first requests (issue 40, item 3): each key's share
of a slot's ``max_queue`` against the line without shares, side by side in one run.

The real SlotManager's leases, line and fair queue (FakeRuntime, the system clock); HTTP
is left out (the router adds nothing to who gets a place). One slot at its
``max_concurrency = 1`` (a long request holds its seat), ``max_queue = 64``: a batch key
floods it with 200 requests, then 10 other keys send their first request each. Printed:
how many of those first requests got a place (the rest: ``429 slot.queue_full``), their
wait until served, and how many of the flood were refused.

Baseline: the line without shares — a full line refuses whoever comes next (the
admission before issue 40), run by putting that rule in the shares' place.

    python bench/queue_share.py [--flood 200] [--others 10] [--max-queue 64] [--service-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import controller.slots.leases as leases_module
from controller.model.errors import SlotQueueFull
from controller.probes.memory import FakeMemoryProbe
from controller.runtime.fake import FakeProber, FakeRuntime
from controller.scheduling.queueshare import Place, place_for
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig, Requester
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec

Rule = Callable[[Mapping[str, int], str, int], Place]


def no_shares(holding: Mapping[str, int], flow: str, capacity: int) -> Place:
    """The baseline: room or a refusal, whoever holds the line."""
    return Place(sum(holding.values()) < capacity)


def _desired(max_queue: int) -> DesiredState:
    spec = SlotSpec.model_validate(
        {
            "name": "s",
            "provider": "demo",
            "port": 41991,
            "model": {"default": "m"},
            "max_concurrency": 1,
            "max_queue": max_queue,
        }
    )
    model = ModelSpec(id="m", source="demo://m", memory_gb=1)
    return DesiredState(
        stacks=("bench",),
        models={"m": model},
        slots={"s": DesiredSlot(spec=normalise(spec, ControllerSettings()), stack="bench")},
    )


async def run(
    rule: Rule, flood: int, others: int, max_queue: int, service_s: float
) -> dict[str, float]:
    """One run under ``rule``: the figures printed by :func:`main`."""
    leases_module.place_for = rule  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runtime = FakeRuntime()
            m = SlotManager(
                runtime=runtime,
                state_dir=Path(tmp) / "state",
                config_dir=Path(tmp) / "config",
                settings=ControllerSettings(memory_budget_gb={"gpu": 24}),
                prober=FakeProber(runtime),
                memory=FakeMemoryProbe({}),
                config=ManagerConfig(stop_timeout_s=1.0),
            )
            await m.set_desired(_desired(max_queue))
            holder = await m.acquire("s")  # loaded, its one seat taken
            book = m.core.table.get("s").book

            async def one(who: Requester) -> float | None:
                asked = time.monotonic()
                try:
                    lease = await m.acquire("s", who)
                except SlotQueueFull:
                    return None
                waited = time.monotonic() - asked
                await asyncio.sleep(service_s)
                m.release(lease)
                return waited

            batch = Requester("nightly", "batch", "id-nightly")
            flooding = [asyncio.ensure_future(one(batch)) for _ in range(flood)]
            while book.queued < min(flood, max_queue):
                await asyncio.sleep(0)
            firsts = [
                asyncio.ensure_future(one(Requester(f"k{i}", "interactive", f"id-k{i}")))
                for i in range(others)
            ]
            await asyncio.sleep(0)
            m.release(holder)
            flooded = await asyncio.gather(*flooding)
            first = await asyncio.gather(*firsts)
            await m.stop_all(reason="bench")
            await m.close()
    finally:
        leases_module.place_for = place_for
    served = [w for w in first if w is not None]
    return {
        "others_in": len(served),
        "others_wait_ms": statistics.fmean(served) * 1000 if served else float("nan"),
        "flood_refused": sum(1 for w in flooded if w is None),
        "flood_served": sum(1 for w in flooded if w is not None),
    }


async def main(
    flood: int = 200, others: int = 10, max_queue: int = 64, service_ms: float = 5.0
) -> dict[str, dict[str, float]]:
    logging.disable(logging.WARNING)  # every refusal is a log line: not the figures
    try:
        return await _figures(flood, others, max_queue, service_ms)
    finally:
        logging.disable(logging.NOTSET)


async def _figures(
    flood: int, others: int, max_queue: int, service_ms: float
) -> dict[str, dict[str, float]]:
    print(
        f"max_concurrency 1, max_queue {max_queue}: a batch key floods {flood} requests, "
        f"then {others} other keys send one first request each (service {service_ms:g} ms)\n"
    )
    print(
        f"{'':22} {'others in line':>15} {'their wait ms':>14} {'flood refused':>14} "
        f"{'flood served':>13}"
    )
    out = {}
    for label, rule in (("no shares (baseline)", no_shares), ("each key its share", place_for)):
        fig = await run(rule, flood, others, max_queue, service_ms / 1000)
        out[label] = fig
        print(
            f"{label:22} {fig['others_in']:>9.0f} of {others:<3} {fig['others_wait_ms']:14.1f} "
            f"{fig['flood_refused']:14.0f} {fig['flood_served']:13.0f}"
        )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=200)
    parser.add_argument("--others", type=int, default=10)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--service-ms", type=float, default=5.0)
    ns = parser.parse_args()
    asyncio.run(main(ns.flood, ns.others, ns.max_queue, ns.service_ms))
