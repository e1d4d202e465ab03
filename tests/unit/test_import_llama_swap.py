"""``slotctl import`` of a llama-swap config.yaml (controller/importers/).

The fixture (``import_fixtures/llama-swap-full.yaml``) is ours and holds every key
llama-swap v250 documents (config-schema.json, config.example.yaml at 0bdb3720);
``KEY_TABLE`` says, for each, what it must become: a stack value the test checks, or a
report entry of a given kind. A documented key missing from the table fails the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomlkit
import yaml

from controller.importers.llamaswap import (
    DOCUMENTED_MODEL_KEYS,
    DOCUMENTED_TOP_KEYS,
    import_llama_swap,
)
from controller.importers.macros import expand_config
from controller.importers.report import ImportReport
from controller.model.errors import ImportSourceError
from controller.spec.loader import load_stack_texts

FIXTURES = Path(__file__).parent / "import_fixtures"
FULL = FIXTURES / "llama-swap-full.yaml"
ENV = {"FIXTURE_MODELS": "/srv/gguf", "FIXTURE_API_KEY": "sk-env-secret"}
LISTING = ["README.md", "tiny-F16.gguf", "tiny-Q8_0.gguf", "mmproj-tiny-F16.gguf"]

# documented key -> where the fixture has it and what it must become: ("stack", check
# on the imported stack) or (kind, the report key that must carry it).
KEY_TABLE: dict[str, tuple[str, str]] = {
    "healthCheckTimeout": ("stack", "every slot's warmup_timeout_s is 300"),
    "logLevel": ("dropped", "logLevel"),
    "logTimeFormat": ("dropped", "logTimeFormat"),
    "logToStdout": ("dropped", "logToStdout"),
    "store": ("dropped", "store"),
    "metricsMaxInMemory": ("dropped", "metricsMaxInMemory"),
    "captureBuffer": ("dropped", "captureBuffer"),
    "ui": ("dropped", "ui"),
    "performance": ("dropped", "performance"),
    "startPort": ("owned", "startPort"),
    "sendLoadingState": ("dropped", "sendLoadingState"),
    "includeAliasesInList": ("approximated", "includeAliasesInList"),
    "globalTTL": ("stack", "small (ttl -1) and bench (no ttl) get ttl_s 120"),
    "unloadTimeout": ("dropped", "unloadTimeout"),
    "macros": ("stack", "chat's source and context come from nested, model and env macros"),
    "apiKeys": ("approximated", "apiKeys"),
    "upstream": ("dropped", "upstream"),
    "profiles": ("dropped", "profiles"),
    "selectors": ("stack", "aliases fast (warm) and spill (spread)"),
    "models": ("stack", "five models, five slots"),
    "groups": ("stack", "big -> exclusive group; forever -> pinned"),
    "matrix": ("dropped", "matrix"),  # its own fixture below (it excludes groups)
    "hooks": ("stack", "embed is autoload"),
    "peers": ("dropped", "peers"),
    "routing": ("dropped", "routing.scheduler.settings.fifo.priority"),
    "models.*.macros": ("stack", "chat's ctx 16384 overrides the global 8192"),
    "models.*.cmd": ("stack", "providers, sources, extra args"),
    "models.*.cmdStop": ("owned", "models.chat.cmdStop"),
    "models.*.name": ("dropped", "models.chat.name"),
    "models.*.description": ("dropped", "models.chat.description"),
    "models.*.env": ("stack", "CUDA_VISIBLE_DEVICES -> device gpu:1; the rest in server.env"),
    "models.*.proxy": ("stack", "bench's fixed port 8999"),
    "models.*.aliases": ("stack", "alias chat-alias -> chat"),
    "models.*.checkEndpoint": ("owned", "models.chat.checkEndpoint"),
    "models.*.ttl": ("stack", "chat's ttl_s 300; embed's 0"),
    "models.*.unloadTimeout": ("dropped", "models.chat.unloadTimeout"),
    "models.*.useModelName": ("owned", "models.chat.useModelName"),
    "models.*.filters": ("dropped", "models.chat.filters"),
    "models.*.metadata": ("dropped", "models.chat.metadata"),
    "models.*.concurrencyLimit": ("approximated", "models.chat.concurrencyLimit"),
    "models.*.sendLoadingState": ("dropped", "models.chat.sendLoadingState"),
    "models.*.unlisted": ("dropped", "models.chat.unlisted"),
    "models.*.timeouts": ("approximated", "models.chat.timeouts.responseHeader"),
    "models.*.compat": ("dropped", "models.chat.compat"),
    "models.*.capabilities": ("dropped", "models.chat.capabilities"),
}


def _imported(text: str | None = None, **kw: Any) -> Any:
    kw.setdefault("env", ENV)
    kw.setdefault("lister", lambda repo: LISTING)
    return import_llama_swap(text if text is not None else FULL.read_text(), **kw)


def _stack(result: Any) -> dict[str, Any]:
    return tomlkit.parse(result.render("config.yaml")).unwrap()


def _slot(stack: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in stack["slot"] if s["name"] == name)


def _model(stack: dict[str, Any], model_id: str) -> dict[str, Any]:
    return next(m for m in stack["model"] if m["id"] == model_id)


def test_the_table_names_every_documented_key_and_the_fixture_has_them() -> None:
    documented = set(DOCUMENTED_TOP_KEYS) | {f"models.*.{k}" for k in DOCUMENTED_MODEL_KEYS}
    assert documented == set(KEY_TABLE)
    raw = yaml.safe_load(FULL.read_text())
    chat = raw["models"]["chat"]
    for key in KEY_TABLE:
        if key == "matrix":
            continue  # exclusive with groups: its own test
        if key.startswith("models.*."):
            assert key.removeprefix("models.*.") in chat, key
        else:
            assert key in raw, key


def test_every_key_is_mapped_or_reported_with_its_kind() -> None:
    result = _imported()
    found = {(f.kind, f.key) for f in result.report.findings}
    for key, (kind, where) in KEY_TABLE.items():
        if kind != "stack" and key != "matrix":
            assert (kind, where) in found, (key, kind, where, sorted(found))


def test_the_stack_carries_models_slots_groups_hooks_and_aliases() -> None:
    stack = _stack(_imported())
    assert [s["name"] for s in stack["slot"]] == ["chat", "small", "embed", "bench", "docker-vllm"]
    chat = _slot(stack, "chat")
    assert chat["provider"] == "llamacpp"
    assert chat["server"]["binary"] == "/opt/llama/llama-server-b9000"
    assert chat["server"]["extra_args"] == ["--parallel", "2", "--jinja"]
    assert chat["server"]["env"] == {"LLAMA_LOG_COLORS": "0"}
    assert chat["device"] == "gpu:1"
    assert (chat["ttl_s"], chat["warmup_timeout_s"], chat["max_concurrency"]) == (300, 300, 4)
    assert chat["upstream_idle_s"] == 90
    assert _model(stack, "chat") == {
        "id": "chat",
        "source": "/srv/gguf/chat-Q4_K_M.gguf",
        "context_length": 16384,
        "temperature": 0.6,
    }
    small = _slot(stack, "small")
    assert (small["device"], small["ttl_s"]) == ("cpu", 120)
    assert _model(stack, "small")["source"] == "hf://ggml-org/tiny-GGUF/tiny-Q8_0.gguf"
    embed = _slot(stack, "embed")
    assert (embed["provider"], embed["gpus"], embed["type"]) == ("vllm", 2, "embedding")
    assert embed["autoload"] is True and embed["pinned"] is True and "ttl_s" not in embed
    bench = _slot(stack, "bench")
    assert (bench["provider"], bench["port"]) == ("openai-compatible", 8999)
    assert bench["server"]["cmd"][-1] == "bench"  # ${MODEL_ID}
    docker = _slot(stack, "docker-vllm")
    assert docker["server"]["image"] == "vllm/vllm-openai:v0.10.0"
    assert (docker["device"], docker["gpus"]) == ("gpu:2,3", 2)
    assert _model(stack, "docker-vllm")["source"] == "/srv/models/coder"  # through -v
    assert _model(stack, "bench")["exclusive_group"] == "big"
    assert _model(stack, "docker-vllm")["exclusive_group"] == "big"
    assert "exclusive_group" not in _model(stack, "chat")  # pair: swap = false
    assert {a["id"]: (a["models"], a["prefer"]) for a in stack["alias"]} == {
        "chat-alias": (["chat"], "first"),
        "fast": (["chat", "small"], "warm"),
        "spill": (["chat", "small"], "spread"),
    }


def test_the_imported_stack_passes_stack_validate() -> None:
    result = _imported()
    report = load_stack_texts([("imported.toml", result.render("config.yaml"))])
    assert not report.errors, [p.message for p in report.errors]
    assert report.state is not None and len(report.state.slots) == 5


def test_api_keys_become_commands_and_no_secret_is_printed() -> None:
    result = _imported()
    assert result.commands == [
        "slotctl key create llama-swap-1 --scope inference",
        "slotctl key create llama-swap-2 --scope inference",
    ]
    text = result.render("config.yaml") + "\n".join(f.line("c") for f in result.report.findings)
    assert "sk-fixture-secret-one" not in text and "sk-env-secret" not in text


def test_an_unset_env_macro_needs_input_and_is_left_as_written() -> None:
    result = _imported(env={"FIXTURE_API_KEY": "x"})
    assert any(
        f.kind == "needs-input" and "FIXTURE_MODELS" in f.reason for f in result.report.findings
    )
    assert _model(_stack(result), "chat")["source"] == "${env.FIXTURE_MODELS}/chat-Q4_K_M.gguf"


def test_macros_nest_in_declaration_order_and_port_is_the_slots() -> None:
    raw = {
        "macros": {"a": "x", "b": "${a}-y", "n": 3},
        "models": {
            "m": {
                "macros": {"a": "z"},
                "cmd": "srv --p ${PORT} --v ${b} --id ${MODEL_ID}\n# ${undeclared}",
                "metadata": {"n": "${n}"},
            }
        },
    }
    out = expand_config(raw, {}, ImportReport("llama-swap"))
    model = out["models"]["m"]
    assert model["cmd"] == "srv --p {port} --v z-y --id m"  # the model's a wins; comment gone
    assert model["metadata"] == {"n": 3}  # a whole-string macro keeps its type
    assert model["proxy"] == "http://localhost:{port}"


def test_an_unknown_macro_in_cmd_is_refused() -> None:
    with pytest.raises(ImportSourceError, match=r"unknown macro \$\{nope\}"):
        _imported("models:\n  m:\n    cmd: llama-server -m ${nope}\n")


def test_matrix_is_reported_and_groups_then_are_not_derived() -> None:
    text = (
        "models:\n  a:\n    cmd: llama-server -m /a.gguf --port ${PORT}\n"
        "  b:\n    cmd: llama-server -m /b.gguf --port ${PORT}\n"
        "matrix:\n  vars: {x: a}\n  sets: {s: 'x & b'}\n"
    )
    result = _imported(text)
    assert ("dropped", "matrix") in {(f.kind, f.key) for f in result.report.findings}
    assert all("exclusive_group" not in m for m in _stack(result)["model"])


def test_no_groups_means_llama_swaps_one_model_at_a_time() -> None:
    text = (
        "models:\n  a:\n    cmd: llama-server -m /a.gguf --port ${PORT}\n"
        "  b:\n    cmd: llama-server -m /b.gguf --port ${PORT}\n"
        "routing:\n  router:\n    use: group\n"
    )
    stack = _stack(_imported(text))
    assert {m["exclusive_group"] for m in stack["model"]} == {"default"}


def test_swapping_exclusive_groups_share_one_exclusive_group() -> None:
    text = (
        "models:\n"
        + "".join(f"  {m}:\n    cmd: llama-server -m /{m}.gguf --port ${{PORT}}\n" for m in "abc")
        + "groups:\n  g1: {members: [a, b]}\n  g2: {members: [c]}\n"
    )
    result = _imported(text)
    assert {m["exclusive_group"] for m in _stack(result)["model"]} == {"llama-swap"}
    assert not result.report.strict_failures()


def test_an_undocumented_key_is_dropped_not_silent() -> None:
    text = "future: 1\nmodels:\n  m:\n    cmd: llama-server -m /m.gguf\n    shiny: true\n"
    keys = _imported(text).report.keys("dropped")
    assert "future" in keys and "models.m.shiny" in keys


def test_offline_hf_quant_needs_input() -> None:
    text = "models:\n  m:\n    cmd: llama-server -hf org/repo:Q5_K_M --port ${PORT}\n"
    result = _imported(text, lister=None)
    assert result.report.keys("needs-input") == ["models.m.cmd: -hf"]
    assert result.report.strict_failures()


def test_not_yaml_or_no_models_is_a_typed_error() -> None:
    with pytest.raises(ImportSourceError):
        _imported("models: [unclosed")
    with pytest.raises(ImportSourceError):
        _imported("logLevel: info\n")
