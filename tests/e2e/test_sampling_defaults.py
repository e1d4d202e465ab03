"""A model's sampling defaults reach its server (controller/providers/sampling.py).

Unit level: each provider's start flags (llama-server's, vLLM's generation-config override,
the demo server's ``--sampling``), what each leaves untold, and the warning every stack
command gives for it. End to end: a demo slot under ``slotctl up`` whose model sets
``max_tokens = 3`` answers a request without a budget with 3 tokens and one with its own
budget with that; its server reports the defaults at ``GET /props`` (as llama-server).
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.cli.stack import load_report
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.providers.sampling import sampling_args, unpassed
from controller.spec.schema import ModelSpec, SlotSpec
from tests.e2e.conftest import Slotctl
from tests.integration.test_api import Api, start_api

MODEL = ModelSpec(
    id="qwen",
    source="/models/qwen.gguf",
    memory_gb=1,
    temperature=0.25,
    top_k=40,
    repeat_penalty=1.1,
    presence_penalty=0.5,
    max_tokens=64,
    seed=7,
    stop=["</s>"],
)


def _slot(provider: str) -> SlotSpec:
    return SlotSpec.model_validate(
        {"name": "chat", "provider": provider, "port": 8081, "model": {"default": "qwen"}}
    )


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_llama_server_is_told_its_flags_before_the_slots_own() -> None:
    slot = SlotSpec.model_validate(
        {
            "name": "chat",
            "provider": "llamacpp",
            "port": 8081,
            "model": {"default": "qwen"},
            "server": {"extra_args": ["--parallel", "2"]},
        }
    )
    argv = list(build_launch(slot, MODEL, BuildContext()).argv)
    assert _after(argv, "--temp") == "0.25"
    assert _after(argv, "--top-k") == "40"
    assert _after(argv, "--repeat-penalty") == "1.1"
    assert _after(argv, "--presence-penalty") == "0.5"
    assert _after(argv, "--seed") == "7"
    assert "--n-predict" not in argv  # a cap there, not a default: never told
    assert argv[-2:] == ["--parallel", "2"]
    assert unpassed("llamacpp", MODEL) == ["max_tokens", "stop"]


def test_vllm_gets_one_generation_config_override_in_its_names() -> None:
    argv = list(build_launch(_slot("vllm"), MODEL, BuildContext()).argv)
    override = json.loads(_after(argv, "--override-generation-config"))
    assert override == {"repetition_penalty": 1.1, "temperature": 0.25, "top_k": 40}
    assert unpassed("vllm", MODEL) == ["max_tokens", "presence_penalty", "seed", "stop"]


def test_llama_cpp_python_and_a_generic_command_are_told_nothing() -> None:
    argv = list(build_launch(_slot("llama-cpp-python"), MODEL, BuildContext()).argv)
    assert not {"--temp", "--override-generation-config", "--sampling"} & set(argv)
    assert sampling_args("llama-cpp-python", MODEL) == []
    assert len(unpassed("llama-cpp-python", MODEL)) == 7
    assert sampling_args("llamacpp", ModelSpec(id="bare")) == []  # nothing set, nothing said


def test_the_demo_server_takes_them_all() -> None:
    argv = list(build_launch(_slot("demo"), MODEL, BuildContext()).argv)
    assert json.loads(_after(argv, "--sampling"))["stop"] == ["</s>"]
    assert unpassed("demo", MODEL) == []


STACK = """
[stack]
name = "s"

[[model]]
id = "qwen"
source = "/models/qwen.gguf"
memory_gb = 1
temperature = 0.3
stop = ["END"]

[[slot]]
name = "py"
provider = "llama-cpp-python"
port = 9101
model = {{ default = "qwen" }}

[[slot]]
name = "ls"
provider = "llamacpp"
port = 9102
model = {{ default = "qwen" }}
"""


def test_every_stack_command_warns_of_a_default_the_server_is_not_told(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(STACK.format())
    args = argparse.Namespace(paths=[str(path)], config_dir=str(tmp_path / "conf"))
    report = load_report(args)
    assert report.ok, report.errors
    told = {p.slot: p for p in report.warnings if p.code == "slot.sampling_not_passed"}
    assert set(told) == {"py", "ls"}
    assert "stop, temperature" in told["py"].message
    assert "'stop'" not in told["ls"].message and "sets stop," in told["ls"].message
    assert told["ls"].hint is not None and "--temp" not in told["ls"].hint  # keys, not flags
    assert told["py"].severity == "warning" and told["py"].line is not None


DEMO_STACK = """
[stack]
name = "sampling"

[[model]]
id = "short"
source = "demo://short"
max_tokens = 3
temperature = 0.5

[[slot]]
name = "chat"
provider = "demo"
device = "cpu"
autoload = true
model = { default = "short" }
"""


@pytest.fixture
def ctl(tmp_path: Path) -> Iterator[Slotctl]:
    ctl = Slotctl(tmp_path)
    try:
        yield ctl
    finally:
        leftovers = ctl.close()
    assert not leftovers, leftovers


def _tokens(api: Api, **extra: object) -> int:
    body = {"model": "short", "messages": [{"role": "user", "content": "hi"}], **extra}
    reply = api.call("POST", "/v1/chat/completions", body, timeout=60)
    assert reply.status == 200, reply
    return int(reply.body["usage"]["completion_tokens"])


def test_a_demo_slot_answers_by_its_models_defaults(ctl: Slotctl, tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    (stacks / "sampling.toml").write_text(DEMO_STACK)
    api = start_api(ctl, str(stacks))
    api.wait_state("chat", "ready", timeout=60)
    assert _tokens(api) == 3  # the model's max_tokens, applied by the server
    assert _tokens(api, max_tokens=5) == 5  # a request's own wins
    slot = api.slot("chat")
    with urllib.request.urlopen(slot["endpoint"] + "/props", timeout=10) as answer:
        params = json.load(answer)["default_generation_settings"]["params"]
    assert params == {"max_tokens": 3, "temperature": 0.5}


def test_the_demo_refuses_a_default_budget_it_would_refuse_in_a_request() -> None:
    """A --sampling max_tokens over the per-request limit would fail every request that
    sets none: refused at start (argparse: exit 2), as a request's own is (400)."""
    from controller.demo.config import MAX_TOKENS_LIMIT, parse_args

    ok = parse_args(["--port", "0", "--model", "m", "--sampling", '{"max_tokens": 8}'])
    assert ok.sampling == {"max_tokens": 8}
    for bad in (str(MAX_TOKENS_LIMIT + 1), "-1", "true", '"8"'):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--port", "0", "--model", "m", "--sampling", f'{{"max_tokens": {bad}}}'])
        assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(["--port", "0", "--model", "m", "--sampling", "[1]"])
