"""A controller restarted with resident slots that exceed the budget (issue 10, item 2).

The real ``slotctl`` CLI and controller on the process runtime with demo servers: the
first controller holds three slots within a 2 GiB budget; the budget is cut to 1 GiB and
the controller restarted. Restore loads the two most important slots, in priority order,
and leaves the third waiting for memory: no eviction, no reload storm.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.helpers import free_port


def _settings(config: Path, budget_gb: float) -> None:
    config.mkdir(parents=True, exist_ok=True)
    (config / "controller.toml").write_text(
        f"memory_budget_gb = {{cpu = {budget_gb}}}\nsafety_margin_gb = 0.0\n"
    )


def _stack() -> str:
    text = '[stack]\nname = "restart"\n'
    for name in ("top", "mid", "low"):
        text += f'[[model]]\nid = "m-{name}"\nsource = "demo://m-{name}"\nmemory_gb = 0.4\n'
    for name, priority, autoload in (("low", 10, True), ("mid", 50, False), ("top", 90, True)):
        text += (
            f'[[slot]]\nname = "{name}"\nprovider = "demo"\nmodel.default = "m-{name}"\n'
            f'device = "cpu"\nport = {free_port()}\npriority = {priority}\n'
            f"autoload = {json.dumps(autoload)}\ndrain_timeout_s = 1.0\n"
            '[slot.server]\nextra_args = ["--load-seconds", "0.3"]\n'
        )
    return text


def test_restart_with_residents_over_budget_loads_by_priority_and_waits(ctl: Slotctl) -> None:
    _settings(ctl.config, 2.0)
    stack = ctl.tmp / "restart.toml"
    stack.write_text(_stack())
    ctl.ok("stack", "apply", stack)
    ctl.start_up()
    ctl.ok("slot", "load", "mid")  # a residency wish, kept across restarts
    ctl.wait_states({"top": "ready", "mid": "ready", "low": "ready"})
    ctl.ok("down")

    _settings(ctl.config, 1.0)  # now only two of the three fit
    ctl.start_up()
    ctl.wait_states({"top": "ready", "mid": "ready", "low": "offline"})
    time.sleep(3.0)  # several resync/retry rounds: nothing may move any more
    assert ctl.states() == {"top": "ready", "mid": "ready", "low": "offline"}
    log = ctl.controller_log()
    assert "eviction" not in log, log
    restart = log[log.index("controller: runtime") :]
    assert restart.index("top ") < restart.index("mid ") < restart.index("low "), restart
    assert restart.count("[model.insufficient_memory]") == 1, restart  # said once
    low = wait_until(
        lambda: next((s for s in ctl.json("slot", "list") if s["name"] == "low"), None),
        "low in the list",
    )
    record = json.loads((ctl.state / "slots" / "low" / "state.json").read_text())
    assert record["extra"]["waiting"] == "waiting_for_memory", (low, record)
    assert "waiting for memory" in record["message"]
