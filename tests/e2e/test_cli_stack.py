"""``slotctl stack validate|show`` as a user runs them: a real subprocess, real files.

Exit codes (SPEC §9, ``controller/cli/main.py``): 0 valid, 1 invalid, 2 usage or any
error, an unexpected one included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import controller
from controller.cli import main as cli_main
from controller.cli import stack as cli_stack

REPO = Path(__file__).resolve().parents[2]
WORKSTATION = REPO / "stacks" / "workstation.toml"
QUICKSTART = REPO / "examples" / "quickstart" / "quickstart.toml"
ERROR_KEYS = {"code", "message", "file", "slot", "key", "line", "hint"}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An empty config dir, so a user's own controller.toml never leaks into a test."""
    config = tmp_path / "config"
    config.mkdir()
    return config


def run(
    *args: str | Path, config_dir: Path, env: Mapping[str, str] | None = None, code: str = ""
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in {"NO_COLOR", "FORCE_COLOR", "TERM"}}
    base |= {
        "SLOTCTL_CONFIG_DIR": str(config_dir),
        "SLOTCTL_STATE_DIR": str(config_dir.parent / "state"),
        "PYTHONPATH": str(REPO),
    }
    argv = [sys.executable, "-c", code, *map(str, args)] if code else None
    argv = argv or [sys.executable, "-m", "controller", *map(str, args)]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
        cwd=config_dir.parent,
        check=False,
    )


