"""Swapping models on one GPU: put to sleep and woken, against full unloads (issue 22).

The real SlotManager over the process runtime and real demo servers in sleep mode (vLLM's
dev-mode API: ``--enable-sleep-mode``), loading in ``--load-seconds`` (default 5) and waking
in ``--wake-seconds`` (default 0.3). The GPU is a budget that fits one model; host memory
(the ``cpu`` budget) holds the sleepers. Requests alternate between the models; a request's
time is the lease (the swap: an eviction, then a wake or a cold load) plus one completion
from the server. Two runs side by side in one process, the same alternation:

* two models, A B A B ...: the median swap with sleep against full unloads (the goal: at
  least 10x faster, and within 20 % of the demo server's own wake time);
* three models, A B C A B C ..., room for one awake and one asleep: the median request and
  the cold starts, with sleep against full unloads. A cycle longer than what fits defeats
  any recency order (the one asleep is always the one needed after next, as with LRU), so
  also A B A C A B A C ..., one model used every other request.

Prints a table; never fails on timing.

    python bench/swap.py [--swaps 6] [--load-seconds 5] [--wake-seconds 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.probes.memory import SystemMemoryProbe
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.integration.helpers import free_ports


def _state(names: list[str], *, sleep: bool, load_s: float, wake_s: float) -> DesiredState:
    settings = ControllerSettings()
    slots, models = {}, {}
    for name, port in zip(names, free_ports(len(names)), strict=True):
        models[f"m-{name}"] = ModelSpec(id=f"m-{name}", source=f"demo://{name}", memory_gb=1.0)
        args = ["--load-seconds", f"{load_s:g}", "--wake-seconds", f"{wake_s:g}"]
        spec = SlotSpec.model_validate(
            {
                "name": name,
                "provider": "demo",
                "port": port,
                "device": "gpu",
                "model": {"default": f"m-{name}"},
                "autoload": False,
                "sleep": sleep,
                "drain_timeout_s": 1.0,
                "server": {"extra_args": args},
            }
        )
        slots[name] = DesiredSlot(spec=normalise(spec, settings), stack="bench")
    return DesiredState(stacks=("bench",), models=models, slots=slots)


def _complete(endpoint: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        endpoint + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()


async def run(
    names: list[str], order: list[str], *, sleep: bool, host_gb: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Requests in ``order``; each one's time (the first of each model: its first load)."""
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        runtime = ProcessRuntime(state)
        settings = ControllerSettings(
            memory_budget_gb={"gpu": 1.5, "cpu": host_gb},
            safety_margin_gb=0.0,
            host_margin_gb=0.0,
        )
        manager = SlotManager(
            runtime=runtime,
            state_dir=state,
            config_dir=Path(tmp) / "config",
            settings=settings,
            memory=SystemMemoryProbe(),
            config=ManagerConfig(stop_timeout_s=5.0),
        )
        await manager.set_desired(
            _state(names, sleep=sleep, load_s=args.load_seconds, wake_s=args.wake_seconds)
        )
        times: list[tuple[str, float, bool]] = []
        seen: set[str] = set()
        try:
            for name in order:
                starts = sum(1 for e in manager.events.since(0) if e.to_state == "starting")
                began = time.perf_counter()
                lease = await manager.acquire(name)
                endpoint = manager.endpoint(name)
                assert endpoint is not None
                await asyncio.to_thread(_complete, endpoint, f"m-{name}")
                manager.release(lease)
                took = time.perf_counter() - began
                cold = sum(1 for e in manager.events.since(0) if e.to_state == "starting") > starts
                if name in seen:
                    times.append((name, took, cold))
                seen.add(name)
        finally:
            await manager.stop_all()
            await manager.close()
            await runtime.close()
        swaps = [t for _, t, _ in times]
        return {
            "median_s": statistics.median(swaps),
            "swaps": len(swaps),
            "cold": sum(1 for _, _, c in times if c),
            "wakes": sum(
                1 for e in manager.events.since(0) if e.details.get("reason") == "request"
            ),
        }


def _row(label: str, result: dict[str, Any]) -> str:
    return (
        f"{label:<30} {result['median_s']:>9.3f} s {result['swaps']:>6} "
        f"{result['cold']:>6} {result['wakes']:>6}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swaps", type=int, default=6)
    parser.add_argument("--load-seconds", type=float, default=5.0)
    parser.add_argument("--wake-seconds", type=float, default=0.3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    two = ["a", "b"]
    order2 = [two[i % 2] for i in range(args.swaps + 2)]
    three = ["a", "b", "c"]
    order3 = [three[i % 3] for i in range(args.swaps + 3)]
    print(
        f"demo servers: load {args.load_seconds:g} s, wake {args.wake_seconds:g} s; one GPU "
        "(a budget) that fits one model; requests after each model's first load"
    )
    header = f"{'run':<30} {'median':>11} {'swaps':>6} {'cold':>6} {'wakes':>6}"
    print(header)
    sleep2 = await run(two, order2, sleep=True, host_gb=8.0, args=args)
    print(_row("A B A B ...  sleep", sleep2))
    unload2 = await run(two, order2, sleep=False, host_gb=8.0, args=args)
    print(_row("A B A B ...  full unloads", unload2))
    sleep3 = await run(three, order3, sleep=True, host_gb=1.5, args=args)
    print(_row("A B C ...    sleep (1 asleep)", sleep3))
    unload3 = await run(three, order3, sleep=False, host_gb=1.5, args=args)
    print(_row("A B C ...    full unloads", unload3))
    hot = ["a", "b", "a", "c"]
    order_hot = [hot[i % 4] for i in range(args.swaps + 3)]
    sleep_hot = await run(three, order_hot, sleep=True, host_gb=1.5, args=args)
    print(_row("A B A C ...  sleep (1 asleep)", sleep_hot))
    unload_hot = await run(three, order_hot, sleep=False, host_gb=1.5, args=args)
    print(_row("A B A C ...  full unloads", unload_hot))
    ratio = unload2["median_s"] / sleep2["median_s"]
    over = sleep2["median_s"] / args.wake_seconds - 1
    print(
        f"two models: swapping by sleep is {ratio:.1f}x faster than full unloads "
        f"(goal >= 10x); its median is {over * 100:+.0f} % of the demo server's wake time "
        f"{args.wake_seconds:g} s (goal within 20 %)"
    )
    print(
        f"three models, room for one awake + one asleep: A B C: {sleep3['cold']} cold starts "
        f"in {sleep3['swaps']} requests with sleep, {unload3['cold']} with full unloads; "
        f"A B A C: {sleep_hot['cold']} in {sleep_hot['swaps']} with sleep, "
        f"{unload_hot['cold']} with full unloads"
    )


if __name__ == "__main__":
    asyncio.run(main())
