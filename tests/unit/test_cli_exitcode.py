"""Exit codes and event lines of the CLI: one ``ExitCode`` list, one ``event_line``.

``ExitCode`` is checked against docs/cli.md (the documented values) and against what
``slotctl`` returns in-process (``cli.main.main``) for each outcome: success, a negative
answer (``diff --exit-code`` drift, an invalid stack), a typed error, an unexpected
exception, Ctrl-C, usage errors. The stack commands run on the local backend (no
controller: the config and state dirs of ``tmp_path``), with slots that are never loaded.

``event_line`` is the one text form of an event: ``slotctl events`` (from the wire form),
``slotctl up`` and ``apply --once`` print it; the tests pin that they print the same.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import logging
import re
from pathlib import Path

import pytest

import controller.cli.stack as cli_stack
from controller.cli.feed import render_line
from controller.cli.main import main
from controller.cli.output import Style
from controller.daemon.main import Controller, DaemonOptions
from controller.kit import eventloop
from controller.model.errors import SlotConfigError
from controller.model.events import Event, EventKind, EvictionReason, Op, event_line
from controller.model.exitcode import ExitCode

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "cli.md"

STACK = """\
[stack]
name = "codes"

[[model]]
id = "m-a"
source = "demo://a"
memory_gb = 0.05

[[slot]]
name = "a"
provider = "demo"
model.default = "m-a"
device = "cpu"
port = 45871
autoload = false
"""


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    for name in ("SLOTCTL_SERVER", "SLOTCTL_TOKEN", "SLOTCTL_RUNTIME"):
        monkeypatch.delenv(name, raising=False)
    return ["--config-dir", str(tmp_path / "config"), "--state-dir", str(tmp_path / "state")]


@pytest.fixture
def stack(tmp_path: Path) -> Path:
    path = tmp_path / "codes.toml"
    path.write_text(STACK)
    return path


# ======================================================================= ExitCode


def test_the_documented_exit_codes_are_the_enum() -> None:
    text = " ".join(DOCS.read_text().split())
    match = re.search(
        r"Exit codes: 0 success; 1 the command's negative answer .*?130 interrupted", text
    )
    assert match, "docs/cli.md lost its exit code paragraph"
    documented = {
        int(n) for n in re.findall(r"(?:^|; )(\d+) ", match.group(0).removeprefix("Exit codes: "))
    }
    assert documented == {int(c) for c in ExitCode}
    assert (ExitCode.OK, ExitCode.NEGATIVE, ExitCode.ERROR, ExitCode.INTERRUPTED) == (0, 1, 2, 130)
    assert ExitCode.FATAL is ExitCode.NEGATIVE  # `up` after an internal error exits 1


def test_commands_return_exit_codes_not_literals() -> None:
    """Every command of the CLI (and ``slotctl up``) returns an ``ExitCode`` member: a
    ``return 0``/``return 1`` or a ``cmd_*`` annotated ``-> int`` would bypass the list."""
    found = []
    for path in sorted(
        [
            *(ROOT / "controller" / "cli").glob("*.py"),
            *(ROOT / "controller" / "daemon").glob("*.py"),
        ]
    ):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            command = isinstance(node, ast.FunctionDef) and node.name.startswith("cmd_")
            if command and not (
                isinstance(node.returns, ast.Name) and node.returns.id == "ExitCode"
            ):
                found.append(f"{path.name}:{node.lineno} {node.name} is not -> ExitCode")
            value = node.value if isinstance(node, ast.Return) else None
            if isinstance(value, ast.Constant) and type(value.value) is int:
                found.append(f"{path.name}:{node.lineno} returns the literal {value.value}")
    assert not found, found


def test_diff_exit_code_semantics(dirs: list[str], stack: Path, tmp_path: Path) -> None:
    diff = [*dirs, "stack", "diff", str(stack)]
    assert main([*diff, "--exit-code"]) is ExitCode.NEGATIVE  # drift: not applied yet
    assert main(diff) is ExitCode.OK  # drift without --exit-code is no failure
    assert main([*dirs, "stack", "apply", str(stack)]) is ExitCode.OK
    assert (tmp_path / "config" / "slots" / "a.toml").exists()
    assert main([*diff, "--exit-code"]) is ExitCode.OK  # in sync
    bad = tmp_path / "bad.toml"
    bad.write_text(STACK.replace('device = "cpu"\n', 'device = "cpu"\nbogus = 1\n'))
    assert main([*dirs, "stack", "diff", str(bad), "--exit-code"]) is ExitCode.ERROR


def test_apply_exit_codes(
    dirs: list[str], stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(STACK.replace('device = "cpu"\n', 'device = "cpu"\nbogus = 1\n'))
    assert main([*dirs, "stack", "apply", str(bad)]) is ExitCode.NEGATIVE  # invalid
    # --wait needs a controller: refused before anything is written
    assert main([*dirs, "stack", "apply", str(stack), "--wait"]) is ExitCode.ERROR
    assert "no controller is running" in capsys.readouterr().err
    assert not (tmp_path / "config" / "slots").exists()
    assert main([*dirs, "stack", "apply", str(stack), "--dry-run"]) is ExitCode.OK
    assert not (tmp_path / "config" / "slots").exists()
    assert main([*dirs, "stack", "validate", str(stack)]) is ExitCode.OK
    assert main([*dirs, "stack", "validate", str(bad)]) is ExitCode.NEGATIVE


def test_failures_map_to_their_codes(
    dirs: list[str], stack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    validate = [*dirs, "stack", "validate", str(stack)]

    def typed(*args: object) -> None:
        raise SlotConfigError("refused")

    def unexpected(*args: object) -> None:
        raise RuntimeError("boom")

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    def not_an_exit_code(*args: object) -> int:
        return 3

    for func, code in (
        (typed, ExitCode.ERROR),
        (unexpected, ExitCode.ERROR),
        (interrupted, ExitCode.INTERRUPTED),
        (not_an_exit_code, ExitCode.ERROR),  # never an undocumented status
    ):
        monkeypatch.setattr(cli_stack, "cmd_validate", func)
        assert main(validate) is code, func.__name__
    assert main([]) is ExitCode.OK  # bare `slotctl`: its help
    assert main([*dirs, "slot"]) is ExitCode.OK  # a bare group: its help
    with pytest.raises(SystemExit) as usage:
        main(["stack", "frobnicate"])
    assert usage.value.code == ExitCode.ERROR  # argparse's usage status is ours


def test_apply_once_runs_on_the_event_loop_slotctl_up_chooses(
    dirs: list[str],
    stack: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``apply --once`` honours ``SLOTCTL_EVENT_LOOP`` as ``slotctl up`` does
    (controller.kit.eventloop); a value it does not know is refused before anything is
    written."""
    apply_once = [*dirs, "stack", "apply", str(stack), "--once", "--timeout", "30"]
    monkeypatch.setenv(eventloop.ENV, "tokio")
    assert main(apply_once) is ExitCode.ERROR
    assert not (tmp_path / "config" / "slots").exists()
    choices = ["asyncio", "uvloop"] if importlib.util.find_spec("uvloop") else ["asyncio"]
    for choice in choices:
        monkeypatch.setenv(eventloop.ENV, choice)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slotctl.eventloop"):
            assert main(apply_once) is ExitCode.OK, choice
        assert [r.getMessage() for r in caplog.records if r.name == "slotctl.eventloop"] == [
            f"event loop: {choice}"
        ]
    assert (tmp_path / "config" / "slots" / "a.toml").exists()


