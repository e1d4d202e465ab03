"""The process runtime against the real demo server: start, probe, adopt, stop, faults."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from controller.model.errors import SlotSpawnFailed
from controller.probes.readiness import ProbeOutcome
from controller.runtime.base import RunStatus
from controller.runtime.process.records import RECORD
from controller.runtime.process.runtime import ProcessRuntime
from controller.store.state import StateStore
from tests.integration.helpers import demo_launch, free_port, probe_until_settled


@pytest.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[ProcessRuntime]:
    rt = ProcessRuntime(tmp_path / "state", kill_grace_s=5.0)
    yield rt
    for observed in await rt.list_managed():
        await rt.stop(observed.slot, timeout=0.5)


def _labelled(owner: str, slot: str) -> list[int]:
    pids = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        ours = env.get("SLOTCTL_OWNER") == owner and env.get("SLOTCTL_SLOT") == slot
        if ours and proc.status() != psutil.STATUS_ZOMBIE:
            pids.append(proc.pid)
    return pids


async def test_start_probe_ready_and_stop(runtime: ProcessRuntime) -> None:
    launch = demo_launch("chat", ["--load-seconds", "0.3"])
    observed = await runtime.start(launch)
    assert observed.status is RunStatus.RUNNING
    assert observed.config_hash == launch.config_hash()
    assert observed.endpoint == launch.endpoint
    result = await probe_until_settled(runtime, launch)
    assert result.outcome is ProbeOutcome.READY, result
    assert result.models == ("chat-model",)
    record = runtime.store.read_aux("chat", RECORD)
    assert record is not None and record["pid"] == int(observed.ident or 0)
    logs = await runtime.logs("chat")
    assert any("slotctl-demo ready" in line for line in logs), logs
    stopped = await runtime.stop("chat", timeout=5)
    assert stopped.status is RunStatus.EXITED
    assert (await runtime.inspect("chat")).status is RunStatus.MISSING
    assert runtime.store.read_aux("chat", RECORD) is None


async def test_adoption_by_a_new_runtime_object(runtime: ProcessRuntime, tmp_path: Path) -> None:
    launch = demo_launch("adopt")
    first = await runtime.start(launch)
    assert (await probe_until_settled(runtime, launch)).outcome is ProbeOutcome.READY
    second_rt = ProcessRuntime(tmp_path / "state")
    seen = await second_rt.inspect("adopt")
    assert seen.running and seen.ident == first.ident
    again = await second_rt.start(launch)
    assert again.ident == first.ident
    assert _labelled(second_rt.owner, "adopt") == [int(first.ident or 0)]
    # The record is lost (controller killed between spawn and record): labels still find it.
    StateStore(tmp_path / "state").delete_aux("adopt", RECORD)
    third_rt = ProcessRuntime(tmp_path / "state")
    found = await third_rt.inspect("adopt")
    assert found.running and found.ident == first.ident
    assert found.config_hash == launch.config_hash()
    assert [o.slot for o in await third_rt.list_managed()] == ["adopt"]
    stopped = await third_rt.stop("adopt", timeout=5)
    assert stopped.status is RunStatus.EXITED
    assert _labelled(second_rt.owner, "adopt") == []


async def test_start_with_other_config_refuses_while_running(runtime: ProcessRuntime) -> None:
    port = free_port()
    await runtime.start(demo_launch("busy", port=port))
    with pytest.raises(SlotSpawnFailed, match="another config"):
        await runtime.start(demo_launch("busy", ["--tokens-per-second", "5"], port=port))


async def test_recycled_pid_is_not_ours(runtime: ProcessRuntime) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        runtime.store.write_aux(
            "ghost",
            RECORD,
            {"pid": stranger.pid, "create_time": 12345.0, "config_hash": "x", "started_at": 1.0},
        )
        observed = await runtime.inspect("ghost")
        assert observed.status is RunStatus.EXITED
        await runtime.stop("ghost", timeout=0.5)
        assert stranger.poll() is None, "a process that is not ours was signalled"
    finally:
        stranger.kill()
        stranger.wait()


async def test_slow_stop_escalates_to_sigkill(runtime: ProcessRuntime) -> None:
    launch = demo_launch("slow", ["--slow-stop", "30"])
    await runtime.start(launch)
    assert (await probe_until_settled(runtime, launch)).outcome is ProbeOutcome.READY
    began = time.monotonic()
    stopped = await runtime.stop("slow", timeout=0.5)
    elapsed = time.monotonic() - began
    assert stopped.status is RunStatus.EXITED
    assert stopped.exit_code == -signal.SIGKILL
    assert elapsed < 5, elapsed


async def test_a_stopped_server_is_killed_after_the_stop_timeout(runtime: ProcessRuntime) -> None:
    """A hung server (here stopped with SIGSTOP: the SIGTERM stays pending, never
    handled) is stopped all the same: SIGKILL after the stop timeout (issue 26)."""
    launch = demo_launch("frozen", [])
    started = await runtime.start(launch)
    assert (await probe_until_settled(runtime, launch)).outcome is ProbeOutcome.READY
    os.kill(int(started.ident or 0), signal.SIGSTOP)
    began = time.monotonic()
    stopped = await runtime.stop("frozen", timeout=0.5)
    elapsed = time.monotonic() - began
    assert stopped.status is RunStatus.EXITED
    assert stopped.exit_code == -signal.SIGKILL
    assert 0.5 <= elapsed < 5, elapsed


async def test_fail_on_load_exits(runtime: ProcessRuntime) -> None:
    launch = demo_launch("fail", ["--fail-on-load", "--load-seconds", "0.2"])
    await runtime.start(launch)
    result = await probe_until_settled(runtime, launch)
    assert result.outcome is ProbeOutcome.EXITED
    observed = await runtime.inspect("fail")
    assert observed.status is RunStatus.EXITED and observed.exit_code == 1
    assert any("injected failure" in line for line in await runtime.logs("fail"))


async def test_hang_on_load_stays_warming_until_timeout(runtime: ProcessRuntime) -> None:
    launch = demo_launch("hang", ["--hang-on-load"])
    await runtime.start(launch)
    result = await probe_until_settled(runtime, launch, warmup_timeout_s=1.0)
    assert result.outcome is ProbeOutcome.TIMED_OUT, result
    assert result.attempts > 3
    assert (await runtime.inspect("hang")).running


async def test_empty_models_reads_as_no_model(runtime: ProcessRuntime) -> None:
    launch = demo_launch("empty", ["--empty-models"])
    await runtime.start(launch)
    result = await probe_until_settled(runtime, launch)
    assert result.outcome is ProbeOutcome.NO_MODEL


async def test_crash_after_exits_while_serving(runtime: ProcessRuntime) -> None:
    launch = demo_launch("crash", ["--crash-after", "2"])
    await runtime.start(launch)
    # The readiness sentinel is inference request 1.
    assert (await probe_until_settled(runtime, launch)).outcome is ProbeOutcome.READY
    body = {"model": "crash-model", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        async with session.post(launch.endpoint + "/v1/completions", json=body) as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ClientError):
            async with session.post(launch.endpoint + "/v1/completions", json=body) as resp:
                await resp.read()
    for _ in range(100):
        observed = await runtime.inspect("crash")
        if not observed.running:
            break
        await asyncio.sleep(0.02)
    assert observed.status is RunStatus.EXITED and observed.exit_code == 3


async def test_port_conflict_names_the_holder(runtime: ProcessRuntime) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(SlotSpawnFailed) as caught:
            await runtime.start(demo_launch("conflict", port=port))
    assert f"port {port} is in use by pid {os.getpid()}" in caught.value.message
    assert (await runtime.inspect("conflict")).status is RunStatus.MISSING


async def test_missing_binary_is_a_typed_error(runtime: ProcessRuntime) -> None:
    from dataclasses import replace

    launch = replace(demo_launch("nobin"), argv=("/nonexistent/llama-server", "--port", "1"))
    with pytest.raises(SlotSpawnFailed, match="No such file"):
        await runtime.start(launch)


def execed(pid: int, marker: str, timeout: float = 10.0) -> psutil.Process:
    """The process once it runs its own program (``marker`` in its command line): between
    fork and exec, /proc shows the parent's environment, not the labels."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    while marker not in " ".join(proc.cmdline()):
        assert time.monotonic() < deadline, f"pid {pid} never ran {marker!r}"
        time.sleep(0.01)
    return proc


