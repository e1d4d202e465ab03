"""Time to ready: how late does the controller notice that a server became ready?

For N demo servers with a fixed load time, the delay between the server's own logged
ready time (``slotctl-demo ready ... t=``) and the moment the probe reports ``ready``:
slotctl's proportional schedule side by side with a naive fixed 1 s poll (what peers do).
Prints p50/p95/max; never fails on timing.

    python bench/time_to_ready.py [--servers 10] [--load-seconds 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.probe import ProbeOutcome, ProbeResult, probe_once, wait_ready
from controller.runtime.base import LaunchSpec
from controller.runtime.process import ProcessRuntime
from tests.integration.helpers import demo_launch


async def naive_poll(attempt: Callable[[], Awaitable[ProbeResult]]) -> ProbeResult:
    while True:
        result = await attempt()
        if result.outcome is ProbeOutcome.READY:
            return result
        await asyncio.sleep(1.0)


async def one(
    runtime: ProcessRuntime, session: aiohttp.ClientSession, launch: LaunchSpec, naive: bool
) -> float:
    await runtime.start(launch)

    async def attempt() -> ProbeResult:
        return await probe_once(session, launch.endpoint, launch.probe)

    async def alive() -> bool:
        return True

    if naive:
        await naive_poll(attempt)
    else:
        await wait_ready(attempt, alive=alive, warmup_timeout_s=60)
    detected = time.time()
    line = next(x for x in await runtime.logs(launch.slot) if "slotctl-demo ready" in x)
    return detected - float(line.rsplit("t=", 1)[1])


def stats(delays: list[float]) -> str:
    ms = sorted(d * 1000 for d in delays)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):7.1f} ms   p95 {p95:7.1f} ms   max {ms[-1]:7.1f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=10)
    parser.add_argument("--load-seconds", type=float, default=1.5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runtime = ProcessRuntime(Path(tmp))
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            results: dict[str, list[float]] = {}
            try:
                for label, naive in (("slotctl schedule", False), ("naive 1 s poll", True)):
                    launches = [
                        # Spread the load times so the naive poll's phase is not one value.
                        demo_launch(
                            f"b{'n' if naive else 's'}{i}",
                            ["--load-seconds", f"{args.load_seconds + 0.1 * i:.2f}"],
                        )
                        for i in range(args.servers)
                    ]
                    results[label] = list(
                        await asyncio.gather(*(one(runtime, session, la, naive) for la in launches))
                    )
                    for la in launches:
                        await runtime.stop(la.slot, timeout=5)
            finally:
                for observed in await runtime.list_managed():
                    await runtime.stop(observed.slot, timeout=5)
    print(
        f"time to ready: {args.servers} demo servers at once, load "
        f"{args.load_seconds:g}..{args.load_seconds + 0.1 * (args.servers - 1):g} s"
    )
    for label, delays in results.items():
        print(f"  {label:18s} {stats(delays)}")
    ours = statistics.median(results["slotctl schedule"])
    naive = statistics.median(results["naive 1 s poll"])
    print(f"  ratio (naive / slotctl, p50): {naive / max(ours, 1e-6):.1f}x")


if __name__ == "__main__":
    asyncio.run(main())
