"""SlotManager costs: warm lease pairs, one cold load joined by many, victim planning.

(a) warm ``acquire``/``release`` pairs on a ready slot (FakeRuntime + FakeProber, real
    clock), per pair in µs, next to a bare ``asyncio.Lock`` acquire/release pair;
(b) cold join: N concurrent acquirers of one cold slot (FakeRuntime ``load_s``): wall
    time and the number of server starts (one);
(c) eviction planning over 1,000 resident slots (``plan_eviction``), median of repeats,
    next to a naive planner that re-sorts the candidates before picking each victim.

Prints a table; never fails on timing.

    python bench/manager.py [--pairs 20000] [--acquirers 100] [--candidates 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.kit.clock import SYSTEM_CLOCK
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.runtime.fake import FakeProber, FakeRuntime
from controller.scheduling.eviction import EvictionCandidate, is_eligible, plan_eviction
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec

# ============================================================================ helpers


def percentile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def row(label: str, p50: float, p99: float, unit: str = "µs", note: str = "") -> str:
    return f"  {label:48s} p50 {p50:8.2f} {unit}   p99 {p99:8.2f} {unit}  {note}"


async def manager_for(
    tmp: Path, names: Sequence[str], runtime: FakeRuntime, **slot_kw: Any
) -> SlotManager:
    settings = ControllerSettings(safety_margin_gb=0.0)
    slots = {
        name: DesiredSlot(
            spec=normalise(
                SlotSpec.model_validate(
                    {
                        "name": name,
                        "provider": "demo",
                        "port": 20000 + i,
                        "model": {"default": f"{name}-m"},
                        "device": "gpu",
                        "autoload": False,
                        **slot_kw,
                    }
                ),
                settings,
            ),
            stack="bench",
        )
        for i, name in enumerate(names)
    }
    models = {f"{n}-m": ModelSpec(id=f"{n}-m", source=f"demo://{n}", memory_gb=1) for n in names}
    memory = FakeMemoryProbe({"gpu": 64 * GIB})
    manager = SlotManager(
        runtime=runtime,
        state_dir=tmp / "state",
        config_dir=tmp / "config",
        settings=settings,
        prober=FakeProber(runtime),
        memory=memory,
        clock=SYSTEM_CLOCK,
        config=ManagerConfig(stop_timeout_s=1.0),
    )
    memory.used_by = manager.admitted_bytes
    await manager.set_desired(DesiredState(stacks=("bench",), models=models, slots=slots))
    return manager


async def timed_pairs(pair: Callable[[], Awaitable[None]], n: int) -> list[float]:
    """Per-call durations in µs (each call timed on its own)."""
    for _ in range(min(500, n // 10)):  # warm up
        await pair()
    out = [0.0] * n
    clock = time.perf_counter_ns
    gc.collect()
    for i in range(n):
        t0 = clock()
        await pair()
        out[i] = (clock() - t0) / 1000
    out.sort()
    return out


# ============================================================================ (a) warm pairs


async def bench_warm(tmp: Path, pairs: int, writing_pairs: int) -> list[str]:
    runtime = FakeRuntime(SYSTEM_CLOCK)
    manager = await manager_for(tmp, ["warm"], runtime)
    await manager.load("warm")
    lines = []
    try:
        lock = asyncio.Lock()

        async def lock_pair() -> None:
            await lock.acquire()
            lock.release()

        async def lease_pair() -> None:
            manager.release(await manager.acquire("warm"))

        base = await timed_pairs(lock_pair, pairs)
        first = await timed_pairs(lease_pair, writing_pairs)
        held = await manager.acquire("warm")  # slot stays serving: no transition per pair
        nested = await timed_pairs(lease_pair, pairs)
        manager.release(held)
        b50, f50, n50 = (statistics.median(x) for x in (base, first, nested))
        lines.append(
            f"(a) warm acquire+release on a ready slot, FakeRuntime, real clock "
            f"({pairs:,} pairs; {writing_pairs:,} for the state.json-writing case)"
        )
        lines.append(row("bare asyncio.Lock acquire/release", b50, percentile(base, 0.99)))
        lines.append(
            row(
                "lease pair, ready<->serving (state.json coalesced)",
                f50,
                percentile(first, 0.99),
                note=f"x{f50 / b50:.0f} the lock",
            )
        )
        lines.append(
            row(
                "lease pair, slot already serving",
                n50,
                percentile(nested, 0.99),
                note=f"x{n50 / b50:.0f} the lock",
            )
        )
    finally:
        await manager.stop_all()
        await manager.close()
    return lines


# ============================================================================ (b) cold join


async def bench_cold(tmp: Path, acquirers: int, load_s: float) -> list[str]:
    runtime = FakeRuntime(SYSTEM_CLOCK)
    # max_queue (default 64) bounds cold waiters per slot: raised so all of them may wait.
    manager = await manager_for(tmp, ["cold"], runtime, max_queue=max(64, acquirers))
    runtime.script("cold", load_s=load_s)
    try:
        t0 = time.perf_counter()
        leases = await asyncio.gather(*(manager.acquire("cold") for _ in range(acquirers)))
        wall = time.perf_counter() - t0
        ok = sum(1 for lease in leases if lease.error is None)
        for lease in leases:
            manager.release(lease)
        view = manager.view("cold")
    finally:
        await manager.stop_all()
        await manager.close()
    return [
        f"(b) cold join: {acquirers} concurrent acquirers, one slot, load_s={load_s:g}",
        f"  {'wall time until every lease':48s} {wall * 1000:8.1f} ms "
        f"({(wall - load_s) * 1000:.1f} ms over load_s)",
        f"  {'server starts':48s} {runtime.starts['cold']:8d}",
        f"  {'leases granted':48s} {ok:8d}   final state {view.state.value}, {view.leases} leases",
    ]


# ============================================================================ (c) planning


def candidates(n: int, seed: int = 7) -> list[EvictionCandidate]:
    rng = random.Random(seed)
    states = [SlotState.READY] * 8 + [SlotState.IDLE, SlotState.SERVING]
    return [
        EvictionCandidate(
            name=f"s{i:04d}",
            devices=("gpu",),
            bytes=rng.randint(1, 16) * GIB // 2,
            priority=rng.choice([10, 30, 50, 50, 50, 70, 90, 100]),
            last_used=rng.uniform(0, 10_000),
            state=rng.choice(states),
            pinned=rng.random() < 0.05,
            leases=1 if rng.random() < 0.05 else 0,
        )
        for i in range(n)
    ]


def naive_plan(cands: Sequence[EvictionCandidate], device: str, need: int) -> list[str]:
    """Baseline: re-sort the remaining eligible slots before picking each victim."""
    remaining = [c for c in cands if device in c.devices and is_eligible(c)]
    if sum(c.bytes for c in remaining) < need:
        return []
    chosen: list[EvictionCandidate] = []
    freed = 0
    while freed < need:
        remaining.sort(key=lambda c: (c.priority, c.last_used, c.name))
        victim = remaining.pop(0)
        chosen.append(victim)
        freed += victim.bytes
    for c in sorted(chosen, key=lambda c: (-c.priority, -c.last_used)):
        if freed - c.bytes >= need:
            chosen.remove(c)
            freed -= c.bytes
    return [c.name for c in chosen]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def bench_plan(n: int, repeats: int) -> list[str]:
    cands = candidates(n)
    evictable = sum(c.bytes for c in cands if is_eligible(c))
    lines = [f"(c) victim planning over {n:,} resident slots (median of {repeats} runs)"]
    for label, need in (("need 8 GiB", 8 * GIB), ("need half of evictable", evictable // 2)):
        plan = plan_eviction(cands, "gpu", need, 10_000.0, for_slot="x")
        naive = naive_plan(cands, "gpu", need)
        same = [v.name for v in plan.victims] == naive
        ours = median_ms(lambda need=need: plan_eviction(cands, "gpu", need, 10_000.0), repeats)
        slow_repeats = max(3, repeats // 10)
        theirs = median_ms(lambda need=need: naive_plan(cands, "gpu", need), slow_repeats)
        lines.append(
            f"  {label + f' ({len(plan.victims)} victims)':48s} plan_eviction {ours:7.3f} ms"
            f"   naive re-sort {theirs:8.3f} ms   x{theirs / ours:.1f}"
            f"   same victims: {'yes' if same else 'NO'}"
        )
    return lines


# ============================================================================ main


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20_000)
    parser.add_argument("--writing-pairs", type=int, default=5_000)
    parser.add_argument("--acquirers", type=int, default=100)
    parser.add_argument("--load-seconds", type=float, default=0.2)
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(
        f"SlotManager bench: {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}, {time.strftime('%Y-%m-%d')}"
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for line in await bench_warm(Path(tmp) / "warm", args.pairs, args.writing_pairs):
            print(line)
        for line in await bench_cold(Path(tmp) / "cold", args.acquirers, args.load_seconds):
            print(line)
    for line in bench_plan(args.candidates, args.repeats):
        print(line)
    print(f"(total {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    asyncio.run(main())
