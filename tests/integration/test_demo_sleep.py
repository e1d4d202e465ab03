"""The demo server's sleep mode (vLLM's dev-mode API) against slotctl's real sleeper.

:class:`controller.probes.sleep.HttpSleeper` (what the manager uses) drives a real demo server
on 127.0.0.1 through vLLM's protocol (:data:`controller.probes.sleep.VLLM_SLEEP`): level 1 and
level 2 (wake weights, reload them, wake the KV cache), ``/is_sleeping``, a failing wake, a
server without sleep mode; and the host RAM a level-1 sleeper really holds.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import aiohttp
import psutil
import pytest

from controller.probes.sleep import VLLM_SLEEP, HttpSleeper
from tests.integration.test_demo_server import MODEL, Demo, Spawn

MIB = 1 << 20


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Demo servers with the knobs given, all stopped after the test."""
    started: list[Demo] = []

    def start(*knobs: str) -> Demo:
        started.append(Demo(knobs, MODEL))
        return started[-1]

    yield start
    for demo in started:
        demo.stop()


async def _complete(base: str) -> int:
    body = {"model": "demo-model", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(base + "/v1/completions", json=body) as r:
        return r.status


async def test_level_one_sleeps_holds_host_ram_and_wakes(spawn: Spawn) -> None:
    demo = spawn(
        "--enable-sleep-mode",
        "--memory-mb",
        "64",
        "--sleep-memory-mb",
        "96",
        "--wake-seconds",
        "0.2",
    )
    await demo.ready()
    sleeper = HttpSleeper()
    assert await sleeper.asleep(demo.base, VLLM_SLEEP, 5) is False
    assert await _complete(demo.base) == 200
    rss_awake = psutil.Process(demo.pid).memory_info().rss
    assert await sleeper.sleep(demo.base, VLLM_SLEEP, 1, 5) == ""
    assert await sleeper.asleep(demo.base, VLLM_SLEEP, 5) is True
    assert await _complete(demo.base) == 503  # asleep: no inference
    rss_asleep = psutil.Process(demo.pid).memory_info().rss
    assert rss_asleep - rss_awake > 16 * MIB  # 96 MiB of host RAM instead of 64 MiB
    started = time.monotonic()
    assert await sleeper.wake(demo.base, VLLM_SLEEP, 1, 5) == ""
    assert time.monotonic() - started >= 0.2  # the configured wake time
    assert await sleeper.asleep(demo.base, VLLM_SLEEP, 5) is False
    assert await _complete(demo.base) == 200
    await demo.line("slotctl-demo awake model=demo-model")


async def test_level_two_wakes_through_the_weights_reload(spawn: Spawn) -> None:
    demo = spawn("--enable-sleep-mode", "--reload-seconds", "0.1")
    await demo.ready()
    sleeper = HttpSleeper()
    assert await sleeper.sleep(demo.base, VLLM_SLEEP, 2, 5) == ""
    async with aiohttp.ClientSession() as http:
        async with http.post(demo.base + "/wake_up?tags=weights") as answer:
            assert answer.status == 200
        # weights back but not reloaded: still asleep (the KV cache), and inference refused
        async with http.get(demo.base + "/is_sleeping") as answer:
            assert (await answer.json())["is_sleeping"] is True
    assert await sleeper.wake(demo.base, VLLM_SLEEP, 2, 5) == ""  # the three calls
    assert await sleeper.asleep(demo.base, VLLM_SLEEP, 5) is False
    assert await _complete(demo.base) == 200


async def test_a_failing_wake_says_why_and_a_server_without_sleep_mode_cannot_sleep(
    spawn: Spawn,
) -> None:
    failing = spawn("--enable-sleep-mode", "--fail-wake")
    plain = spawn()
    await failing.ready()
    await plain.ready()
    sleeper = HttpSleeper()
    assert await sleeper.sleep(failing.base, VLLM_SLEEP, 1, 5) == ""
    failed = await sleeper.wake(failing.base, VLLM_SLEEP, 1, 5)
    assert failed == "POST /wake_up: HTTP 500"
    assert await sleeper.asleep(failing.base, VLLM_SLEEP, 5) is True  # still asleep
    failed = await sleeper.sleep(plain.base, VLLM_SLEEP, 1, 5)
    assert failed == "POST /sleep?level=1&mode=wait: HTTP 404"
    assert await sleeper.asleep(plain.base, VLLM_SLEEP, 5) is None  # it does not say


async def test_a_wake_that_takes_too_long_times_out(spawn: Spawn) -> None:
    demo = spawn("--enable-sleep-mode", "--wake-seconds", "3")
    await demo.ready()
    sleeper = HttpSleeper()
    assert await sleeper.sleep(demo.base, VLLM_SLEEP, 1, 5) == ""
    failed = await sleeper.wake(demo.base, VLLM_SLEEP, 1, 0.5)
    assert failed.startswith("POST /wake_up: TimeoutError"), failed


async def test_a_level_two_wake_has_one_timeout_for_its_three_calls(spawn: Spawn) -> None:
    # Each call (wake the weights, reload them, wake the KV cache) takes 0.4 s, within the
    # 1 s budget alone; the three together do not: the wake times out (a slower machine
    # only makes it later).
    demo = spawn("--enable-sleep-mode", "--wake-seconds", "0.4", "--reload-seconds", "0.4")
    await demo.ready()
    sleeper = HttpSleeper()
    assert await sleeper.sleep(demo.base, VLLM_SLEEP, 2, 5) == ""
    started = time.monotonic()
    failed = await sleeper.wake(demo.base, VLLM_SLEEP, 2, 1.0)
    assert "TimeoutError" in failed, failed
    assert time.monotonic() - started < 2.0  # about the budget (slack for a loaded machine)


async def _stream_tokens(base: str, started: asyncio.Event) -> tuple[int, str | None]:
    """A streamed chat of 20 tokens at 20 tokens/s: (content chunks, last finish_reason)."""
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "stream": True,
    }
    tokens, finish = 0, None
    async with (
        aiohttp.ClientSession() as http,
        http.post(base + "/v1/chat/completions", json=body) as answer,
    ):
        assert answer.status == 200
        async for line in answer.content:
            if not line.startswith(b"data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content"):
                tokens += 1
                started.set()
            finish = choice["finish_reason"] or finish
    return tokens, finish


