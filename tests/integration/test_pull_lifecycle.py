"""The slot lifecycle's ``pulling`` for real (issue 35, SPEC §1 and §10): a SlotManager
whose ``files`` seam is the real model-files engine, pulling through the real
``huggingface_hub`` client from the hub server of ``tests/integration/hubserver.py``; the
servers are the fake runtime's (the real llama.cpp server on a pulled file is
``tests/e2e/test_model_pull_e2e.py``'s). Each test waits on state (the hub's counters,
the slot's state, files on disk), never on time.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants as hf_constants

from controller.kit.eventbus import EventBus
from controller.model.errors import (
    InsufficientDisk,
    ModelAccessDenied,
    ModelFileMissing,
    SlotctlError,
)
from controller.model.events import EventKind
from controller.model.lifecycle import SlotState
from controller.model.sizes import GIB
from controller.modelfiles.hub import HubSettings
from controller.modelfiles.pull import ModelFiles
from controller.probes.memory import FakeMemoryProbe
from controller.runtime.fake import FakeProber, FakeRuntime, FakeSleeper
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from tests.integration.helpers import free_port
from tests.integration.hubserver import HubServer

MIB = 1024 * 1024
S = SlotState


def blob(size: int, seed: int = 0) -> bytes:
    block = (b"%08d" % seed) * 8192  # 64 KiB
    return (block * (size // len(block) + 1))[:size]


async def until(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait for a state (the deadline only turns a hang into a failure)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


@pytest.fixture(autouse=True)
def long_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A held response must not look like a stalled one to the client's read timeout."""
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 300)


def slot(name: str, model: str, **kw: Any) -> SlotSpec:
    data: dict[str, Any] = {
        "name": name,
        "provider": "demo",
        "port": free_port(),
        "model": {"default": model},
        "device": "cpu",
    }
    data.update(kw)
    return normalise(SlotSpec.model_validate(data), ControllerSettings())


class World:
    """A manager over the fake runtime whose model files are the real engine's."""

    def __init__(self, tmp: Path, hub: HubServer, models_dir: Path | None = None) -> None:
        self.tmp = tmp
        self.hub = hub
        self.models_dir = models_dir or tmp / "models"
        self.runtime = FakeRuntime()
        self.events = EventBus()
        self.files = ModelFiles(
            self.models_dir,
            tmp / "state",
            hub_settings=HubSettings(endpoint=hub.endpoint),
            margin_bytes=0,
            progress_interval_s=0.0,
        )
        self.manager = SlotManager(
            runtime=self.runtime,
            state_dir=tmp / "state",
            config_dir=tmp / "config",
            prober=FakeProber(self.runtime),
            memory=FakeMemoryProbe({"cpu": 64 * GIB, "gpu": 24 * GIB}),
            events=self.events,
            config=ManagerConfig(stop_timeout_s=1.0, models_dir=self.models_dir),
            sleeper=FakeSleeper(self.runtime),
            files=self.files,
        )
        self.files.references = self.manager.file_references

    async def declare(self, models: list[ModelSpec], slots: list[SlotSpec]) -> None:
        await self.manager.set_desired(
            DesiredState(
                stacks=("t",),
                models={m.id: m for m in models},
                slots={s.name: DesiredSlot(spec=s, stack="t") for s in slots},
            )
        )

    def lfs_gets(self) -> int:
        return sum(1 for r in self.hub.requests if r.route == "lfs" and r.method == "GET")

    def states(self, name: str) -> list[str]:
        return [after for slot, _, after in self.manager.transitions if slot == name]

    async def close(self) -> None:
        await self.manager.stop_all()
        await self.manager.close()


@pytest.fixture
async def world(tmp_path: Path, hub: HubServer) -> AsyncIterator[World]:
    w = World(tmp_path, hub)
    yield w
    hub.release()
    await w.close()


