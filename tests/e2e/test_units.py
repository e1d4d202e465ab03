"""Co-loaded units as a user runs them (docs/design/0013): ``slotctl up`` a stack with a
``[[unit]]``, a request for one member loads both, the dry run explains the unit, and
taking the unit out is an in-place change (no server restarts)."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.test_api import model, start_api, write_settings


def slot(name: str, model_id: str, **extra: str) -> str:
    lines = [f'[[slot]]\nname = "{name}"\nprovider = "demo"\ndevice = "cpu"']
    lines.append(f'model.default = "{model_id}"\nautoload = false')
    lines += [f"{k} = {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def write_stack(path: Path, unit: bool) -> None:
    text = '[stack]\nname = "units"\n' + model("chat-m", 2) + model("embed-m", 1, kind="embedding")
    text += slot("chat", "chat-m") + slot("embed", "embed-m", type='"embedding"')
    if unit:
        text += '[[unit]]\nname = "rag"\nslots = ["chat", "embed"]\n'
    path.write_text(text)


def test_a_unit_from_a_stack_file(ctl: Slotctl, tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    write_stack(stacks / "units.toml", unit=True)
    write_settings(ctl.config, cpu_budget_gb=8)
    api = start_api(ctl, str(stacks))
    api.wait_state("chat", "offline")
    plan = ctl.run("slot", "load", "embed", "--dry-run")
    assert plan.returncode == 0, ctl.explain(plan)
    assert "unit rag: chat, embed load together" in plan.stdout, plan.stdout
    body = {"model": "embed-m", "input": "hello"}
    reply = api.call("POST", "/v1/embeddings", body, timeout=60)
    assert reply.status == 200, reply
    chat = api.slot("chat")
    assert chat["state"] in ("ready", "idle") and chat["unit"] == "rag"
    assert 'unit = "rag"' in (ctl.config / "slots" / "chat.toml").read_text()
    diff = ctl.run("stack", "diff", stacks, "--exit-code")
    assert diff.returncode == 0, ctl.explain(diff)
    pids = ctl.pids()
    # out of the unit (GitOps picks the file up): applied in place, no server restarts
    write_stack(stacks / "units.toml", unit=False)
    wait_until(lambda: api.slot("chat")["unit"] is None, "the unit to be gone", timeout=30)
    ctl.wait_log("update    in place, no restart: unit rag -> unset")
    assert api.slot("chat")["state"] in ("ready", "idle")
    assert ctl.pids() == pids
