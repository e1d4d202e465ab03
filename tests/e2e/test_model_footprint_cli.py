"""``slotctl model footprint ID`` through a real ``slotctl up`` (issue 36): a GGUF model
without ``memory_gb`` is explained part by part from its file, a declared one says so;
the dry run carries the same footprint."""

from __future__ import annotations

import json

from tests.e2e.conftest import Slotctl
from tests.integration.helpers import free_port
from tests.integration.panel_gguf import PANEL, write_llama
from tests.integration.test_api import model, slot, start_api, write_settings


def test_model_footprint_explains_each_part(ctl: Slotctl) -> None:
    gguf = write_llama(ctl.tmp / "s.gguf", PANEL[0])
    stack = (
        '[stack]\nname = "foot"\n'
        + f'[[model]]\nid = "tiny"\nsource = "{gguf}"\ncontext_length = 2048\n'
        + model("m-demo", 0.5)
        + '[[slot]]\nname = "chat"\nprovider = "llamacpp"\nmodel.default = "tiny"\n'
        + f'device = "cpu"\nport = {free_port()}\nautoload = false\n'
        + slot("demo", "m-demo")
    )
    write_settings(ctl.config, cpu_budget_gb=64.0)
    path = ctl.tmp / "foot.toml"
    path.write_text(stack)
    ctl.ok("stack", "apply", path)
    start_api(ctl)

    text = ctl.ok("model", "footprint", "tiny")
    assert "slot chat (llamacpp, device cpu):" in text and "(estimated)" in text
    for part in ("weights", "KV cache", "at context 2048", "buffers", "host memory", "f32"):
        assert part in text, text
    assert "--cache-ram" in text  # llama-server's host prompt cache, said
    data = json.loads(ctl.ok("model", "footprint", "tiny", "-o", "json"))
    [fp] = data["slots"]
    assert fp["basis"] == "estimated" and fp["source"] == "gguf" and fp["context"] == 2048
    assert fp["admitted_bytes"] == fp["estimated_bytes"] > fp["weights_bytes"] > 0

    declared = json.loads(ctl.ok("model", "footprint", "m-demo", "-o", "json"))["slots"][0]
    assert declared["basis"] == "declared" and declared["declared_bytes"] == 2**29
    assert declared["why_not"].startswith("no model file")

    plan = ctl.ok("slot", "load", "chat", "--dry-run")
    assert "footprint:" in plan and "(estimated)" in plan
