"""The CLI through the API (issue 6): ``slotctl slot load|unload|swap|reset|hold``,
``slotctl model list|load|unload``, ``slotctl events`` and ``stack apply|diff``, as
subprocesses against a real ``slotctl up --listen 127.0.0.1:0`` on the process runtime.

The controller is found three ways: implicitly through ``--state-dir`` (controller.json
and the token file), explicitly with ``--server``/``--token``, and through
``$SLOTCTL_SERVER``/``$SLOTCTL_TOKEN``; with none reachable every command exits 2.
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from controller.cli.remote import parse_duration
from tests.children import CHILD
from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.helpers import free_port
from tests.integration.test_api import Api, model, slot, start_api, write_settings

GIB = 1024**3

STACK = (
    '[stack]\nname = "remote"\n'
    + model("m-one", 0.4)
    + model("m-two", 0.4)
    + model("m-three", 0.4)
    + model("m-alt", 0.4)
    + model("m-big", 4.0)
    + model("m-unserved", 0.1)
    + slot("one", "m-one", priority=10)
    + slot("two", "m-two", priority=60)
    + slot("three", "m-three", priority=70)
    + slot("big", "m-big")
    + slot("spare", "")
)


def up(ctl: Slotctl, stack: str = STACK) -> Api:
    """Budget 1 GiB on cpu (two 0.4 GiB models fit, a third evicts), the stack applied
    before the controller starts, then ``slotctl up --listen 127.0.0.1:0``."""
    write_settings(ctl.config, cpu_budget_gb=1.0)
    path = ctl.tmp / "remote.toml"
    path.write_text(stack)
    ctl.ok("stack", "apply", path)
    return start_api(ctl)


def fails(ctl: Slotctl, *args: str | Path, code: int = 2) -> subprocess.CompletedProcess[str]:
    result = ctl.run(*args)
    assert result.returncode == code, ctl.explain(result)
    assert "Traceback" not in result.stderr
    return result


def run_with(
    ctl: Slotctl, argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m controller ARGV`` without the harness's --config-dir/--state-dir."""
    return subprocess.run(
        [*ctl.argv()[:3], *argv],
        capture_output=True,
        text=True,
        timeout=90,
        env={**ctl.env, **(env or {})},
        cwd=ctl.tmp,
        check=False,
        **CHILD,
    )


# ============================================================================ slot commands