async def test_labels_env_and_secret_scrubbed(
    runtime: ProcessRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTCTL_TOKEN", "secret")
    launch = demo_launch("env")
    observed = await runtime.start(launch)
    env = execed(int(observed.ident or 0), "controller.demo").environ()
    assert env["SLOTCTL_MANAGED"] == "true" and env["SLOTCTL_SLOT"] == "env"
    assert env["SLOTCTL_CONFIG_HASH"] == launch.config_hash()
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # device = cpu
    assert "SLOTCTL_TOKEN" not in env


async def test_a_gpu_server_sees_its_placement_never_the_controllers_visibility(
    runtime: ProcessRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller started with CUDA_VISIBLE_DEVICES (or HIP's variables) set: a server
    placed on GPU 1 is shown GPU 1 (its UUID), and inherits none of the controller's."""
    from controller.model.devices import GpuRef
    from controller.providers.base import BuildContext
    from controller.providers.launch import build_launch
    from controller.spec.schema import ModelSpec, SlotSpec

    for name, value in (("CUDA_VISIBLE_DEVICES", "0"), ("GPU_DEVICE_ORDINAL", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    uuid = "GPU-11111111-0000-4000-8000-000000000001"
    slot = SlotSpec.model_validate(
        {"name": "placed", "provider": "demo", "port": free_port(), "model": {"default": "m"}}
    )
    model = ModelSpec(id="m", source="demo://m")
    launch = build_launch(slot, model, BuildContext()).placed_on((GpuRef(1, uuid, "nvidia"),))
    observed = await runtime.start(launch)
    env = execed(int(observed.ident or 0), "controller.demo").environ()
    assert env["CUDA_VISIBLE_DEVICES"] == uuid
    assert "GPU_DEVICE_ORDINAL" not in env and "CUDA_DEVICE_ORDER" not in env
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{launch.endpoint}/v1/models") as answer:
                    if answer.status == 200:
                        models = await answer.json()
                        break
            await asyncio.sleep(0.05)
    assert models["data"][0]["meta"]["visible_devices"] == {"CUDA_VISIBLE_DEVICES": uuid}
    await runtime.stop("placed", 5.0)


async def test_log_rotated_at_each_start(runtime: ProcessRuntime) -> None:
    launch = demo_launch("logs")
    await runtime.start(launch)
    await probe_until_settled(runtime, launch)
    await runtime.stop("logs", timeout=5)
    await runtime.start(launch)
    await probe_until_settled(runtime, launch)
    log = runtime.log_path("logs")
    assert log.with_name("server.log.1").exists()
    assert "slotctl-demo ready" in log.with_name("server.log.1").read_text()


async def test_ready_detected_within_100ms_of_server_ready(runtime: ProcessRuntime) -> None:
    """Probe timing against the demo server's own ready line (the tight figure: bench/)."""
    launch = demo_launch("timing", ["--load-seconds", "0.8"])
    await runtime.start(launch)
    result = await probe_until_settled(runtime, launch)
    detected = time.time()
    assert result.outcome is ProbeOutcome.READY
    line = next(x for x in await runtime.logs("timing") if "slotctl-demo ready" in x)
    ready_t = float(line.rsplit("t=", 1)[1])
    assert 0 <= detected - ready_t < 0.1, detected - ready_t


def test_label_scan_finds_the_managed_entry_anywhere_and_skips_lookalikes(
    tmp_path: Path,
) -> None:
    """The scan's raw /proc pre-filter (``process_labels._labelled_processes``) must keep
    every process psutil would have found: the managed entry first, last or in between in the
    environment; and a lookalike (another variable's value or name ending in it) is no
    label."""
    rt = ProcessRuntime(tmp_path / "state")
    labels = {"SLOTCTL_OWNER": rt.owner, "SLOTCTL_PORT": "1"}
    envs = {
        "first": {"SLOTCTL_MANAGED": "true", **labels, "SLOTCTL_SLOT": "first"},
        "last": {**labels, "SLOTCTL_SLOT": "last", "SLOTCTL_MANAGED": "true"},
        "value": {**labels, "SLOTCTL_SLOT": "value", "X": "\0SLOTCTL_MANAGED=true"[1:]},
        "name": {**labels, "SLOTCTL_SLOT": "name", "X_SLOTCTL_MANAGED": "true"},
    }
    procs = {
        slot: subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            env=env,
            start_new_session=True,
        )
        for slot, env in envs.items()
    }
    try:
        assert sorted(rt.labelled.scan_all()) == ["first", "last"]
        for slot in ("first", "last"):
            found = rt.labelled.find(slot)
            assert found is not None and found.pid == procs[slot].pid
        assert rt.labelled.find("value") is None and rt.labelled.find("name") is None
        assert (
            rt.labelled.find("firs") is None and rt.labelled.find("irst") is None
        )  # whole values only
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


async def test_a_lost_record_is_found_without_rescanning_proc(runtime: ProcessRuntime) -> None:
    """/proc is scanned in full once, at the first need; a server this runtime spawned
    since is remembered: its record lost (by hand), the same runtime still finds it by
    its labels and records it again, never starting a duplicate."""
    launch = demo_launch("keep")
    first = await runtime.start(launch)
    runtime.store.delete_aux("keep", RECORD)
    seen = await runtime.inspect("keep")
    assert seen.running and seen.ident == first.ident
    assert runtime.store.read_aux("keep", RECORD) is not None  # recorded again
    runtime.store.delete_aux("keep", RECORD)
    again = await runtime.start(launch)  # adopts it: no second server
    assert again.ident == first.ident
    assert _labelled(runtime.owner, "keep") == [int(first.ident or 0)]
    stopped = await runtime.stop("keep", timeout=5)
    assert stopped.status is RunStatus.EXITED
    assert (await runtime.inspect("keep")).status is RunStatus.MISSING


def test_strays_are_those_of_the_first_scan_and_of_each_full_scan(tmp_path: Path) -> None:
    """An unrecorded server comes from before the runtime (a controller killed between a
    spawn and its record): the first look scans /proc once; later looks check only what
    that scan (or a spawn of this runtime) found. A labelled process that appears later
    (another controller on the same state dir, which ControllerLock rules out) is seen
    at the next full scan (``list_managed``, each resync). A candidate that has exited, or
    whose pid now carries other labels, is dropped."""
    rt = ProcessRuntime(tmp_path / "state")

    def stray(slot: str) -> subprocess.Popen[bytes]:
        env = {
            "SLOTCTL_MANAGED": "true",
            "SLOTCTL_OWNER": rt.owner,
            "SLOTCTL_SLOT": slot,
            "SLOTCTL_PORT": "1",
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
        )
        execed(proc.pid, "time.sleep(60)")  # its labels are in /proc from here on
        return proc

    early = stray("early")
    try:
        found = rt.labelled.find("early")  # the first look: a full scan
        assert found is not None and found.pid == early.pid
        late = stray("late")
        try:
            assert rt.labelled.find("late") is None  # not rescanned at every look
            assert "late" in rt.labelled.scan_all()  # the resync's full scan
            found = rt.labelled.find("late")
            assert found is not None and found.pid == late.pid
        finally:
            late.kill()
            late.wait()
        assert rt.labelled.find("late") is None  # exited: dropped
        assert rt.labelled.candidates["late"] == set()
        rt.labelled.remember("early", late.pid)  # a candidate pid that is no "early" server
        found = rt.labelled.find("early")
        assert found is not None and found.pid == early.pid
    finally:
        early.kill()
        early.wait()


async def test_the_process_record_is_atomic_but_not_fsynced(
    runtime: ProcessRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """process.json must survive a crash of the controller (the page cache does), not one
    of the machine (which ends its server too): it is replaced atomically, without the
    two fsyncs of a durable write; state.json writes stay durable (tests/unit/test_store)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    started = await runtime.start(demo_launch("norec"))
    record = runtime.store.read_aux("norec", RECORD)
    assert record is not None and str(record["pid"]) == started.ident
    assert synced == []
    runtime.store.write_aux("norec", "other.json", {"x": 1})  # the default stays durable
    assert len(synced) == 2 and synced[1] == str(runtime.store.slot_dir("norec"))


async def test_the_process_record_is_parsed_again_only_when_the_file_changed(
    runtime: ProcessRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each look at a slot needs its record: the runtime keeps what it wrote and parses
    the file again only when it changed (a new inode, size or times). A record edited or
    deleted by hand, a server killed from outside and a restarted runtime all see what
    is on disk and in /proc now."""
    parsed: list[str] = []
    real = runtime.store.read_aux

    def counted(slot: str, filename: str) -> dict[str, Any] | None:
        parsed.append(slot)
        return real(slot, filename)

    monkeypatch.setattr(runtime.store, "read_aux", counted)
    launch = demo_launch("kept")
    first = await runtime.start(launch)  # no record yet: nothing to parse
    for _ in range(5):
        seen = await runtime.inspect("kept")
        assert seen.running and seen.ident == first.ident
    assert parsed == []  # what the runtime wrote is what it keeps

    # edited by hand: the new content is read (here: a pid that is not ours)
    path = tmp_path / "state" / "slots" / "kept" / RECORD
    record = json.loads(path.read_bytes())
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        path.write_text(json.dumps({**record, "pid": stranger.pid, "create_time": 1.0}))
        edited = await runtime.inspect("kept")
        assert parsed == ["kept"]
        assert edited.status is RunStatus.RUNNING  # the labels still find our server
        assert json.loads(path.read_bytes())["pid"] == int(first.ident or 0)  # re-recorded
        await runtime.inspect("kept")
        assert parsed == ["kept"]
    finally:
        stranger.kill()
        stranger.wait()

    # a restarted controller reads the record from disk and adopts the server
    fresh = ProcessRuntime(tmp_path / "state")
    adopted = await fresh.start(launch)
    assert adopted.ident == first.ident
    assert fresh.records.read("kept") == json.loads(path.read_bytes())

    # killed from outside: the kept record does not hide it
    os.killpg(int(first.ident or 0), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (await runtime.inspect("kept")).running and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    gone = await runtime.inspect("kept")
    assert gone.status is RunStatus.EXITED and gone.message == "killed by SIGKILL"
    assert (await fresh.inspect("kept")).status is RunStatus.EXITED

    # deleted by hand: seen at the next look
    runtime.store.delete_aux("kept", RECORD)
    assert (await runtime.inspect("kept")).status is RunStatus.MISSING
