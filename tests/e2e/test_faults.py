"""Faults in the controller's environment that must not take the data plane down (issue 13).

A real ``slotctl up`` (a subprocess, process runtime, demo servers) in GitOps mode or on a
plain config dir, and the environment turned hostile under it: a symlink loop in the
stack dir, the config dir deleted, the stack dir deleted and re-created, an API delete of
a slot the stack dir declares. Each time the servers keep running (same pid, still
``ready``), the controller says what happened, and it keeps following its directories.
docs/reliability.md lists these tests in its fault table; ``make soak`` adds a long run
of random directory faults (``test_directory_faults_soak``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Slotctl, SlotDef, wait_until
from tests.e2e.test_workflow import alive, expected_states, write_stack

SOAK = os.environ.get("SLOTCTL_SOAK") == "1"


def _gitops(ctl: Slotctl, slots: list[SlotDef]) -> tuple[Path, Path, dict[str, int]]:
    stack_dir = ctl.tmp / "gitops"
    stack = write_stack(stack_dir / "e2e.toml", slots)
    ctl.start_up(stack_dir)
    ctl.wait_states(expected_states(slots))
    return stack_dir, stack, ctl.pids()


def _still_serving(ctl: Slotctl, slots: list[SlotDef], pids: dict[str, int]) -> None:
    up = ctl.controllers[-1][0]
    assert up.poll() is None, f"the controller exited:\n{ctl.controller_log()}"
    assert ctl.pids() == pids
    assert all(alive(pid) for pid in pids.values())
    # The controller's own view (the CLI's `slot list` reads the config dir, gone here).
    status, body = _api(ctl, "GET", "/api/slots")
    assert status == 200, body
    assert {s["name"]: s["state"] for s in body["slots"]} == expected_states(slots)


def _config_line(ctl: Slotctl, slot: str) -> str:
    path = ctl.config / "slots" / f"{slot}.toml"
    return path.read_text() if path.exists() else ""


def test_symlink_loop_in_the_stack_dir_is_reported_and_contained(ctl: Slotctl) -> None:
    slots = [SlotDef("loop-a")]
    stack_dir, stack, pids = _gitops(ctl, slots)

    (stack_dir / "loop.toml").symlink_to("loop.toml")  # ELOOP on every read and resolve()
    ctl.wait_log("stack dir is invalid")
    assert "loop.toml" in ctl.controller_log()
    _still_serving(ctl, slots, pids)

    # The watcher still follows the stack dir: removing the loop and editing applies.
    (stack_dir / "loop.toml").unlink()
    slots[0] = dataclasses.replace(slots[0], priority=71)
    write_stack(stack, slots)
    wait_until(lambda: "priority = 71" in _config_line(ctl, "loop-a"), "the edit to apply")
    _still_serving(ctl, slots, pids)
    assert "ended unexpectedly" not in ctl.controller_log()


def test_deleted_config_dir_changes_nothing(ctl: Slotctl) -> None:
    slots = [SlotDef("cfg-a"), SlotDef("cfg-b", autoload=False)]
    stack = write_stack(ctl.tmp / "stacks" / "e2e.toml", slots)
    ctl.ok("stack", "apply", stack)
    ctl.start_up("--resync", "1")
    ctl.wait_states(expected_states(slots))
    pids = ctl.pids()

    shutil.rmtree(ctl.config)
    ctl.wait_log(f"config dir {ctl.config} is gone")
    time.sleep(2.5)  # two resync periods and watcher passes: nothing unloaded or removed
    _still_serving(ctl, slots, pids)

    # The dir comes back (a restore): it is watched again, the servers stay as they are.
    ctl.ok("stack", "apply", stack)
    ctl.wait_log("was re-created or replaced: watching the new one")
    slots[0] = dataclasses.replace(slots[0], priority=64)
    ctl.ok("stack", "apply", write_stack(stack, slots))
    ctl.wait_log("priority 50 -> 64")
    _still_serving(ctl, slots, pids)


def test_deleted_config_dir_is_rebuilt_from_the_stack_dir(ctl: Slotctl) -> None:
    slots = [SlotDef("reb-a"), SlotDef("reb-b", autoload=False)]
    _, _, pids = _gitops(ctl, slots)
    before = {p.name for p in (ctl.config / "slots").iterdir()}

    shutil.rmtree(ctl.config)
    ctl.wait_log("re-applying the stack dir to rebuild it")
    wait_until(
        lambda: (
            (ctl.config / "slots").is_dir()
            and {p.name for p in (ctl.config / "slots").iterdir()} == before
        ),
        "the config dir to be rebuilt",
    )
    _still_serving(ctl, slots, pids)


def test_stack_dir_deleted_and_recreated_keeps_gitops(ctl: Slotctl) -> None:
    slots = [SlotDef("re-a"), SlotDef("re-b", autoload=False)]
    stack_dir, stack, pids = _gitops(ctl, slots)

    shutil.rmtree(stack_dir)  # `rm -rf stacks && git clone ... stacks`
    ctl.wait_log(f"stack dir {stack_dir} is gone")
    stack_dir.mkdir()
    slots[1] = dataclasses.replace(slots[1], priority=81)
    write_stack(stack, slots)
    ctl.wait_log("was re-created or replaced: watching the new one")
    wait_until(lambda: "priority = 81" in _config_line(ctl, "re-b"), "the new clone to apply")
    _still_serving(ctl, slots, pids)

    # And the new directory is followed from then on.
    slots[1] = dataclasses.replace(slots[1], priority=82)
    write_stack(stack, slots)
    wait_until(lambda: "priority = 82" in _config_line(ctl, "re-b"), "a later edit to apply")

    # Replaced by a rename (rsync/atomic checkout style): followed as well.
    staged = ctl.tmp / "gitops.new"
    slots[1] = dataclasses.replace(slots[1], priority=83)
    write_stack(staged / "e2e.toml", slots)
    os.rename(stack_dir, ctl.tmp / "gitops.old")
    os.rename(staged, stack_dir)
    wait_until(lambda: "priority = 83" in _config_line(ctl, "re-b"), "the renamed dir to apply")
    _still_serving(ctl, slots, pids)


def _api(
    ctl: Slotctl, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    record = json.loads((ctl.state / "controller.json").read_text())
    token = (ctl.state / "token").read_text().strip()
    request = urllib.request.Request(
        f"http://{record['listen']}{path}",
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        data=None if body is None else json.dumps(body).encode(),
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_api_delete_of_a_slot_the_stack_dir_declares_is_refused(ctl: Slotctl) -> None:
    slots = [SlotDef("own-a"), SlotDef("own-b", autoload=False)]
    stack_dir, _, pids = _gitops(ctl, slots)

    status, body = _api(ctl, "DELETE", "/api/slots/own-a")
    assert status == 409, body
    assert body["error"]["code"] == "slot.owned_by_stack"
    assert body["error"]["stack"] == "e2e"
    assert body["error"]["stack_dir"] == str(stack_dir)
    status, body = _api(ctl, "DELETE", "/api/slots/own-b?force=true")
    assert status == 409, body
    assert (ctl.config / "slots" / "own-a.toml").exists()
    assert (ctl.config / "slots" / "own-b.toml").exists()
    _still_serving(ctl, slots, pids)


def test_api_config_writes_to_a_slot_the_stack_dir_declares_are_refused(ctl: Slotctl) -> None:
    """PUT, PATCH and swap would be overwritten by the next apply (or stick silently
    until then): refused like a delete, and the config file is left as it was."""
    slots = [SlotDef("cfg-a"), SlotDef("cfg-b", autoload=False)]
    _, _, pids = _gitops(ctl, slots)
    before = (ctl.config / "slots" / "cfg-a.toml").read_text()
    writes = [
        ("PATCH", "/api/slots/cfg-a/defaults", {"priority": 99}),
        ("PUT", "/api/slots/cfg-a/config", {"provider": "demo", "port": 1}),
        ("POST", "/api/slots/cfg-a/swap", {"model": "cfg-b-model"}),
    ]
    for method, path, payload in writes:
        status, body = _api(ctl, method, path, payload)
        assert status == 409, (method, body)
        assert body["error"]["code"] == "slot.owned_by_stack", body
        assert body["error"]["slot"] == "cfg-a"
    assert (ctl.config / "slots" / "cfg-a.toml").read_text() == before
    _still_serving(ctl, slots, pids)


@pytest.mark.slow
@pytest.mark.skipif(not SOAK, reason="soak run: SLOTCTL_SOAK=1 (make soak)")
@pytest.mark.timeout(1200)
def test_directory_faults_soak(ctl: Slotctl) -> None:
    """``make soak``: 60 random directory faults against one GitOps controller, each
    followed by an edit that must apply; the servers never restart."""
    rng = random.Random(int(os.environ.get("SLOTCTL_FAULT_SEED", "13")))
    slots = [SlotDef("soak-a"), SlotDef("soak-b"), SlotDef("soak-c", autoload=False)]
    stack_dir, stack, pids = _gitops(ctl, slots)
    for round_ in range(60):
        fault = rng.choice(["loop", "config", "stack", "rename"])
        if fault == "loop":
            (stack_dir / "loop.toml").symlink_to("loop.toml")
            ctl.wait_log("stack dir is invalid")
            (stack_dir / "loop.toml").unlink()
        elif fault == "config":
            shutil.rmtree(ctl.config)
        elif fault == "stack":
            shutil.rmtree(stack_dir)
            stack_dir.mkdir()
        else:
            staged = ctl.tmp / "staged"
            write_stack(staged / "e2e.toml", slots)
            shutil.rmtree(stack_dir)
            os.rename(staged, stack_dir)
        slots[2] = dataclasses.replace(slots[2], priority=round_ % 90 + 1)
        write_stack(stack, slots)
        want = f"priority = {round_ % 90 + 1}\n"
        try:
            wait_until(lambda want=want: want in _config_line(ctl, "soak-c"), f"round {round_}")
        except AssertionError as exc:
            raise AssertionError(f"{exc} ({fault}):\n{ctl.controller_log()[-6000:]}") from None
        _still_serving(ctl, slots, pids)
