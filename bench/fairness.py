"""Fair queueing at a slot's ``max_concurrency`` (issue 23): priority classes and per-key
round-robin against plain FIFO, side by side in one run.

The real SlotManager's leases and wait queue (FakeRuntime, the system clock): each
request takes a lease (waiting for its turn when the slot is at its limit), holds it for
the service time, releases it. HTTP is left out on purpose: the router adds ~0.2 ms a
request and has no say in the order; what is measured is who waits how long.

1. a batch key with 50 requests in flight and an interactive key with 1 (a person: it
   pauses 200 ms after each answer), against one slot with ``max_concurrency = 4``: the
   interactive key's wait p50/p99 and the batch throughput, with classes (interactive 8,
   batch 1) and with FIFO (``queue_aging_s=0``).
   Goal: interactive p99 wait <= one service time; batch throughput within 10 % of FIFO.
2. two batch keys with 50 and 5 in flight: each one's share of the requests served.
   Goal: within 20 % of equal shares.

    python bench/fairness.py [--seconds 8] [--service-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.probes.memory import FakeMemoryProbe
from controller.runtime.fake import FakeProber, FakeRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig, Requester
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec

THINK_S = 0.2  # the interactive client's pause between an answer and its next request


def _manager(tmp: Path, aging_s: float) -> SlotManager:
    runtime = FakeRuntime()
    return SlotManager(
        runtime=runtime,
        state_dir=tmp / "state",
        config_dir=tmp / "config",
        settings=ControllerSettings(queue_aging_s=aging_s, memory_budget_gb={"gpu": 24}),
        prober=FakeProber(runtime),
        memory=FakeMemoryProbe({}),
        config=ManagerConfig(stop_timeout_s=1.0),
    )


def _desired() -> DesiredState:
    spec = SlotSpec.model_validate(
        {
            "name": "s",
            "provider": "demo",
            "port": 41990,
            "model": {"default": "m"},
            "max_concurrency": 4,
            "max_queue": 1000,
        }
    )
    model = ModelSpec(id="m", source="demo://m", memory_gb=1)
    return DesiredState(
        stacks=("bench",),
        models={"m": model},
        slots={"s": DesiredSlot(spec=normalise(spec, ControllerSettings()), stack="bench")},
    )


async def _run(
    aging_s: float,
    clients: dict[Requester, int],
    seconds: float,
    service_s: float,
    think_s: dict[Requester, float] | None = None,
) -> dict[Requester, list[float]]:
    """Each requester's waits (seconds) over ``seconds`` of closed-loop clients."""
    with tempfile.TemporaryDirectory() as tmp:
        m = _manager(Path(tmp), aging_s)
        await m.set_desired(_desired())
        m.release(await m.acquire("s"))  # loaded before the clock starts
        waits: dict[Requester, list[float]] = {who: [] for who in clients}
        end = time.monotonic() + seconds

        async def client(who: Requester) -> None:
            while time.monotonic() < end:
                asked = time.monotonic()
                lease = await m.acquire("s", who)
                waits[who].append(time.monotonic() - asked)
                await asyncio.sleep(service_s)
                m.release(lease)
                pause = (think_s or {}).get(who, 0.0)
                if pause:
                    await asyncio.sleep(pause)  # a person reads the answer before the next

        await asyncio.gather(*(client(w) for w, n in clients.items() for _ in range(n)))
        await m.stop_all(reason="bench")
        await m.close()
        return waits


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(seconds: float, service_ms: float) -> None:
    service = service_ms / 1000
    ui, ci = Requester("chat-ui", "interactive"), Requester("ci", "batch")
    print(f"max_concurrency 4, service time {service_ms:.0f} ms, {seconds:.0f} s a run\n")
    print(
        f"1. batch key x50 and interactive key x1 (a person: {THINK_S * 1000:.0f} ms between "
        "an answer and the next request) against one slot"
    )
    print(
        f"{'':10} {'ui p50 ms':>10} {'ui p99 ms':>10} {'ui reqs':>8} {'batch req/s':>12} "
        f"{'all req/s':>10}"
    )
    rows = {}
    for label, aging in (("FIFO", 0.0), ("classes", 30.0)):
        waits = await _run(aging, {ci: 50, ui: 1}, seconds, service, {ui: THINK_S})
        rows[label] = waits
        p50, p99 = _pct(waits[ui], 0.5) * 1000, _pct(waits[ui], 0.99) * 1000
        rate = len(waits[ci]) / seconds
        total = (len(waits[ci]) + len(waits[ui])) / seconds
        print(f"{label:10} {p50:10.1f} {p99:10.1f} {len(waits[ui]):8d} {rate:12.1f} {total:10.1f}")
    fifo, fair = rows["FIFO"], rows["classes"]
    ratio = len(fair[ci]) / max(1, len(fifo[ci]))
    p99 = _pct(fair[ui], 0.99)
    print(
        f"   interactive p99 wait {p99 * 1000:.1f} ms = {p99 / service:.2f} service times "
        f"(goal <= 1); batch throughput {ratio:.3f}x FIFO (goal >= 0.90: the interactive\n"
        "   key's own share of the slot comes out of it; the slot's whole rate is the column "
        "'all')\n"
    )
    print("2. two batch keys, x50 and x5")
    big, small = Requester("big", "batch"), Requester("small", "batch")
    for label, aging in (("FIFO", 0.0), ("classes", 30.0)):
        waits = await _run(aging, {big: 50, small: 5}, seconds, service)
        total = len(waits[big]) + len(waits[small])
        share = len(waits[small]) / max(1, total)
        mean = statistics.fmean(waits[small]) * 1000 if waits[small] else float("nan")
        print(
            f"{label:10} small's share {share:.3f} (equal: 0.500, within 20 %: >= 0.400), "
            f"its mean wait {mean:.0f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--service-ms", type=float, default=50.0)
    ns = parser.parse_args()
    asyncio.run(main(ns.seconds, ns.service_ms))
