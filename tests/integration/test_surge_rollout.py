"""Surge rollouts with the real process runtime and demo servers (issue 25, item 1).

A changed slot's new server starts on a fresh port beside the old one, is probed ready,
the endpoint switches, the old one drains and stops: requests taken the way the router
takes them (lease, endpoint, HTTP, release) never fail across the switch. A new server
that fails never replaces a working old one. A slot without room beside the old one, or
with a declared port, is recreated and the decision says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from controller.model.errors import SlotctlError
from controller.model.events import EventKind
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.probes.readiness import HttpProber
from controller.runtime.base import RunStatus
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.slots.surge import ROLLOUT_RECORD
from controller.spec.loader import DesiredSlot, normalise
from controller.spec.schema import ControllerSettings, SlotSpec
from tests.integration.helpers import demo_launch
from tests.integration.test_manager_scenarios import Env, model

S = SlotState


async def until(check: Any, what: str, timeout: float = 30.0) -> None:
    """Poll ``check`` until it holds (a deadline, never a fixed sleep)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    environment = Env(tmp_path)
    try:
        yield environment
    finally:
        for manager in reversed(environment.managers):
            with contextlib.suppress(SlotctlError):
                await manager.stop_all(reason="test teardown")
            await manager.close()


def servers_of(runtime: ProcessRuntime, slot: str) -> list[psutil.Process]:
    return runtime.labelled.leaders(slot)


def auto_slot(env: Env, *args: str, **kw: Any) -> SlotSpec:
    return env.slot("chat", "chat-m", *args, port=None, **kw)


