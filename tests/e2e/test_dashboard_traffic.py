"""The dashboard shows traffic (issue 24), in headless Chromium against a real ``slotctl
up``: each slot's request rate and latency as sparklines from the router's own counters
(``GET /api/traffic``), the queue of a cold slot, the lease flips folded into one
``requests`` line (a toggle shows each), and a slot's log view, following its server's
output. Screenshots go to ``artifacts/`` (as tests/e2e/test_dashboard.py's).
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Slotctl, wait_until
from tests.e2e.test_dashboard import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS
from tests.integration.test_api import Api, model, slot, start_api, write_settings

STACK = (
    '[stack]\nname = "traffic"\n'
    + model("m-chat", 0.2)
    + model("m-slow", 0.2)
    + slot("chat", "m-chat", autoload=True)
    + slot("slow", "m-slow", load_s=8.0)  # cold: its requests queue for 8 s
)


@pytest.fixture
def busy(ctl: Slotctl) -> Iterator[Api]:
    write_settings(ctl.config, cpu_budget_gb=2.0)
    path = ctl.tmp / "traffic.toml"
    path.write_text(STACK)
    ctl.ok("stack", "apply", path)
    api = start_api(ctl)
    api.wait_state("chat", "ready")
    yield api


def chat(api: Api, model_id: str) -> int:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return api.call("POST", "/v1/chat/completions", body, timeout=120).status


def test_dashboard_shows_traffic_the_queue_folded_requests_and_a_log(
    busy: Api, tmp_path: Path
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    api = busy
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 900},
            device_scale_factor=1,
            color_scheme="light",
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.add_init_script(f"localStorage.setItem('slotctl.token', {json.dumps(api.token)})")
            page.goto(api.base)
            expect(page.locator("#conn")).to_have_attribute("data-conn", "live")
            chat_row = page.locator('tr[data-slot="chat"]')
            slow_row = page.locator('tr[data-slot="slow"]')
            expect(chat_row).to_have_attribute("data-state", "ready")

            # the log view of a slot not started yet, then following it as it starts
            slow_row.locator('button[data-action="logs"]').click()
            panel = page.locator("#logs-panel")
            expect(panel).to_be_visible()
            expect(page.locator("#logs-title")).to_have_text("Logs · slow")
            expect(page.locator("#logs-follow")).to_have_attribute("aria-pressed", "true")

            # 30 requests to chat; 3 cold ones to slow, which queue while it loads
            for _ in range(30):
                assert chat(api, "m-chat") == 200
            cold = [threading.Thread(target=chat, args=(api, "m-slow")) for _ in range(3)]
            for thread in cold:
                thread.start()
            expect(slow_row.locator(".queued")).to_have_text("3 queued", timeout=7_000)
            expect(page.locator(".chip.queued")).to_contain_text("3")
            expect(page.locator("#log-lines")).to_contain_text("slotctl-demo", timeout=7_000)

            # rate and latency sparklines of chat, from the sampled counters
            expect(chat_row.locator(".c-req svg.spark")).to_be_visible(timeout=10_000)
            rate = float(chat_row.locator(".c-req").get_attribute("data-rate") or 0)
            assert rate > 0
            expect(chat_row.locator(".c-req .spark-val")).to_contain_text("30")
            expect(chat_row.locator(".c-lat svg.spark")).to_be_visible()
            expect(chat_row.locator(".c-lat .spark-val b")).to_contain_text("ms")

            # the 60 lease flips are one "requests" line; the toggle shows each
            burst = page.locator('#events li[data-kind="requests"][data-slot="chat"]')
            expect(burst).to_have_attribute("data-requests", "30")
            flips = page.locator('#events li[data-kind="transition"]', has_text="serving")
            expect(flips).to_have_count(0)
            page.locator("#flips-toggle").check()
            expect(flips.first).to_be_visible()
            page.locator("#flips-toggle").uncheck()
            expect(flips).to_have_count(0)

            # the table fits the page at 1440 px: no column scrolled out of sight
            sizes = page.evaluate(
                "(w => [w.scrollWidth, w.clientWidth])(document.querySelector('.table-wrap'))"
            )
            assert sizes[0] <= sizes[1], sizes
            page.mouse.move(0, 0)
            page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACTS / "dashboard-traffic.png"), full_page=True)
            page.emulate_media(color_scheme="dark")
            page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACTS / "dashboard-traffic-dark.png"), full_page=True)

            for thread in cold:
                thread.join(timeout=60)
            expect(slow_row).to_have_attribute("data-state", "ready", timeout=30_000)
            expect(slow_row.locator(".queued")).to_have_count(0)
            # still following: the slow server's ready line arrived after its start
            expect(page.locator("#log-lines")).to_contain_text("slotctl-demo ready")
            page.locator("#logs-close").click()
            expect(panel).to_be_hidden()
            assert not errors, errors
        finally:
            browser.close()
    wait_until(lambda: (ARTIFACTS / "dashboard-traffic.png").exists(), "the screenshot")
    shutil.copy(ARTIFACTS / "dashboard-traffic.png", tmp_path / "dashboard-traffic.png")
    assert (ARTIFACTS / "dashboard-traffic.png").stat().st_size > 10_000
