"""The demo server's sleep mode (vLLM's dev-mode API) against slotctl's real sleeper.

:class:`controller.probes.sleep.HttpSleeper` (what the manager uses) drives a real demo server
on 127.0.0.1 through vLLM's protocol (:data:`controller.probes.sleep.VLLM_SLEEP`): level 1 and
level 2 (wake weights, reload them, wake the KV cache), ``/is_sleeping``, a failing wake, a
server without sleep mode; and the host RAM a level-1 sleeper really holds.
"""

from __future__ import annotations

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
    assert await sleeper.sleep(plain.base, VLLM_SLEEP, 1, 5) == "POST /sleep?level=1: HTTP 404"
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