async def _client(
    manager: SlotManager, stop: asyncio.Event, outcomes: list[str], body: dict[str, Any]
) -> None:
    """Requests one after another the way the router takes them: a lease, the slot's
    endpoint read then, the HTTP request, the release."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            lease = await manager.acquire("chat")
            try:
                endpoint = manager.endpoint("chat")
                async with session.post(f"{endpoint}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    outcomes.append("ok" if resp.status == 200 else f"status {resp.status}")
            except aiohttp.ClientError as exc:
                outcomes.append(f"failed: {exc!r}")
            finally:
                manager.release(lease)


async def _with_load(
    manager: SlotManager, change: Any, *, clients: int = 4, tokens: int = 8
) -> tuple[Any, list[str]]:
    stop = asyncio.Event()
    outcomes: list[str] = []
    body = {
        "model": "chat-m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
    }
    tasks = [asyncio.create_task(_client(manager, stop, outcomes, body)) for _ in range(clients)]
    try:
        await asyncio.sleep(0.3)
        result = await change()
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return result, outcomes


async def test_a_surge_switches_without_a_failed_request(env: Env) -> None:
    old = auto_slot(env, "--tokens-per-second", "200")
    m = await env.manager(env.desired([old], [model("chat-m", 2)]))
    await m.load("chat", resident=False)
    runtime = m.runtime
    assert isinstance(runtime, ProcessRuntime)
    old_port = int((m.endpoint("chat") or "").rsplit(":", 1)[1])
    (old_server,) = servers_of(runtime, "chat")
    new = auto_slot(env, "--tokens-per-second", "200", "--load-seconds", "0.5")
    want = DesiredSlot(spec=new, stack="scenarios")
    assert m.rollout_for(want).surge, m.rollout_for(want)
    events: list[Any] = []
    m.events.add_listener(lambda e: events.append(e) if e.kind == EventKind.ROLLOUT else None)
    shown: list[tuple[str, str | None] | None] = []  # the slot's view at each rollout event

    def seen(event: Any) -> None:
        if event.kind == EventKind.ROLLOUT:
            live = m.view("chat").rollout
            shown.append((live.phase, live.server) if live is not None else None)

    m.events.add_listener(seen)

    async def change() -> Any:
        m.upsert(want)
        return await m.roll_out("chat", want)

    decision, outcomes = await _with_load(m, change)
    assert decision.surge
    assert outcomes and all(o == "ok" for o in outcomes), [o for o in outcomes if o != "ok"]
    assert [e.details["phase"] for e in events] == ["started", "switched", "done"]
    assert shown == [("starting", "starting"), ("switched", "ready"), None]
    # One server of the new config remains, on another port; the old one is gone.
    (server,) = servers_of(runtime, "chat")
    assert server.pid != old_server.pid and not old_server.is_running()
    assert m.observe("chat") is not None
    assert m.observe("chat").config_hash == m.launch_hash(want)  # type: ignore[union-attr]
    assert int((m.endpoint("chat") or "").rsplit(":", 1)[1]) != old_port
    assert m.view("chat").state in (S.READY, S.SERVING)
    assert m.store.read_aux("chat", ROLLOUT_RECORD) is None
    assert m.store.read_port("chat") == int((m.endpoint("chat") or "").rsplit(":", 1)[1])


async def test_requests_in_flight_finish_on_the_old_server(env: Env) -> None:
    """A slow answer taken before the switch completes on the old server (the drain)."""
    old = auto_slot(env, "--tokens-per-second", "20")
    m = await env.manager(env.desired([old], [model("chat-m", 2)]))
    await m.load("chat", resident=False)
    want = DesiredSlot(spec=auto_slot(env, "--tokens-per-second", "21"), stack="scenarios")
    lease = await m.acquire("chat")
    endpoint = m.endpoint("chat")
    body = {"model": "chat-m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 30}

    async def slow() -> int:
        url = f"{endpoint}/v1/chat/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
            await resp.read()
            return resp.status

    request = asyncio.create_task(slow())
    await asyncio.sleep(0.2)
    m.upsert(want)
    rolling = asyncio.create_task(m.roll_out("chat", want))
    # Both servers' memory counts while they run side by side (the new one starting or
    # switched to, the old one draining): waited for, not slept on (issue 40, item 16).
    await until(lambda: m.admitted_bytes("gpu") == 4 * GIB, "both servers' memory counted")
    status = await request  # ~1.5 s of tokens: the switch happens meanwhile
    m.release(lease)
    assert status == 200
    assert (await rolling).surge
    assert m.endpoint("chat") != endpoint
    assert m.admitted_bytes("gpu") == 2 * GIB


async def test_a_failed_new_server_keeps_the_old_one_serving(env: Env) -> None:
    old = auto_slot(env)
    m = await env.manager(env.desired([old], [model("chat-m", 2)]))
    await m.load("chat", resident=False)
    runtime = m.runtime
    assert isinstance(runtime, ProcessRuntime)
    endpoint = m.endpoint("chat")
    old_hash = m.observe("chat").config_hash  # type: ignore[union-attr]
    want = DesiredSlot(spec=auto_slot(env, "--fail-on-load"), stack="scenarios")
    events: list[Any] = []
    m.events.add_listener(lambda e: events.append(e) if e.kind == EventKind.ROLLOUT else None)

    async def change() -> Any:
        m.upsert(want)
        with pytest.raises(SlotctlError) as failed:
            await m.roll_out("chat", want)
        return failed.value

    error, outcomes = await _with_load(m, change)
    assert "exited while warming" in error.message
    assert outcomes and all(o == "ok" for o in outcomes), outcomes
    assert m.endpoint("chat") == endpoint
    assert m.observe("chat").config_hash == old_hash  # type: ignore[union-attr]
    assert len(servers_of(runtime, "chat")) == 1
    assert m.view("chat").state in (S.READY, S.SERVING)
    assert [e.details["phase"] for e in events] == ["started", "failed"]
    assert m.store.read_aux("chat", ROLLOUT_RECORD) is None
    assert "the old server keeps serving" in events[-1].message
    # The next try is under the crash-loop breaker.
    assert m.view("chat").failures == 1
    assert m.view("chat").retry_after_s > 0
    shown = m.view("chat").rollout  # the slot's view says the rollout failed
    assert shown is not None and (shown.way, shown.phase, shown.server) == (
        "surge",
        "failed",
        "failed",
    )
    assert "rollout failed" in shown.message


async def test_no_room_or_a_declared_port_recreates_and_says_why(env: Env) -> None:
    env.budget_gb = 6.0
    m = await env.manager(env.desired([auto_slot(env)], [model("chat-m", 4)]))
    await m.load("chat", resident=False)
    want = DesiredSlot(spec=auto_slot(env, "--load-seconds", "0.1"), stack="scenarios")
    decision = m.rollout_for(want)
    assert decision.text == "recreate: no room to surge, needs 4.00 GiB, 2.00 GiB free"
    fixed = DesiredSlot(spec=env.slot("chat", "chat-m", port=env.port()), stack="scenarios")
    assert "is declared: two servers cannot share it" in m.rollout_for(fixed).text
    m.upsert(want)
    assert not (await m.roll_out("chat", want)).surge  # the caller recreates
    runtime = m.runtime
    assert isinstance(runtime, ProcessRuntime)
    assert len(servers_of(runtime, "chat")) == 1


async def test_a_cancelled_surge_stops_its_new_server(env: Env) -> None:
    """The controller stopping mid-surge (its reconciler cancelled): the new server is
    stopped with it, the old one is the slot's, no rollout record is left."""
    m = await env.manager(env.desired([auto_slot(env)], [model("chat-m", 2)]))
    await m.load("chat", resident=False)
    runtime = m.runtime
    assert isinstance(runtime, ProcessRuntime)
    (old_server,) = servers_of(runtime, "chat")
    want = DesiredSlot(spec=auto_slot(env, "--load-seconds", "30"), stack="scenarios")
    m.upsert(want)
    rolling = asyncio.create_task(m.roll_out("chat", want))
    await until(lambda: len(servers_of(runtime, "chat")) == 2, "the new one starting")
    rolling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rolling
    assert [p.pid for p in servers_of(runtime, "chat")] == [old_server.pid]
    assert m.store.read_aux("chat", ROLLOUT_RECORD) is None
    assert m.admitted_bytes("gpu") == 2 * GIB