async def test_slotctl_sleeps_with_mode_wait_so_requests_in_flight_finish(spawn: Spawn) -> None:
    """Issue 40, item 6: vLLM's ``/sleep`` aborts the requests in flight unless asked
    ``mode=wait`` (docs/features/sleep_mode.md: "The default is mode="abort""). slotctl's
    sleeper asks for ``wait``: a stream in flight ends whole, then the server sleeps."""
    demo = spawn("--enable-sleep-mode", "--tokens-per-second", "20")
    await demo.ready()
    started = asyncio.Event()
    stream = asyncio.create_task(_stream_tokens(demo.base, started))
    await asyncio.wait_for(started.wait(), 10)
    assert await HttpSleeper().sleep(demo.base, VLLM_SLEEP, 1, 10) == ""
    assert await stream == (20, "length")  # whole: not aborted by the sleep
    assert await HttpSleeper().asleep(demo.base, VLLM_SLEEP, 5) is True


async def test_the_demo_aborts_requests_in_flight_on_a_sleep_by_default(spawn: Spawn) -> None:
    """The double does what vLLM does without ``mode``: the stream in flight is cut
    (``finish_reason: abort``), so the test above would fail without ``mode=wait``."""
    demo = spawn("--enable-sleep-mode", "--tokens-per-second", "20")
    await demo.ready()
    started = asyncio.Event()
    stream = asyncio.create_task(_stream_tokens(demo.base, started))
    await asyncio.wait_for(started.wait(), 10)
    async with aiohttp.ClientSession() as http, http.post(demo.base + "/sleep?level=1") as r:
        assert r.status == 200
    tokens, finish = await stream
    assert tokens < 20 and finish == "abort"
    async with aiohttp.ClientSession() as http, http.post(demo.base + "/sleep?mode=nap") as r:
        assert r.status == 400  # abort, wait or keep, as vLLM accepts
