"""Placement quality: how many loads the per-GPU placement admits, against the optimum.

200 random slot mixes onto hosts of 2, 4 and 8 GPUs of mixed sizes (16, 24, 48, 80 GiB,
0.5 GiB safety margin). The loads arrive one at a time in random order, as requests and
restores do, and each is placed by :func:`controller.scheduling.placement.place` (the controller's
one placement function; no evictions: every slot stays) or refused. Two scenarios:

* **packable** (what a placement is for: fragmentation): mixes whose loads *all* fit the
  host, proven offline (exactly, by branch and bound, on 2 and 4 GPUs; by first fit
  decreasing on 8, where the exact search is too slow). The figure is the loads admitted
  as a ratio of all of them (the optimum), in random arrival order and in decreasing
  order (a restore of known loads, largest first).
* **overfull** (context): mixes that need 1.3x the host. The offline optimum admits the
  most loads by leaving the big ones out (an optimal set is always the ``k`` smallest
  loads); an online placement cannot refuse a load that fits, so no online rule gets near
  it, and which loads stay is priority and eviction's business, not placement's.

Side by side in the same run on the same mixes: first fit (the lowest-index GPU with
room) and worst fit (the GPU with the most room), the two online rules a placement might
use instead of best fit. The goal is >= 0.95 of the optimum. Prints figures; never fails.

    python bench/placement.py [--mixes 200] [--seed 7]
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.model.devices import GpuRef
from controller.model.sizes import GIB
from controller.scheduling.fit import DeviceMemory
from controller.scheduling.placement import DeviceFacts, Need, place

MARGIN = GIB // 2
SIZES_GB = (16, 24, 48, 80)


LOAD_GB = (1, 2, 4, 5, 7, 8, 10, 14, 16, 20, 24, 32, 40)


def mix(rng: random.Random, gpus: int, fill: float) -> tuple[list[int], list[int]]:
    """A host's GPU sizes and a stream of load sizes (bytes) of about ``fill`` x its room."""
    sizes = [rng.choice(SIZES_GB) * GIB for _ in range(gpus)]
    room = sum(s - MARGIN for s in sizes)
    loads: list[int] = []
    while True:
        size = rng.choice(LOAD_GB) * GIB
        if sum(loads) + size > fill * room:
            if fill <= 1.0 and loads:
                break
            loads.append(size)
            if fill > 1.0:
                break
            continue
        loads.append(size)
    rng.shuffle(loads)
    return sizes, loads


def packable(
    rng: random.Random, gpus: int, fits: Callable[..., bool]
) -> tuple[list[int], list[int]]:
    """A mix whose loads all fit the host (as ``fits`` proves)."""
    while True:
        sizes, loads = mix(rng, gpus, rng.uniform(0.8, 0.98))
        if fits(loads, [s - MARGIN for s in sizes]):
            return sizes, loads


def ours(sizes: Sequence[int], loads: Sequence[int]) -> int:
    """The controller's placement, one load at a time (best fit, ties to the lower index)."""
    admitted = [0] * len(sizes)
    count = 0
    for n, size in enumerate(loads):
        facts = [
            DeviceFacts(
                f"gpu:{i}",
                admitted[i],
                DeviceMemory(f"gpu:{i}", total, total - admitted[i], "bench", i),
                None,
                MARGIN,
                gpu=GpuRef(i),
            )
            for i, total in enumerate(sizes)
        ]
        placement = place(Need(f"s{n}", size), facts, lambda: (), 0.0)
        if placement.option is not None and placement.option.fits:
            for gpu in placement.gpus:
                admitted[gpu.index] += size
            count += 1
    return count


def online(sizes: Sequence[int], loads: Sequence[int], pick: Callable[[list[int]], int]) -> int:
    """A simple online rule over the GPUs' rooms (``pick`` chooses among those that fit)."""
    room = [s - MARGIN for s in sizes]
    count = 0
    for size in loads:
        fits = [i for i, r in enumerate(room) if r >= size]
        if fits:
            i = pick([room[j] if j in fits else -1 for j in range(len(room))])
            room[i] -= size
            count += 1
    return count


def first_fit(rooms: list[int]) -> int:
    return next(i for i, r in enumerate(rooms) if r >= 0)


def worst_fit(rooms: list[int]) -> int:
    return max(range(len(rooms)), key=lambda i: (rooms[i], -i))