# ======================================================================= event_line


def _events() -> list[Event]:
    return [
        Event(
            id=17,
            kind=EventKind.TRANSITION,
            op=Op.LOAD,
            slot="chat",
            model="m-chat",
            from_state="warming",
            to_state="ready",
            message="probe ok",
            time=1_700_000_000.0,
        ),
        Event(
            id=18,
            kind=EventKind.REFUSAL,
            op=Op.ADMIT,
            slot="coder",
            message="needs 9.00 GiB, 2.00 GiB free",
            error="admission.no_memory",
            time=1_700_000_001.5,
        ),
        Event(
            id=19,
            kind=EventKind.EVICTION,
            op=Op.EVICT,
            slot="old",
            reason=EvictionReason.PRELOAD,
            time=1_700_000_002.0,
        ),
    ]


def test_event_line_format() -> None:
    transition, refusal, eviction = _events()
    line = event_line(transition)
    assert re.fullmatch(
        r"\d\d:\d\d:\d\d  #17  transition  chat {12}  warming -> ready  probe ok", line
    ), line
    assert event_line(refusal, red=lambda s: f"<{s}>").endswith(
        "#18  refusal     coder             admit  <[admission.no_memory]>  needs 9.00 GiB, "
        "2.00 GiB free"
    )
    assert event_line(eviction, started=1_700_000_000.0).startswith("   2.0s  #19  eviction")
    seen = Event(id=0, kind=EventKind.TRANSITION, op=Op.RECONCILE, slot="x", to_state="ready")
    assert "#" not in event_line(seen) and "- -> ready" in event_line(seen)


def test_the_wire_form_round_trips() -> None:
    for event in _events():
        again = Event.from_dict(json.loads(json.dumps(event.to_dict())))
        assert again == event
        assert isinstance(again.kind, EventKind) and isinstance(again.op, Op)
    newer = Event.from_dict({"id": 1, "kind": "novel", "op": "other", "extra": True})
    assert (newer.kind, newer.op) == ("novel", "other")  # shown, not refused
    with pytest.raises(ValueError, match="an id, a kind and an op"):
        Event.from_dict({"kind": "transition"})


def test_slotctl_events_and_up_print_the_same_line() -> None:
    out = io.StringIO()
    daemon = Controller(DaemonOptions(config_dir=Path("c"), state_dir=Path("s"), out=out))
    style = Style(io.StringIO())  # not a terminal: no colour
    for event in _events():
        wire = json.dumps(event.to_dict())
        again = Event.from_dict(json.loads(wire))
        assert render_line(again, wire, "text", style) == event_line(event)
        assert render_line(again, wire, "json", style) == wire
        daemon._print_event(event)
    assert out.getvalue().splitlines() == [event_line(e) for e in _events()]
