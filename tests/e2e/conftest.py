"""End-to-end harness: the real ``slotctl`` CLI as subprocesses, the real process runtime
and the demo server, with a private config dir and state dir per test.

``ctl`` (function): a :class:`Slotctl` bound to ``tmp_path/config`` and ``tmp_path/state``.
Its teardown runs ``slotctl down`` (which stops a running controller and every server it,
or an ``apply --once``, left behind; skipped when there is none of these, as ``down``
would do nothing), reaps every controller it started, and fails the
test if any demo server labelled with this state dir (``SLOTCTL_OWNER``) still runs — so
nothing outlives a test, and the leftover-children check in ``tests/conftest.py`` holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import psutil
import pytest

from controller.store.lock import ControllerLock
from tests.children import CHILD
from tests.integration.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str, timeout: float = 30.0, every: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


@dataclass
class SlotDef:
    """One demo slot of a generated stack file."""

    name: str
    autoload: bool = True
    priority: int = 50
    load_seconds: float = 0.3
    extra: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    options: tuple[tuple[str, str], ...] = ()  # more slot keys, as TOML (key, value) pairs

    @property
    def extra_args(self) -> list[str]:
        return ["--load-seconds", f"{self.load_seconds:g}", *self.extra]


def stack_text(stack: str, slots: Sequence[SlotDef]) -> str:
    """A stack file: one ``demo://`` model per slot, every slot on the demo provider."""
    out = [f'[stack]\nname = "{stack}"\n']
    for slot in slots:
        out.append(f'[[model]]\nid = "m-{slot.name}"\nsource = "demo://{slot.name}"\n')
        out.append("memory_gb = 0.05\n")
    for slot in slots:
        args = ", ".join(json.dumps(a) for a in slot.extra_args)
        out.append(
            f'\n[[slot]]\nname = "{slot.name}"\nprovider = "demo"\n'
            f'model.default = "m-{slot.name}"\ndevice = "cpu"\nport = {slot.port}\n'
            f"autoload = {'true' if slot.autoload else 'false'}\n"
            f"priority = {slot.priority}\n"
            + "".join(f"{key} = {value}\n" for key, value in slot.options)
            + f"[slot.server]\nextra_args = [{args}]\n"
        )
    return "".join(out)


