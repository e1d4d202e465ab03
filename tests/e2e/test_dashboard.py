"""The dashboard in a real browser: headless Chromium (Debian ``chromium``) driven by
Playwright's Python package, against ``slotctl up --listen 127.0.0.1:0`` as a subprocess.

The page asks for the token, lists the slots, and follows the event stream: a slot loaded
with its Load button goes ``warming`` -> ``ready`` and, after Unload, ``offline``, with no
page reload. Screenshots (light and dark) go to ``artifacts/`` under the repository root
(git-ignored) for a person to look at. Playwright never downloads a browser here: it is
pointed at ``/usr/bin/chromium``; without it the test fails (``apt-get install chromium``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO, Slotctl, wait_until
from tests.integration.helpers import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "artifacts"


def dashboard_stack() -> str:
    """Four demo slots: two autoload (one pinned), ``coder`` loads in 2 s on demand."""
    slots: list[dict[str, Any]] = [
        {"name": "chat", "model": "llama-3.1-8b-demo", "gb": 0.6, "autoload": True, "prio": 80},
        {"name": "coder", "model": "qwen2.5-coder-7b-demo", "gb": 0.5, "load": 2, "prio": 40},
        {
            "name": "embed",
            "model": "bge-small-demo",
            "gb": 0.15,
            "autoload": True,
            "prio": 60,
            "pinned": True,
            "type": "embedding",
        },
        {"name": "vision", "model": "qwen2-vl-2b-demo", "gb": 0.7, "prio": 30},
    ]
    out = ['[stack]\nname = "dashboard"\n']
    for s in slots:
        kind = '\nkind = "embedding"' if s.get("type") == "embedding" else ""
        out.append(
            f'[[model]]\nid = "{s["model"]}"\nsource = "demo://{s["name"]}"\n'
            f"memory_gb = {s['gb']}{kind}\n"
        )
    for s in slots:
        args = ["--load-seconds", str(s.get("load", 0.3))]
        extra = f'type = "{s["type"]}"\n' if "type" in s else ""
        out.append(
            f'\n[[slot]]\nname = "{s["name"]}"\nprovider = "demo"\n'
            f'model.default = "{s["model"]}"\ndevice = "cpu"\nport = {free_port()}\n'
            f"autoload = {str(s.get('autoload', False)).lower()}\n"
            f"pinned = {str(s.get('pinned', False)).lower()}\n"
            f"priority = {s['prio']}\n{extra}"
            f"[slot.server]\nextra_args = {json.dumps(args)}\n"
        )
    # an alias: the panel says which member a request for it would go to now
    out.append(
        '\n[[alias]]\nid = "assistant"\nmodels = ["qwen2.5-coder-7b-demo", "llama-3.1-8b-demo"]\n'
    )
    # a LoRA adapter: the Adapters panel lists it with its base (resident nowhere yet)
    out.append(
        '\n[[adapter]]\nid = "tone"\nbase = "llama-3.1-8b-demo"\nsource = "/srv/tone"\n'
        "pinned = true\n"
    )
    return "".join(out)


@pytest.fixture
def controller(ctl: Slotctl) -> Iterator[tuple[str, str]]:
    """``slotctl up STACK_DIR --listen 127.0.0.1:0``: yields (base URL, token)."""
    stacks = ctl.tmp / "stacks"
    stacks.mkdir()
    (stacks / "dashboard.toml").write_text(dashboard_stack())
    ctl.config.mkdir(parents=True)
    (ctl.config / "controller.toml").write_text("[memory_budget_gb]\ncpu = 3.0\n")
    ctl.start_up(stacks, "--listen", "127.0.0.1:0")

    def listen() -> str | None:
        try:
            record = json.loads((ctl.state / "controller.json").read_text())
        except (OSError, ValueError):
            return None
        value = record.get("listen")
        return value if value and not value.endswith(":0") else None

    address = wait_until(listen, "the API address in controller.json")
    token = (ctl.state / "token").read_text().strip()
    ctl.wait_states({"chat": "ready", "embed": "ready", "coder": "offline"})
    yield f"http://{address}", token


def test_dashboard_follows_a_load_and_an_unload_live(
    controller: tuple[str, str], tmp_path: Path
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    url, token = controller
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh user-data dir
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 820},
            device_scale_factor=1,
            color_scheme="light",
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on(
                "console",
                lambda msg: errors.append(msg.text) if msg.type == "error" else None,
            )
            navigations: list[str] = []
            page.on("framenavigated", lambda frame: navigations.append(frame.url))

            page.goto(url)
            # the token, once: asked by the page, kept in localStorage
            expect(page.locator("#token-dialog")).to_be_visible()
            page.fill("#token-input", "wrong")
            page.click("#token-submit")
            expect(page.locator("#token-error")).to_be_visible()
            page.fill("#token-input", token)
            page.click("#token-submit")
            expect(page.locator("#token-dialog")).to_be_hidden()
            assert page.evaluate("localStorage.getItem('slotctl.token')") == token
            errors.clear()  # the wrong token's 401 was expected

            rows = page.locator("#slot-rows tr")
            expect(rows).to_have_count(4)
            chat = page.locator('tr[data-slot="chat"]')
            coder = page.locator('tr[data-slot="coder"]')
            expect(chat).to_have_attribute("data-state", "ready")
            expect(coder).to_have_attribute("data-state", "offline")
            expect(page.locator("#conn")).to_have_attribute("data-conn", "live")
            expect(page.locator('tr[data-slot="embed"] .pin')).to_have_text("pinned")
            expect(page.locator('.device-card[data-device="cpu"]')).to_be_visible()
            serves = page.locator('tr[data-alias="assistant"] td').nth(3)
            expect(serves).to_have_text("llama-3.1-8b-demo")  # coder is not loaded yet
            tone = page.locator('tr[data-adapter="tone"] td')
            expect(tone.nth(0)).to_have_text("tone (pinned)")
            expect(tone.nth(1)).to_have_text("llama-3.1-8b-demo")
            expect(tone.nth(3)).to_have_text("—")
            page.evaluate("window.__sameDocument = true")  # gone if the page reloads
            loads_before = len(navigations)

            # Load: warming, then ready, from the event stream
            coder.locator('button[data-action="load"]').click()
            expect(coder).to_have_attribute("data-state", "warming", timeout=10_000)
            expect(coder.locator(".badge")).to_have_text("warming")
            expect(coder).to_have_attribute("data-state", "ready", timeout=30_000)
            expect(page.locator('#events li[data-kind="transition"]').first).to_be_visible()
            expect(page.locator("#events")).to_contain_text("coder")
            expect(coder.locator('button[data-action="load"]')).to_be_disabled()
            expect(serves).to_have_text("qwen2.5-coder-7b-demo", timeout=10_000)  # warm now
            expect(page.locator(".toast")).to_have_count(0, timeout=10_000)  # for the picture
            page.mouse.move(0, 0)  # no hover highlight in the picture
            page.wait_for_timeout(500)  # let the memory bars settle
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

            page.emulate_media(color_scheme="dark")
            page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACTS / "dashboard-dark.png"), full_page=True)
            page.emulate_media(color_scheme="light")

            # Unload: offline, still without a reload
            coder.locator('button[data-action="unload"]').click()
            expect(coder).to_have_attribute("data-state", "offline", timeout=30_000)
            expect(page.locator("#events")).to_contain_text("offline")
            assert page.evaluate("window.__sameDocument === true")
            assert len(navigations) == loads_before, navigations
            page.screenshot(path=str(tmp_path / "after-unload.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    shutil.copy(ARTIFACTS / "dashboard.png", tmp_path / "dashboard.png")
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_one_time_login_link(controller: tuple[str, str], ctl: Slotctl, tmp_path: Path) -> None:
    """A one-time link (`slotctl dashboard`'s, as `up`'s on a terminal) logs the page in
    once, then leaves the address bar;
    used again (another browser) it is refused and the page asks for the token."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    url, token = controller
    link = ctl.ok("dashboard").strip()  # `up`'s output is a file here: it prints no link
    assert link.startswith(f"{url}/#login=") and token not in ctl.controller_log()
    with sync_playwright() as pw:
        for attempt, profile in enumerate(("first", "second")):
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            try:
                page = browser.new_page()
                page.goto(link)
                if attempt == 0:
                    expect(page.locator("#slot-rows tr")).to_have_count(4)
                    expect(page.locator("#token-dialog")).to_be_hidden()
                    assert page.evaluate("localStorage.getItem('slotctl.token')") == token
                    assert "login=" not in page.url
                    page.go_back()  # the entry was replaced: the code is not in the history
                    assert "login=" not in page.url
                else:  # one use only
                    expect(page.locator("#token-dialog")).to_be_visible()
                    expect(page.locator("#token-error")).to_contain_text("used or expired")
                    assert page.evaluate("localStorage.getItem('slotctl.token')") is None
            finally:
                browser.close()


