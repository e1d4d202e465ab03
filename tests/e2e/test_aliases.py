"""Aliases end to end (issue 25, item 3): ``stack validate`` refuses a bad ``[[alias]]``,
``stack apply`` writes one, ``stack diff`` shows ``=== aliases``, ``slotctl up`` routes a
request for it to the warm member, ``model list`` shows it, and an apply without it
removes it — through the real CLI as subprocesses and real demo servers.
"""

from __future__ import annotations

import json

from controller.spec.loader import load_stack_texts, load_stacks
from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.test_api import model, slot, start_api, write_settings

ALIAS = '[[alias]]\nid = "chat"\nmodels = ["m-big", "m-small"]\nprefer = "warm"\n'


def stack_text(*parts: str) -> str:
    return (
        '[stack]\nname = "al"\n'
        + model("m-big", 0.05)
        + model("m-small", 0.05)
        + slot("big", "m-big")
        + slot("small", "m-small", autoload=True)
        + "".join(parts)
    )


def test_an_alias_from_validate_to_a_routed_request(ctl: Slotctl) -> None:
    write_settings(ctl.config, cpu_budget_gb=4.0)
    path = ctl.tmp / "al.toml"

    path.write_text(stack_text(ALIAS.replace('"m-small"]', '"m-smol"]')))
    result = ctl.run("stack", "validate", path)
    assert result.returncode != 0, ctl.explain(result)
    assert "alias.unknown_member" in result.stdout + result.stderr
    assert "did you mean 'm-small'?" in result.stdout + result.stderr
    result = ctl.run("stack", "apply", path)
    assert result.returncode != 0 and not (ctl.config / "models.toml").exists()

    path.write_text(stack_text(ALIAS))
    ctl.ok("stack", "validate", path)
    planned = ctl.ok("stack", "apply", path, "--dry-run")  # no controller: the files' plan
    assert "create    alias chat -> m-big, m-small (prefer warm)" in planned, planned
    assert not (ctl.config / "models.toml").exists()  # nothing written
    api = start_api(ctl)
    planned = ctl.ok("stack", "apply", path, "--dry-run")  # the controller's plan
    assert "create    alias chat -> m-big, m-small (prefer warm)" in planned, planned
    assert "dry run: nothing written" in planned
    diff = ctl.run("stack", "diff", path)
    assert "=== aliases" in diff.stdout and "+ chat -> m-big, m-small (prefer warm)" in diff.stdout
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")
    assert json.loads(ctl.ok("stack", "diff", path, "-o", "json", "--exit-code"))["in_sync"]

    def listed() -> dict[str, object] | None:
        data = api.call("GET", "/v1/models").body["data"]
        return next((e for e in data if e["id"] == "chat"), None)

    entry = wait_until(listed, "the alias in /v1/models")
    assert entry["alias"] is True and entry["members"] == ["m-big", "m-small"]
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = api.call("POST", "/v1/chat/completions", body)
    assert reply.status == 200, reply.raw
    assert reply.body["model"] == "m-small"  # the resident member served it
    assert ctl.states()["big"] == "offline"
    table = ctl.ok("model", "list")
    assert "ALIAS" in table and "chat" in table and "m-small" in table.split("chat", 1)[1]

    # the live config dir exports back to a stack file with the same alias
    exported = load_stack_texts([("al.toml", ctl.ok("stack", "export", "--stack", "al"))])
    assert exported.state is not None, exported.errors
    assert exported.state.aliases["chat"].spec == load_stacks([path]).state.aliases["chat"].spec
    assert "[[alias]]" in ctl.ok("stack", "show", path)

    path.write_text(stack_text(ALIAS.replace('"warm"', '"first"')))
    planned = ctl.ok("stack", "apply", path, "--dry-run")
    assert "update    alias chat -> m-big, m-small (prefer first)" in planned, planned
    assert "(no changes)" not in planned
    path.write_text(stack_text())
    diff = ctl.run("stack", "diff", path)
    assert "- chat" in diff.stdout
    assert "delete    alias chat" in ctl.ok("stack", "apply", path, "--dry-run")
    ctl.ok("stack", "apply", path)
    wait_until(lambda: listed() is None, "the alias to be gone from /v1/models")
    reply = api.call("POST", "/v1/chat/completions", body)
    assert reply.status == 404