def slotctl(*args: str | Path, home: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    return run(*args, config_dir=home, **kw)


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


HEAD = '[stack]\nname = "s"\n'


# ---------------------------------------------------------------------- validate


@pytest.mark.parametrize(
    "paths",
    [
        pytest.param([REPO / "stacks"], id="dir"),
        pytest.param([WORKSTATION], id="file"),
        pytest.param([QUICKSTART], id="quickstart"),
    ],
)
def test_validate_good(home: Path, paths: list[Path]) -> None:
    result = slotctl("stack", "validate", *paths, home=home)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok 1 file(s) valid: stack ")
    assert result.stderr == ""


def test_validate_good_summary(home: Path) -> None:
    result = slotctl("stack", "validate", WORKSTATION, home=home)
    summary, *models = result.stdout.splitlines()
    assert summary == "ok 1 file(s) valid: stack workstation, 4 model(s), 6 slot(s)"
    # Then each model's files as a load would find them here (issue 35), offline: the
    # example's local paths are not on this host, its hub file's size is not known.
    assert models == [
        "  model qwen2.5-14b-instruct-q4: /models/qwen2.5-14b-instruct-q4_k_m.gguf is missing "
        "(a path on this host: nothing to pull it from): a load would be refused on this host",
        "  model qwq-32b-q4: would pull from hf://Qwen/QwQ-32B-GGUF/qwq-32b-q4_k_m.gguf: its "
        "size is not known offline",
        "  model qwen2.5-coder-7b-q4: /models/qwen2.5-coder-7b-instruct-q4_k_m.gguf is missing "
        "(a path on this host: nothing to pull it from): a load would be refused on this host",
        "  model nomic-embed-text-v1.5: /models/nomic-embed-text-v1.5.f16.gguf is missing "
        "(a path on this host: nothing to pull it from): a load would be refused on this host",
    ]


def test_validate_good_json(home: Path) -> None:
    result = slotctl("stack", "validate", "-o", "json", REPO / "stacks", home=home)
    assert result.returncode == 0
    report = json.loads(result.stdout)
    models = report.pop("models")
    assert report == {
        "valid": True,
        "files": [str(WORKSTATION)],
        "errors": [],
        "warnings": [],
    }
    actions = {m["model"]: (m["action"], m["bytes"]) for m in models}
    assert actions == {
        "qwen2.5-14b-instruct-q4": ("missing", None),
        "qwq-32b-q4": ("pull", None),  # offline: the hub's size is not known
        "qwen2.5-coder-7b-q4": ("missing", None),
        "nomic-embed-text-v1.5": ("missing", None),
    }


# One row per bad-input class: (file text, line, slot, key, code, hint substring).
BAD = [
    pytest.param(
        HEAD + '[[slot]]\nname = "a\n', 4, None, None, "stack.toml_syntax", "TOML syntax",
        id="toml-syntax",
    ),
    pytest.param(
        HEAD + "x = 1\nx = 2\n", 4, None, None, "stack.toml_syntax", "TOML syntax",
        id="toml-duplicate-key",
    ),
    pytest.param(
        HEAD + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\nprority = 5\n',
        7, "a", "prority", "slot.unknown_key", "did you mean 'priority'?",
        id="unknown-key",
    ),
    pytest.param(
        HEAD + '\n[[slot]]\nname = "a"\nport = 1\n',
        4, "a", "provider", "slot.missing_key", "add the required key 'provider'",
        id="missing-provider",
    ),
    pytest.param(
        HEAD + '[[slot]]\nname = "a"\nprovider = "demo"\nport = "8081"\n',
        6, "a", "port", "slot.invalid_value", None,
        id="port-string",
    ),
    pytest.param(
        '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n',
        1, None, "stack.name", "stack.missing_key", "[stack]",
        id="missing-stack",
    ),
    pytest.param(
        HEAD + '[slot]\nname = "a"\nprovider = "demo"\nport = 1\n',
        3, None, "slot", "stack.invalid_value", "[[slot]] (double brackets)",
        id="single-bracket-slot",
    ),
    pytest.param(
        HEAD + '[[model]]\nid = "qwen-7b"\n[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n'
        'model.default = "qwen-7"\n',
        9, "a", "model.default", "slot.unknown_model", "did you mean 'qwen-7b'?",
        id="unknown-model",
    ),
    pytest.param(
        HEAD + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n'
        'server.extra_args = ["--n-gpu-layers", "99"]\n',
        7, "a", "server.extra_args[0]", "slot.hardware_flag", "remove '--n-gpu-layers'",
        id="hardware-flag",
    ),
    pytest.param(
        HEAD + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\ncontext_length = 4096\n',
        7, "a", "context_length", "slot.model_owned_key", "[[model]]",
        id="model-owned-key",
    ),
    pytest.param(
        HEAD + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n'
        '[[slot]]\nname = "b"\nprovider = "demo"\nport = 1\n',
        10, "b", "port", "slot.duplicate_port", "own port",
        id="duplicate-port",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("text", "line", "slot", "key", "code", "hint"), BAD)
def test_validate_bad_text_report(
    home: Path,
    tmp_path: Path,
    text: str,
    line: int,
    slot: str | None,
    key: str | None,
    code: str,
    hint: str | None,
) -> None:
    path = write(tmp_path, "bad.toml", text)
    result = slotctl("stack", "validate", path, home=home)
    assert result.returncode == 1, result.stdout + result.stderr
    first, message, *rest = result.stdout.splitlines()
    assert first.startswith(f"{path}:{line}: error [{code}]")
    if slot:
        assert f"slot {slot}" in first
    if key:
        assert f"key {key}" in first
    assert message.startswith("    ") and message.strip()
    if hint:
        assert rest[0].startswith("    hint: ") and hint in rest[0]
    assert rest[-1].startswith("invalid 1 error(s), 0 warning(s) in 1 file(s)")


@pytest.mark.parametrize(("text", "line", "slot", "key", "code", "hint"), BAD)
def test_validate_bad_json(
    home: Path,
    tmp_path: Path,
    text: str,
    line: int,
    slot: str | None,
    key: str | None,
    code: str,
    hint: str | None,
) -> None:
    path = write(tmp_path, "bad.toml", text)
    result = slotctl("stack", "validate", "-o", "json", path, home=home)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert set(report) == {"valid", "files", "errors", "warnings"}
    assert report["valid"] is False
    assert report["files"] == [str(path)]
    assert report["warnings"] == []
    [error] = report["errors"]
    assert set(error) == ERROR_KEYS
    assert (error["file"], error["line"], error["slot"], error["key"], error["code"]) == (
        str(path),
        line,
        slot,
        key,
        code,
    )
    assert error["message"]
    if hint:
        assert hint in error["hint"]


def test_a_deeply_nested_file_is_refused_as_invalid(home: Path, tmp_path: Path) -> None:
    """Issue 40, item 5: 400 KB of nested arrays (under the 1 MiB limit) is an invalid
    file named in the report (exit 1), not an internal error (exit 2)."""
    deep = 200_000
    path = write(tmp_path, "deep.toml", HEAD + "x = " + "[" * deep + "]" * deep + "\n")
    result = slotctl("stack", "validate", path, home=home)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith(f"{path}: error [stack.too_deep]"), result.stdout
    assert "internal error" not in result.stderr


def test_duplicates_across_two_files_in_a_directory(home: Path, tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    first = write(stacks, "a.toml", HEAD + '[[slot]]\nname = "chat"\nprovider = "demo"\nport = 1\n')
    second = write(
        stacks,
        "b.toml",
        '[stack]\nname = "t"\n[[slot]]\nname = "chat"\nprovider = "demo"\nport = 1\n',
    )
    result = slotctl("stack", "validate", "-o", "json", stacks, home=home)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["files"] == [str(first), str(second)]
    [error] = report["errors"]
    assert (error["file"], error["line"], error["slot"], error["code"]) == (
        str(second),
        4,
        "chat",
        "slot.duplicate_name",
    )
    assert f"first at {first}:4" in error["message"]
    text = slotctl("stack", "validate", stacks, home=home)
    assert text.returncode == 1
    assert f"{second}:4: error [slot.duplicate_name] slot chat, key name" in text.stdout


def test_missing_path_is_reported(home: Path, tmp_path: Path) -> None:
    result = slotctl("stack", "validate", tmp_path / "nope.toml", home=home)
    assert result.returncode == 1
    assert f"{tmp_path / 'nope.toml'}: error [stack.unreadable]" in result.stdout


def test_warnings_do_not_fail_validation(home: Path, tmp_path: Path) -> None:
    path = write(
        tmp_path, "s.toml", HEAD + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\nlru = true\n'
    )
    result = slotctl("stack", "validate", path, home=home)
    assert result.returncode == 0, result.stdout
    assert f"{path}:7: warning [slot.lru_flag_retired] slot a, key lru" in result.stdout
    assert result.stdout.splitlines()[-1].endswith("1 slot(s), 1 warning(s)")
    report = json.loads(slotctl("stack", "validate", "-o", "json", path, home=home).stdout)
    assert report["valid"] is True
    assert [w["code"] for w in report["warnings"]] == ["slot.lru_flag_retired"]


def test_invalid_controller_settings_are_located(home: Path) -> None:
    write(home, "controller.toml", 'default_pinned = "agent"\n')
    result = slotctl("stack", "validate", "-o", "json", WORKSTATION, home=home)
    assert result.returncode == 1
    [error] = json.loads(result.stdout)["errors"]
    assert (error["file"], error["line"], error["key"]) == (
        str(home / "controller.toml"),
        1,
        "default_pinned",
    )


def test_controller_settings_apply(home: Path, tmp_path: Path) -> None:
    write(home, "controller.toml", 'default_pinned = ["a"]\n')
    path = write(tmp_path, "s.toml", HEAD + '[[slot]]\nname = "a"\nprovider = "demo"\nport = 1\n')
    shown = json.loads(slotctl("stack", "show", "-o", "json", path, home=home).stdout)
    assert shown["slots"][0]["pinned"] is True
    flag = slotctl(
        "--config-dir", tmp_path / "empty", "stack", "show", "-o", "json", path, home=home
    )
    assert json.loads(flag.stdout)["slots"][0]["pinned"] is False  # --config-dir wins


# ------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["stack", "validate"], id="no-paths"),
        pytest.param(["stack", "validate", "--frobnicate", "x.toml"], id="unknown-option"),
        pytest.param(["stack", "validate", "-o", "yaml", "x.toml"], id="bad-output"),
        pytest.param(["stack", "frobnicate"], id="unknown-command"),
    ],
)
def test_usage_errors_exit_2(home: Path, args: list[str]) -> None:
    result = slotctl(*args, home=home)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "usage: slotctl" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [[], ["stack"]], ids=["no-command", "no-stack-command"])
