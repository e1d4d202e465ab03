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

# Every key path config-schema.json documents at llama-swap v250-5-g0bdb3720 (``*``: any
# name), listed by walking the schema's properties.
SCHEMA_PATHS = [
    "healthCheckTimeout",
    "globalTTL",
    "unloadTimeout",
    "logLevel",
    "logTimeFormat",
    "metricsMaxInMemory",
    "captureBuffer",
    "store",
    "store.path",
    "ui",
    "ui.activity",
    "ui.activity.session_id",
    "performance",
    "performance.disabled",
    "performance.every",
    "startPort",
    "sendLoadingState",
    "includeAliasesInList",
    "macros",
    "profiles",
    "profiles.*.description",
    "profiles.*.pins",
    "selectors",
    "selectors.*.strategy",
    "selectors.*.targets",
    "selectors.*.settings",
    "selectors.*.settings.spillover",
    "selectors.*.name",
    "selectors.*.description",
    "selectors.*.unlisted",
    "selectors.*.metadata",
    "models",
    "models.*.macros",
    "models.*.cmd",
    "models.*.cmdStop",
    "models.*.name",
    "models.*.description",
    "models.*.env",
    "models.*.proxy",
    "models.*.aliases",
    "models.*.checkEndpoint",
    "models.*.ttl",
    "models.*.unloadTimeout",
    "models.*.useModelName",
    "models.*.filters",
    "models.*.filters.stripParams",
    "models.*.filters.setParams",
    "models.*.filters.setParamsByID",
    "models.*.metadata",
    "models.*.concurrencyLimit",
    "models.*.sendLoadingState",
    "models.*.unlisted",
    "models.*.timeouts",
    "models.*.timeouts.connect",
    "models.*.timeouts.keepalive",
    "models.*.timeouts.responseHeader",
    "models.*.timeouts.tlsHandshake",
    "models.*.timeouts.expectContinue",
    "models.*.timeouts.idleConn",
    "models.*.compat",
    "models.*.compat.ignoreWebsockets",
    "models.*.capabilities",
    "models.*.capabilities.in",
    "models.*.capabilities.out",
    "models.*.capabilities.tools",
    "models.*.capabilities.reranker",
    "models.*.capabilities.context",
    "groups",
    "groups.*.swap",
    "groups.*.exclusive",
    "groups.*.persistent",
    "groups.*.members",
    "matrix",
    "matrix.vars",
    "matrix.evict_costs",
    "matrix.sets",
    "hooks",
    "hooks.on_startup",
    "hooks.on_startup.preload",
    "logToStdout",
    "apiKeys",
    "peers",
    "peers.*.proxy",
    "peers.*.apiKey",
    "peers.*.models",
    "peers.*.filters",
    "peers.*.filters.stripParams",
    "peers.*.filters.setParams",
    "peers.*.timeouts",
    "peers.*.timeouts.connect",
    "peers.*.timeouts.keepalive",
    "peers.*.timeouts.responseHeader",
    "peers.*.timeouts.tlsHandshake",
    "peers.*.timeouts.idleConn",
    "upstream",
    "upstream.ignorePaths",
    "routing",
    "routing.scheduler",
    "routing.scheduler.use",
    "routing.scheduler.settings",
    "routing.scheduler.settings.fifo",
    "routing.scheduler.settings.fifo.priority",
    "routing.router",
    "routing.router.use",
    "routing.router.settings",
    "routing.router.settings.groups",
    "routing.router.settings.groups.*.swap",
    "routing.router.settings.groups.*.exclusive",
    "routing.router.settings.groups.*.persistent",
    "routing.router.settings.groups.*.members",
    "routing.router.settings.matrix",
    "routing.router.settings.matrix.vars",
    "routing.router.settings.matrix.evict_costs",
    "routing.router.settings.matrix.sets",
]