def test_slot_commands(ctl: Slotctl) -> None:
    api = up(ctl)

    # ---- load: 202 loading, then --wait follows it to ready; again: already loaded
    answer = json.loads(ctl.ok("slot", "load", "one", "-o", "json"))
    assert answer["status"] == "loading" and answer["slot"]["name"] == "one"
    assert answer["slot"]["resident"] is True
    out = ctl.ok("slot", "load", "one", "--wait", "--timeout", "60")
    assert "slot one: ready after" in out
    # Issue 40, item 10: an explicit load makes the slot resident, and says so.
    said = ctl.ok("slot", "load", "one").strip()
    assert said.startswith("slot one: already loaded (ready)"), said
    assert "resident: kept loaded until `slotctl slot unload one`" in said, said
    assert "ttl_s" in said, said
    final = json.loads(ctl.ok("slot", "load", "two", "--wait", "-o", "json"))
    assert final["status"] == "ready" and final["slot"]["state"] == "ready"

    # ---- --dry-run: what would be evicted and why; a refusal exits 1
    out = ctl.ok("slot", "load", "three", "--dry-run")
    assert "would evict 1 slot(s) first" in out, out
    assert "one: priority 10" in out and "frees 0.40 GiB" in out
    plan = json.loads(ctl.ok("slot", "load", "three", "--dry-run", "-o", "json"))["plan"]
    assert plan["action"] == "evict-then-load" and plan["evict"][0]["slot"] == "one"
    refused = fails(ctl, "slot", "load", "big", "--dry-run", code=1)
    assert "would be refused: [model.insufficient_memory]" in refused.stdout
    assert "needs 4.00 GiB" in refused.stdout
    plan = json.loads(fails(ctl, "slot", "load", "big", "--dry-run", "-o", "json", code=1).stdout)
    assert plan["plan"]["action"] == "refuse"
    assert api.slot("three")["state"] == "offline" and api.slot("one")["state"] == "ready"

    # ---- typed API errors: exit 2, "slotctl: error [code]: message"
    err = fails(ctl, "slot", "load", "big").stderr
    assert err.startswith("slotctl: error [model.insufficient_memory]: slot 'big' needs")
    assert (
        "slotctl: error [slot.config_error]: slot 'spare' is not activated"
        in fails(ctl, "slot", "load", "spare").stderr
    )
    for args in (
        ("load", "nope"),
        ("unload", "nope"),
        ("reset", "nope"),
        ("swap", "nope", "m-alt"),
        ("hold", "nope", "--for", "1m"),
    ):
        assert "error [slot.not_found]" in fails(ctl, "slot", *args).stderr, args
    assert "error [model.not_found]" in fails(ctl, "slot", "swap", "one", "m-nope").stderr

    # ---- hold: a batch lease for a duration (90s / 2h ...)
    held = json.loads(ctl.ok("slot", "hold", "two", "--for", "90s", "-o", "json"))
    assert held["slot"] == "two" and held["expires_in_s"] == 90 and held["lease"] >= 1
    out = ctl.ok("slot", "hold", "two", "--for", "2h")
    assert out.startswith("slot two: held for 2h (lease ")
    assert api.slot("two")["state"] == "serving"
    usage = fails(ctl, "slot", "hold", "two", "--for", "soon")
    assert "invalid duration 'soon'" in usage.stderr
    fails(ctl, "slot", "hold", "two")  # --for is required

    # ---- swap, unload, reset
    out = ctl.ok("slot", "swap", "one", "m-alt")
    assert out.strip() == "slot one: serves m-alt (ready)"
    swapped = json.loads(ctl.ok("slot", "swap", "one", "m-alt", "-o", "json"))
    assert swapped["status"] == "swapped" and swapped["slot"]["model_id"] == "m-alt"
    unloaded = json.loads(ctl.ok("slot", "unload", "one", "-o", "json"))
    assert unloaded["status"] == "unloaded" and unloaded["slot"]["state"] == "offline"
    assert ctl.ok("slot", "reset", "one").strip() == (
        "slot one: crash-loop breaker reset (offline)"
    )
    reset = json.loads(ctl.ok("slot", "reset", "one", "-o", "json"))
    assert reset["status"] == "reset" and reset["slot"]["failures"] == 0
    out = ctl.ok("slot", "unload", "two")  # held: drained (drain_timeout_s = 1), stopped
    assert out.strip() == "slot two: unloaded (offline)"
    assert ctl.states()["two"] == "offline"  # the local view (state.json) agrees


# ============================================================================ model commands


