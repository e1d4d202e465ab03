"""The declarative workflow end to end (SPEC §8-9): ``slotctl up``, ``stack
apply|diff|export``, GitOps, ``apply --once`` and ``down``, through the real CLI as
subprocesses, on the real process runtime with demo servers on free ports.

Every wait polls a condition with a deadline; the fixture ``ctl`` (``conftest.py``)
stops everything with ``slotctl down`` and checks that no demo server outlives a test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from controller.cli.main import main as cli_main
from tests.e2e.conftest import Slotctl, SlotDef, stack_text, wait_until


def six() -> list[SlotDef]:
    """Four autoload slots (one slower to load) and two loaded on demand."""
    return [
        SlotDef("s1", priority=51),
        SlotDef("s2", priority=52),
        SlotDef("s3", priority=53, load_seconds=1.0),
        SlotDef("s4", priority=54),
        SlotDef("s5", autoload=False, priority=55),
        SlotDef("s6", autoload=False, priority=56),
    ]


def write_stack(path: Path, slots: Sequence[SlotDef], stack: str = "e2e") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stack_text(stack, slots))
    return path


def expected_states(slots: Sequence[SlotDef]) -> dict[str, str]:
    return {s.name: "ready" if s.autoload else "offline" for s in slots}


def diff_code(ctl: Slotctl, stack: Path) -> int:
    result = ctl.run("stack", "diff", stack, "--exit-code")
    assert result.returncode in (0, 1), ctl.explain(result)
    return result.returncode


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def paused(proc: psutil.Process | int) -> Iterator[None]:
    """SIGSTOP the controller so a drift can be observed before it repairs it."""
    pid = proc if isinstance(proc, int) else proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


# ===================================================================== up + apply/diff/export


def test_apply_change_drift_export_prune_down(ctl: Slotctl) -> None:
    slots = six()
    autoload = [s.name for s in slots if s.autoload]
    stack = write_stack(ctl.tmp / "stacks" / "e2e.toml", slots)
    up = ctl.start_up()

    # ---- apply --wait: converged when it returns
    out = ctl.ok("stack", "apply", stack, "--wait", "--timeout", "60")
    assert "converged in" in out
    assert ctl.states() == expected_states(slots)
    pids = ctl.pids()
    assert sorted(pids) == autoload
    assert all(alive(p) for p in pids.values())

    # ---- in sync: exit 0, json and json-patch shapes
    assert diff_code(ctl, stack) == 0
    assert json.loads(ctl.ok("stack", "diff", stack, "-o", "json-patch")) == []
    doc = json.loads(ctl.ok("stack", "diff", stack, "-o", "json", "--exit-code"))
    assert doc["in_sync"] is True
    assert {a["slot"]: a["kind"] for a in doc["actions"]} == {s.name: "noop" for s in slots}
    assert doc["config_diffs"] == {} and doc["drift"] == {} and doc["orphans"] == []

    # ---- one slot's server.extra_args changes: only that slot restarts
    slots[1] = dataclasses.replace(slots[1], extra=("--tokens-per-second", "77"))
    write_stack(stack, slots)
    plan = json.loads(ctl.ok("stack", "diff", stack, "-o", "json"))
    assert {a["slot"]: a["kind"] for a in plan["actions"] if a["kind"] != "noop"} == {
        "s2": "recreate"
    }
    patch = json.loads(ctl.ok("stack", "diff", stack, "-o", "json-patch"))
    assert {op["op"] for op in patch} <= {"add", "remove", "replace", "move", "copy", "test"}
    assert {op["path"].split("/")[2] for op in patch} == {"s2"}
    assert any(op["path"].startswith("/slots/s2/server") for op in patch)
    out = ctl.ok("stack", "apply", stack, "--wait", "--timeout", "60")
    assert "recreate" in out and "s2" in out
    after = ctl.pids()
    assert after["s2"] != pids["s2"]
    assert not alive(pids["s2"])
    assert {n: p for n, p in after.items() if n != "s2"} == {
        n: p for n, p in pids.items() if n != "s2"
    }
    assert ctl.states() == expected_states(slots)
    pids = after

    # ---- a server killed by hand: drift (1), then the controller brings it back (0)
    with paused(up.pid):
        os.kill(pids["s3"], signal.SIGKILL)
        result = ctl.run("stack", "diff", stack, "--exit-code")
        assert result.returncode == 1, ctl.explain(result)
        assert "s3" in result.stdout and "not running" in result.stdout
    wait_until(lambda: diff_code(ctl, stack) == 0, "the controller to restart s3", 60)
    after = ctl.pids()
    assert after["s3"] != pids["s3"] and alive(after["s3"])
    assert {n: p for n, p in after.items() if n != "s3"} == {
        n: p for n, p in pids.items() if n != "s3"
    }
    pids = after

    # ---- a slot's config file edited on disk: drift (1) until the stack is re-applied
    path = ctl.config / "slots" / "s4.toml"
    text = path.read_text()
    assert "priority = 54" in text
    path.write_text(text.replace("priority = 54", "priority = 99"))
    result = ctl.run("stack", "diff", stack, "--exit-code")
    assert result.returncode == 1, ctl.explain(result)
    assert "-priority = 99" in result.stdout and "+priority = 54" in result.stdout
    patch = json.loads(ctl.ok("stack", "diff", stack, "-o", "json-patch"))
    assert patch == [{"op": "replace", "path": "/slots/s4/priority", "value": 54}]
    ctl.wait_log("priority 54 -> 99")  # the controller applies the hand edit in place
    out = ctl.ok("stack", "apply", stack, "--wait", "--timeout", "60")
    assert "configured: s4" in out
    assert diff_code(ctl, stack) == 0
    ctl.wait_log("priority 99 -> 54")
    assert ctl.pids() == pids  # priority is applied in place: nothing restarted

    # ---- export round-trips
    exported = ctl.tmp / "exported" / "e2e.toml"
    exported.parent.mkdir()
    exported.write_text(ctl.ok("stack", "export"))
    out = ctl.ok("stack", "apply", exported, "--wait", "--timeout", "60")
    assert "configured: nothing changed" in out
    assert diff_code(ctl, exported) == 0
    assert diff_code(ctl, stack) == 0
    assert ctl.pids() == pids

    # ---- --prune with one slot dropped removes exactly that slot
    dropped = pids["s4"]
    kept = [s for s in slots if s.name != "s4"]
    write_stack(stack, kept)
    out = ctl.ok("stack", "apply", stack, "--prune", "--wait", "--timeout", "60")
    assert "delete" in out and "s4" in out
    assert sorted(p.name for p in (ctl.config / "slots").iterdir()) == sorted(
        f"{s.name}.toml" for s in kept
    )
    wait_until(lambda: not alive(dropped), "the pruned slot's server to stop", 30)
    assert {n: p for n, p in ctl.pids().items() if n != "s4"} == {
        n: p for n, p in pids.items() if n != "s4"
    }
    assert diff_code(ctl, stack) == 0
    states = ctl.states()
    assert {n: states[n] for n in expected_states(kept)} == expected_states(kept)

    # ---- down stops the controller and every server
    out = ctl.ok("down")
    assert up.wait(timeout=30) == 0
    assert "controller stopped" in ctl.controller_log()
    assert ctl.owned_processes() == []
    assert not any(alive(p) for p in pids.values())


# ===================================================================== GitOps


def test_gitops_stack_dir(ctl: Slotctl) -> None:
    slots = [SlotDef("g1"), SlotDef("g2"), SlotDef("g3", autoload=False)]
    stack_dir = ctl.tmp / "gitops"
    stack = write_stack(stack_dir / "e2e.toml", slots)
    up = ctl.start_up(stack_dir)
    ctl.wait_states(expected_states(slots))
    pids = ctl.pids()
    assert sorted(pids) == ["g1", "g2"]

    # ---- saving a changed file: the changed slot restarts, the other keeps serving
    slots[0] = dataclasses.replace(slots[0], extra=("--tokens-per-second", "33"))
    write_stack(stack, slots)
    wait_until(lambda: ctl.pids().get("g1") not in (None, pids["g1"]), "g1 to be recreated", 30)
    ctl.wait_states(expected_states(slots))
    after = ctl.pids()
    assert after["g2"] == pids["g2"]
    pids = after

    # ---- saving an invalid file changes nothing and is reported with file:line
    config_before = {p.name: p.read_bytes() for p in (ctl.config / "slots").iterdir()}
    good = stack_text("e2e", slots)
    lines = good.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line == 'name = "g2"\n')
    lines.insert(at + 1, "prority = 5\n")  # a typo: unknown key on line at + 2
    stack.write_text("".join(lines))
    log = ctl.wait_log("stack dir is invalid")
    assert f"{stack}:{at + 2}" in log, log
    assert "prority" in log
    assert ctl.pids() == pids
    assert {p.name: p.read_bytes() for p in (ctl.config / "slots").iterdir()} == config_before
    assert ctl.states() == expected_states(slots)

    # ---- the fix (with a change) is applied
    slots[1] = dataclasses.replace(slots[1], priority=77)
    write_stack(stack, slots)
    wait_until(
        lambda: "priority = 77" in (ctl.config / "slots" / "g2.toml").read_text(),
        "the fixed stack to reach the config dir",
    )
    ctl.wait_log("priority 50 -> 77")
    assert diff_code(ctl, stack_dir) == 0
    assert ctl.pids() == pids  # in place: no restart

    # ---- SIGTERM (as systemd or Ctrl-C would): the controller stops its servers
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=30) == 0
    assert "controller stopped" in ctl.controller_log()
    assert ctl.owned_processes() == []
    assert not any(alive(p) for p in pids.values())


# ===================================================================== no controller


def test_apply_without_a_controller_once_then_adopted(ctl: Slotctl) -> None:
    slots = [SlotDef("o1"), SlotDef("o2"), SlotDef("o3", autoload=False)]
    stack = write_stack(ctl.tmp / "stacks" / "e2e.toml", slots)

    # ---- --wait needs a running controller: exit 2, a message, nothing applied
    result = ctl.run("stack", "apply", stack, "--wait", "--timeout", "5")
    assert result.returncode == 2, ctl.explain(result)
    assert "no controller is running" in result.stderr
    assert not (ctl.config / "slots").exists()

    # ---- --once converges in this process; servers keep running
    out = ctl.ok("stack", "apply", stack, "--once", "--timeout", "60")
    assert "converged in" in out
    assert ctl.states() == expected_states(slots)
    pids = ctl.pids()
    assert sorted(pids) == ["o1", "o2"]
    assert all(alive(p) for p in pids.values())
    assert diff_code(ctl, stack) == 0

    # ---- a following `up` adopts them (same pids)
    up = ctl.start_up("--keep-running")
    result = ctl.run("stack", "apply", stack, "--once")
    assert result.returncode == 2, ctl.explain(result)  # a controller runs: use --wait
    # A change the controller must act on: once it has, its first pass over every slot
    # (queued at start, before this change) is done too.
    slots[2] = dataclasses.replace(slots[2], priority=60)
    write_stack(stack, slots)
    ctl.ok("stack", "apply", stack, "--wait", "--timeout", "60")
    ctl.wait_log("priority 50 -> 60")
    assert ctl.pids() == pids
    assert all(alive(p) for p in pids.values())
    assert ctl.states() == expected_states(slots)
    assert "-> starting" not in ctl.controller_log()  # nothing was started again

    # ---- --keep-running: the controller exits, its servers stay for the next one
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=30) == 0
    assert "servers keep running (--keep-running)" in ctl.controller_log()
    assert ctl.pids() == pids
    assert all(alive(p) for p in pids.values())

    # ---- down without a controller stops them
    assert "stopped 3 slot(s)" in ctl.ok("down")
    assert ctl.owned_processes() == []
    assert not any(alive(p) for p in pids.values())


def test_down_without_a_controller_stops_once_servers(ctl: Slotctl) -> None:
    stack = write_stack(ctl.tmp / "stacks" / "e2e.toml", [SlotDef("d1"), SlotDef("d2")])
    ctl.ok("stack", "apply", stack, "--once", "--timeout", "60")
    pids = ctl.pids()
    assert len(ctl.owned_processes()) == 2
    out = ctl.ok("down")
    assert "stopped 2 slot(s)" in out
    assert ctl.owned_processes() == []
    assert not any(alive(p) for p in pids.values())


# ===================================================================== diff errors exit 2


def _bad_stack(ctl: Slotctl) -> list[str]:
    path = ctl.tmp / "bad.toml"
    path.write_text('[stack]\nname = "bad"\n[[slot]]\nname = "x\n')
    return ["stack", "diff", str(path), "--exit-code"]


def _missing(ctl: Slotctl) -> list[str]:
    return ["stack", "diff", str(ctl.tmp / "nope.toml"), "--exit-code"]


def _unknown_option(ctl: Slotctl) -> list[str]:
    return ["stack", "diff", str(write_stack(ctl.tmp / "s.toml", [SlotDef("a")])), "--bogus"]


def _state_json_is_a_directory(ctl: Slotctl) -> list[str]:
    (ctl.state / "slots" / "a" / "state.json").mkdir(parents=True)
    return ["stack", "diff", str(write_stack(ctl.tmp / "s.toml", [SlotDef("a")])), "--exit-code"]


def _config_dir_is_a_file(ctl: Slotctl) -> list[str]:
    ctl.config.write_text("not a directory\n")
    return ["stack", "diff", str(write_stack(ctl.tmp / "s.toml", [SlotDef("a")])), "--exit-code"]


@pytest.mark.parametrize(
    ("make", "stderr"),
    [
        pytest.param(_bad_stack, "TOML syntax", id="invalid-stack-file"),
        pytest.param(_missing, "no such file", id="nonexistent-path"),
        pytest.param(_unknown_option, "unrecognized arguments: --bogus", id="unknown-option"),
        pytest.param(_state_json_is_a_directory, "unreadable state file", id="state-json-dir"),
        pytest.param(_config_dir_is_a_file, "is not a directory", id="config-dir-file"),
    ],
)
def test_diff_errors_exit_2(ctl: Slotctl, make: object, stderr: str) -> None:
    assert callable(make)
    args = make(ctl)
    result = ctl.run(*args)
    assert result.returncode == 2, ctl.explain(result)
    assert stderr in result.stderr, ctl.explain(result)
    assert "Traceback" not in result.stderr


def test_a_mangled_process_record_is_treated_as_lost(ctl: Slotctl) -> None:
    """A hand-mangled process.json is ignored (the labels still find a live server)."""
    record = ctl.state / "slots" / "a" / "process.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"pid": "not-a-pid", "create_time": 0}')
    stack = write_stack(ctl.tmp / "s.toml", [SlotDef("a")])
    result = ctl.run("stack", "diff", str(stack), "--exit-code")
    assert result.returncode == 1, ctl.explain(result)  # drift (not applied), not an error
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr


def test_diff_unexpected_exception_in_process_exits_2(
    ctl: Slotctl, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import controller.cli.backend_local
    import controller.reconcile.apply

    async def boom(*args: object, **kw: object) -> None:
        raise RuntimeError("planner exploded")

    monkeypatch.setattr(controller.reconcile.apply, "plan_stack", boom)
    monkeypatch.setattr(controller.cli.backend_local, "plan_stack", boom)
    stack = write_stack(ctl.tmp / "s.toml", [SlotDef("a")])
    base = ["--config-dir", str(ctl.config), "--state-dir", str(ctl.state), "stack", "diff"]
    assert cli_main([*base, str(stack), "--exit-code"]) == 2
    assert cli_main([*base, str(stack), "-o", "json-patch"]) == 2
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: planner exploded" in err