async def test_the_old_server_exiting_mid_surge_does_not_stop_the_new_one(env: Env) -> None:
    """The old server dies while the new one warms: the surge still switches (the old
    one's stop finds it gone), the exit check after it stops nothing, and the new server
    serves."""
    m = await env.manager(env.desired([auto_slot(env)], [model("chat-m", 2)]))
    await m.load("chat", resident=False)
    runtime = m.runtime
    assert isinstance(runtime, ProcessRuntime)
    (old_server,) = servers_of(runtime, "chat")
    want = DesiredSlot(spec=auto_slot(env, "--load-seconds", "1"), stack="scenarios")
    m.upsert(want)
    rolling = asyncio.create_task(m.roll_out("chat", want))
    await asyncio.sleep(0.3)
    os.kill(old_server.pid, signal.SIGKILL)  # reaped by the runtime (our child)
    checking = asyncio.create_task(m.check_exits())  # sees the old one gone
    assert (await rolling).surge
    await checking
    (server,) = servers_of(runtime, "chat")
    assert server.pid != old_server.pid
    assert m.view("chat").state in (S.READY, S.SERVING)
    assert m.observe("chat").config_hash == m.launch_hash(want)  # type: ignore[union-attr]


async def test_a_surge_server_of_a_slot_nobody_declares_is_reaped(env: Env) -> None:
    """A rollout interrupted by a restart, its slot removed meanwhile: the orphan reaper
    stops the slot's second server too (it is not the slot's own server)."""
    m = await env.manager(env.desired([], [model("chat-m", 2)]))
    runtime = m.runtime
    assert isinstance(runtime, ProcessRuntime)
    await runtime.surge.start_instance(demo_launch("gone"))
    assert len(servers_of(runtime, "gone")) == 1
    assert (await runtime.inspect("gone")).status is RunStatus.MISSING  # not the slot's own
    assert await m.reap_orphan("gone")
    assert servers_of(runtime, "gone") == []


async def test_a_surge_goes_to_another_gpu_when_its_own_is_full(env: Env) -> None:
    """Two 8 GiB GPUs, a 6 GiB slot on GPU 0: its new server does not fit beside the old
    one there, but does on GPU 1 (the multi-GPU placement); it is surged there, and the
    slot is placed on GPU 1 afterwards."""
    from tests.unit.test_multigpu import GpuProbe

    probe = GpuProbe([8, 8])
    settings = ControllerSettings(safety_margin_gb=0.0)

    def make(*args: str) -> SlotSpec:
        data = {"name": "chat", "provider": "demo", "model": {"default": "chat-m"}}
        data.update(device="gpu", server={"extra_args": list(args)})
        return normalise(SlotSpec.model_validate(data), settings)

    spec = make()
    m = SlotManager(
        runtime=ProcessRuntime(env.state_dir, kill_grace_s=5.0),
        state_dir=env.state_dir,
        config_dir=env.config_dir,
        settings=settings,
        prober=HttpProber(timeout_s=5.0),
        memory=probe,
        config=ManagerConfig(stop_timeout_s=5.0),
    )
    env.managers.append(m)
    probe.used_by = m.resident_bytes
    await m.set_desired(env.desired([spec], [model("chat-m", 6)]))
    await m.load("chat", resident=False)
    assert m.view("chat").gpus == (0,)
    want = DesiredSlot(spec=make("--tokens-per-second", "50"), stack="scenarios")
    decision = m.rollout_for(want)
    assert decision.surge and "gpu:1" in decision.reason, decision
    m.upsert(want)
    assert (await m.roll_out("chat", want)).surge
    assert m.view("chat").gpus == (1,)
    assert m.admitted_bytes("gpu:0") == 0 and m.admitted_bytes("gpu:1") == 6 * GIB
    assert m.observe("chat").config_hash == m.launch_hash(want)  # type: ignore[union-attr]
