"""The controller's own faults (issue 13): contained, reported, restarted; or a clean exit 1.

An in-process :class:`~controller.daemon.Controller` (process runtime, demo servers, the
API on 127.0.0.1) with a fault injected into one background task: the task is restarted
with backoff and counted (event, ``slotctl_background_failures_total``) while the data
plane serves; a failure of the supervision itself exits 1 and leaves the servers to the
next controller. Also: stack-file parsing and config reads run off the event loop, an
oversized stack file is refused (``stack.too_large``), and a missing config dir keeps the
last good desired state.
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import shutil
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

import controller.api.stack_routes as routes
import controller.daemon.gitops as gitops
import controller.daemon.supervise as supervise
import controller.reconcile.reconciler as reconciler_module
import controller.spec.files as files
from controller.daemon.main import Controller, DaemonOptions, stop_everything
from controller.model.errors import ControllerAlreadyRunning
from controller.model.sizes import GIB
from controller.probes.memory import FakeMemoryProbe
from controller.reconcile.reconciler import Reconciler
from controller.runtime.fake import FakeProber, FakeRuntime
from controller.slots.manager import SlotManager
from controller.spec.configdir import read_config_dir
from controller.spec.loader import MAX_FILE_BYTES
from controller.store.state import StateStore
from tests.e2e.conftest import SlotDef, stack_text

TOKEN = "faults"


@dataclass
class Running:
    controller: Controller
    runner: asyncio.Task[int]
    out: io.StringIO
    root: Path

    @property
    def manager(self) -> SlotManager:
        assert self.controller.manager is not None
        return self.controller.manager

    def get(self, path: str) -> str:
        record = self.controller.lock.read()
        assert record is not None and record.listen
        request = urllib.request.Request(
            f"http://{record.listen}{path}", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            text: str = response.read().decode()
            return text

    def post(self, path: str, body: str) -> str:
        record = self.controller.lock.read()
        assert record is not None and record.listen
        request = urllib.request.Request(
            f"http://{record.listen}{path}",
            data=body.encode(),
            method="POST",
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            text: str = response.read().decode()
            return text

    async def until(self, check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = check()
            if value:
                return value
            if self.runner.done():
                raise AssertionError(f"the controller ended: {self.out.getvalue()}")
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.out.getvalue()}")
            await asyncio.sleep(0.05)


async def start(root: Path, *, stack: str | None = None) -> Running:
    stack_dir = None
    if stack is not None:
        stack_dir = root / "stacks"
        stack_dir.mkdir(parents=True, exist_ok=True)
        (stack_dir / "faults.toml").write_text(stack)
    out = io.StringIO()
    opts = DaemonOptions(
        config_dir=root / "config",
        state_dir=root / "state",
        stack_dir=stack_dir,
        out=out,
        listen="127.0.0.1:0",
        token=TOKEN,
        resync_s=1.0,
    )
    controller = Controller(opts)
    runner = asyncio.create_task(controller.run())
    ready = asyncio.create_task(controller.ready.wait())
    await asyncio.wait({runner, ready}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        raise AssertionError(f"the controller did not start: {out.getvalue()}")
    return Running(controller, runner, out, root)


@pytest.fixture
async def cleanup(tmp_path: Path) -> AsyncIterator[list[Running]]:
    started: list[Running] = []
    yield started
    for running in started:
        running.controller.stop.set()
        if not running.runner.done():
            await asyncio.wait_for(running.runner, 60)
    # Whatever a controller left running (the fatal path keeps servers): stop it.
    await stop_everything(tmp_path / "config", tmp_path / "state", "process", lambda _: None)


def _owned(state_dir: Path) -> list[psutil.Process]:
    owner = str(state_dir.resolve())
    found = []
    for proc in psutil.process_iter():
        try:
            if (
                proc.status() != psutil.STATUS_ZOMBIE
                and proc.environ().get("SLOTCTL_OWNER") == owner
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


async def test_a_failing_background_task_is_reported_restarted_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleanup: list[Running]
) -> None:
    calls = 0
    original = Reconciler.run

    async def flaky(self: Reconciler, stop: asyncio.Event) -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError(f"injected fault {calls}")
        await original(self, stop)

    monkeypatch.setattr(Reconciler, "run", flaky)
    monkeypatch.setattr(supervise, "RESTART_BASE_S", 0.05)
    slot = SlotDef("sup-a")
    running = await start(tmp_path, stack=stack_text("faults", [slot]))
    cleanup.append(running)

    # Restarted twice (0.05 s, then 0.1 s), then the reconciler loads the autoload slot.
    await running.until(lambda: calls >= 3, "the third start of the reconciler")
    await running.until(
        lambda: running.manager.view("sup-a").state.value == "ready", "the slot to load"
    )
    failures = [
        e for e in running.manager.events.since(0) if e.kind == "error" and e.op == "background"
    ]
    assert [e.details["task"] for e in failures] == ["reconciler", "reconciler"]
    assert [e.details["restart_in_s"] for e in failures] == [0.05, 0.1]
    assert all(e.error == "controller.task_failed" for e in failures)
    assert "injected fault 1" in failures[0].message
    metrics = await asyncio.to_thread(running.get, "/metrics")
    assert 'slotctl_background_failures_total{task="reconciler"} 2.0' in metrics
    assert "background task reconciler failed" in running.out.getvalue()

    running.controller.stop.set()
    assert await asyncio.wait_for(running.runner, 60) == 0
    assert _owned(tmp_path / "state") == []


async def test_a_failure_of_supervision_exits_1_and_leaves_the_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleanup: list[Running]
) -> None:
    running = await start(tmp_path, stack=stack_text("faults", [SlotDef("fatal-a")]))
    cleanup.append(running)
    await running.until(
        lambda: running.manager.view("fatal-a").state.value == "ready", "the slot to load"
    )
    pid = int(StateStore(tmp_path / "state").read_aux("fatal-a", "process.json")["pid"])  # type: ignore[index]

    def broken_report(*args: object) -> None:
        raise RuntimeError("the report itself failed")

    async def failing_refresh() -> None:
        raise RuntimeError("injected watcher fault")

    assert running.controller.supervisor is not None and running.controller.watcher is not None
    monkeypatch.setattr(running.controller.supervisor, "report_failure", broken_report)
    monkeypatch.setattr(running.controller.watcher, "refresh", failing_refresh)
    (tmp_path / "config" / "touch.toml").write_text("# wake the watcher\n")

    assert await asyncio.wait_for(running.runner, 60) == 1
    out = running.out.getvalue()
    assert "internal error: background task watch ended" in out
    assert "servers keep running" in out
    assert psutil.Process(pid).is_running()
    assert StateStore(tmp_path / "state").read("fatal-a").state.value == "ready"  # type: ignore[union-attr]


async def test_stack_files_are_parsed_off_the_event_loop_and_size_limited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleanup: list[Running]
) -> None:
    loop_thread = threading.get_ident()
    threads: list[tuple[str, int]] = []

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            threads.append((name, threading.get_ident()))
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(gitops, "load_stacks", spy("load_stacks", gitops.load_stacks))
    monkeypatch.setattr(gitops, "apply_to_config", spy("apply_to_config", gitops.apply_to_config))
    # The desired state's one owner reads the config dir (issue 27; its files source,
    # issue 41): for the reconciler, GitOps and the API alike.
    monkeypatch.setattr(files, "read_config_dir", spy("read_config_dir", files.read_config_dir))
    monkeypatch.setattr(
        routes, "load_stack_texts", spy("load_stack_texts", routes.load_stack_texts)
    )
    monkeypatch.setattr(
        routes, "apply_to_config", spy("api_apply_to_config", routes.apply_to_config)
    )
    slots = [SlotDef("off-a", autoload=False)]
    running = await start(tmp_path, stack=stack_text("faults", slots))
    cleanup.append(running)
    threads.clear()  # from here on: the watcher, the resync, their applies
    stack_file = tmp_path / "stacks" / "faults.toml"
    stack_file.write_text(stack_text("faults", [*slots, SlotDef("off-b", autoload=False)]))
    await running.until(lambda: "off-b" in running.manager.names(), "off-b to be applied")
    names = {name for name, _ in threads}
    assert {"load_stacks", "read_config_dir", "apply_to_config"} <= names, threads
    on_loop = [name for name, ident in threads if ident == loop_thread]
    assert on_loop == [], f"parsed or written on the event loop: {on_loop}"

    # The same through the API: parse, apply and the re-read after it, off the loop.
    threads.clear()
    body = json.dumps({"stack": stack_text("api", [SlotDef("off-c", autoload=False)])})
    answer = await asyncio.to_thread(running.post, "/api/stacks/apply", body)
    assert json.loads(answer)["changed"] == ["models", "off-c"]
    await running.until(lambda: "off-c" in running.manager.names(), "off-c to be applied")
    names = {name for name, _ in threads}
    assert {"load_stack_texts", "read_config_dir", "api_apply_to_config"} <= names, threads
    # Issue 27: what the API plans against is read through the desired state's owner
    # (before the write), not by the planner itself.
    order = [name for name, _ in threads]
    assert order.index("read_config_dir") < order.index("api_apply_to_config"), order
    on_loop = [name for name, ident in threads if ident == loop_thread]
    assert on_loop == [], f"parsed or written on the event loop: {on_loop}"

    # A stack file over the limit is refused unparsed; nothing changes.
    before = sorted(p.name for p in (tmp_path / "config" / "slots").iterdir())
    (tmp_path / "stacks" / "huge.toml").write_text("# " + "x" * MAX_FILE_BYTES + "\n")
    await running.until(lambda: "stack.too_large" in running.out.getvalue(), "the refusal")
    assert "stack dir is invalid: nothing changed" in running.out.getvalue()
    assert sorted(p.name for p in (tmp_path / "config" / "slots").iterdir()) == before
    assert set(running.manager.names()) == {"off-a", "off-b", "off-c"}

    # Issue 40, item 5: one nested too deeply for the parsers (400 KB, under the limit)
    # is an invalid file named in one report line; the watcher lives on (it crash-looped
    # on a RecursionError, a 3,000-line traceback a restart).
    (tmp_path / "stacks" / "huge.toml").unlink()
    deep = tmp_path / "stacks" / "deep.toml"
    deep.write_text("x = " + "[" * 200_000 + "]" * 200_000 + "\n")
    await running.until(lambda: "stack.too_deep" in running.out.getvalue(), "the refusal")
    said = running.out.getvalue()
    assert str(deep) in said and "Traceback" not in said and "RecursionError" not in said
    deep.unlink()
    stack_file.write_text(stack_text("faults", [*slots, SlotDef("off-d", autoload=False)]))
    await running.until(lambda: "off-d" in running.manager.names(), "the watcher to go on")


async def test_a_missing_or_unreadable_config_dir_keeps_the_last_good_state(
    tmp_path: Path,
) -> None:
    from controller.reconcile.apply import apply_to_config
    from controller.spec.loader import load_stack_texts

    config_dir = tmp_path / "config"
    report = load_stack_texts([("s.toml", stack_text("keep", [SlotDef("keep-a")]))])
    assert report.state is not None
    apply_to_config(report.state, config_dir, prune=False)
    runtime = FakeRuntime()
    manager = SlotManager(
        runtime=runtime,
        state_dir=tmp_path / "state",
        config_dir=config_dir,
        prober=FakeProber(runtime),
        memory=FakeMemoryProbe({"cpu": 8 * GIB}),
    )
    reconciler = Reconciler(manager, config_dir)
    await manager.set_desired(reconciler.refresh().desired())
    assert reconciler.plan("keep-a").kind == "load"

    shutil.rmtree(config_dir)
    snapshot = read_config_dir(config_dir)
    assert not snapshot.readable
    assert [p.code for p in snapshot.errors] == ["config.unreadable"]
    assert "keep-a" in reconciler.refresh().slots
    assert reconciler.plan("keep-a").kind == "load"  # never "delete"

    config_dir.mkdir()
    (config_dir / "slots").write_text("not a directory\n")
    assert "keep-a" in reconciler.refresh().slots
    assert reconciler.plan("keep-a").kind == "load"
    await manager.close()


async def test_a_second_controller_on_the_same_state_dir_is_refused(
    tmp_path: Path, cleanup: list[Running]
) -> None:
    running = await start(tmp_path, stack=stack_text("faults", [SlotDef("one-a")]))
    cleanup.append(running)
    await running.until(
        lambda: running.manager.view("one-a").state.value == "ready", "the slot to load"
    )
    second = Controller(
        DaemonOptions(
            config_dir=tmp_path / "config",
            state_dir=tmp_path / "state",
            out=io.StringIO(),
            listen="127.0.0.1:0",
            token=TOKEN,
        )
    )
    with pytest.raises(ControllerAlreadyRunning) as refused:
        await second.run()
    assert f"pid {os.getpid()}" in refused.value.message
    assert not running.runner.done()
    assert running.manager.view("one-a").state.value == "ready"
    assert len(_owned(tmp_path / "state")) == 1


async def test_a_dead_reconciler_subtask_ends_run_for_the_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker or the event follower that dies used to vanish silently (fewer workers,
    or autoload slots never looked at again after a crash); now ``run`` fails at once, and
    the daemon's supervisor reports and restarts it."""

    async def dies(*_: Any) -> None:
        raise RuntimeError("injected follower fault")

    monkeypatch.setattr(reconciler_module, "follow_manager", dies)
    runtime = FakeRuntime()
    manager = SlotManager(
        runtime=runtime,
        state_dir=tmp_path / "state",
        config_dir=tmp_path / "config",
        prober=FakeProber(runtime),
        memory=FakeMemoryProbe({"cpu": 8 * GIB}),
    )
    reconciler = Reconciler(manager, tmp_path / "config", resync_s=3600.0)
    with pytest.raises(RuntimeError, match="a reconciler task ended") as ended:
        await asyncio.wait_for(reconciler.run(asyncio.Event()), 10)
    assert "injected follower fault" in str(ended.value.__cause__)
    await manager.close()


