"""The dashboard shows a slot's replicas together (issue 38), in a real browser
(headless Chromium through Playwright, as ``test_dashboard.py``): ``chat`` with
``replicas = 2`` lists ``chat`` then ``chat-r1`` right after it (the desired state
publishes a replica after every declared slot), with a ``replica 1 of chat`` tag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import Slotctl, wait_until
from tests.e2e.test_dashboard import CHROMIUM, CHROMIUM_ARGS
from tests.integration.helpers import free_port

STACK = """[stack]
name = "reps"
[[model]]
id = "m-chat"
source = "demo://chat"
memory_gb = 0.1
[[model]]
id = "m-other"
source = "demo://other"
memory_gb = 0.1

[[slot]]
name = "chat"
provider = "demo"
model.default = "m-chat"
device = "cpu"
port = {chat}
autoload = true
replicas = 2

[[slot]]
name = "other"
provider = "demo"
model.default = "m-other"
device = "cpu"
port = {other}
autoload = false
"""


def test_replicas_are_listed_together_with_their_tag(ctl: Slotctl, tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    stacks = ctl.tmp / "stacks"
    stacks.mkdir()
    (stacks / "reps.toml").write_text(STACK.format(chat=free_port(), other=free_port()))
    ctl.start_up(stacks, "--listen", "127.0.0.1:0")

    def listen() -> str | None:
        try:
            value = json.loads((ctl.state / "controller.json").read_text()).get("listen")
        except (OSError, ValueError):
            return None
        return value if value and not value.endswith(":0") else None

    url = f"http://{wait_until(listen, 'the API address')}"
    token = (ctl.state / "token").read_text().strip()
    ctl.wait_states({"chat": "ready", "chat-r1": "ready", "other": "offline"})
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            page.fill("#token-input", token)
            page.click("#token-submit")
            rows = page.locator("#slot-rows tr")
            expect(rows).to_have_count(3)
            names = [rows.nth(i).get_attribute("data-slot") for i in range(3)]
            assert names.index("chat-r1") == names.index("chat") + 1, names  # together
            tag = page.locator('tr[data-slot="chat-r1"] .pin.replica')
            expect(tag).to_have_text("replica 1 of chat")
            expect(page.locator('tr[data-slot="chat"] .pin.replica')).to_have_text(
                "replica 0 of chat"
            )
            expect(page.locator('tr[data-slot="other"] .pin.replica')).to_have_count(0)
            assert not errors, errors
        finally:
            browser.close()
