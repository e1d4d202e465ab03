"""``slotctl key`` against a real ``slotctl up`` (issue 23), and the dashboard's keys
panel in headless Chromium: a key created by the CLI (printed once) works at once,
``key list`` shows its last use and never a secret, the dashboard shows each key's class
and the requests waiting by class, and a revoked key is refused at once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.e2e.conftest import Slotctl
from tests.e2e.test_dashboard import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS
from tests.e2e.test_dashboard_traffic import STACK
from tests.integration.test_api import Api, start_api, write_settings


def _chat(api: Api, key: str, model_id: str) -> int:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return api.call("POST", "/v1/chat/completions", body, token=key, timeout=120).status


def test_keys_from_the_cli_and_the_dashboards_keys_panel(ctl: Slotctl, tmp_path: Path) -> None:
    write_settings(ctl.config, cpu_budget_gb=2.0)
    (ctl.tmp / "keys.toml").write_text(STACK)
    ctl.ok("stack", "apply", ctl.tmp / "keys.toml")
    api = start_api(ctl)
    api.wait_state("chat", "ready")

    ui = ctl.ok("key", "create", "chat-ui", "--priority", "interactive").strip()
    ci = ctl.ok("key", "create", "ci", "--priority", "batch", "--rpm", "100").strip()
    assert ui.startswith("sk-slotctl-") and ci.startswith("sk-slotctl-") and ui != ci
    keys_file = (ctl.state / "keys.json").read_text()
    assert ui not in keys_file and ci not in keys_file
    assert _chat(api, ui, "m-chat") == 200  # accepted at once, no restart
    listing = ctl.ok("key", "list")
    assert "chat-ui" in listing and "ago" in listing and ui not in listing
    rows = {k["name"]: k for k in json.loads(ctl.ok("key", "list", "-o", "json"))["keys"]}
    assert rows["chat-ui"]["last_used"] is not None and rows["ci"]["last_used"] is None
    assert rows["ci"]["rpm"] == 100 and rows["ci"]["priority"] == "batch"
    refused = ctl.run("key", "create", "chat-ui")
    assert refused.returncode == 2 and "exists" in refused.stderr

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    cold = threading.Thread(target=_chat, args=(api, ci, "m-slow"))  # waits 8 s, batch
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 900},
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.add_init_script(f"localStorage.setItem('slotctl.token', {json.dumps(api.token)})")
            page.goto(api.base)
            expect(page.locator("#conn")).to_have_attribute("data-conn", "live")
            row = page.locator('#key-rows tr[data-key="chat-ui"]')
            expect(row).to_contain_text("interactive")
            expect(row).to_contain_text("ago")
            expect(page.locator('#key-rows tr[data-key="ci"]')).to_contain_text("never")
            cold.start()
            expect(page.locator("#queue-by-class")).to_contain_text("batch 1", timeout=6_000)
            page.screenshot(path=str(ARTIFACTS / "dashboard-keys.png"), full_page=True)
            cold.join(timeout=60)
            expect(page.locator("#queue-by-class")).to_contain_text("batch 0", timeout=6_000)
            expect(page.locator('#key-rows tr[data-key="ci"]')).to_contain_text("ago")
            assert not errors, errors
        finally:
            browser.close()

    ctl.ok("key", "revoke", "ci")
    assert _chat(api, ci, "m-chat") == 401
    gone = ctl.run("key", "revoke", "ci")
    assert gone.returncode == 2 and "key.not_found" in gone.stderr
