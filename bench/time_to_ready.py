"""Time to ready: how late does the controller notice that a server became ready?

For N servers started at once, the delay between the moment the server was ready and
the moment the probe reports ``ready``, and the probe requests that took, three ways:

* **log wake**: :class:`~controller.probes.readiness.HttpProber` with the runtime as its log
  source: the provider's ``ready_log`` line in the slot's log wakes the probe
  (inotify), the proportional schedule runs underneath;
* **schedule**: the same prober without the log (the proportional schedule alone);
* **line never comes**: the log is followed but the pattern never matches (a server
  that does not print the line the provider declares): the armed fallback schedule alone
  (floor 250 ms, see :func:`controller.probes.readiness.next_delay`);
* **naive 1 s poll**: what peers do.

``--server demo`` (default): demo servers with load times spread over 0.1 s steps; the
ready moment is the server's own ``slotctl-demo ready ... t=`` stamp. ``--server
llama-cpp-python``: the real ``llama_cpp.server`` loading the tiny test GGUF; its ready
moment is when its "Uvicorn running on" line landed in the log, seen by a thread of this
script that re-reads the log every millisecond (so those figures carry up to ~1 ms of
observation error). Prints p50/p95/p99/max and probe requests per load; never fails on
timing.

    python bench/time_to_ready.py [--servers 10] [--load-seconds 1.5] [--server demo]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.kit.clock import SYSTEM_CLOCK
from controller.probes.readiness import HttpProber, ProbeOutcome, ProbeResult, ProbeSpec, probe_once
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.runtime.base import LaunchSpec
from controller.runtime.process.runtime import ProcessRuntime
from controller.spec.schema import ModelSpec, SlotSpec
from tests.integration.helpers import demo_launch, free_port

MODES = ("log wake", "schedule", "line never comes", "naive 1 s poll")
NEVER: Final = r"(?!)"  # a pattern that matches no line


async def naive_poll(attempt: Callable[[], Awaitable[ProbeResult]]) -> ProbeResult:
    attempts = 0
    while True:
        attempts += 1
        result = await attempt()
        if result.outcome is ProbeOutcome.READY:
            return ProbeResult(result.outcome, attempts=attempts)
        await asyncio.sleep(1.0)


class LineStamp(threading.Thread):
    """Re-reads a log every millisecond; notes when a line matching ``pattern`` shows."""

    def __init__(self, path: Path, pattern: str) -> None:
        super().__init__(daemon=True)
        self.path, self.pattern = path, re.compile(pattern, re.MULTILINE)
        self.seen: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                text = self.path.read_text(errors="replace")
            except FileNotFoundError:
                text = ""
            if self.pattern.search(text):
                self.seen = time.time()
                return
            time.sleep(0.001)


class Timed(HttpProber):
    """An :class:`HttpProber` that notes when its latest attempt began."""

    last_began = 0.0

    async def probe(self, endpoint: str, spec: ProbeSpec, *, slot: str) -> ProbeResult:
        self.last_began = time.time()
        return await super().probe(endpoint, spec, slot=slot)


async def one(
    runtime: ProcessRuntime,
    session: aiohttp.ClientSession,
    launch: LaunchSpec,
    mode: str,
    server: str,
) -> tuple[float, int, float]:
    """(detected - ready, probe requests, last attempt's start - ready) for one load."""
    await runtime.start(launch)
    stamp = None
    if server != "demo":
        assert launch.probe.ready_log is not None
        stamp = LineStamp(runtime.log_path(launch.slot), launch.probe.ready_log)
        stamp.start()

    async def alive() -> bool:
        return (await runtime.inspect(launch.slot)).running

    began = 0.0
    if mode == "naive 1 s poll":
        result = await naive_poll(lambda: probe_once(session, launch.endpoint, launch.probe))
    else:
        prober = Timed(logs=runtime if mode in ("log wake", "line never comes") else None)
        spec = launch.probe
        if mode == "line never comes":
            spec = dataclasses.replace(spec, ready_log=NEVER)
        try:
            result = await prober.wait_ready(
                launch.endpoint,
                spec,
                slot=launch.slot,
                alive=alive,
                warmup_timeout_s=120,
                clock=SYSTEM_CLOCK,
            )
        finally:
            await prober.close()
        began = prober.last_began
    detected = time.time()
    assert result.outcome is ProbeOutcome.READY, result
    if stamp is not None:
        stamp.join(timeout=5)
        assert stamp.seen is not None, "the ready line never showed"
        ready = stamp.seen
    else:
        line = next(x for x in await runtime.logs(launch.slot) if "slotctl-demo ready" in x)
        ready = float(line.rsplit("t=", 1)[1])
    return detected - ready, result.attempts, (began - ready if began else float("nan"))


def llama_cpp_python_launch(name: str, gguf: Path) -> LaunchSpec:
    slot = SlotSpec.model_validate(
        {
            "name": name,
            "provider": "llama-cpp-python",
            "device": "cpu",
            "port": free_port(),
            "type": "llm",
            "model": {"default": "tiny"},
        }
    )
    model = ModelSpec.model_validate(
        {"id": "tiny", "source": str(gguf), "kind": "llm", "context_length": 128}
    )
    return build_launch(slot, model, BuildContext(runtime="process"))


def stats(delays: list[float], attempts: list[int], began: list[float]) -> str:
    ms = sorted(d * 1000 for d in delays)
    starts = [b * 1000 for b in began if b == b]  # NaN: the naive poll is not timed

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, round(q * (len(ms) - 1)))]

    return (
        f"p50 {statistics.median(ms):7.1f} ms   p95 {pct(0.95):7.1f} ms   "
        f"p99 {pct(0.99):7.1f} ms   max {ms[-1]:7.1f} ms   "
        f"probes/load {statistics.mean(attempts):5.1f}"
        + (f"   last probe began p50 {statistics.median(starts):+6.1f} ms" if starts else "")
    )


