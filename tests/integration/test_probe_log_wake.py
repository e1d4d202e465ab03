"""Event-driven readiness against real servers: the slot log's ready line wakes the probe.

The process runtime follows the slot's log file (``controller/runtime/logwatch.py``,
inotify); :class:`HttpProber` built with it probes as soon as the provider's
``ready_log`` line lands. The clock here never ends a scheduled wait by itself (each
sleep lasts an hour), so a probe that answers at all was woken by the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controller.probe import HttpProber, ProbeOutcome, ProbeResult
from controller.runtime.logwatch import follow
from controller.runtime.process import ProcessRuntime
from controller.slots import SlotManager
from tests.integration.helpers import demo_launch
from tests.unit.test_probe_wake import wait_ready_stuck


@pytest.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[ProcessRuntime]:
    rt = ProcessRuntime(tmp_path / "state")
    yield rt
    for observed in await rt.list_managed():
        await rt.stop(observed.slot, timeout=5.0)


async def _wait_ready_stuck(runtime: ProcessRuntime, knobs: list[str]) -> ProbeResult:
    launch = demo_launch("wake", knobs)
    assert launch.probe.ready_log is not None  # the demo provider declares its line
    await runtime.start(launch)
    return await wait_ready_stuck(runtime, launch)


async def test_ready_line_wakes_the_probe(runtime: ProcessRuntime) -> None:
    result = await _wait_ready_stuck(runtime, ["--load-seconds", "0.5"])
    # the first attempt (at once: 503 while loading), then the one the ready line woke
    assert result.outcome is ProbeOutcome.READY and result.attempts == 2, result


async def test_loaded_without_a_model_line_wakes_the_probe_too(runtime: ProcessRuntime) -> None:
    result = await _wait_ready_stuck(runtime, ["--load-seconds", "0.5", "--empty-models"])
    assert result.outcome is ProbeOutcome.NO_MODEL and result.attempts == 2, result


async def test_follow_reports_appended_text_until_stopped(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"before the watch\n")
    seen: list[str] = []
    got = asyncio.Event()

    def on_text(text: str) -> None:
        seen.append(text)
        got.set()

    stop = follow(path, on_text)
    assert stop is not None
    try:
        with path.open("ab") as log:
            log.write("one \u00e9".encode()[:-1])  # a UTF-8 character split across writes
            log.flush()
            await asyncio.wait_for(got.wait(), 5)
            got.clear()
            log.write("\u00e9".encode()[-1:] + b"\n")
            log.flush()
            await asyncio.wait_for(got.wait(), 5)
        assert "".join(seen) == "one \u00e9\n"  # only what came after the watch began
        got.clear()
        path.write_bytes(b"after a truncation\n")  # copy-truncate: read from the top
        await asyncio.wait_for(got.wait(), 5)
        assert "".join(seen).endswith("after a truncation\n")
    finally:
        stop()
    count = len(seen)
    with path.open("ab") as log:
        log.write(b"after the stop\n")
    await asyncio.sleep(0.1)
    assert len(seen) == count


async def test_follow_of_a_missing_log_is_none(tmp_path: Path) -> None:
    assert follow(tmp_path / "nope.log", lambda text: None) is None


def test_the_manager_probes_with_its_runtime_as_the_log_source(tmp_path: Path) -> None:
    runtime = ProcessRuntime(tmp_path / "state")
    manager = SlotManager(runtime=runtime, state_dir=tmp_path / "state", config_dir=tmp_path)
    assert isinstance(manager.prober, HttpProber) and manager.prober.logs is runtime