def packs(items: Sequence[int], rooms: Sequence[int]) -> bool:
    """Exact: can ``items`` all be packed into bins of ``rooms``? (branch and bound)"""
    items = sorted(items, reverse=True)
    if sum(items) > sum(rooms):
        return False

    @functools.cache
    def search(k: int, left: tuple[int, ...]) -> bool:
        if k == len(items):
            return True
        tried: set[int] = set()
        for i, room in enumerate(left):
            if room >= items[k] and room not in tried:  # equal rooms are symmetric
                tried.add(room)
                rest = sorted((*left[:i], room - items[k], *left[i + 1 :]), reverse=True)
                if search(k + 1, tuple(rest)):
                    return True
        return False

    return search(0, tuple(sorted(rooms, reverse=True)))


def ffd_packs(items: Sequence[int], rooms: Sequence[int]) -> bool:
    left = list(rooms)
    for size in sorted(items, reverse=True):
        i = next((j for j, r in enumerate(left) if r >= size), None)
        if i is None:
            return False
        left[i] -= size
    return True


def best_count(loads: Sequence[int], sizes: Sequence[int], fits: Callable[..., bool]) -> int:
    """The largest k whose k smallest loads ``fits`` packs (an optimal set is always the k
    smallest: swapping a packed load for a smaller unpacked one keeps it packed)."""
    smallest = sorted(loads)
    rooms = [s - MARGIN for s in sizes]
    low, high = 0, len(smallest)
    while low < high:
        k = (low + high + 1) // 2
        if fits(smallest[:k], rooms):
            low = k
        else:
            high = k - 1
    return low


def ratio(got: int, best: int) -> float:
    """Admitted against the reference (a mix where nothing fits at all: met)."""
    return 1.0 if best == 0 else got / best


def report(label: str, ratios: list[float]) -> str:
    ratios = sorted(ratios)
    at = sum(1 for r in ratios if r >= 0.9999) / len(ratios)
    return (
        f"  {label:34s} mean {statistics.fmean(ratios):.3f}  p5 {ratios[len(ratios) // 20]:.3f}"
        f"  min {ratios[0]:.3f}  at the reference {at:5.1%}"
    )


RULES: dict[str, Callable[[Sequence[int], Sequence[int]], int]] = {
    "best fit (slotctl)": ours,
    "first fit": lambda sizes, loads: online(sizes, loads, first_fit),
    "worst fit": lambda sizes, loads: online(sizes, loads, worst_fit),
}


def scenario_packable(gpus: int, mixes: int, seed: int) -> None:
    rng = random.Random(seed + gpus)
    fits = packs if gpus <= 4 else ffd_packs
    proof = "exact" if gpus <= 4 else "FFD"
    results: dict[str, list[float]] = {}
    count = 0
    for _ in range(mixes):
        sizes, loads = packable(rng, gpus, fits)
        count += len(loads)
        for label, rule in RULES.items():
            results.setdefault(f"{label}, arrival order", []).append(
                rule(sizes, loads) / len(loads)
            )
        decreasing = sorted(loads, reverse=True)
        results.setdefault("best fit (slotctl), largest first", []).append(
            ours(sizes, decreasing) / len(loads)
        )
    print(f"\n{gpus} GPUs, packable mixes (all loads fit, {proof} proof; {count} loads)")
    for label, ratios in results.items():
        print(report(label, ratios))


def scenario_overfull(gpus: int, mixes: int, seed: int) -> None:
    rng = random.Random(seed + 100 + gpus)
    exact = gpus <= 4
    results: dict[str, list[float]] = {}
    count = 0
    spent = 0.0
    for _ in range(mixes):
        sizes, loads = mix(rng, gpus, 1.3)
        count += len(loads)
        best = best_count(loads, sizes, packs if exact else ffd_packs)
        for label, rule in RULES.items():
            t0 = time.perf_counter()
            got = rule(sizes, loads)
            if label.startswith("best"):
                spent += time.perf_counter() - t0
                assert not exact or got <= best, (sizes, loads)  # nothing beats the optimum
            results.setdefault(label, []).append(ratio(got, best))
    reference = "the exact optimum" if exact else "FFD's count (offline)"
    print(f"\n{gpus} GPUs, overfull mixes (1.3x the host; {count} loads) against {reference}")
    for label, ratios in results.items():
        print(report(label, ratios))
    print(f"  placement cost: {spent / count * 1e6:.0f} µs a load (pure, {gpus} GPUs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    print(f"placement: {args.mixes} random mixes per host and scenario")
    started = time.perf_counter()
    for gpus in (2, 4, 8):
        scenario_packable(gpus, args.mixes, args.seed)
    for gpus in (2, 4, 8):
        scenario_overfull(gpus, args.mixes, args.seed)
    took = time.perf_counter() - started
    print(f"\ngoal: best fit >= 0.95 of the optimum on packable mixes ({took:.1f} s)")


if __name__ == "__main__":
    main()