def test_no_command_prints_help(home: Path, args: list[str]) -> None:
    """Bare ``slotctl`` (or a bare command group) is a request for help, not an error."""
    result = slotctl(*args, home=home)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: slotctl") and "examples:" in result.stdout
    assert result.stderr == ""


def test_version(home: Path) -> None:
    result = slotctl("--version", home=home)
    assert result.returncode == 0
    assert result.stdout == f"slotctl {controller.__version__}\n"


def test_help_documents_exit_codes(home: Path) -> None:
    result = slotctl("stack", "--help", home=home)
    assert result.returncode == 0
    assert "exit 0 valid, 1 invalid, 2 usage or internal error" in " ".join(result.stdout.split())


# ------------------------------------------------------------------------ colour


def test_no_color_output_has_no_escape_codes(home: Path, tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.toml", HEAD + '[[slot]]\nname = "a"\n')  # no provider
    forced = slotctl("stack", "validate", bad, WORKSTATION, home=home, env={"FORCE_COLOR": "1"})
    assert "\x1b[" in forced.stdout  # the check below can fail: colour does exist
    plain = slotctl(
        "stack", "validate", bad, WORKSTATION, home=home, env={"FORCE_COLOR": "1", "NO_COLOR": "1"}
    )
    assert plain.returncode == 1
    assert "\x1b" not in plain.stdout + plain.stderr
    assert plain.stdout == slotctl("stack", "validate", bad, WORKSTATION, home=home).stdout
    shown = slotctl("stack", "show", REPO / "stacks", home=home, env={"NO_COLOR": "1"})
    assert "\x1b" not in shown.stdout + shown.stderr


# -------------------------------------------------------------------------- show


def _without_location(slots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k not in {"file", "line"}} for s in slots]


