"""The dashboard shows a pulling slot's progress (issue 35): headless Chromium against
``slotctl up`` whose slot's model is pulled from the hub server of
``tests/integration/hubserver.py``, held halfway. The slot's row shows ``pulling`` with a
bar, bytes done of total, rate and ETA, live from the progress events; once released, the
row goes on to ``ready`` without a page reload. A screenshot goes to ``artifacts/``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Slotctl, wait_until
from tests.e2e.test_dashboard import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS
from tests.e2e.test_model_pull_e2e import Api, partial_bytes, stack, use_hub, write_stack
from tests.integration.hubserver import HubServer

MIB = 1024 * 1024


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server
        server.release()


def test_the_dashboard_shows_a_pulling_slots_bar_rate_and_eta(
    ctl: Slotctl, hub: HubServer, tmp_path: Path
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    models = ctl.tmp / "models"
    use_hub(ctl, hub, models)
    block = hashlib.sha256(b"weights").digest() * 2048
    data = (block * (24 * MIB // len(block) + 1))[: 24 * MIB]
    hub.add_repo("org/w", {"w.gguf": data})
    hub.fault("w.gguf", hold_at=12 * MIB)
    stacks = write_stack(ctl, stack({"w": "hf://org/w/w.gguf"}, [("big", "w", "demo")]))
    ctl.start_up(stacks)
    ctl.wait_states({"big": "offline"})
    api = Api(ctl)
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 700},
            device_scale_factor=1,
            color_scheme="light",
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.goto(f"http://{api.host}:{api.port}")
            page.fill("#token-input", api.token)
            page.click("#token-submit")
            row = page.locator('tr[data-slot="big"]')
            expect(row).to_have_attribute("data-state", "offline")
            page.evaluate("window.__sameDocument = true")

            row.locator('button[data-action="load"]').click()
            assert hub.held.wait(120), "the pull never reached the hold"
            wait_until(lambda: partial_bytes(models) >= 10 * MIB, "10 MiB on disk", 60)
            expect(row).to_have_attribute("data-state", "pulling", timeout=30_000)
            pull = row.locator(".slot-pull")
            expect(pull).to_be_visible(timeout=30_000)
            # 10 of 24 MiB on disk: about 41.7 %, its bytes, a rate and an ETA
            expect(pull.locator(".pull-text")).to_contain_text("%", timeout=30_000)
            expect(pull.locator(".pull-text")).to_contain_text("/ 24.0 MiB", timeout=30_000)
            expect(pull.locator(".pull-text")).to_contain_text("/s", timeout=30_000)
            expect(pull.locator(".pull-text")).to_contain_text("ETA", timeout=30_000)
            percent = float(pull.get_attribute("data-percent") or "0")
            assert 40 <= percent <= 50, percent
            width = page.evaluate(
                "document.querySelector('tr[data-slot=\"big\"] .pull-fill').style.width"
            )
            assert width.endswith("%") and 40 <= float(width[:-1]) <= 50, width
            page.mouse.move(0, 0)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-pulling.png"), full_page=True)

            hub.release()
            expect(row).to_have_attribute("data-state", "ready", timeout=60_000)
            expect(row.locator(".slot-pull")).to_have_count(0)
            assert page.evaluate("window.__sameDocument === true")
            assert not errors, errors
        finally:
            hub.release()  # before the controller stops: its transfer is not left held
            browser.close()