class Slotctl:
    """Runs ``python -m controller --config-dir C --state-dir S ...`` for one test."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.config = tmp / "config"
        self.state = tmp / "state"
        self.controllers: list[tuple[subprocess.Popen[bytes], IO[bytes], Path]] = []
        self.extra_env: dict[str, str] = {}  # e.g. a fake NVML for every command

    # ------------------------------------------------------------------ running the CLI

    @property
    def env(self) -> dict[str, str]:
        drop = {"NO_COLOR", "FORCE_COLOR", "TERM", "SLOTCTL_TOKEN"}
        env = {
            k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLOTCTL_")
        }
        env["PYTHONPATH"] = str(REPO)
        env["NO_COLOR"] = "1"
        for key, value in self.extra_env.items():
            env[key] = f"{value}{os.pathsep}{env[key]}" if key == "PYTHONPATH" else value
        env["PYTHONFAULTHANDLER"] = "1"  # a hung controller dumps its threads on SIGABRT
        return env

    def argv(self, *args: str | Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "controller",
            "--config-dir",
            str(self.config),
            "--state-dir",
            str(self.state),
            *map(str, args),
        ]

    def run(self, *args: str | Path, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.tmp,
            check=False,
            **CHILD,
        )

    def ok(self, *args: str | Path, timeout: float = 90.0) -> str:
        """Run; assert exit 0; return stdout."""
        result = self.run(*args, timeout=timeout)
        assert result.returncode == 0, self.explain(result)
        return result.stdout

    def json(self, *args: str | Path) -> Any:
        return json.loads(self.ok(*args, "-o", "json"))

    def explain(self, result: subprocess.CompletedProcess[str]) -> str:
        return (
            f"$ slotctl {' '.join(map(str, result.args[7:]))}\nexit {result.returncode}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}\n"
            f"--- controller\n{self.controller_log()}"
        )

    # ------------------------------------------------------------------ the controller

    def start_up(self, *args: str | Path) -> subprocess.Popen[bytes]:
        """``slotctl up ARGS`` in the background, output to ``up-N.log``; returns once the
        controller holds the state dir."""
        log_path = self.tmp / f"up-{len(self.controllers)}.log"
        log = log_path.open("wb")
        if "--listen" not in args:  # never the fixed default port: tests run in parallel
            args = (*args, "--listen", "127.0.0.1:0")
        proc = subprocess.Popen(
            self.argv("up", *args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.tmp,
            **CHILD,
        )
        self.controllers.append((proc, log, log_path))
        wait_until(
            lambda: proc.poll() is not None or "controller: runtime" in self.controller_log(),
            "the controller to start",
        )
        assert proc.poll() is None, f"slotctl up exited early:\n{self.controller_log()}"
        return proc

    def controller_log(self) -> str:
        if not self.controllers:
            return "(no controller started)"
        return self.controllers[-1][2].read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 30.0) -> str:
        return wait_until(
            lambda: text in self.controller_log() and self.controller_log(),
            f"{text!r} in the controller output",
            timeout,
        )

    # ------------------------------------------------------------------ observing

    def pids(self) -> dict[str, int]:
        """slot -> pid from ``<state>/slots/<name>/process.json`` (running or not)."""
        out = {}
        for record in sorted(self.state.glob("slots/*/process.json")):
            with contextlib.suppress(OSError, ValueError, KeyError):
                out[record.parent.name] = int(json.loads(record.read_text())["pid"])
        return out

    def states(self) -> dict[str, str]:
        return {row["name"]: row["state"] for row in self.json("slot", "list")}

    def wait_states(self, want: Mapping[str, str], timeout: float = 60.0) -> dict[str, str]:
        def check() -> dict[str, str] | None:
            now = self.states()
            return now if all(now.get(k) == v for k, v in want.items()) else None

        try:
            return wait_until(check, f"slot states {dict(want)}", timeout, every=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; now {self.states()}\n{self.controller_log()}") from None

    def owned_processes(self) -> list[psutil.Process]:
        """Live processes labelled with this state dir (demo servers we started)."""
        owner = str(self.state.resolve())
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if proc.environ().get("SLOTCTL_OWNER") == owner:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    # ------------------------------------------------------------------ teardown

    def anything_to_stop(self) -> bool:
        """Whether ``slotctl down`` has anything to stop here: a controller of ours still
        running, a live controller on the state dir, a server record, or a labelled server.
        Without any, ``down`` is a no-op, and a cold ``slotctl down`` (it imports the whole
        controller: about 0.7 s of CPU) is not worth its cost in every test's teardown."""
        if not self.state.is_dir():
            return False
        if any(proc.poll() is None for proc, _, _ in self.controllers):
            return True
        if ControllerLock(self.state).running() is not None:
            return True
        if any(self.state.glob("slots/*/process.json")):
            return True
        return bool(self.owned_processes())

    def close(self) -> list[str]:
        """Stop everything this test started; returns what had to be killed by force."""
        problems: list[str] = []
        if self.anything_to_stop():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run("down", "--timeout", "30", timeout=60)
        for proc, log, _ in self.controllers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                problems.append(
                    f"controller pid {proc.pid} survived `slotctl down`:\n{self.controller_log()}"
                )
            finally:
                log.close()
        for proc in self.owned_processes():
            problems.append(f"demo server {proc.pid} {' '.join(proc.cmdline())[:100]}")
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.Error):
                proc.wait(5)
        return problems


@pytest.fixture
def ctl(tmp_path: Path) -> Iterator[Slotctl]:
    harness = Slotctl(tmp_path)
    try:
        yield harness
    finally:
        leftovers = harness.close()
    assert not leftovers, f"left running after `slotctl down`: {leftovers}"