FULL_F, ROUTING_F, MATRIX_F = (
    "llama-swap-full.yaml",
    "llama-swap-routing.yaml",
    "llama-swap-matrix.yaml",
)
# documented key -> (the fixture that has it, what it must become): "stack" (checked by
# the named test on the imported stack) or a report kind and the report key that carries
# it. A key reported dropped or owned whole covers the keys under it.
KEY_TABLE: dict[str, tuple[str, str, str]] = {
    "healthCheckTimeout": (FULL_F, "stack", "test_the_stack_carries_models_slots..."),
    "logLevel": (FULL_F, "dropped", "logLevel"),
    "logTimeFormat": (FULL_F, "dropped", "logTimeFormat"),
    "logToStdout": (FULL_F, "dropped", "logToStdout"),
    "store": (FULL_F, "dropped", "store"),
    "metricsMaxInMemory": (FULL_F, "dropped", "metricsMaxInMemory"),
    "captureBuffer": (FULL_F, "dropped", "captureBuffer"),
    "ui": (FULL_F, "dropped", "ui"),
    "performance": (FULL_F, "dropped", "performance"),
    "startPort": (FULL_F, "owned", "startPort"),
    "sendLoadingState": (FULL_F, "dropped", "sendLoadingState"),
    "includeAliasesInList": (FULL_F, "approximated", "includeAliasesInList"),
    "globalTTL": (FULL_F, "stack", "test_the_stack_carries_models_slots... (small's ttl_s)"),
    "unloadTimeout": (FULL_F, "dropped", "unloadTimeout"),
    "macros": (FULL_F, "stack", "test_macros_nest_in_declaration_order_and_port_is_the_slots"),
    "apiKeys": (FULL_F, "approximated", "apiKeys"),
    "upstream": (FULL_F, "dropped", "upstream"),
    "profiles": (FULL_F, "dropped", "profiles"),
    "selectors.*.strategy": (FULL_F, "stack", "the aliases fast (warm) and spill (spread)"),
    "selectors.*.targets": (FULL_F, "dropped", "selectors.fast.targets"),
    "selectors.*.settings.spillover": (FULL_F, "approximated", "selectors.spill.strategy"),
    "selectors.*.name": (FULL_F, "dropped", "selectors.fast.name"),
    "selectors.*.description": (FULL_F, "dropped", "selectors.fast.description"),
    "selectors.*.unlisted": (FULL_F, "dropped", "selectors.fast.unlisted"),
    "selectors.*.metadata": (FULL_F, "dropped", "selectors.fast.metadata"),
    "models.*.macros": (FULL_F, "stack", "chat's ctx 16384 overrides the global 8192"),
    "models.*.cmd": (FULL_F, "stack", "providers, sources, extra args"),
    "models.*.cmdStop": (FULL_F, "owned", "models.chat.cmdStop"),
    "models.*.name": (FULL_F, "dropped", "models.chat.name"),
    "models.*.description": (FULL_F, "dropped", "models.chat.description"),
    "models.*.env": (FULL_F, "owned", "models.chat.env: CUDA_VISIBLE_DEVICES"),
    "models.*.proxy": (FULL_F, "owned", "models.bench.proxy"),
    "models.*.aliases": (FULL_F, "stack", "alias chat-alias -> chat"),
    "models.*.checkEndpoint": (FULL_F, "owned", "models.chat.checkEndpoint"),
    "models.*.ttl": (FULL_F, "stack", "chat's ttl_s 300; embed's 0"),
    "models.*.unloadTimeout": (FULL_F, "dropped", "models.chat.unloadTimeout"),
    "models.*.useModelName": (FULL_F, "owned", "models.chat.useModelName"),
    "models.*.filters": (FULL_F, "dropped", "models.chat.filters"),
    "models.*.metadata": (FULL_F, "dropped", "models.chat.metadata"),
    "models.*.concurrencyLimit": (FULL_F, "approximated", "models.chat.concurrencyLimit"),
    "models.*.sendLoadingState": (FULL_F, "dropped", "models.chat.sendLoadingState"),
    "models.*.unlisted": (FULL_F, "dropped", "models.chat.unlisted"),
    "models.*.timeouts.connect": (FULL_F, "owned", "models.chat.timeouts.connect"),
    "models.*.timeouts.keepalive": (FULL_F, "dropped", "models.chat.timeouts.keepalive"),
    "models.*.timeouts.responseHeader": (
        FULL_F,
        "approximated",
        "models.chat.timeouts.responseHeader",
    ),
    "models.*.timeouts.tlsHandshake": (FULL_F, "dropped", "models.chat.timeouts.tlsHandshake"),
    "models.*.timeouts.expectContinue": (
        FULL_F,
        "dropped",
        "models.chat.timeouts.expectContinue",
    ),
    "models.*.timeouts.idleConn": (FULL_F, "dropped", "models.chat.timeouts.idleConn"),
    "models.*.compat": (FULL_F, "dropped", "models.chat.compat"),
    "models.*.capabilities": (FULL_F, "dropped", "models.chat.capabilities"),
    "groups.*.swap": (FULL_F, "stack", "big -> exclusive group big; pair (swap false) none"),
    "groups.*.exclusive": (FULL_F, "approximated", "groups.big.exclusive"),
    "groups.*.persistent": (FULL_F, "stack", "forever -> embed pinned"),
    "groups.*.members": (FULL_F, "stack", "bench and docker-vllm in group big"),
    "matrix": (MATRIX_F, "dropped", "matrix"),
    "hooks.on_startup.preload": (FULL_F, "stack", "embed is autoload"),
    "peers": (FULL_F, "dropped", "peers"),
    "routing.scheduler.use": (ROUTING_F, "owned", "routing.scheduler.use"),
    "routing.scheduler.settings.fifo.priority": (
        ROUTING_F,
        "dropped",
        "routing.scheduler.settings.fifo.priority",
    ),
    "routing.router.use": (ROUTING_F, "stack", "test_routing_groups..."),
    "routing.router.settings.groups.*.swap": (ROUTING_F, "stack", "pair -> exclusive group"),
    "routing.router.settings.groups.*.exclusive": (ROUTING_F, "stack", "exclusive: false"),
    "routing.router.settings.groups.*.persistent": (ROUTING_F, "stack", "keep -> c pinned"),
    "routing.router.settings.groups.*.members": (ROUTING_F, "stack", "a, b in pair"),
    "routing.router.settings.matrix": (
        ROUTING_F,
        "dropped",
        "routing.router.settings.matrix",
    ),
}