def test_model_commands(ctl: Slotctl) -> None:
    api = up(ctl)
    table = ctl.ok("model", "list")
    header, *rows = table.splitlines()
    assert header.split() == [
        "MODEL",
        "KIND",
        "STATE",
        "MEMORY",
        "RESIDENT",
        "LOADABLE",
        "SLOTS",
        "FILES",  # a demo:// model has no files to pull (issue 35)
        "SIZE",
    ]
    by_id = {r.split()[0]: r.split() for r in rows}
    assert by_id["m-one"][1:] == ["llm", "unloaded", "0.40", "GiB", "no", "yes", "one", "-", "-"]
    assert by_id["m-unserved"][6:] == ["no", "-", "-", "-"]
    listed = json.loads(ctl.ok("model", "list", "-o", "json"))
    assert {m["id"] for m in listed["models"]} >= {"m-one", "m-big", "m-unserved"}
    assert yaml.safe_load(ctl.ok("model", "list", "-o", "yaml")) == listed

    answer = json.loads(ctl.ok("model", "load", "m-three", "-o", "json"))
    assert answer["status"] == "loading" and answer["slot"]["name"] == "three"
    out = ctl.ok("model", "load", "m-three", "--wait", "--timeout", "60")
    assert "on slot three" in out and "slot three: ready after" in out
    out = ctl.ok("model", "load", "m-three")
    assert out.strip().startswith("model m-three: already loaded on slot three (ready); resident")
    assert api.ok("GET", "/api/models/m-three/state")["state"] == "loaded"

    assert "error [model.not_found]" in fails(ctl, "model", "load", "m-nope").stderr
    assert "error [model.not_found]" in fails(ctl, "model", "unload", "m-nope").stderr
    err = fails(ctl, "model", "load", "m-unserved").stderr
    assert "error [slot.config_error]: model 'm-unserved' is disabled" in err
    err = fails(ctl, "model", "load", "m-big").stderr
    assert "error [model.insufficient_memory]" in err

    assert ctl.ok("model", "unload", "m-three").strip() == "model m-three: unloading"
    api.wait_state("three", "offline")
    again = json.loads(ctl.ok("model", "unload", "m-three", "-o", "json"))
    assert again == {"status": "already unloaded"}


# ============================================================================ events


