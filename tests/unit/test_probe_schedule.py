"""The readiness schedule and outcome logic, with a fake clock (no sleeping)."""

from __future__ import annotations

import asyncio

import pytest

from controller.kit.clock import FakeClock
from controller.probes.readiness import (
    ARMED_BASE_DELAY_S,
    CAP_S,
    ProbeOutcome,
    ProbeResult,
    next_delay,
    wait_ready,
)


def test_next_delay_is_fast_then_proportional_then_capped() -> None:
    assert next_delay(0.0) == pytest.approx(0.02)
    assert next_delay(0.1) == pytest.approx(0.02)
    assert next_delay(2.0) == pytest.approx(0.05)
    assert next_delay(10.0) == pytest.approx(0.25)
    assert next_delay(60.0) == CAP_S
    delays = [next_delay(t / 10) for t in range(0, 400)]
    assert delays == sorted(delays), "the schedule never speeds up again"


def test_armed_schedule_has_the_sparser_floor_and_the_same_cap() -> None:
    assert next_delay(0.0, armed=True) == ARMED_BASE_DELAY_S == 0.25
    assert next_delay(5.0, armed=True) == pytest.approx(0.25)
    assert next_delay(20.0, armed=True) == pytest.approx(0.5)
    assert next_delay(60.0, armed=True) == CAP_S
    assert all(next_delay(t / 10, armed=True) >= next_delay(t / 10) for t in range(0, 600))


def _scripted(clock: FakeClock, ready_at: float, outcome: ProbeOutcome = ProbeOutcome.READY):
    calls: list[float] = []

    async def attempt() -> ProbeResult:
        calls.append(clock.monotonic())
        if clock.monotonic() >= ready_at:
            return ProbeResult(outcome, "ok", ("m",))
        return ProbeResult(ProbeOutcome.STILL_WARMING, "HTTP 503")

    return attempt, calls


async def _alive() -> bool:
    return True


async def test_schedule_detects_a_fast_server_within_one_base_delay() -> None:
    clock = FakeClock(start=0.0)
    attempt, calls = _scripted(clock, ready_at=0.3)
    result = await wait_ready(attempt, alive=_alive, warmup_timeout_s=60, clock=clock)
    assert result.outcome is ProbeOutcome.READY
    assert calls[0] == 0.0, "first attempt is immediate"
    assert calls[-1] - 0.3 <= 0.02 + 1e-9
    assert all(d == pytest.approx(0.02) for d in clock.sleeps[:10])


async def test_schedule_backs_off_for_a_slow_server_but_never_beyond_one_second() -> None:
    clock = FakeClock(start=0.0)
    attempt, calls = _scripted(clock, ready_at=120.0)
    result = await wait_ready(attempt, alive=_alive, warmup_timeout_s=600, clock=clock)
    assert result.outcome is ProbeOutcome.READY
    assert max(clock.sleeps) <= CAP_S
    assert calls[-1] - 120.0 <= CAP_S
    # A naive 20 ms poll would have made 6,000 attempts; the schedule makes a few hundred.
    assert len(calls) < 300, len(calls)


async def test_timeout_reads_as_timed_out_not_error() -> None:
    clock = FakeClock(start=0.0)
    attempt, _ = _scripted(clock, ready_at=1e9)
    result = await wait_ready(attempt, alive=_alive, warmup_timeout_s=5, clock=clock)
    assert result.outcome is ProbeOutcome.TIMED_OUT
    assert "still warming after 5s" in result.message
    assert clock.monotonic() == pytest.approx(5.0)


async def test_no_model_ends_warming() -> None:
    clock = FakeClock(start=0.0)
    attempt, _ = _scripted(clock, ready_at=0.1, outcome=ProbeOutcome.NO_MODEL)
    result = await wait_ready(attempt, alive=_alive, warmup_timeout_s=5, clock=clock)
    assert result.outcome is ProbeOutcome.NO_MODEL


async def test_exit_while_warming() -> None:
    clock = FakeClock(start=0.0)
    attempt, calls = _scripted(clock, ready_at=1e9)
    alive_until = 0.5

    async def alive() -> bool:
        return clock.monotonic() < alive_until

    result = await wait_ready(attempt, alive=alive, warmup_timeout_s=60, clock=clock)
    assert result.outcome is ProbeOutcome.EXITED
    assert calls and calls[-1] < alive_until


