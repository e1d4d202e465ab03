"""Stopping the controller answers what waits (issue 40, item 11).

Ctrl-C (SIGINT) or SIGTERM on a real ``slotctl up`` while a request waits for a cold
slot's load: the request is answered ``503`` in OpenAI's error shape with a
``Retry-After``, never a dropped connection (curl's status 000). A real controller
process, a demo server that takes long to load, a plain HTTP client.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.e2e.conftest import Slotctl, SlotDef, wait_until
from tests.e2e.test_workflow import write_stack


def _post(url: str, token: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    request = urllib.request.Request(
        url,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        data=json.dumps(body).encode(),
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            out.update(status=response.status, headers=dict(response.headers))
            out["body"] = response.read()
    except urllib.error.HTTPError as exc:
        out.update(status=exc.code, headers=dict(exc.headers), body=exc.read())
    except Exception as exc:  # the connection dropped: what the test refuses
        out.update(status=0, error=repr(exc))


def _state(listen: str, token: str) -> str:
    request = urllib.request.Request(
        f"http://{listen}/api/slots/slow", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return str(json.loads(response.read())["state"])
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # the controller has not read the stack yet
            return ""
        raise


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_request_waiting_for_a_cold_load_is_answered_503_when_up_stops(
    ctl: Slotctl, sig: signal.Signals
) -> None:
    slots = [SlotDef("slow", autoload=False, load_seconds=30.0)]
    stack = write_stack(ctl.tmp / "stacks" / "e2e.toml", slots)
    ctl.ok("stack", "apply", stack)
    up = ctl.start_up()

    def listen() -> str | None:  # published once bound (":0" until then)
        try:
            value = json.loads((ctl.state / "controller.json").read_text()).get("listen")
        except (OSError, ValueError):
            return None
        return value if value and not value.endswith(":0") else None

    record = {"listen": wait_until(listen, "the API address in controller.json")}
    token = (ctl.state / "token").read_text().strip()
    url = f"http://{record['listen']}/v1/chat/completions"
    answer: dict[str, Any] = {}
    body = {"model": "m-slow", "messages": [{"role": "user", "content": "hi"}]}
    client = threading.Thread(target=_post, args=(url, token, body, answer), daemon=True)
    client.start()

    # the request waits: its slot is loading (the demo server takes 30 s)
    def loading() -> bool:
        assert not answer, f"answered before the stop: {answer}"
        return _state(record["listen"], token) in ("starting", "warming")

    wait_until(loading, "the cold load to begin")
    up.send_signal(sig)
    client.join(timeout=60)
    assert not client.is_alive(), "the waiting request was never answered"
    assert up.wait(timeout=60) == 0, ctl.controller_log()
    assert answer.get("status") == 503, (answer, ctl.controller_log())
    assert int(answer["headers"]["Retry-After"]) >= 1
    error = json.loads(answer["body"])["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["code"] == "slot.load_stopped", error
    assert "controller shutdown" in error["message"], error