class Follower:
    """``slotctl events ARGS`` in the background; lines read by a thread."""

    def __init__(self, ctl: Slotctl, *args: str) -> None:
        self.proc = subprocess.Popen(
            ctl.argv("events", *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ctl.env,
            cwd=ctl.tmp,
            **CHILD,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def until(self, text: str, timeout: float = 30.0) -> list[str]:
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            seen.append(line)
            if text in line:
                return seen
        raise AssertionError(f"no {text!r} in the event lines: {seen}")

    def stop(self) -> str:
        """Ends it; its pipes are closed however it ends (killed after a timeout too)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(timeout=10)
        assert self.proc.stderr is not None and self.proc.stdout is not None
        try:
            return self.proc.stderr.read()
        finally:
            self.proc.stderr.close()
            self.proc.stdout.close()


def test_events_follow(ctl: Slotctl) -> None:
    up(ctl)
    # From the first buffered event (--since 0): what happens before a stream is open is
    # replayed to it, so nothing waits for the streams to open (issue 40, item 16: a
    # fixed second that a busy machine could outlast).
    text = Follower(ctl, "--since", "0")
    raw = Follower(ctl, "--since", "0", "-o", "json")
    try:
        ctl.ok("slot", "load", "one", "--wait", "--timeout", "60")
        lines = text.until("warming -> ready")
        transitions = [line for line in lines if "transition" in line and " one " in line]
        assert any("offline -> starting" in line for line in transitions), lines
        assert all(line[2] == ":" and "#" in line for line in lines), lines
        records = [json.loads(line) for line in raw.until('"to":"ready"')]
        assert all({"id", "kind", "op", "slot", "from", "to", "time"} <= set(r) for r in records)
        assert [r["id"] for r in records] == sorted(r["id"] for r in records)
        ready = records[-1]
        assert (ready["kind"], ready["slot"], ready["from"], ready["to"]) == (
            "transition",
            "one",
            "warming",
            "ready",
        )
    finally:
        text.stop()
        raw.stop()
    # resume from an id (Last-Event-ID): the buffered events after it, then exit after N
    replay = ctl.ok("events", "--since", str(ready["id"] - 2), "-n", "2", "-o", "json")
    ids = [json.loads(line)["id"] for line in replay.splitlines()]
    assert ids == [ready["id"] - 1, ready["id"]]


def test_events_end_when_the_controller_stops(ctl: Slotctl) -> None:
    up(ctl)
    ctl.ok("slot", "load", "one", "--wait", "--timeout", "60")  # events in the buffer
    follower = Follower(ctl, "--since", "0", "-o", "json")
    try:
        follower.until('"id"')  # the stream is open: it replayed the first event
        ctl.ok("down")
        assert follower.proc.wait(timeout=30) == 0
    finally:
        err = follower.stop()
    assert "the event stream ended" in err


# ============================================================================ reaching it


def test_server_and_token_discovery(ctl: Slotctl) -> None:
    api = up(ctl)
    url, token = api.base, api.token
    elsewhere = ["--state-dir", str(ctl.tmp / "elsewhere"), "--config-dir", str(ctl.tmp / "e")]

    # implicit: --state-dir's controller.json and token file
    assert json.loads(ctl.ok("model", "list", "-o", "json"))["models"]
    # explicit --server/--token, from a state dir with no controller at all
    for server in (url, url.removeprefix("http://")):
        result = run_with(ctl, [*elsewhere, "--server", server, "--token", token, "model", "list"])
        assert result.returncode == 0 and "m-one" in result.stdout, result
    # the environment
    env = {"SLOTCTL_SERVER": url, "SLOTCTL_TOKEN": token}
    result = run_with(ctl, [*elsewhere, "slot", "load", "one", "-o", "json"], env)
    assert result.returncode == 0 and json.loads(result.stdout)["status"] == "loading", result
    # --token wins over the environment: a wrong one is refused
    result = run_with(ctl, [*elsewhere, "--token", "wrong", "model", "list"], env)
    assert result.returncode == 2
    assert result.stderr.startswith("slotctl: error [auth.unauthorized]: wrong bearer token")
    # no token for a remote server: the local token file is never sent elsewhere
    result = run_with(ctl, [*elsewhere, "--server", url, "model", "list"])
    assert result.returncode == 2 and "error [auth.unauthorized]" in result.stderr
    assert "--token" in result.stderr
    # ... but the local controller named explicitly gets the local token
    result = ctl.run("--server", url.replace("127.0.0.1", "localhost"), "model", "list")
    assert result.returncode == 0, ctl.explain(result)
    api.wait_state("one", "ready")


def test_a_refused_token_says_which_and_where_it_came_from(ctl: Slotctl) -> None:
    """Issue 40, item 7: ``SLOTCTL_TOKEN=wrong slotctl slot list`` said "the token of
    <state>/token was refused: the token of <state>/token was" — garbled, and blaming the
    file for the variable's token. Each source of a refused token is named, once."""
    up(ctl)
    token_file = ctl.state / "token"

    result = run_with(ctl, [*ctl.argv()[3:], "slot", "list"], {"SLOTCTL_TOKEN": "wrong"})
    assert result.returncode == 2, result
    said = result.stderr
    assert said.startswith("slotctl: error [auth.unauthorized]: wrong bearer token"), said
    assert "the token from $SLOTCTL_TOKEN was refused" in said, said
    assert f"{token_file}" not in said.split("refused", 1)[0], said  # not blamed on the file
    assert said.count("was refused") == 1, said

    result = run_with(ctl, [*ctl.argv()[3:], "--token", "wrong", "slot", "list"])
    assert "the token from --token was refused" in result.stderr, result.stderr

    real = token_file.read_text()
    try:
        token_file.write_text("stale\n")  # a token file of an earlier controller
        result = run_with(ctl, [*ctl.argv()[3:], "slot", "list"])
        assert f"the token of {token_file} was refused" in result.stderr, result.stderr
        assert result.stderr.count("was refused") == 1, result.stderr
    finally:
        token_file.write_text(real)


def test_another_state_dir_says_no_controller_answered_there(ctl: Slotctl) -> None:
    """Issue 40, item 8: without the README's ``export SLOTCTL_*`` line, ``slot list``
    printed an empty table and exited 0 while a controller ran, and ``slot load`` said
    only "start one with `slotctl up`". Both name the state dir they read, say that no
    controller answered there, and name --state-dir and $SLOTCTL_STATE_DIR."""
    up(ctl)
    other = ctl.tmp / "other-state"
    elsewhere = ["--state-dir", str(other), "--config-dir", str(ctl.tmp / "other-config")]

    result = run_with(ctl, [*elsewhere, "slot", "list"])
    assert result.returncode == 0, result  # the files of that dir: nothing is wrong there
    said = result.stderr
    assert f"no controller answered on the state dir {other}" in said, said
    assert "--state-dir" in said and "$SLOTCTL_STATE_DIR" in said, said

    result = run_with(ctl, [*elsewhere, "slot", "load", "one"])
    assert result.returncode == 2, result
    said = result.stderr
    assert f"no controller is running on the state dir {other}" in said, said
    assert "--state-dir" in said and "$SLOTCTL_STATE_DIR" in said, said


def test_unreachable_controller_exits_2(ctl: Slotctl) -> None:
    ctl.config.mkdir(parents=True)
    commands = [
        ("model", "list"),
        ("model", "load", "m"),
        ("slot", "load", "x"),
        ("slot", "load", "x", "--dry-run"),
        ("slot", "hold", "x", "--for", "1m"),
        ("events",),
    ]
    for args in commands:
        result = fails(ctl, *args)
        assert result.stderr.startswith(
            "slotctl: error [controller.unreachable]: no controller is running on"
        ), result.stderr
        assert "--server" in result.stderr
    closed = f"http://127.0.0.1:{free_port()}"
    for args in commands:
        result = fails(ctl, "--server", closed, *args)
        assert f"cannot reach the controller at {closed}" in result.stderr, result.stderr
    result = fails(ctl, "--server", "ftp://example/", "model", "list")
    assert "invalid server URL" in result.stderr
    # an explicit server must answer even for stack diff (no silent fallback)
    stack = ctl.tmp / "s.toml"
    stack.write_text('[stack]\nname = "s"\n')
    result = fails(ctl, "--server", closed, "stack", "diff", stack, "--exit-code")
    assert "cannot reach the controller" in result.stderr


def test_controller_without_api(ctl: Slotctl) -> None:
    """``up --listen none``: the imperative commands say so; apply/diff use the files."""
    write_settings(ctl.config, cpu_budget_gb=1.0)
    path = ctl.tmp / "remote.toml"
    path.write_text(STACK)
    ctl.ok("stack", "apply", path)
    ctl.start_up("--listen", "none")
    result = fails(ctl, "model", "list")
    assert "serves no API (started with --listen none)" in result.stderr
    assert ctl.run("stack", "diff", path, "--exit-code").returncode == 0


# ============================================================================ stack apply/diff


def test_stack_apply_and_diff_through_the_api(ctl: Slotctl) -> None:
    api = up(ctl)
    url, token = api.base, api.token
    # A client with its own (empty) config and state dirs: only the API can reach the
    # controller's config dir.
    client = ["--config-dir", str(ctl.tmp / "cc"), "--state-dir", str(ctl.tmp / "cs")]
    remote = [*client, "--server", url, "--token", token]
    stack_dir = ctl.tmp / "extra"
    stack_dir.mkdir()
    models_file = stack_dir / "a-models.toml"
    models_file.write_text('[stack]\nname = "extra"\n' + model("m-x", 0.1))
    slots_file = stack_dir / "b-slots.toml"
    x1 = '[stack]\nname = "extra"\n' + slot("x1", "m-x", load_s=0.2, autoload=True)
    slots_file.write_text(x1)
    create_line = f"  {'create':<9} {'x1':<20} new slot"

    result = run_with(ctl, [*remote, "stack", "diff", str(stack_dir), "--exit-code"])
    assert result.returncode == 1, result
    assert "=== slot x1: create" in result.stdout

    result = run_with(ctl, [*remote, "stack", "apply", str(stack_dir), "--dry-run"])
    assert result.returncode == 0, result
    assert result.stdout.splitlines() == [
        "plan for stack extra:",
        create_line + " (autoload: will load)",
        "dry run: nothing written",
    ]
    assert not (ctl.config / "slots" / "x1.toml").exists()

    result = run_with(ctl, [*remote, "stack", "apply", str(stack_dir), "--wait", "--timeout", "60"])
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "plan for stack extra:",
        create_line + " (autoload: will load)",
        "configured: models, x1",
    ]
    assert any("x1" in line and "ready" in line for line in lines), lines
    assert lines[-1].startswith("converged in ")
    # again, converged already: the slot's state, no transition that never happened
    result = run_with(ctl, [*remote, "stack", "apply", str(stack_dir), "--wait", "--timeout", "60"])
    assert result.returncode == 0, result
    again = result.stdout.splitlines()
    assert again[1:3] == ["  (no changes)", "configured: nothing changed"], again
    assert not any("->" in line for line in again), again
    (seen,) = [line for line in again if " x1 " in line]
    assert seen.split()[1:4] == ["state", "x1", "ready"], again
    assert again[-1].startswith("converged in ")
    assert (ctl.config / "slots" / "x1.toml").exists()  # the controller's config dir
    assert not (ctl.tmp / "cc" / "slots").exists()  # not the client's

    result = run_with(ctl, [*remote, "stack", "diff", str(stack_dir), "--exit-code"])
    assert result.returncode == 0 and result.stdout.strip() == "in sync", result
    result = run_with(ctl, [*remote, "stack", "diff", str(stack_dir), "-o", "json-patch"])
    assert json.loads(result.stdout) == []

    # a change: drift (1) with the unified diff and the json-patch, then applied again
    slots_file.write_text(x1.replace("[slot.server]", "priority = 42\n[slot.server]"))
    result = run_with(ctl, [*remote, "stack", "diff", str(stack_dir), "--exit-code"])
    assert result.returncode == 1, result
    assert "+priority = 42" in result.stdout
    patch = json.loads(
        run_with(ctl, [*remote, "stack", "diff", str(stack_dir), "-o", "json-patch"]).stdout
    )
    assert patch == [{"op": "replace", "path": "/slots/x1/priority", "value": 42}]
    doc = json.loads(run_with(ctl, [*remote, "stack", "diff", str(stack_dir), "-o", "json"]).stdout)
    assert doc["in_sync"] is False and set(doc["config_diffs"]) == {"x1"}
    result = run_with(ctl, [*remote, "stack", "apply", str(stack_dir)])
    assert result.returncode == 0 and "configured: x1" in result.stdout, result
    wait_until(lambda: api.slot("x1")["priority"] == 42, "the priority to apply in place")

    # invalid stacks: apply exits 1 and diff 2, nothing sent, nothing changed
    bad = ctl.tmp / "bad.toml"
    bad.write_text('[stack]\nname = "extra"\n[[slot]]\nname = "x1"\nprovider = "demo"\nbogus = 1\n')
    result = run_with(ctl, [*remote, "stack", "apply", str(bad)])
    assert result.returncode == 1 and "nothing was applied" in result.stderr, result
    result = run_with(ctl, [*remote, "stack", "diff", str(bad), "--exit-code"])
    assert result.returncode == 2 and "cannot diff" in result.stderr, result

    # --prune through the API found implicitly through the state dir: with a config dir
    # of its own, only the API reaches the controller's
    models_file.unlink()
    slots_file.write_text('[stack]\nname = "extra"\n' + model("m-x", 0.1))
    implicit = ["--config-dir", str(ctl.tmp / "cc2"), "--state-dir", str(ctl.state)]
    argv = [*implicit, "stack", "apply", str(stack_dir), "--prune", "--wait", "--timeout", "60"]
    result = run_with(ctl, argv)
    assert result.returncode == 0, result
    assert "delete    x1" in result.stdout and "converged in" in result.stdout
    assert not (ctl.tmp / "cc2" / "slots").exists()
    assert not (ctl.config / "slots" / "x1.toml").exists()
    wait_until(lambda: api.call("GET", "/api/slots/x1").status == 404, "x1 to be removed")


# ============================================================================ durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("15m", 900), ("2h", 7200), ("1h30m", 5400), ("1d", 86400), ("45", 45)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "soon", "5x", "2h5", "-5", "h", "1.5.h"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid duration"):
        parse_duration(text)