def _covered(path: str) -> bool:
    if path in KEY_TABLE or any(k.startswith(path + ".") for k in KEY_TABLE):
        return True
    parts = path.split(".")
    ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
    return any(a in KEY_TABLE and KEY_TABLE[a][1] in ("dropped", "owned") for a in ancestors)


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


def test_every_documented_key_is_in_the_table_and_in_its_fixture() -> None:
    assert [p for p in SCHEMA_PATHS if not _covered(p)] == []
    for key, (fixture, _, _) in KEY_TABLE.items():
        assert _has(yaml.safe_load((FIXTURES / fixture).read_text()), key.split(".")), key


def _has(node: Any, parts: list[str]) -> bool:
    """Whether the YAML tree has the key path (``*``: any entry of a mapping)."""
    if not parts:
        return True
    if not isinstance(node, dict):
        return False
    head, rest = parts[0], parts[1:]
    if head == "*":
        return any(_has(v, rest) for v in node.values())
    return head in node and _has(node[head], rest)


def test_documented_keys_the_importer_knows_by_name() -> None:
    tops = {p for p in SCHEMA_PATHS if "." not in p}
    models = {
        p.split(".")[2] for p in SCHEMA_PATHS if p.count(".") == 2 and p.startswith("models.*.")
    }
    assert tops == set(DOCUMENTED_TOP_KEYS)
    assert models == set(DOCUMENTED_MODEL_KEYS)


def test_every_key_is_mapped_or_reported_with_its_kind() -> None:
    for fixture in (FULL_F, ROUTING_F, MATRIX_F):
        result = _imported((FIXTURES / fixture).read_text())
        found = {(f.kind, f.key) for f in result.report.findings}
        for key, (where, kind, report_key) in KEY_TABLE.items():
            if where == fixture and kind != "stack":
                assert (kind, report_key) in found, (key, kind, report_key, sorted(found))


def test_routing_groups_map_like_top_level_groups() -> None:
    stack = _stack(_imported((FIXTURES / ROUTING_F).read_text()))
    groups = {m["id"]: m.get("exclusive_group") for m in stack["model"]}
    assert groups == {"a": "pair", "b": "pair", "c": None}
    assert _slot(stack, "c")["pinned"] is True
    assert "pinned" not in _slot(stack, "a")


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
    result = _imported((FIXTURES / MATRIX_F).read_text())
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


def test_use_model_name_of_a_generic_server_is_an_alias_rewrite() -> None:
    text = (
        "models:\n  bench:\n    cmd: my-server --port ${PORT}\n"
        "    useModelName: upstream-name\n    aliases: [b2]\n"
    )
    result = _imported(text)
    stack = _stack(result)
    assert [m["id"] for m in stack["model"]] == ["upstream-name"]
    assert stack["slot"][0]["name"] == "upstream-name"
    assert stack["slot"][0]["server"]["cmd"] == ["my-server", "--port", "{port}"]
    assert {a["id"]: a["models"] for a in stack["alias"]} == {
        "bench": ["upstream-name"],
        "b2": ["upstream-name"],
    }
    assert not result.report.strict_failures()
    assert not load_stack_texts([("u.toml", result.render("c"))]).errors


