"""A just-spawned server's labels are readable when ``start`` returns (``await_exec``).

``Popen`` returns once the child's exec passed its point of no return, but the kernel
fills in the new image's environment a little later: a read of ``/proc/PID/environ`` in
between is empty, and a server read then has no labels (a stranger to a resync: a
duplicate start). The spawn waits for the labels (bounded)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil

from controller.runtime.process.labels import await_exec
from controller.runtime.process.runtime import ProcessRuntime
from tests.integration.helpers import demo_launch

# Sleeps, then execs itself into a sleeper whose environment carries the label: the
# window between a spawn and the labels showing, made long enough to look into.
_LATE_EXEC = (
    "import os, sys, time; time.sleep(0.4); "
    "env = dict(os.environ, SLOTCTL_MANAGED='true'); "
    "os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)'], env)"
)


def _environ_has_label(pid: int) -> bool:
    return psutil.Process(pid).environ().get("SLOTCTL_MANAGED") == "true"


def test_await_exec_waits_until_the_labels_show() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _LATE_EXEC], start_new_session=True)
    try:
        time.sleep(0.05)
        assert not _environ_has_label(proc.pid)  # not yet: the exec comes later
        assert await_exec(proc.pid, timeout_s=10.0)
        assert _environ_has_label(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_await_exec_is_bounded_and_false_without_labels() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    try:
        assert not await_exec(proc.pid, timeout_s=0.2)  # never labelled: gives up
    finally:
        proc.kill()
        proc.wait()
    assert not await_exec(proc.pid, timeout_s=0.2)  # gone


async def test_every_spawned_server_is_labelled_when_start_returns(tmp_path: Path) -> None:
    """Many starts in a row: each server's labels are read right after ``start``, as a
    resync or another controller's look would read them."""
    runtime = ProcessRuntime(tmp_path / "state")
    sleeper = (sys.executable, "-c", "import time; time.sleep(30)")
    try:
        for index in range(20):
            launch = demo_launch(f"s{index}")
            launch = replace(launch, argv=sleeper)
            observed = await runtime.start(launch)
            labels = runtime.labelled.labels_of(psutil.Process(int(observed.ident or 0)))
            assert labels is not None and labels["SLOTCTL_SLOT"] == f"s{index}"
            assert _late_labels_seen_by_a_fresh_scan(tmp_path, f"s{index}")
    finally:
        for observed in await runtime.list_managed():
            await runtime.stop(observed.slot, timeout=2)


def _late_labels_seen_by_a_fresh_scan(tmp_path: Path, slot: str) -> bool:
    """A second runtime on the same state dir (a restarted controller) finds it too."""
    other = ProcessRuntime(tmp_path / "state")
    return slot in other.labelled.scan_all()