def launches_for(args: argparse.Namespace, mode: str, tmp: Path) -> list[LaunchSpec]:
    tag = "".join(word[0] for word in mode.split())
    if args.server == "demo":
        return [
            # Spread the load times so the schedule's phase is not one value.
            demo_launch(f"b{tag}{i}", ["--load-seconds", f"{args.load_seconds + 0.1 * i:.2f}"])
            for i in range(args.servers)
        ]
    from tests.integration.tiny_gguf import write_tiny_llama

    gguf = tmp / "tiny.gguf"
    if not gguf.exists():
        write_tiny_llama(gguf)
    return [llama_cpp_python_launch(f"l{tag}{i}", gguf) for i in range(args.servers)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=10)
    parser.add_argument("--load-seconds", type=float, default=1.5)
    parser.add_argument("--server", choices=("demo", "llama-cpp-python"), default="demo")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument(
        "--sequential", action="store_true", help="one server at a time, not all at once"
    )
    args = parser.parse_args()
    modes = [m for m in MODES if m in args.modes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        runtime = ProcessRuntime(Path(tmp))
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            results: dict[str, tuple[list[float], list[int], list[float]]] = {}
            try:
                for mode in modes:
                    launches = launches_for(args, mode, Path(tmp))
                    if args.sequential:
                        measured = [
                            await one(runtime, session, la, mode, args.server) for la in launches
                        ]
                    else:
                        measured = await asyncio.gather(
                            *(one(runtime, session, la, mode, args.server) for la in launches)
                        )
                    results[mode] = tuple(list(column) for column in zip(*measured, strict=True))
                    for la in launches:
                        await runtime.stop(la.slot, timeout=5)
            finally:
                for observed in await runtime.list_managed():
                    await runtime.stop(observed.slot, timeout=5)
    what = (
        f"demo servers at once, load {args.load_seconds:g}.."
        f"{args.load_seconds + 0.1 * (args.servers - 1):g} s"
        if args.server == "demo"
        else "llama_cpp.server processes at once (tiny GGUF)"
    )
    how = "one after another" if args.sequential else "at once"
    print(f"time to ready: {args.servers} {what.replace('at once', how)}")
    for label, (delays, attempts, began) in results.items():
        print(f"  {label:16s} {stats(delays, attempts, began)}")
    if "log wake" in results and "schedule" in results:
        ours = statistics.median(results["log wake"][0])
        schedule = statistics.median(results["schedule"][0])
        print(f"  ratio (schedule / log wake, p50): {schedule / max(ours, 1e-6):.1f}x")


if __name__ == "__main__":
    asyncio.run(main())
