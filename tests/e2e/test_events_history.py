"""``slotctl events`` as ``kubectl events`` (issue 24): the recent history first, lease
flips folded into one ``requests`` line a slot and burst (``--all`` shows each),
``--since 10m`` / ``--since ID``, ``--watch-only`` for the new events only; and what an
``idle`` slot is, said plainly (``op: idle``, ``slot get``'s ``server`` and ``meaning``).

A real ``slotctl up`` with demo servers; requests through its router over HTTP.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tests.e2e.conftest import Slotctl
from tests.e2e.test_cli_remote import Follower, up
from tests.integration.test_api import Api, model, slot

STACK = (
    '[stack]\nname = "feed"\n'
    + model("m-one", 0.1)
    + model("m-nap", 0.1)
    + slot("one", "m-one", autoload=True)
    + slot("nap", "m-nap", autoload=True, idle_timeout_s=1)
)


def ask(api: Api, model_id: str, n: int) -> None:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for _ in range(n):
        assert api.call("POST", "/v1/chat/completions", body).status == 200


def records(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


def is_flip(r: dict[str, Any]) -> bool:
    return r["kind"] == "transition" and r["op"] == "lease"


def test_events_prints_the_history_first_with_the_lease_flips_folded(ctl: Slotctl) -> None:
    api = up(ctl, STACK)
    api.wait_state("one", "ready")
    api.wait_state("nap", "idle")
    ask(api, "m-one", 20)

    # the history first, then following: the load is there, the 40 flips are one line
    history = Follower(ctl, "-o", "json")
    try:
        seen = records(history.until('"kind":"requests"'))
    finally:
        history.stop()
    assert any(r["slot"] == "one" and r["to"] == "starting" for r in seen), seen
    assert not any(is_flip(r) for r in seen), seen
    folded = seen[-1]
    assert folded["slot"] == "one" and folded["id"] == 0
    assert folded["details"]["requests"] == 20 and folded["details"]["total"] == 20
    # the idle slot says what happened: op idle, nothing unloaded
    (nap,) = [r for r in seen if r["slot"] == "nap" and r["to"] == "idle"]
    assert nap["op"] == "idle" and "stays up" in nap["message"]

    # text: one line for the burst
    text = Follower(ctl)
    try:
        lines = text.until("requests")
    finally:
        text.stop()
    assert "20 requests since" in lines[-1] and " one " in lines[-1], lines
    assert not any("ready -> serving" in line for line in lines), lines

    # --all: every flip
    every = Follower(ctl, "--all", "-o", "json")
    try:
        flips = [r for r in records(every.until('"details":{"requests":20}')) if is_flip(r)]
    finally:
        every.stop()
    assert flips and flips[0]["details"]["requests"] == 0


def test_since_a_duration_and_watch_only_leave_the_older_history_out(ctl: Slotctl) -> None:
    api = up(ctl, STACK)
    api.wait_state("one", "ready")
    api.wait_state("nap", "idle")
    time.sleep(2.5)  # the loads are older than 2 s now
    for args in (("--since", "2s"), ("--watch-only",)):
        follower = Follower(ctl, *args, "-n", "1", "-o", "json")
        try:
            # a request every 3 s (a burst is shown 2 s after its last request) until it
            # shows one line, however long it takes to connect: the first is a burst of
            # requests, never the older loads
            deadline = time.monotonic() + 60
            while follower.proc.poll() is None and time.monotonic() < deadline:
                ask(api, "m-one", 1)
                time.sleep(3.0)
            (only,) = records(follower.until('"kind":"requests"'))
            assert only["slot"] == "one" and only["details"]["requests"] >= 1, only
            assert follower.proc.wait(timeout=30) == 0  # -n 1
        finally:
            follower.stop()
    # a duration of ten minutes is the whole history
    every = Follower(ctl, "--since", "10m", "-o", "json")
    try:
        assert records(every.until('"to":"starting"'))[-1]["slot"] in ("one", "nap")
    finally:
        every.stop()


def test_slot_get_says_whether_the_server_is_up_and_what_idle_means(ctl: Slotctl) -> None:
    api = up(ctl, STACK)
    api.wait_state("nap", "idle")
    status = ctl.json("slot", "get", "nap")["status"]
    assert status["state"] == "idle" and status["idle_reason"] == "timeout"
    assert status["server"] == "up"
    assert "nothing was unloaded" in status["meaning"]
    models = {m["id"]: m for m in ctl.json("model", "list")["models"]}
    assert models["m-nap"]["state"] == "loaded"  # and that is true: the server is up
    ctl.ok("down")
    offline = ctl.json("slot", "get", "nap")["status"]  # from the files
    assert offline["server"] == "down" and offline["state"] == "offline", offline
