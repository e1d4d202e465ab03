"""A LoRA adapter on a real llama.cpp engine, through the router by the adapter's id
(issue 37): a tiny base GGUF and a tiny LoRA adapter GGUF written with the ``gguf``
package (tests/integration/tiny_lora.py), served by llama-cpp-python's server on CPU.

llama-cpp-python's server takes one adapter at start (``--lora_path``) and applies it at
scale 1 to every request, so the adapter's slot serves only the adapter, and a second
slot serves the base model (docs/adapters.md says why this engine rather than a
``llama-server`` built from source). Greedy decoding: the adapter's answer differs from
the base model's, the base model's request never lands on the adapter's slot, and
``base:adapter`` names the same weights.
"""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.conftest import Slotctl
from tests.integration.helpers import free_port
from tests.integration.llama_fixtures import require_llama_server
from tests.integration.test_api import start_api, write_settings


def _slot(name: str, **extra: Any) -> str:
    lines = [
        f'[[slot]]\nname = "{name}"\nprovider = "llama-cpp-python"\nmodel.default = "tiny-base"',
        f'device = "cpu"\nport = {free_port()}\nautoload = true',
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def _complete(api: Any, model: str) -> tuple[int, str, Any]:
    body = {"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    reply = api.call("POST", "/v1/completions", body)
    text = reply.body["choices"][0]["text"] if reply.status == 200 else ""
    return reply.status, text, reply


def test_the_adapter_changes_greedy_output_through_the_router(ctl: Slotctl) -> None:
    require_llama_server()
    from tests.integration.tiny_gguf import write_tiny_llama
    from tests.integration.tiny_lora import write_tiny_lora

    base = write_tiny_llama(ctl.tmp / "tiny-base.gguf")
    lora = write_tiny_lora(ctl.tmp / "tiny-lora.gguf")
    write_settings(ctl.config, cpu_budget_gb=8.0)
    path = ctl.tmp / "lora.toml"
    path.write_text(
        '[stack]\nname = "lora"\n'
        + f'[[model]]\nid = "tiny-base"\nsource = "{base}"\ncontext_length = 128\n'
        + _slot("plain")
        + _slot("tuned", adapters=["tiny-lora"])
        + f'[[adapter]]\nid = "tiny-lora"\nbase = "tiny-base"\nsource = "{lora}"\nrank = 4\n'
        + '[[alias]]\nid = "chat"\nmodels = ["tiny-base"]\nprefer = "spread"\n'
    )
    ctl.ok("stack", "validate", path)
    api = start_api(ctl)
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "120")

    status, plain, reply = _complete(api, "tiny-base")
    assert status == 200, reply.raw
    status, tuned, reply = _complete(api, "tiny-lora")
    assert status == 200, reply.raw
    assert tuned != plain, (tuned, plain)  # the adapter at scale 1 changes greedy output
    for _ in range(3):  # deterministic, and the base never lands on the adapter's slot
        assert _complete(api, "tiny-base")[1] == plain
        assert _complete(api, "tiny-lora")[1] == tuned
    assert _complete(api, "tiny-base:tiny-lora")[1] == tuned
    for _ in range(3):  # an alias of the base model never lands on the adapter's slot either
        assert _complete(api, "chat")[1] == plain
    models = {m["id"]: m for m in api.call("GET", "/v1/models").body["data"]}
    assert models["tiny-lora"]["parent"] == "tiny-base"


def test_a_start_time_adapter_is_pulled_before_its_server_starts(ctl: Slotctl) -> None:
    require_llama_server()
    from tests.e2e.test_model_pull_e2e import use_hub
    from tests.integration.hubserver import HubServer
    from tests.integration.tiny_gguf import write_tiny_llama
    from tests.integration.tiny_lora import write_tiny_lora

    base = write_tiny_llama(ctl.tmp / "tiny-base.gguf")
    lora = write_tiny_lora(ctl.tmp / "built" / "tiny-lora.gguf").read_bytes()
    with HubServer() as hub:
        models = ctl.tmp / "models"
        use_hub(ctl, hub, models)
        hub.add_repo("org/lora", {"tiny-lora.gguf": lora})
        write_settings(ctl.config, cpu_budget_gb=8.0)
        path = ctl.tmp / "lora.toml"
        path.write_text(
            '[stack]\nname = "lora"\n'
            + f'[[model]]\nid = "tiny-base"\nsource = "{base}"\ncontext_length = 128\n'
            + _slot("plain")
            + _slot("tuned", adapters=["tiny-lora"])
            + '[[adapter]]\nid = "tiny-lora"\nbase = "tiny-base"\n'
            + 'source = "hf://org/lora/tiny-lora.gguf"\n'
        )
        api = start_api(ctl)
        ctl.ok("stack", "apply", path, "--wait", "--timeout", "120")
        assert (models / "org" / "lora" / "tiny-lora.gguf").read_bytes() == lora
        plain, tuned = _complete(api, "tiny-base"), _complete(api, "tiny-lora")
        assert plain[0] == tuned[0] == 200 and plain[1] != tuned[1]
        hub.release()
