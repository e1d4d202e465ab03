"""The dashboard explains a slot's footprint (issue 36 item 3): headless Chromium against
``slotctl up`` with a slot whose model is a generated GGUF without ``memory_gb`` and a demo
slot that declares one. A slot's Memory cell opens the footprint view, fed by
``GET /api/models/{id}/footprint``: the GGUF slot's weights (by type, layers on the
device), its KV cache at the slot's context, buffers and host memory, then the declared,
estimated and observed figures and the one admission counts — each with the API's
figure; the loaded demo slot's view says what was seen (its process tree's RSS) and that
the declared figure counts. A screenshot goes to ``artifacts/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Slotctl, wait_until
from tests.e2e.test_dashboard import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS
from tests.integration.helpers import free_port
from tests.integration.panel_gguf import PANEL, write_llama
from tests.integration.test_api import model, slot, start_api, write_settings


def _figure(row: Any) -> int | None:
    raw = row.get_attribute("data-bytes")
    return int(raw) if raw else None


def test_the_dashboard_shows_each_part_of_a_footprint(ctl: Slotctl, tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    from playwright.sync_api import expect, sync_playwright

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
    api = start_api(ctl)
    api.call("POST", "/api/slots/demo/load")
    api.wait_state("demo", "ready", "serving", "idle")

    def seen_demo() -> dict[str, Any] | None:
        [fp] = api.ok("GET", "/api/models/m-demo/footprint")["slots"]
        return fp if fp["observed_bytes"] else None

    wait_until(seen_demo, "the demo server's use to be learnt", 30)
    [tiny] = api.ok("GET", "/api/models/tiny/footprint")["slots"]
    assert tiny["basis"] == "estimated" and tiny["source"] == "gguf"

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
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.goto(api.base)
            page.fill("#token-input", api.token)
            page.click("#token-submit")
            panel = page.locator("#fp-panel")
            expect(panel).to_be_hidden()

            # The GGUF slot, not loaded: admitted by its estimate, part by part.
            page.locator('tr[data-slot="chat"] button[data-action="footprint"]').click()
            expect(panel).to_be_visible()
            expect(page.locator("#fp-title")).to_have_text("Footprint · chat")
            rows = panel.locator("tr[data-part]")
            expect(rows).to_have_count(8, timeout=15_000)
            want = {
                "weights": tiny["weights_bytes"],
                "kv": tiny["kv_bytes"],
                "buffers": tiny["buffers_bytes"],
                "host": tiny["host_bytes"],
                "declared": None,
                "estimated": tiny["estimated_bytes"],
                "observed": None,
                "admitted": tiny["admitted_bytes"],
            }
            shown = {str(r.get_attribute("data-part")): _figure(r) for r in rows.element_handles()}
            assert shown == want, (shown, want)
            assert tiny["weights_bytes"] > 0 and tiny["kv_bytes"] > 0 and tiny["buffers_bytes"] > 0
            weights = panel.locator('tr[data-part="weights"]')
            for word in ("f32", f"{tiny['layers_on_device']}/{tiny['layers']} layers"):
                expect(weights).to_contain_text(word)
            kv = panel.locator('tr[data-part="kv"]')
            expect(kv).to_contain_text("at context 2048")
            expect(kv).to_contain_text(f"parallel {tiny['parallel']}")
            expect(panel.locator('tr[data-part="host"]')).to_contain_text("prompt cache")
            expect(panel.locator('tr[data-part="declared"]')).to_contain_text("no memory_gb")
            expect(panel.locator('tr[data-part="observed"]')).to_contain_text("not seen yet")
            admitted = panel.locator('tr[data-part="admitted"]')
            expect(admitted).to_have_attribute("data-basis", "estimated")
            expect(admitted).to_contain_text("the estimate from the model file")
            expect(panel.locator("tr.fp-used")).to_have_attribute("data-part", "estimated")
            page.mouse.move(0, 0)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-footprint.png"), full_page=True)

            # The demo slot, loaded: declared counts; what its server held is shown.
            page.locator('tr[data-slot="demo"] button[data-action="footprint"]').click()
            expect(page.locator("#fp-title")).to_have_text("Footprint · demo")
            expect(panel.locator('[data-part="no-estimate"]')).to_contain_text("no model file")
            declared = panel.locator('tr[data-part="declared"]')
            expect(declared).to_have_attribute("data-bytes", str(2**29))
            expect(panel.locator("tr.fp-used")).to_have_attribute("data-part", "declared")
            expect(panel.locator('tr[data-part="admitted"]')).to_have_attribute(
                "data-basis", "declared"
            )
            observed = panel.locator('tr[data-part="observed"]')
            expect(observed).to_contain_text("rss")
            figure = _figure(observed.element_handle())
            assert figure is not None and figure > 0

            page.locator("#fp-close").click()
            expect(panel).to_be_hidden()
            assert not errors, errors
        finally:
            browser.close()
