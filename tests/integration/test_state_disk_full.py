"""A state dir that refuses writes (ENOSPC, EROFS, EIO): persist-then-commit (issue 13).

A SlotManager on the real process runtime and demo servers. Each slot transition writes
``state.json`` first and changes the slot in memory only once that write succeeded, so
memory never runs ahead of disk; a refused write is the typed ``state.write_failed``
(503 + Retry-After, path and errno). What is ready keeps serving (lease transitions are
not durable and never fail a request), the controller recovers by itself when space
returns, and nothing leaks: a server whose process record cannot be written is stopped
at once, one started before a refused transition is stopped at shutdown.

Twice: with the error injected (``OSError`` from the store's atomic write: ENOSPC, EROFS,
EIO at chosen moments) and on a real, small tmpfs filled to the last byte (root only).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

import controller.store.state as store_module
from controller.model.errors import StateWriteFailed
from controller.model.lifecycle import SlotState
from controller.probes.memory import FakeMemoryProbe
from controller.probes.readiness import HttpProber
from controller.reconcile.apply import apply_to_config
from controller.reconcile.reconciler import Reconciler
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.slots.table import OBSERVED
from controller.spec.loader import DesiredSlot, DesiredState, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from controller.store.state import StateStore
from tests.integration.helpers import free_ports

S = SlotState
SETTINGS = ControllerSettings(memory_budget_gb={"gpu": 10.0}, safety_margin_gb=0.0)


def desired(names: list[str], *, autoload: tuple[str, ...] = ()) -> DesiredState:
    ports = free_ports(len(names))
    slots = {}
    models = {}
    for name, port in zip(names, ports, strict=True):
        spec = SlotSpec.model_validate(
            {
                "name": name,
                "provider": "demo",
                "port": port,
                "model": {"default": f"m-{name}"},
                "device": "gpu",
                "autoload": name in autoload,
                "pinned": False,
                "server": {"extra_args": ["--load-seconds", "0.1"]},
            }
        )
        slots[name] = DesiredSlot(spec=normalise(spec, SETTINGS), stack="disk")
        models[f"m-{name}"] = ModelSpec(id=f"m-{name}", source=f"demo://{name}", memory_gb=1.0)
    return DesiredState(stacks=("disk",), models=models, slots=slots)


@dataclass
class Disk:
    """Decides which writes under ``state_dir`` fail, and with which errno."""

    state_dir: Path
    code: int | None = None
    only: Callable[[Path, Any], bool] = lambda path, data: True
    refused: list[str] = field(default_factory=list)

    def fail(self, number: int | None, only: Callable[[Path, Any], bool] | None = None) -> None:
        self.code = number
        self.only = only or (lambda path, data: True)


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Disk:
    state = Disk(tmp_path / "state")
    real = store_module.atomic_write_json

    def write(path: Path, data: Any, **kwargs: Any) -> None:
        if state.code is not None and state.state_dir in path.parents and state.only(path, data):
            state.refused.append(f"{path.parent.name}/{path.name}")
            raise OSError(state.code, os.strerror(state.code), str(path))
        real(path, data, **kwargs)

    monkeypatch.setattr(store_module, "atomic_write_json", write)
    return state


@pytest.fixture
async def managers(tmp_path: Path) -> AsyncIterator[list[SlotManager]]:
    made: list[SlotManager] = []
    yield made
    for manager in made:
        with contextlib.suppress(StateWriteFailed):
            await manager.stop_all(reason="test teardown")
        await manager.close()


async def make_manager(
    state_dir: Path, config_dir: Path, want: DesiredState, made: list[SlotManager]
) -> SlotManager:
    manager = SlotManager(
        runtime=ProcessRuntime(state_dir, kill_grace_s=5.0),
        state_dir=state_dir,
        config_dir=config_dir,
        settings=SETTINGS,
        prober=HttpProber(timeout_s=5.0),
        memory=FakeMemoryProbe({}),
        config=ManagerConfig(stop_timeout_s=5.0),
    )
    made.append(manager)
    await manager.set_desired(want)
    return manager


def owned(state_dir: Path, slot: str) -> list[psutil.Process]:
    """Live demo servers labelled with this state dir and slot."""
    owner = str(state_dir.resolve())
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if env.get("SLOTCTL_OWNER") == owner and env.get("SLOTCTL_SLOT") == slot:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def agree(manager: SlotManager, state_dir: Path, name: str) -> SlotState:
    """Memory and disk say the same (no file: never left offline), but for observations
    the disk has not taken yet (SPEC §3: they may lag; a refusing disk keeps them in
    memory): then memory is at one and the disk at one too, or at the intent before."""
    record = StateStore(state_dir).read(name)
    on_disk = record.state if record is not None else S.OFFLINE
    in_memory = manager.view(name).state
    if name in manager.core.table.unpersisted:
        assert in_memory in OBSERVED and on_disk in OBSERVED | {S.STARTING}, (in_memory, on_disk)
        return in_memory
    assert in_memory is on_disk, f"{name}: memory {in_memory.value}, disk {on_disk.value}"
    return in_memory


async def serve_one(manager: SlotManager, name: str) -> None:
    """One request through a lease, as the router does it."""
    lease = await manager.acquire(name)
    try:
        endpoint = manager.view(name).endpoint
        assert endpoint is not None
        url = f"{endpoint}/v1/models"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        assert b"m-" in body
    finally:
        manager.release(lease)


async def check_refused_then_recovered(
    manager: SlotManager,
    state_dir: Path,
    fill: Callable[[], None],
    free: Callable[[], None],
    expected_errno: int,
) -> None:
    """The shared scenario: a ready slot ``a``, a cold slot ``b``; the disk fills up."""
    await manager.load("a")
    pid_a = owned(state_dir, "a")[0].pid
    fill()

    # What is ready keeps serving (its lease transitions are not durable).
    for _ in range(3):
        await serve_one(manager, "a")
    assert manager.view("a").state is S.READY

    # A load is refused, typed, naming path and errno; nothing started, nothing changed.
    with pytest.raises(StateWriteFailed) as refused:
        await manager.load("b")
    assert refused.value.errno == expected_errno
    assert refused.value.details["path"].startswith(str(state_dir))
    assert refused.value.http_status == 503 and refused.value.retry_after_s > 0
    assert agree(manager, state_dir, "b") is S.OFFLINE
    assert owned(state_dir, "b") == []

    # An unload is refused too (not dropped): the server still runs, memory == disk.
    with pytest.raises(StateWriteFailed):
        await manager.unload("a")
    assert agree(manager, state_dir, "a") is S.READY
    assert [p.pid for p in owned(state_dir, "a")] == [pid_a]
    await serve_one(manager, "a")

    # Space returns: everything works again, the pending lease state is written.
    free()
    manager.core.table.flush_unpersisted()
    assert agree(manager, state_dir, "a") is S.READY
    await manager.load("b")
    assert agree(manager, state_dir, "b") is S.READY
    await manager.unload("a")
    assert agree(manager, state_dir, "a") is S.OFFLINE
    assert owned(state_dir, "a") == []


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EROFS, errno.EIO])
async def test_injected_write_errors_change_nothing_and_recover(
    tmp_path: Path, disk: Disk, managers: list[SlotManager], number: int
) -> None:
    manager = await make_manager(disk.state_dir, tmp_path / "config", desired(["a", "b"]), managers)
    await check_refused_then_recovered(
        manager, disk.state_dir, lambda: disk.fail(number), lambda: disk.fail(None), number
    )
    assert disk.refused  # the injection was exercised


async def test_a_server_whose_record_cannot_be_written_is_stopped_at_once(
    tmp_path: Path, disk: Disk, managers: list[SlotManager]
) -> None:
    manager = await make_manager(disk.state_dir, tmp_path / "config", desired(["b"]), managers)
    disk.fail(errno.ENOSPC, lambda path, data: path.name == "process.json")
    with pytest.raises(StateWriteFailed):
        await manager.load("b")
    assert "b/process.json" in disk.refused
    assert owned(disk.state_dir, "b") == []  # spawned, then killed: never unrecorded
    assert agree(manager, disk.state_dir, "b") is S.ERROR


async def test_a_server_whose_observed_state_cannot_be_written_serves_and_is_stopped(
    tmp_path: Path, disk: Disk, managers: list[SlotManager]
) -> None:
    """Its observations (warming, ready) are refused by the disk: the load still succeeds
    (they are written off the loop, SPEC §3), state.json keeps the intent (starting, with
    the process record), and a shutdown whose writes are refused too stops the server."""
    manager = await make_manager(disk.state_dir, tmp_path / "config", desired(["b"]), managers)
    disk.fail(errno.ENOSPC, lambda path, data: data.get("state") in ("warming", "ready"))
    await manager.load("b")
    await serve_one(manager, "b")
    assert agree(manager, disk.state_dir, "b") is S.READY
    record = StateStore(disk.state_dir).read("b")
    assert record is not None and record.state is S.STARTING
    assert len(owned(disk.state_dir, "b")) == 1  # runs, recorded in process.json
    disk.fail(errno.ENOSPC)
    await manager.stop_all(reason="shutdown while the disk is full")
    assert owned(disk.state_dir, "b") == []


async def test_shutdown_while_the_disk_refuses_writes_stops_every_server(
    tmp_path: Path, disk: Disk, managers: list[SlotManager]
) -> None:
    manager = await make_manager(disk.state_dir, tmp_path / "config", desired(["a", "b"]), managers)
    await manager.load("a")
    await manager.load("b")
    disk.fail(errno.EROFS)
    await manager.stop_all(reason="shutdown while the state dir is read-only")
    assert owned(disk.state_dir, "a") == [] and owned(disk.state_dir, "b") == []


async def test_the_reconciler_recovers_by_itself_when_space_returns(
    tmp_path: Path, disk: Disk, managers: list[SlotManager]
) -> None:
    want = desired(["c"], autoload=("c",))
    apply_to_config(want, tmp_path / "config", prune=False)
    manager = await make_manager(disk.state_dir, tmp_path / "config", want, managers)
    reconciler = Reconciler(manager, tmp_path / "config", resync_s=60.0)
    disk.fail(errno.ENOSPC)
    stop = asyncio.Event()
    with manager.events.subscribe() as events:
        runner = asyncio.create_task(reconciler.run(stop))
        try:
            async with asyncio.timeout(30):
                async for event in events:
                    if event.kind == "error" and event.error == "state.write_failed":
                        break
            assert agree(manager, disk.state_dir, "c") is S.OFFLINE
            disk.fail(None)  # space returns: no call, no reset
            async with asyncio.timeout(60):
                while manager.view("c").state is not S.READY:
                    await asyncio.sleep(0.1)
        finally:
            stop.set()
            await runner
    assert agree(manager, disk.state_dir, "c") is S.READY


# ============================================================================ real tmpfs


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    # Mandatory where the Docker tests are (CI, as root: .ci/run sets the variable): a
    # machine that can run a private dockerd can mount a tmpfs.
    unavailable = pytest.fail if os.environ.get("SLOTCTL_REQUIRE_DOCKER") == "1" else pytest.skip
    if os.geteuid() != 0:
        unavailable("mounting a tmpfs needs root")
    mount = tmp_path / "state"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_a_real_full_tmpfs_changes_nothing_and_recovers(
    tmp_path: Path, tmpfs: Path, managers: list[SlotManager]
) -> None:
    manager = await make_manager(tmpfs, tmp_path / "config", desired(["a", "b"]), managers)
    filler = tmpfs / "filler"

    def fill() -> None:
        chunk = b"\0" * 4096
        with filler.open("wb", buffering=0) as handle, contextlib.suppress(OSError):
            while True:
                handle.write(chunk)
        with pytest.raises(OSError):
            (tmpfs / "probe").write_bytes(chunk)

    await check_refused_then_recovered(manager, tmpfs, fill, lambda: filler.unlink(), errno.ENOSPC)
    await manager.stop_all(reason="test end")
    assert owned(tmpfs, "a") == [] and owned(tmpfs, "b") == []


async def test_an_unload_whose_last_write_is_refused_is_finished_by_a_retry(
    tmp_path: Path, disk: Disk, managers: list[SlotManager]
) -> None:
    manager = await make_manager(disk.state_dir, tmp_path / "config", desired(["a"]), managers)
    await manager.load("a")
    disk.fail(errno.EIO, lambda path, data: data.get("state") == "offline")
    with pytest.raises(StateWriteFailed):
        await manager.unload("a")
    assert agree(manager, disk.state_dir, "a") is S.UNLOADING  # stopped, not yet recorded
    assert owned(disk.state_dir, "a") == []
    disk.fail(None)
    await manager.unload("a")  # the retry the 503 asked for: finishes, no illegal transition
    assert agree(manager, disk.state_dir, "a") is S.OFFLINE


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SLOTCTL_SOAK") != "1", reason="soak run: SLOTCTL_SOAK=1")
@pytest.mark.timeout(900)
async def test_flapping_disk_soak(tmp_path: Path, disk: Disk, managers: list[SlotManager]) -> None:
    """``make soak``: 150 random loads, unloads and requests while the state dir flaps
    between writable and refusing (ENOSPC/EROFS/EIO at random). After every operation
    memory and disk agree and every slot's server runs iff its state says so; at the end
    shutdown leaves nothing running."""
    rng = random.Random(int(os.environ.get("SLOTCTL_FAULT_SEED", "13")))
    names = ["f1", "f2", "f3"]
    manager = await make_manager(disk.state_dir, tmp_path / "config", desired(names), managers)
    codes = [errno.ENOSPC, errno.EROFS, errno.EIO]
    for _ in range(150):
        disk.fail(rng.choice([None, None, *codes]))
        name = rng.choice(names)
        op = rng.choice(["load", "unload", "request"])
        with contextlib.suppress(StateWriteFailed):
            if op == "load":
                await manager.load(name)
            elif op == "unload":
                await manager.unload(name)
            elif manager.view(name).state in (S.READY, S.SERVING):
                await serve_one(manager, name)
        for each in names:
            state = manager.view(each).state
            if each not in manager.core.table.unpersisted:  # a lease transition may lag, by design
                agree(manager, disk.state_dir, each)
            running = bool(owned(disk.state_dir, each))
            if state in (S.READY, S.SERVING, S.IDLE, S.WARMING):
                assert running, f"{each} is {state.value} but no server runs"
            elif state in (S.OFFLINE, S.ERROR):
                assert not running, f"{each} is {state.value} but a server runs"
    disk.fail(rng.choice(codes))
    await manager.stop_all(reason="shutdown while the disk refuses writes")
    assert all(owned(disk.state_dir, each) == [] for each in names)
