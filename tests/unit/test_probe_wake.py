"""Event-driven readiness: a log line wakes the probe (controller/probes/readiness.py).

The clock here never ends a sleep by itself (each ``sleep`` lasts an hour of real time),
so an attempt that comes early can only have been woken by the event.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

from controller.probes.readiness import HttpProber, LogLines, ProbeOutcome, ProbeResult, wait_ready
from controller.providers.base import READY_LOG
from controller.runtime.base import LaunchSpec, Runtime


class StuckClock:
    """Real monotonic time; every sleep takes an hour (the schedule never fires)."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def time(self) -> float:
        return self.monotonic()

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(3600)


async def wait_ready_stuck(
    runtime: Runtime, launch: LaunchSpec, timeout: float = 30.0
) -> ProbeResult:
    """Probe a real server under a clock whose schedule never fires: only the server's own
    ready line (followed through ``runtime``) can wake the probe after its first try."""
    prober = HttpProber(logs=runtime)

    async def alive() -> bool:
        return (await runtime.inspect(launch.slot)).running

    try:
        return await asyncio.wait_for(
            prober.wait_ready(
                launch.endpoint,
                launch.probe,
                slot=launch.slot,
                alive=alive,
                warmup_timeout_s=120,
                clock=StuckClock(),
            ),
            timeout=timeout,
        )
    finally:
        await prober.close()


async def _alive() -> bool:
    return True


async def test_a_wake_cuts_the_scheduled_wait_short() -> None:
    ready = asyncio.Event()
    wake = asyncio.Event()
    calls: list[float] = []

    async def attempt() -> ProbeResult:
        calls.append(asyncio.get_running_loop().time())
        if ready.is_set():
            return ProbeResult(ProbeOutcome.READY, "ok", ("m",))
        return ProbeResult(ProbeOutcome.STILL_WARMING, "HTTP 503")

    async def announce() -> None:
        await asyncio.sleep(0.05)
        ready.set()
        wake.set()  # what the log watcher does when the ready line shows

    clock = StuckClock()
    announcer = asyncio.create_task(announce())
    result = await asyncio.wait_for(
        wait_ready(attempt, alive=_alive, warmup_timeout_s=60, clock=clock, wake=wake), 10
    )
    await announcer
    assert result.outcome is ProbeOutcome.READY and result.attempts == 2
    assert len(clock.sleeps) == 1  # one scheduled wait, cut short by the wake
    assert not wake.is_set(), "a wake is consumed by the attempt it caused"


async def test_a_wake_during_an_attempt_is_not_lost() -> None:
    wake = asyncio.Event()
    outcomes = iter([ProbeOutcome.STILL_WARMING, ProbeOutcome.NO_MODEL])

    async def attempt() -> ProbeResult:
        wake.set()  # the line lands while the first attempt is in flight
        return ProbeResult(next(outcomes), "")

    clock = StuckClock()
    result = await asyncio.wait_for(
        wait_ready(attempt, alive=_alive, warmup_timeout_s=60, clock=clock, wake=wake), 10
    )
    assert result.outcome is ProbeOutcome.NO_MODEL and result.attempts == 2
    assert clock.sleeps == [], "the set wake means: probe again at once"


async def test_without_a_wake_the_schedule_alone_decides() -> None:
    async def attempt() -> ProbeResult:
        return ProbeResult(ProbeOutcome.STILL_WARMING, "HTTP 503")

    probing = asyncio.create_task(
        wait_ready(attempt, alive=_alive, warmup_timeout_s=60, clock=StuckClock())
    )
    await asyncio.sleep(0.1)
    assert not probing.done()  # stuck in the hour-long scheduled sleep
    probing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await probing


async def test_a_woken_attempt_that_finds_no_server_goes_back_to_the_schedule() -> None:
    wake = asyncio.Event()
    wake.set()  # a line that matched too early: the HTTP probe still decides
    calls = 0

    async def attempt() -> ProbeResult:
        nonlocal calls
        calls += 1
        return ProbeResult(ProbeOutcome.STILL_WARMING, "connection refused")

    clock = StuckClock()
    probing = asyncio.create_task(
        wait_ready(attempt, alive=_alive, warmup_timeout_s=60, clock=clock, wake=wake)
    )
    await asyncio.sleep(0.1)
    assert not probing.done() and calls == 2 and len(clock.sleeps) == 1
    probing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await probing


def test_log_lines_match_whole_lines_across_chunks() -> None:
    hits: list[int] = []
    lines = LogLines(re.compile(r"^server is listening on "), lambda: hits.append(1))
    lines("loading model...\nserver is list")
    assert hits == []  # half a line is not a line yet
    lines("ening on http://127.0.0.1:8080\n")
    assert hits == [1]
    lines("progress 10%\rprogress 100%\rserver is listening on x\r")
    assert hits == [1, 1]
    lines("x" * 200_000)  # a line that never ends is cut, not kept whole
    assert len(lines._partial) <= 64 * 1024
    lines("\nnot server is listening on \n")
    assert hits == [1, 1]


def test_provider_patterns_match_what_the_servers_print() -> None:
    def matches(provider: str, line: str) -> bool:
        return re.search(READY_LOG[provider], line) is not None

    assert matches("demo", "slotctl-demo ready model=m port=8080 t=1700000000.123456")
    assert matches("demo", "slotctl-demo loaded without a model port=8080 (--empty-models)")
    assert not matches("demo", "slotctl-demo listening host=127.0.0.1 port=8080 model=m pid=1")
    assert matches(
        "llamacpp",
        "main: server is listening on http://127.0.0.1:8080 - starting the main loop",
    )
    assert matches(
        "llama-cpp-python", "INFO:     Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C)"
    )
    # uvicorn.run logs this before it binds its port: not the ready line for that server
    assert not matches("llama-cpp-python", "INFO:     Application startup complete.")
    assert matches("vllm", "INFO:     Application startup complete.")
