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

from controller.probes.readiness import HttpProber, ProbeOutcome, ProbeResult
from controller.runtime.logwatch import follow
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
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
    # one attempt: the one the ready line woke (a server just started is not tried at
    # once: its log is followed from its first line, so the line cannot be missed)
    assert result.outcome is ProbeOutcome.READY and result.attempts == 1, result


async def test_loaded_without_a_model_line_wakes_the_probe_too(runtime: ProcessRuntime) -> None:
    result = await _wait_ready_stuck(runtime, ["--load-seconds", "0.5", "--empty-models"])
    assert result.outcome is ProbeOutcome.NO_MODEL and result.attempts == 1, result


async def test_a_line_written_before_the_probe_watches_still_wakes_it(
    runtime: ProcessRuntime,
) -> None:
    """The probe begins to watch after the spawn; a server quicker than that (its ready
    line already in the log) is still seen at once: the log of a server this runtime
    started is followed from its first line, not from the moment the watch began."""
    launch = demo_launch("quick", ["--load-seconds", "0"])
    await runtime.start(launch)
    assert runtime.logs_from_start("quick")
    deadline = asyncio.get_running_loop().time() + 20
    while not any("slotctl-demo ready" in line for line in await runtime.logs("quick")):
        assert asyncio.get_running_loop().time() < deadline, await runtime.logs("quick")
        await asyncio.sleep(0.02)
    result = await wait_ready_stuck(runtime, launch, timeout=10)
    assert result.outcome is ProbeOutcome.READY and result.attempts == 1, result


async def test_an_adopted_server_is_tried_at_once(runtime: ProcessRuntime, tmp_path: Path) -> None:
    """A server the runtime did not start (adopted after a restart) has its log followed
    from now on: its ready line may be long past, so the probe tries at once."""
    launch = demo_launch("adopted", ["--load-seconds", "0"])
    await runtime.start(launch)
    await wait_ready_stuck(runtime, launch, timeout=20)
    restarted = ProcessRuntime(tmp_path / "state")
    assert (await restarted.start(launch)).running  # adopted, not started
    assert not restarted.logs_from_start("adopted")
    result = await wait_ready_stuck(restarted, launch, timeout=10)
    assert result.outcome is ProbeOutcome.READY and result.attempts == 1, result


class Heard:
    """What a log follower reported (its ``on_text``), and a wait for the next report."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.got = asyncio.Event()

    def __call__(self, text: str) -> None:
        self.seen.append(text)
        self.got.set()

    @property
    def text(self) -> str:
        return "".join(self.seen)

    async def next(self) -> None:
        await asyncio.wait_for(self.got.wait(), 5)
        self.got.clear()


async def test_follow_from_an_offset_reports_what_is_there_already(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"--- header\nfirst line\n")
    heard = Heard()
    stop = follow(path, heard, offset=len(b"--- header\n"))
    assert stop is not None
    try:
        await heard.next()
        assert heard.text == "first line\n"
        with path.open("ab") as log:
            log.write(b"second line\n")
        await heard.next()
        assert heard.text == "first line\nsecond line\n"
    finally:
        stop()
    stopped_at_once = follow(path, heard, offset=0)  # stopped before its first read
    assert stopped_at_once is not None
    stopped_at_once()
    await asyncio.sleep(0.05)
    assert heard.text == "first line\nsecond line\n"


async def test_follow_reports_appended_text_until_stopped(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"before the watch\n")
    heard = Heard()
    stop = follow(path, heard)
    assert stop is not None
    try:
        with path.open("ab") as log:
            log.write("one \u00e9".encode()[:-1])  # a UTF-8 character split across writes
            log.flush()
            await heard.next()
            log.write("\u00e9".encode()[-1:] + b"\n")
            log.flush()
            await heard.next()
        assert heard.text == "one \u00e9\n"  # only what came after the watch began
        path.write_bytes(b"after a truncation\n")  # copy-truncate: read from the top
        await heard.next()
        assert heard.text.endswith("after a truncation\n")
    finally:
        stop()
    count = len(heard.seen)
    with path.open("ab") as log:
        log.write(b"after the stop\n")
    await asyncio.sleep(0.1)
    assert len(heard.seen) == count


async def test_follow_of_a_missing_log_is_none(tmp_path: Path) -> None:
    assert follow(tmp_path / "nope.log", lambda text: None) is None


def test_the_manager_probes_with_its_runtime_as_the_log_source(tmp_path: Path) -> None:
    runtime = ProcessRuntime(tmp_path / "state")
    manager = SlotManager(runtime=runtime, state_dir=tmp_path / "state", config_dir=tmp_path)
    assert isinstance(manager.prober, HttpProber) and manager.prober.logs is runtime