async def test_a_load_pulls_its_model_with_progress_then_starts_on_the_verified_file(
    world: World, hub: HubServer
) -> None:
    data = blob(6 * MIB, 1)
    hub.add_repo("org/chat", {"chat.gguf": data})
    hub.fault("chat.gguf", hold_at=3 * MIB)
    model = ModelSpec(id="chat", source="hf://org/chat/chat.gguf", memory_gb=0.1)
    await world.declare([model], [slot("chat", "chat")])
    sub = world.events.subscribe()
    plan = await world.manager.explain("chat")
    assert plan.action == "load" and plan.pull is not None
    assert plan.pull.message == "would pull 6.3 MB from hf://org/chat/chat.gguf"

    load = asyncio.create_task(world.manager.load("chat"))
    await asyncio.to_thread(hub.held.wait, 60)
    await until(
        lambda: (v := world.manager.view("chat").pull) is not None and v.phase == "downloading",
        "the pull's progress in the slot's view",
    )
    view = world.manager.view("chat")
    assert view.state is S.PULLING and view.pull is not None
    assert view.pull.bytes_total == len(data) and view.pull.source == model.source
    assert world.runtime.starts["chat"] == 0  # no server on bytes not yet verified
    hub.release()
    ready = await load

    assert ready.state is S.READY and ready.pull is None
    assert world.states("chat")[:3] == ["pulling", "starting", "warming"]
    dest = world.models_dir / "org/chat/chat.gguf"
    assert dest.read_bytes() == data and world.files.records.verified(dest) is not None
    progress = []
    while (event := sub.get_nowait()) is not None:
        if event.kind == EventKind.PROGRESS:
            progress.append(event)
    assert progress and all(e.slot == "chat" and e.model == "chat" for e in progress)
    phases = [e.details["phase"] for e in progress]
    assert "downloading" in phases and phases[-1] == "done"
    last = [e for e in progress if e.details["phase"] == "downloading"][-1]
    assert {"bytes_done", "bytes_total", "rate_bps", "eta_s", "percent"} <= set(last.details)
    assert world.files.records.last_used(dest) is not None  # marked used at the start
    assert world.files.stats.snapshot()["outcomes"]["pulled"] == 1  # type: ignore[index]

    # Present: the next load goes straight to starting, no network call.
    await world.manager.unload("chat")
    before = len(hub.requests)
    await world.manager.load("chat")
    assert world.states("chat")[-3:] == ["starting", "warming", "ready"]
    assert len(hub.requests) == before


async def test_two_slots_that_need_one_file_share_one_download(
    world: World, hub: HubServer
) -> None:
    data = blob(4 * MIB, 2)
    hub.add_repo("org/shared", {"s.gguf": data})
    hub.fault("s.gguf", hold_at=MIB)
    model = ModelSpec(id="shared", source="hf://org/shared/s.gguf", memory_gb=0.1)
    await world.declare([model], [slot("a", "shared"), slot("b", "shared")])
    first = asyncio.create_task(world.manager.load("a"))
    await asyncio.to_thread(hub.held.wait, 60)
    second = asyncio.create_task(world.manager.load("b"))
    await until(lambda: world.manager.view("b").state is S.PULLING, "b pulling")
    plan = await world.manager.explain("b")
    hub.release()
    await asyncio.gather(first, second)
    assert world.manager.view("a").state is S.READY and world.manager.view("b").state is S.READY
    assert world.lfs_gets() == 1 and hub.sent("s.gguf") == len(data)
    assert world.files.stats.snapshot()["outcomes"]["pulled"] == 1  # type: ignore[index]
    assert plan.pull is not None and plan.pull.in_flight  # it joins: no second download
    assert plan.pull.message == "would join the pull in flight from hf://org/shared/s.gguf"


async def test_deleting_the_slot_mid_pull_cancels_the_pull_nobody_else_waits_for(
    world: World, hub: HubServer
) -> None:
    data = blob(4 * MIB, 3)
    hub.add_repo("org/gone", {"g.gguf": data})
    hub.fault("g.gguf", hold_at=2 * MIB)
    model = ModelSpec(id="gone", source="hf://org/gone/g.gguf", memory_gb=0.1)
    await world.declare([model], [slot("gone", "gone")])
    load = asyncio.create_task(world.manager.load("gone"))
    await asyncio.to_thread(hub.held.wait, 60)
    await until(lambda: bool(world.files.pulling()), "the pull in flight")

    await world.manager.remove("gone")
    with pytest.raises(SlotctlError):
        await load
    await until(lambda: world.files.stats.snapshot()["in_flight"] == 0, "the pull to end")
    assert world.files.stats.snapshot()["outcomes"]["cancelled"] == 1  # type: ignore[index]
    assert world.files.pulling() == []
    assert "gone" not in world.manager.names() and world.runtime.starts["gone"] == 0
    assert world.states("gone")[-2:] == ["pulling", "offline"]
    assert not (world.models_dir / "org/gone/g.gguf").exists()  # its bytes kept: partial
    state = await world.files.state(model)
    assert state.state in ("partial", "absent")


async def test_unloading_one_of_two_waiters_leaves_the_pull_to_the_other(
    world: World, hub: HubServer
) -> None:
    data = blob(4 * MIB, 4)
    hub.add_repo("org/two", {"t.gguf": data})
    hub.fault("t.gguf", hold_at=MIB)
    model = ModelSpec(id="two", source="hf://org/two/t.gguf", memory_gb=0.1)
    await world.declare([model], [slot("x", "two"), slot("y", "two")])
    x = asyncio.create_task(world.manager.load("x"))
    y = asyncio.create_task(world.manager.load("y"))
    await asyncio.to_thread(hub.held.wait, 60)
    await until(
        lambda: (
            world.manager.view("y").state is S.PULLING
            and world.manager.view("x").state is S.PULLING
        ),
        "both pulling",
    )
    unloaded = await world.manager.unload("x")
    assert unloaded.state is S.OFFLINE and "pull stopped" in world.manager.view("x").message
    with pytest.raises(SlotctlError):
        await x
    hub.release()
    assert (await y).state is S.READY
    assert world.files.stats.snapshot()["outcomes"]["cancelled"] == 0  # type: ignore[index]
    assert world.lfs_gets() == 1


