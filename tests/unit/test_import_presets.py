"""``slotctl import`` of a llama.cpp router presets file, and the command itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tomlkit

from controller.cli.main import main
from controller.cli.migrate import detect_format
from controller.importers.presets import import_presets, parse_ini
from controller.spec.loader import load_stack_texts

FIXTURES = Path(__file__).parent / "import_fixtures"
PRESETS = FIXTURES / "presets-full.ini"
LISTING = ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]


def _stack(text: str) -> dict[str, Any]:
    return tomlkit.parse(text).unwrap()


def test_ini_sections_globals_and_repeated_keys() -> None:
    top, sections = parse_ini("version = 1\n; c\n[*]\nc = 1\n[a]\nx = 1\nx = 2\n", "f.ini")
    assert top == {"version": "1"}
    assert sections == {"*": {"c": "1"}, "a": {"x": "2"}}


def test_presets_become_llamacpp_slots() -> None:
    result = import_presets(PRESETS.read_text(), lister=lambda repo: LISTING)
    stack = _stack(result.render("models.ini"))
    tiny, custom = stack["model"]
    assert tiny == {
        "id": "ggml-org/tiny-GGUF:Q8_0",
        "source": "hf://ggml-org/tiny-GGUF/tiny-Q8_0.gguf",
        "context_length": 8192,
        "chat_template": "chatml",
    }
    assert custom["source"] == "/models/custom-Q4_K_M.gguf" and custom["context_length"] == 4096
    first, second = stack["slot"]
    assert first["name"] == "ggml-org-tiny-gguf-q8-0" and first["autoload"] is False
    assert first["server"]["extra_args"] == ["--jinja", "-np", "2"]
    assert first["server"]["env"] == {"LLAMA_ARG_CACHE_RAM": "0"}
    assert (second["autoload"], second["port"]) == (True, 8080)
    report = {(f.kind, f.key) for f in result.report.findings}
    assert ("dropped", "[custom].stop-timeout") in report
    assert ("dropped", "[custom].mmap") in report
    assert ("owned", "[custom]: --host") in report
    assert ("owned", "[custom]: --alias") in report
    assert ("owned", "[custom]: --api-key") in report
    assert not load_stack_texts([("p.toml", result.render("models.ini"))]).errors


def test_format_detection() -> None:
    assert detect_format("x.ini", "") == "llama-server-presets"
    assert detect_format("-", "; c\n[a]\n") == "llama-server-presets"
    assert detect_format("config.yaml", "models: {}") == "llama-swap"


def test_the_command_prints_the_stack_and_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "stack.toml"
    code = main(["import", str(PRESETS), "--offline", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 0  # valid: offline, the hub file is left to name (hf://org/repo)
    assert "needs-input" in err and "stop-timeout" in err
    assert "[stack]" in out.read_text()


def test_strict_writes_nothing_and_json_carries_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "stack.toml"
    assert main(["import", str(PRESETS), "--offline", "--strict", "--output", str(out)]) == 1
    assert not out.exists() and "--strict" in capsys.readouterr().err
    assert main(["import", str(PRESETS), "--offline", "-o", "json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert {"stack", "findings", "commands", "problems"} <= set(data)
    assert any(f["key"] == "[custom].stop-timeout" for f in data["findings"])


def test_an_unreadable_source_exits_2(tmp_path: Path) -> None:
    assert main(["import", str(tmp_path / "missing.yaml")]) == 2
