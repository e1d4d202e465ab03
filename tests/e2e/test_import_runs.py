"""An imported llama-swap config runs: ``slotctl import`` writes the stack, ``slotctl
up`` loads the preloaded model's slot (the demo server, started from llama-swap's
``cmd``) and serves a request for its alias through the router; the other slot waits
for a request, as llama-swap's would."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.e2e.conftest import Slotctl
from tests.integration.test_api import start_api

CONFIG = f"""
healthCheckTimeout: 60
macros:
  "demo": "{sys.executable} -m controller.demo --port ${{PORT}}"
models:
  "chat-demo":
    cmd: ${{demo}} --load-seconds 0.1
    env: ["CUDA_VISIBLE_DEVICES="]
    aliases: ["gpt-4o-mini"]
  "other-demo":
    cmd: ${{demo}}
    env: ["CUDA_VISIBLE_DEVICES="]
    ttl: 600
hooks:
  on_startup:
    preload: ["chat-demo"]
"""


def test_imported_llama_swap_config_loads_and_serves(ctl: Slotctl) -> None:
    config = ctl.tmp / "config.yaml"
    config.write_text(CONFIG)
    stacks = ctl.tmp / "stacks"
    stacks.mkdir()
    out = ctl.run("import", config, "--output", stacks / "imported.toml", "--strict")
    assert out.returncode == 0, ctl.explain(out)
    text = (stacks / "imported.toml").read_text()
    assert 'provider = "demo"' in text and 'device = "cpu"' in text
    ctl.ok("stack", "validate", stacks)
    api = start_api(ctl, str(stacks))
    ctl.wait_states({"chat-demo": "ready", "other-demo": "offline"})
    body = {"model": "gpt-4o-mini", "prompt": "hi", "max_tokens": 2}
    reply = api.call("POST", "/v1/completions", body)
    assert reply.status == 200, reply.raw
    assert reply.body["model"] == "chat-demo"


def test_imported_llama_cpp_python_model_loads_on_the_real_engine(
    ctl: Slotctl, gguf_path: Path
) -> None:
    """The real llama-cpp-python server, started from an imported llama-swap ``cmd``:
    its ``--model``, ``--n_ctx`` and ``--n_gpu_layers 0`` become the model's source,
    context and a cpu slot, and the slot serves a completion."""
    config = ctl.tmp / "config.yaml"
    config.write_text(
        "models:\n"
        "  tiny:\n"
        f"    cmd: {sys.executable} -m llama_cpp.server --model {gguf_path}"
        " --n_ctx 128 --n_gpu_layers 0 --port ${PORT}\n"
        "hooks:\n  on_startup:\n    preload: [tiny]\n"
    )
    stacks = ctl.tmp / "stacks"
    stacks.mkdir()
    out = ctl.run("import", config, "--output", stacks / "tiny.toml", "--strict")
    assert out.returncode == 0, ctl.explain(out)
    text = (stacks / "tiny.toml").read_text()
    assert 'provider = "llama-cpp-python"' in text and "context_length = 128" in text
    api = start_api(ctl, str(stacks))
    ctl.wait_states({"tiny": "ready"}, timeout=120)
    reply = api.call("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert reply.status == 200, reply.raw
    assert reply.body["choices"]
