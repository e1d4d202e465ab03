"""A slot's rollout is in the slot itself (``GET /api/slots/NAME``: ``rollout``), not only
in its events: a client that looks mid-rollout (a dashboard opened then, ``curl``) sees
which way it rolls out, its phase and the new server's state (issue 25, item 1).

Against ``slotctl up STACK_DIR`` with demo servers: a surge (the new server warms beside
the old one, then serves), a surge whose new server fails (the old one keeps serving, the
slot says the rollout failed), and a recreate (``rollout = "recreate"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.test_api import Api, start_api


def stack(*args: str, rollout: str | None = None) -> str:
    way = f'rollout = "{rollout}"\n' if rollout else ""
    extra = ", ".join(f'"{a}"' for a in args)
    return (
        '[stack]\nname = "ro"\n\n'
        '[[model]]\nid = "chat-m"\nsource = "demo://chat"\nmemory_gb = 0.01\n\n'
        '[[slot]]\nname = "chat"\nprovider = "demo"\nmodel.default = "chat-m"\n'
        f'device = "cpu"\nautoload = true\n{way}'
        f"[slot.server]\nextra_args = [{extra}]\n"
    )


def up(ctl: Slotctl, text: str) -> tuple[Api, Path]:
    stacks = ctl.tmp / "stacks"
    stacks.mkdir()
    (stacks / "ro.toml").write_text(text)
    api = start_api(ctl, str(stacks))
    ctl.wait_states({"chat": "ready"})
    return api, stacks / "ro.toml"


def chat(api: Api) -> dict[str, Any]:
    slot: dict[str, Any] = api.ok("GET", "/api/slots/chat")
    return slot


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_a_surge_is_in_the_slot_while_it_runs(ctl: Slotctl) -> None:
    api, file = up(ctl, stack("--load-seconds", "0.2"))
    before = chat(api)
    assert before["rollout"] is None
    old_port = port_of(before["endpoint"])
    file.write_text(stack("--load-seconds", "4"))  # the new server warms for 4 s

    def warming() -> dict[str, Any] | None:
        rollout: dict[str, Any] | None = chat(api)["rollout"]
        return rollout if rollout is not None and rollout["server"] == "warming" else None

    rollout = wait_until(warming, "the surge's new server warming, in the slot", timeout=30)
    assert rollout["way"] == "surge"
    assert rollout["phase"] == "starting"
    assert "beside the running server" in rollout["reason"]
    assert isinstance(rollout["port"], int) and rollout["port"] != old_port
    assert rollout["since"]
    during = chat(api)
    assert during["state"] == "ready"  # the old server serves meanwhile
    assert port_of(during["endpoint"]) == old_port
    listed = {s["name"]: s for s in api.ok("GET", "/api/slots")["slots"]}
    assert listed["chat"]["rollout"] is not None  # the list carries it too

    done = wait_until(
        lambda: (slot := chat(api))["rollout"] is None and slot, "the rollout done", timeout=30
    )
    assert done["state"] == "ready"
    assert port_of(done["endpoint"]) == rollout["port"]  # the new server is the slot's


def test_a_failed_surge_is_in_the_slot(ctl: Slotctl) -> None:
    api, file = up(ctl, stack("--load-seconds", "0.2"))
    old_port = port_of(chat(api)["endpoint"])
    file.write_text(stack("--load-seconds", "0.3", "--fail-on-load"))

    def failed() -> dict[str, Any] | None:
        rollout: dict[str, Any] | None = chat(api)["rollout"]
        return rollout if rollout is not None and rollout["phase"] == "failed" else None

    rollout = wait_until(failed, "the failed rollout, in the slot", timeout=30)
    assert rollout["way"] == "surge"
    assert rollout["server"] == "failed"
    assert "rollout failed" in rollout["message"]
    assert "the old server keeps serving" in rollout["message"]
    slot = chat(api)
    assert slot["state"] == "ready"
    assert port_of(slot["endpoint"]) == old_port


def test_a_recreate_is_in_the_slot_while_it_runs(ctl: Slotctl) -> None:
    api, file = up(ctl, stack("--load-seconds", "0.2", rollout="recreate"))
    file.write_text(stack("--load-seconds", "4", rollout="recreate"))

    def starting() -> dict[str, Any] | None:
        rollout: dict[str, Any] | None = chat(api)["rollout"]
        return rollout if rollout is not None and rollout["phase"] == "starting" else None

    rollout = wait_until(starting, "the recreate's new server starting, in the slot", timeout=30)
    assert rollout["way"] == "recreate"
    assert rollout["reason"] == 'rollout = "recreate"'
    assert rollout["server"] in ("offline", "pulling", "starting", "warming")
    assert rollout["port"] is None
    done = wait_until(
        lambda: (slot := chat(api))["rollout"] is None and slot, "the recreate done", timeout=30
    )
    assert done["state"] == "ready"


def test_dry_run_and_diff_say_which_way_a_change_rolls_out(ctl: Slotctl) -> None:
    """``stack apply --dry-run`` and ``stack diff`` against the running controller: the
    change's way (the controller's decision, with the memory it has), nothing rolled."""
    path = ctl.tmp / "ro.toml"
    path.write_text(stack("--load-seconds", "0.2"))
    api = start_api(ctl)
    ctl.ok("stack", "apply", path, "--wait", "--timeout", "60")
    port = port_of(chat(api)["endpoint"])

    path.write_text(stack("--load-seconds", "0.3"))
    planned = ctl.ok("stack", "apply", path, "--dry-run")
    assert "surge     chat" in planned, planned  # issue 40: a surge is called one
    assert "; surge: " in planned and "beside the running server" in planned, planned
    diff = ctl.run("stack", "diff", path)
    assert "surge: " in diff.stdout and "beside the running server" in diff.stdout, diff.stdout

    path.write_text(stack("--load-seconds", "0.3", rollout="recreate"))
    planned = ctl.ok("stack", "apply", path, "--dry-run")
    assert 'recreate: rollout = "recreate"' in planned, planned
    slot = chat(api)
    assert slot["rollout"] is None and port_of(slot["endpoint"]) == port  # nothing rolled