@pytest.mark.parametrize("source", [REPO / "stacks", QUICKSTART], ids=["workstation", "quick"])
def test_show_toml_loads_back_to_the_same_state(home: Path, tmp_path: Path, source: Path) -> None:
    shown = slotctl("stack", "show", source, home=home)
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == ""
    out = write(tmp_path, "shown.toml", shown.stdout)
    validated = slotctl("stack", "validate", out, home=home)
    assert validated.returncode == 0, validated.stdout
    original = json.loads(slotctl("stack", "show", "-o", "json", source, home=home).stdout)
    again = json.loads(slotctl("stack", "show", "-o", "json", out, home=home).stdout)
    assert again["stacks"] == original["stacks"]
    assert again["models"] == original["models"]
    assert again["aliases"] == original["aliases"]
    assert _without_location(again["slots"]) == _without_location(original["slots"])
    # and showing the shown file prints it again unchanged (a fixed point)
    assert slotctl("stack", "show", out, home=home).stdout == shown.stdout


def test_show_json_is_the_normalised_state(home: Path) -> None:
    result = slotctl("stack", "show", "-o", "json", REPO / "stacks", home=home)
    assert result.returncode == 0
    state = json.loads(result.stdout)
    assert set(state) == {"stacks", "models", "slots", "aliases", "adapters"}
    assert state["stacks"] == ["workstation"] and state["aliases"] == state["adapters"] == []
    slots = {s["name"]: s for s in state["slots"]}
    assert list(slots) == ["chat", "reasoning", "code", "embed", "tts", "stt"]
    chat = slots["chat"]
    assert chat["model"] == {"default": "qwen2.5-14b-instruct-q4"}
    assert (chat["autoload"], chat["pinned"], chat["priority"], chat["port"]) == (
        True,
        False,
        90,
        8081,
    )
    assert chat["stack"] == "workstation"
    lines = WORKSTATION.read_text().splitlines()
    name_line = next(i for i, text in enumerate(lines, 1) if text.startswith('name = "chat"'))
    assert chat["file"] == str(WORKSTATION)
    assert chat["line"] == name_line - 1  # the [[slot]] header
    assert lines[chat["line"] - 1] == "[[slot]]"
    assert chat["warmup_timeout_s"] == 600.0  # defaults are filled in
    assert chat["server"]["extra_args"] == ["--parallel", "2", "--flash-attn"]
    assert slots["embed"]["pinned"] is True
    assert slots["tts"]["model"] == {"default": ""}
    assert [m["id"] for m in state["models"]] == [
        "qwen2.5-14b-instruct-q4",
        "qwq-32b-q4",
        "qwen2.5-coder-7b-q4",
        "nomic-embed-text-v1.5",
    ]