def test_the_slot_table_fits_a_1400_px_window(controller: tuple[str, str], tmp_path: Path) -> None:
    """Issue 40, item 14: at 1,400 px the slot table overflowed its panel (a scroll bar
    across the panel, the actions column out of sight). The table and its rows
    fit the window: nothing is wider than the page, and no column is out of sight."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    url, token = controller
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 820},
            device_scale_factor=1,
        )
        try:
            page = browser.new_page()
            page.goto(url)
            page.fill("#token-input", token)
            page.click("#token-submit")
            for name in ("chat", "coder", "embed", "vision"):
                expect(page.locator(f'tr[data-slot="{name}"]')).to_be_visible()
            expect(page.locator('tr[data-slot="chat"]')).to_have_attribute("data-state", "ready")
            sizes = page.evaluate(
                """() => {
                    const row = document.querySelector('tr[data-slot="chat"]');
                    const table = row.closest('table');
                    const box = table.parentElement;
                    const doc = document.documentElement;
                    return {page: doc.scrollWidth, window: window.innerWidth,
                            table: table.scrollWidth, box: box.clientWidth,
                            right: table.getBoundingClientRect().right};
                }"""
            )
            assert sizes["page"] <= sizes["window"], sizes
            assert sizes["table"] <= sizes["box"], sizes
            assert sizes["right"] <= sizes["window"], sizes
        finally:
            browser.close()