async def test_an_armed_wake_that_never_fires_still_sees_the_server_within_the_floor() -> None:
    """A server whose ready line never comes (or is missed): the fallback schedule sees it
    at most ARMED_BASE_DELAY_S late, with far fewer attempts than the dense schedule."""
    clock = FakeClock(start=0.0)
    attempt, calls = _scripted(clock, ready_at=1.0)
    result = await wait_ready(
        attempt, alive=_alive, warmup_timeout_s=60, clock=clock, wake=asyncio.Event()
    )
    assert result.outcome is ProbeOutcome.READY
    assert calls[-1] - 1.0 <= ARMED_BASE_DELAY_S + 1e-9
    assert all(d >= ARMED_BASE_DELAY_S for d in clock.sleeps)
    assert len(calls) <= 6, calls  # the dense schedule: ~50 for a 1 s load


async def test_after_the_wake_fires_the_dense_schedule_takes_over() -> None:
    """The line came but the woken attempt found the server still warming (it logged a
    moment early): from then on the 20 ms schedule, not the armed 250 ms floor."""
    clock = FakeClock(start=0.0)
    wake = asyncio.Event()
    calls: list[float] = []
    woken: list[float] = []

    async def attempt() -> ProbeResult:
        calls.append(clock.monotonic())
        if clock.monotonic() >= 1.1:
            return ProbeResult(ProbeOutcome.READY, "ok", ("m",))
        if clock.monotonic() >= 0.9 and not woken:
            woken.append(clock.monotonic())
            wake.set()  # the line lands during this attempt
        return ProbeResult(ProbeOutcome.STILL_WARMING, "HTTP 503")

    result = await wait_ready(attempt, alive=_alive, warmup_timeout_s=60, clock=clock, wake=wake)
    assert result.outcome is ProbeOutcome.READY
    before = [d for d in clock.sleeps if d >= ARMED_BASE_DELAY_S]
    after = clock.sleeps[len(before) :]
    assert before and all(d >= ARMED_BASE_DELAY_S for d in before)
    assert after and all(d < ARMED_BASE_DELAY_S for d in after), clock.sleeps
    assert calls[-1] - 1.1 <= 0.03


async def test_a_server_just_started_is_first_tried_by_its_line_or_the_fallback() -> None:
    """``first_now=False`` (the log is followed from the server's first line, so the line
    cannot be missed): no attempt at once; without the line, the first attempt comes
    after the armed floor and the fallback goes on; a line that comes during that first
    wait is tried at once, and the dense schedule takes over from there."""
    clock = FakeClock(start=0.0)
    attempt, calls = _scripted(clock, ready_at=1.0)
    result = await wait_ready(
        attempt,
        alive=_alive,
        warmup_timeout_s=60,
        clock=clock,
        wake=asyncio.Event(),
        first_now=False,
    )
    assert result.outcome is ProbeOutcome.READY
    assert calls[0] == pytest.approx(ARMED_BASE_DELAY_S), calls
    assert calls[-1] - 1.0 <= ARMED_BASE_DELAY_S + 1e-9
    assert len(calls) == 4, calls  # 0.25, 0.5, 0.75, 1.0 (at once as well: 5)

    clock = FakeClock(start=0.0)
    wake = asyncio.Event()
    seen: list[float] = []

    async def woken() -> ProbeResult:
        seen.append(clock.monotonic())
        return ProbeResult(ProbeOutcome.STILL_WARMING, "HTTP 503")

    wake.set()  # the line is in the log already (read at the watch's first read)
    probing = asyncio.create_task(
        wait_ready(woken, alive=_alive, warmup_timeout_s=1, clock=clock, wake=wake, first_now=False)
    )
    result = await probing
    assert result.outcome is ProbeOutcome.TIMED_OUT
    assert seen[0] == 0.0  # the wake, not the fallback, brought the first attempt
    assert clock.sleeps[0] == pytest.approx(0.02), clock.sleeps  # dense from there