async def test_a_missing_file_that_cannot_be_pulled_is_refused_and_nothing_changes(
    world: World, tmp_path: Path
) -> None:
    model = ModelSpec(id="local", source=str(tmp_path / "nowhere.gguf"), memory_gb=0.1)
    await world.declare([model], [slot("local", "local")])
    plan = await world.manager.explain("local")
    assert plan.action == "refuse" and plan.refusal is not None
    assert plan.refusal.error.code == "model.file_missing"
    with pytest.raises(ModelFileMissing):
        await world.manager.load("local")
    assert world.manager.view("local").state is S.OFFLINE and world.states("local") == []


async def test_a_failed_pull_is_error_with_its_typed_code_under_the_breaker(
    world: World, hub: HubServer
) -> None:
    hub.add_repo("org/gated", {"w.gguf": blob(MIB, 5)}, gated=True)
    model = ModelSpec(id="gated", source="hf://org/gated/w.gguf", memory_gb=0.1)
    await world.declare([model], [slot("gated", "gated")])
    sub = world.events.subscribe()
    with pytest.raises(ModelAccessDenied):
        await world.manager.load("gated")
    view = world.manager.view("gated")
    assert view.state is S.ERROR and view.failures == 1 and view.retry_after_s > 0
    assert world.states("gated") == ["pulling", "error"]
    errors = []
    while (event := sub.get_nowait()) is not None:
        if event.kind == EventKind.TRANSITION and event.to_state == "error":
            errors.append(event)
    assert [e.error for e in errors] == ["model.access_denied"]
    assert world.runtime.starts["gated"] == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """A real small filesystem (tmpfs) as the models dir."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


async def test_a_pull_that_does_not_fit_the_disk_is_refused_at_admission(
    tmp_path: Path, hub: HubServer, small_disk: Callable[[int], Path]
) -> None:
    disk = small_disk(2 * MIB)
    world = World(tmp_path, hub, disk / "models")
    try:
        hub.add_repo("org/huge", {"h.gguf": blob(3 * MIB, 6)})
        model = ModelSpec(id="huge", source="hf://org/huge/h.gguf", memory_gb=0.1)
        await world.declare([model], [slot("huge", "huge")])
        plan = await world.manager.explain("huge")
        assert plan.action == "refuse" and plan.refusal is not None
        assert plan.refusal.error.code == "model.insufficient_disk"
        with pytest.raises(InsufficientDisk) as refused:
            await world.manager.load("huge")
        assert refused.value.details["needed_bytes"] == 3 * MIB
        assert refused.value.details["free_bytes"] <= 2 * MIB
        view = world.manager.view("huge")
        assert view.state is S.OFFLINE and world.states("huge") == []  # nothing changed
        assert world.runtime.starts["huge"] == 0 and hub.sent("h.gguf") == 0
        assert [p for p in disk.rglob("*") if p.is_file()] == []  # not a byte written
        assert os.statvfs(disk).f_bfree == os.statvfs(disk).f_blocks
    finally:
        await world.close()


async def test_a_restart_that_finds_a_slot_pulling_sets_it_offline_and_the_load_resumes(
    tmp_path: Path, hub: HubServer
) -> None:
    data = blob(4 * MIB, 7)
    hub.add_repo("org/r", {"r.gguf": data})
    model = ModelSpec(id="r", source="hf://org/r/r.gguf", memory_gb=0.1)
    record = tmp_path / "state/slots/r/state.json"
    record.parent.mkdir(parents=True)
    record.write_text(
        json.dumps(
            {
                "name": "r",
                "state": "pulling",
                "model_id": "r",
                "port": 1,
                "updated_at": "2026-12-01T00:00:00Z",
                "message": "admitted on cpu",
                "extra": {},
            }
        )
    )
    world = World(tmp_path, hub)
    try:
        await world.declare([model], [slot("r", "r")])
        assert world.manager.view("r").state is S.PULLING
        await world.manager.recover()
        view = world.manager.view("r")
        assert view.state is S.OFFLINE and "pull interrupted" in view.message
        assert (await world.manager.load("r")).state is S.READY
        assert (world.models_dir / "org/r/r.gguf").read_bytes() == data
    finally:
        await world.close()


async def test_gc_references_are_the_declared_models_a_pinned_slots_pinned(
    world: World, hub: HubServer
) -> None:
    models = [
        ModelSpec(id="kept", source="hf://org/k/k.gguf", memory_gb=0.1),
        ModelSpec(id="held", source="hf://org/h/h.gguf", memory_gb=0.1),
    ]
    await world.declare(models, [slot("k", "kept"), slot("h", "held", pinned=True)])
    refs = {r.model: r for r in world.manager.file_references()}
    assert refs["kept"].path == world.models_dir / "org/k/k.gguf" and not refs["kept"].pinned
    assert refs["held"].pinned