def test_servers_recognised_from_their_command_lines() -> None:
    text = (
        "models:\n"
        "  p:\n    cmd: /venv/bin/python -m llama_cpp.server --model /m.gguf --n_ctx 512"
        " --port ${PORT} --n_gpu_layers 0 --model_alias x\n"
        "  v:\n    cmd: vllm serve Qwen/Qwen3-8B --port ${PORT} --max-model-len 4096\n"
        "  d:\n    cmd: python3 -m controller.demo --port ${PORT} --model d --load-seconds 1\n"
        "  r:\n    cmd: llama-server --models-preset /p.ini --port ${PORT} --api-key k\n"
        "  g:\n    cmd: llama-server -m /g.gguf -ngl 20 -ts 1,1 --embeddings -c 0\n"
        "    env: ['CUDA_VISIBLE_DEVICES=GPU-1234-abcd', 'HIP_VISIBLE_DEVICES=all']\n"
    )
    result = _imported(text)
    stack = _stack(result)
    p, v, d, r, g = stack["slot"]
    assert (p["provider"], p["device"], p["server"]["binary"]) == (
        "llama-cpp-python",
        "cpu",
        "/venv/bin/python",
    )
    assert _model(stack, "p")["source"] == "/m.gguf"
    assert _model(stack, "p")["context_length"] == 512
    assert v["provider"] == "vllm"
    assert _model(stack, "v")["source"] == "hf://Qwen/Qwen3-8B"
    assert _model(stack, "v")["context_length"] == 4096
    assert (d["provider"], d["server"]["extra_args"]) == ("demo", ["--load-seconds", "1"])
    assert r["provider"] == "llamacpp" and "server" not in r
    assert (g["type"], g["device"]) == ("embedding", "gpu:GPU-1234-abcd")
    kinds = {(f.kind, f.key) for f in result.report.findings}
    assert ("dropped", "models.r.cmd: --models-preset") in kinds
    assert ("owned", "models.r.cmd: --api-key") in kinds
    assert ("needs-input", "models.r.cmd") in kinds  # no model file: router mode
    assert ("approximated", "models.g.cmd: --n-gpu-layers") in kinds
    assert ("owned", "models.g.cmd: --tensor-split") in kinds
    assert ("approximated", "models.g.cmd: --ctx-size") in kinds
    assert ("approximated", "models.v.cmd: --model") in kinds  # read as a hub repo
    assert ("approximated", "models.g.env: HIP_VISIBLE_DEVICES") not in kinds  # all: any GPU
    assert not load_stack_texts([("s.toml", result.render("c"))]).errors


def test_llama_swaps_cmd_splitting() -> None:
    from controller.importers.argv import split_command

    cmd = "# a comment\nllama-server \\\n  --model '/m m.gguf' # not a comment line\n  -c 8"
    assert split_command(cmd) == [
        "llama-server", "--model", "/m m.gguf", "#", "not", "a", "comment", "line", "-c", "8",
    ]  # fmt: skip
    with pytest.raises(ImportSourceError):
        split_command("llama-server --model 'unbalanced")


def test_a_relative_model_path_is_reported() -> None:
    text = (
        "models:\n  a:\n    cmd: llama-server -m rel/a.gguf --port ${PORT}\n"
        "  b:\n    cmd: llama-server -m ~/b.gguf --port ${PORT}\n"
    )
    findings = {(f.kind, f.key) for f in _imported(text).report.findings}
    assert ("approximated", "models.a.cmd: --model") in findings
    assert ("needs-input", "models.b.cmd: --model") in findings


def test_a_containers_own_port_is_not_the_slots() -> None:
    text = (
        "models:\n  d:\n    proxy: http://127.0.0.1:9100\n    cmd: >\n"
        "      docker run --rm -p 9100:8080 -v /srv:/models ghcr.io/ggml-org/llama.cpp:server\n"
        "      -m /models/d.gguf --host 0.0.0.0 --port 8080\n"
    )
    stack = _stack(_imported(text))
    assert stack["slot"][0]["port"] == 9100  # llama-swap's proxy: the host side
    assert stack["model"][0]["source"] == "/srv/d.gguf"
