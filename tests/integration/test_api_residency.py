"""Residency through the real API (issue 10): loads answer at once, a failed model's wish
is cleared by its unload, refusals are reported once, a prune spares pinned slots.

``slotctl up`` as a subprocess on the process runtime with demo servers, as in
``test_api.py`` (whose harness this reuses).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.helpers import free_port
from tests.integration.test_api import (
    Api,
    apply,
    assert_typed,
    model,
    slot,
    start_api,
    write_settings,
)


def failing_slot(name: str, model_id: str) -> str:
    return (
        f'[[slot]]\nname = "{name}"\nprovider = "demo"\nmodel.default = "{model_id}"\n'
        f'device = "cpu"\nport = {free_port()}\nautoload = false\n'
        # one failure opens the breaker: no retry moves the count the tests read
        "max_consecutive_failures = 1\n"
        '[slot.server]\nextra_args = ["--load-seconds", "0.2", "--fail-on-load"]\n'
    )


PIN = slot("pin", "m-pin", pinned=True)
STACK_NO_PIN = (
    '[stack]\nname = "res"\n'
    + model("m-slow", 0.2)
    + model("m-fail", 0.2)
    + model("m-pin", 0.1)
    + slot("slow", "m-slow", load_s=3.0)
    + failing_slot("fail", "m-fail")
)
STACK = STACK_NO_PIN + PIN


@pytest.fixture
def live(tmp_path: object) -> Iterator[tuple[Api, Slotctl]]:
    from pathlib import Path

    ctl = Slotctl(Path(str(tmp_path)))
    write_settings(ctl.config, cpu_budget_gb=1.0)
    try:
        apply(ctl, STACK, "res.toml")
        yield start_api(ctl), ctl
    finally:
        leftovers = ctl.close()
    assert not leftovers, leftovers


def test_a_load_in_flight_answers_202_at_once(live: tuple[Api, Slotctl]) -> None:
    api, _ = live
    first = api.call("POST", "/api/slots/slow/load")
    assert first.status == 202 and first.body["status"] == "loading", first
    started = time.monotonic()
    again = api.call("POST", "/api/slots/slow/load")
    took = time.monotonic() - started
    # Before: the second call waited for the state to move (the whole 3 s load).
    assert again.status == 202 and again.body["status"] == "loading", again
    assert took < 2.0, f"a load in flight answered after {took:.1f}s"
    api.wait_state("slow", "ready")


def test_unloading_a_failed_model_clears_its_residency_and_failure(
    live: tuple[Api, Slotctl],
) -> None:
    api, ctl = live
    reply = api.call("POST", "/api/models/m-fail/load")
    assert reply.status == 202, reply
    view = api.wait_state("fail", "error")
    assert view["resident"] is True and view["failures"] == 1
    # Before: "200 already unloaded", the wish kept (retried forever, across restarts).
    reply = api.call("POST", "/api/models/m-fail/unload")
    assert reply.status == 200 and reply.body["status"] == "unloaded", reply
    assert reply.body["cleared"] == {"residency": ["fail"], "failures": ["fail"]}
    assert "residency" in reply.body["message"] and "failures" in reply.body["message"]
    view = api.slot("fail")
    assert (view["state"], view["resident"], view["failures"]) == ("offline", False, 0)
    state = api.ok("GET", "/api/models/m-fail/state")
    assert (state["state"], state["resident"]) == ("unloaded", False)
    again = api.call("POST", "/api/models/m-fail/unload")
    assert again.body["status"] == "already unloaded", again
    # The CLI says what it cleared.
    api.ok("POST", "/api/models/m-fail/load", status=202)
    api.wait_state("fail", "error")
    out = ctl.ok("model", "unload", "m-fail")
    assert "cleared the residency of fail and the failures of fail" in out, out


def test_every_refusal_is_reported_once(live: tuple[Api, Slotctl]) -> None:
    api, ctl = live
    mark = len(ctl.controller_log())
    assert_typed(api.call("DELETE", "/api/slots/pin"), 409, "slot.pinned")
    assert_typed(api.call("POST", "/api/models/m-nope/load"), 404, "model.not_found")
    reply = api.call(
        "POST",
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert reply.status == 404

    def lines() -> list[str]:
        return [ln for ln in ctl.controller_log()[mark:].splitlines() if "refusal" in ln]

    wait_until(lambda: len(lines()) >= 3, "three refusal lines")
    time.sleep(0.3)
    text = "\n".join(lines())
    assert text.count("[slot.pinned]") == 1, text
    assert text.count("[model.not_found]") == 2, text


def test_prune_of_a_pinned_slot_needs_force(live: tuple[Api, Slotctl]) -> None:
    api, ctl = live
    without_pin = STACK_NO_PIN
    body = {"stack": without_pin, "name": "res.toml", "prune": True}
    error = assert_typed(api.call("POST", "/api/stacks/apply", body), 409, "slot.pinned")
    assert "--force" in error["message"] and error["slots"] == ["pin"]
    assert (ctl.config / "slots" / "pin.toml").exists()  # all or nothing: nothing applied
    applied = api.ok("POST", "/api/stacks/apply", {**body, "force": True})
    assert "pin" in applied["changed"]
    assert not (ctl.config / "slots" / "pin.toml").exists()
    # The CLI says the same and exits 2 (an error), changing nothing.
    path = ctl.tmp / "again.toml"
    path.write_text(STACK)
    ctl.ok("stack", "apply", path)
    path.write_text(without_pin)
    result = ctl.run("stack", "apply", path, "--prune")
    assert result.returncode == 2 and "--force" in result.stderr, result
    assert (ctl.config / "slots" / "pin.toml").exists()
    ctl.ok("stack", "apply", path, "--prune", "--force")
    assert not (ctl.config / "slots" / "pin.toml").exists()


def test_an_unloaded_autoload_slot_stays_paused_and_diff_says_so(ctl_pause: Slotctl) -> None:
    ctl = ctl_pause
    api = start_api(ctl)
    api.wait_state("auto", "ready")
    out = ctl.ok("slot", "unload", "auto")
    assert "paused" in out and "slotctl slot load auto" in out, out
    time.sleep(2.5)  # the reconciler's retry would have come after about a second
    view = api.slot("auto")
    assert (view["state"], view["paused"]) == ("offline", True)
    diff = ctl.run("stack", "diff", ctl.tmp / "pause.toml", "--exit-code")
    assert diff.returncode == 1 and "paused by `slotctl slot unload`" in diff.stdout, diff
    ctl.ok("slot", "load", "auto")
    api.wait_state("auto", "ready")
    assert api.slot("auto")["paused"] is False
    # A residency wish shows in the diff as a note, not as drift.
    ctl.ok("slot", "load", "lazy")
    api.wait_state("lazy", "ready")
    diff = ctl.run("stack", "diff", ctl.tmp / "pause.toml", "--exit-code")
    assert diff.returncode == 0, diff
    assert "note: resident: kept loaded by `slotctl slot load`" in diff.stdout, diff


@pytest.fixture
def ctl_pause(tmp_path: object) -> Iterator[Slotctl]:
    from pathlib import Path

    ctl = Slotctl(Path(str(tmp_path)))
    write_settings(ctl.config, cpu_budget_gb=1.0)
    text = (
        '[stack]\nname = "pause"\n'
        + model("m-auto", 0.2)
        + model("m-lazy", 0.2)
        + slot("auto", "m-auto", autoload=True)
        + slot("lazy", "m-lazy")
    )
    try:
        apply(ctl, text, "pause.toml")
        yield ctl
    finally:
        leftovers = ctl.close()
    assert not leftovers, leftovers