async def test_a_config_dir_that_refuses_writes_fails_the_apply_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleanup: list[Running]
) -> None:
    slots = [SlotDef("ro-a", autoload=False)]
    running = await start(tmp_path, stack=stack_text("faults", slots))
    cleanup.append(running)
    real = gitops.apply_to_config

    def refused(*args: Any, **kwargs: Any) -> list[str]:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gitops, "apply_to_config", refused)
    stack_file = tmp_path / "stacks" / "faults.toml"
    stack_file.write_text(stack_text("faults", [*slots, SlotDef("ro-b", autoload=False)]))
    await running.until(
        lambda: "apply failed: cannot write the config dir" in running.out.getvalue(), "refusal"
    )
    assert not [e for e in running.manager.events.since(0) if e.op == "background"]
    monkeypatch.setattr(gitops, "apply_to_config", real)  # space returns: the next save applies
    stack_file.write_text(stack_text("faults", [*slots, SlotDef("ro-c", autoload=False)]))
    await running.until(lambda: "ro-c" in running.manager.names(), "ro-c to be applied")


def test_a_config_dir_deleted_while_it_is_read_is_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rm -rf`` removes the slot files one by one: a read in the middle saw some slots
    gone (the soak caught the reconciler unloading them). The read now checks that the
    directory it read is still there, the same one."""
    import controller.spec.configdir as configdir
    from controller.reconcile.apply import apply_to_config
    from controller.spec.loader import load_stack_texts

    config_dir = tmp_path / "config"
    slots = [SlotDef("mid-a"), SlotDef("mid-b")]
    report = load_stack_texts([("s.toml", stack_text("mid", slots))])
    assert report.state is not None
    apply_to_config(report.state, config_dir, prune=False)
    real = configdir._read

    def read_then_rm(path: Path, cache: Any = None) -> Any:
        (path / "slots" / "mid-a.toml").unlink()  # rm -rf, caught half way
        snapshot = real(path, cache)
        shutil.rmtree(path)
        return snapshot

    monkeypatch.setattr(configdir, "_read", read_then_rm)
    snapshot = read_config_dir(config_dir)
    assert not snapshot.readable
    assert "changed while it was read" in snapshot.errors[0].message


async def test_a_changed_controller_toml_says_a_restart_applies_it(
    tmp_path: Path, cleanup: list[Running]
) -> None:
    """Issue 40, item 12: ``controller.toml`` was re-read but its settings kept until a
    restart, silently. A change the running controller does not apply is said, once, in
    up's output, naming what changed; going back to what runs says so too."""
    config = tmp_path / "config"
    config.mkdir(parents=True)
    (config / "controller.toml").write_text("safety_margin_gb = 0.5\n")
    running = await start(tmp_path)
    cleanup.append(running)
    assert running.manager.settings.safety_margin_gb == 0.5
    (config / "controller.toml").write_text("safety_margin_gb = 1.5\nqueue_aging_s = 5\n")
    said = await running.until(
        lambda: "controller.toml changed" in running.out.getvalue() and running.out.getvalue(),
        "the change said",
    )
    line = next(x for x in said.splitlines() if "controller.toml changed" in x)
    assert "restart" in line and "queue_aging_s" in line and "safety_margin_gb" in line, line
    assert running.manager.settings.safety_margin_gb == 0.5  # what runs is kept
    (config / "controller.toml").write_text("safety_margin_gb = 0.5\n")
    await running.until(
        lambda: "controller.toml is back to the settings in force" in running.out.getvalue(),
        "the return said",
    )
    assert running.out.getvalue().count("controller.toml changed") == 1


async def test_a_failed_load_is_said_once_an_attempt(
    tmp_path: Path, cleanup: list[Running]
) -> None:
    """Issue 40, item 14: each failed attempt was printed twice in up's output, as the
    transition to ``error`` and again as the reconciler's error with the same words."""
    bad = SlotDef("bad", load_seconds=0.05, extra=("--fail-on-load",))
    running = await start(tmp_path, stack=stack_text("faults", [bad]))
    cleanup.append(running)
    await running.until(
        lambda: running.out.getvalue().count("warming -> error") >= 2, "two failed attempts"
    )
    said = running.out.getvalue().splitlines()
    failures = [line for line in said if "injected failure (--fail-on-load)" in line]
    transitions = [line for line in failures if "warming -> error" in line]
    assert len(transitions) >= 2 and failures == transitions, "\n".join(failures)