def test_show_migrates_autoload_and_pinned(home: Path, tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "s.toml",
        HEAD + '[[model]]\nid = "m"\n'
        '[[slot]]\nname = "agent"\nprovider = "demo"\nport = 1\nmodel.default = "m"\n'
        '[[slot]]\nname = "b"\nprovider = "demo"\nport = 2\n',
    )
    state = json.loads(slotctl("stack", "show", "-o", "json", path, home=home).stdout)
    got = {s["name"]: (s["autoload"], s["pinned"]) for s in state["slots"]}
    assert got == {"agent": (True, True), "b": (False, False)}


def test_show_of_an_invalid_stack(home: Path, tmp_path: Path) -> None:
    path = write(tmp_path, "bad.toml", HEAD + '[[slot]]\nname = "a"\n')  # no provider
    result = slotctl("stack", "show", "-o", "json", path, home=home)
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"{path}:3: error [slot.missing_key]" in result.stderr


# --------------------------------------------------------------- internal errors

_BOOM = """\
import sys
import controller.cli.stack as stack
def boom(*args, **kwargs):
    raise RuntimeError("boom")
stack.load_stacks = boom
from controller.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_unexpected_exception_exits_2_without_a_traceback(home: Path) -> None:
    result = slotctl("stack", "validate", WORKSTATION, home=home, code=_BOOM)
    assert result.returncode == 2
    assert "slotctl: internal error: RuntimeError: boom" in result.stderr
    assert "--debug" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_debug_prints_the_traceback_and_still_exits_2(home: Path) -> None:
    result = slotctl("--debug", "stack", "validate", WORKSTATION, home=home, code=_BOOM)
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: boom" in result.stderr


def test_unexpected_exception_in_process(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(cli_stack, "load_stacks", boom)
    assert cli_main.main(["--config-dir", str(home), "stack", "validate", str(WORKSTATION)]) == 2
    assert cli_main.main(["--config-dir", str(home), "stack", "show", str(WORKSTATION)]) == 2


def test_typed_error_exits_2(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    from controller.model.errors import SlotConfigError

    def refuse(*args: object, **kwargs: object) -> None:
        raise SlotConfigError("nope")

    monkeypatch.setattr(cli_stack, "load_stacks", refuse)
    assert cli_main.main(["--config-dir", str(home), "stack", "validate", str(WORKSTATION)]) == 2


def test_unreadable_controller_settings_is_not_a_crash(home: Path) -> None:
    (home / "controller.toml").mkdir()  # a directory where a file should be
    result = slotctl("stack", "validate", "-o", "json", WORKSTATION, home=home)
    assert result.returncode == 1  # reported as a located problem of the desired state
    assert "Traceback" not in result.stderr
    [error] = json.loads(result.stdout)["errors"]
    assert (error["file"], error["code"]) == (str(home / "controller.toml"), "stack.unreadable")
