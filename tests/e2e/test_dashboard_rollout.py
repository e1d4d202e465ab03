"""The dashboard shows which way a change rolls out, and the surge's phases, live.

Headless Chromium against ``slotctl up STACK_DIR``: a slot whose server args change is
planned ``surge: ... beside the running server``; the slot's row says so while the new
server starts, and the line goes once the rollout is done.

The new server is held in ``warming`` by a gate (the demo's ``--load-until PATH``) until
the page has looked, then let go: what is asserted waits on state, never on a load's
seconds (issue 40, item 16: on a busy machine the page looked after an 8 s surge had
moved on).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.conftest import Slotctl, wait_until
from tests.e2e.test_dashboard import CHROMIUM, CHROMIUM_ARGS


def stack(load_s: float, *, gate: Path | None = None) -> str:
    """A changed ``gate`` (or load time) is a runtime change: a surge. With a gate the
    new server loads until the gate file exists."""
    held = f', "--load-until", "{gate}"' if gate is not None else ""
    return (
        '[stack]\nname = "dash"\n\n'
        '[[model]]\nid = "chat-m"\nsource = "demo://chat"\nmemory_gb = 0.01\n\n'
        '[[slot]]\nname = "chat"\nprovider = "demo"\nmodel.default = "chat-m"\n'
        'device = "cpu"\nautoload = true\n'
        f'[slot.server]\nextra_args = ["--load-seconds", "{load_s:g}"{held}]\n'
    )


def test_the_dashboard_shows_a_surge(ctl: Slotctl, tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    stacks = ctl.tmp / "stacks"
    stacks.mkdir()
    (stacks / "dash.toml").write_text(stack(0.2))
    ctl.start_up(stacks, "--listen", "127.0.0.1:0")

    def listen() -> str | None:
        try:
            value = json.loads((ctl.state / "controller.json").read_text()).get("listen")
        except (OSError, ValueError):
            return None
        return value if value and not value.endswith(":0") else None

    address = wait_until(listen, "the API address in controller.json")
    token = (ctl.state / "token").read_text().strip()
    ctl.wait_states({"chat": "ready"})
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page()
            page.goto(f"http://{address}")
            page.fill("#token-input", token)
            page.click("#token-submit")
            chat = page.locator('tr[data-slot="chat"]')
            expect(chat).to_have_attribute("data-state", "ready")
            expect(chat.locator(".slot-rollout")).to_have_count(0)
            gate = tmp_path / "gate"
            (stacks / "dash.toml").write_text(stack(0.2, gate=gate))  # held until the gate
            line = chat.locator(".slot-rollout")
            expect(line).to_have_text(re.compile(r"^surge"), timeout=30_000)  # not "recreate:"
            gate.touch()  # the page has seen the surge: the new server may finish
            expect(line).to_have_count(0, timeout=60_000)  # done: the line goes
            expect(chat).to_have_attribute("data-state", "ready")
            expect(page.locator('#events li[data-kind="rollout"]').first).to_be_visible()
        finally:
            browser.close()


def test_a_page_opened_mid_rollout_shows_it(ctl: Slotctl, tmp_path: Path) -> None:
    """The rollout line on the first render, from ``GET /api/slots`` alone: the event
    stream is cut off, so no replayed ``plan``/``rollout`` event can draw it."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import Route, expect, sync_playwright

    from tests.integration.test_api import start_api

    stacks = ctl.tmp / "stacks"
    stacks.mkdir()
    (stacks / "dash.toml").write_text(stack(0.2))
    api = start_api(ctl, str(stacks))
    ctl.wait_states({"chat": "ready"})
    gate = tmp_path / "gate"
    (stacks / "dash.toml").write_text(stack(0.2, gate=gate))  # warming until the gate
    wait_until(
        lambda: (api.ok("GET", "/api/slots/chat")["rollout"] or {}).get("server") == "warming",
        "the surge under way",
        timeout=60,
    )

    def no_events(route: Route) -> None:
        route.abort()

    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page()
            page.route("**/api/events*", no_events)
            page.goto(api.base)
            page.fill("#token-input", api.token)
            page.click("#token-submit")
            chat = page.locator('tr[data-slot="chat"]')
            expect(chat).to_have_attribute("data-state", "ready")  # the old server serves
            line = chat.locator(".slot-rollout")
            expect(line).to_have_text(
                re.compile(r"^surge starting: new server warming on port \d+")
            )
            expect(page.locator('#events li[data-kind="rollout"]')).to_have_count(0)
        finally:
            browser.close()
    gate.touch()  # the page has looked: the surge may finish
    wait_until(lambda: api.ok("GET", "/api/slots/chat")["rollout"] is None, "the rollout done", 60)
