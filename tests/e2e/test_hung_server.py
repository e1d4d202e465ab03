"""A server that hangs after it was ready (issue 26), end to end: a real ``slotctl up``
(process runtime, demo servers), a server stopped with ``SIGSTOP`` mid-stream or while
idle, or wedged by the demo server's ``--hang-after`` knob. The router ends the requests
(``slot.upstream_timeout``, or the liveness probe's revocation), the liveness probe finds
the silent server, the controller stops it (``SIGTERM``, then ``SIGKILL``: a stopped
process ignores the first), the slot goes to ``error`` and the reconciler starts it again
under the crash-loop breaker, as after a crash. And a busy but healthy server (long streams
at full rate, probed while ``serving``) is never killed.

The router side on both of its paths is ``tests/integration/test_hung_server.py``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Slotctl, SlotDef, wait_until
from tests.e2e.test_workflow import alive, write_stack

# Found within ~2 s: two silent probes of 0.5 s, 0.5 s apart. The router gives up after 3 s.
WATCHED = (
    ("liveness_interval_s", "0.5"),
    ("liveness_failures", "2"),
    ("liveness_timeout_s", "0.5"),
    ("upstream_idle_s", "3"),
)


def up(ctl: Slotctl, slot: SlotDef) -> int:
    """``slotctl up`` on a GitOps stack dir of one slot; its server's pid once ready."""
    write_stack(ctl.tmp / "gitops" / "hung.toml", [slot])
    ctl.start_up(ctl.tmp / "gitops")
    ctl.wait_states({slot.name: "ready"})
    return ctl.pids()[slot.name]


def _connection(ctl: Slotctl, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    record = json.loads((ctl.state / "controller.json").read_text())
    host, _, port = record["listen"].rpartition(":")
    token = (ctl.state / "token").read_text().strip()
    return http.client.HTTPConnection(host, int(port), timeout=timeout), token


def chat(
    ctl: Slotctl,
    model: str,
    max_tokens: int,
    *,
    stream: bool = False,
    on_first: Callable[[], None] | None = None,
    timeout: float = 60.0,
) -> tuple[int, list[Any]]:
    """A chat completion through the router: its status and its events (streamed) or its
    JSON body (as the one item)."""
    conn, token = _connection(ctl, timeout)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "are you there"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        response = conn.getresponse()
        if not stream or response.status != 200:
            return response.status, [json.loads(response.read())]
        events: list[Any] = []
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :].strip()
            events.append(data.decode() if data == b"[DONE]" else json.loads(data))
            if len(events) == 1 and on_first is not None:
                on_first()
        return response.status, events
    finally:
        conn.close()


@contextlib.contextmanager
def resumed_at_the_end(pid: int) -> Iterator[None]:
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def restarted(ctl: Slotctl, slot: str, old_pid: int, timeout: float = 60.0) -> int:
    """The slot ready again on a new server; the stopped one gone (killed)."""

    def check() -> int | None:
        pid = ctl.pids().get(slot)
        return pid if pid and pid != old_pid and ctl.states().get(slot) == "ready" else None

    try:
        pid = wait_until(check, f"{slot} restarted on a new server", timeout, every=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{ctl.controller_log()}") from None
    assert not alive(old_pid), "the hung server still runs"
    return pid


def assert_stopped_as_hung(ctl: Slotctl, slot: str) -> None:
    log = ctl.controller_log()
    assert f"slot {slot}: liveness probe missed" in log, log
    assert "liveness probe failed 2 times in a row" in log, log
    assert "the server is hung, stopping it" in log, log


def test_a_server_stopped_mid_stream_is_cut_stopped_and_restarted(ctl: Slotctl) -> None:
    """Before: the stream hung for as long as the server was stopped, the slot read
    ``serving`` with its lease, and nothing happened. Now the stream ends with an error
    event within seconds, and the server is replaced."""
    slot = SlotDef("hung", extra=("--tokens-per-second", "20"), options=WATCHED)
    pid = up(ctl, slot)
    with resumed_at_the_end(pid):
        started = time.monotonic()
        status, events = chat(
            ctl, "m-hung", 2000, stream=True, on_first=lambda: os.kill(pid, signal.SIGSTOP)
        )
        took = time.monotonic() - started
        assert status == 200
        assert took < 15, took
        assert events[-1] != "[DONE]", events[-3:]
        error = events[-1]["error"]
        # The liveness probe (~2 s) usually ends it first (its lease revoked), else the
        # router's upstream idle timeout (3 s).
        assert error["code"] in ("slot.health_failed", "slot.upstream_timeout"), error
        restarted(ctl, "hung", pid)
    assert_stopped_as_hung(ctl, "hung")
    status, events = chat(ctl, "m-hung", 4, stream=True)
    assert status == 200 and events[-1] == "[DONE]"


def test_a_server_stopped_while_ready_is_replaced_and_a_request_meanwhile_is_answered(
    ctl: Slotctl,
) -> None:
    """Stopped between requests (before any head): the probe finds it; a request sent
    meanwhile gets a typed error (the router's 504, or the 503 of the revoked lease or
    of the restart's backoff) instead of hanging, and the slot serves again after."""
    slot = SlotDef("idle", options=WATCHED)
    pid = up(ctl, slot)
    with resumed_at_the_end(pid):
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        status, (body,) = chat(ctl, "m-idle", 4)
        assert time.monotonic() - started < 15
        if status != 200:  # 200: the restarted server answered it (it waited for it)
            assert status in (503, 504), body
            assert body["error"]["code"] in (
                "slot.upstream_timeout",
                "slot.health_failed",
                "slot.crash_looping",
                "slot.not_ready",
            ), body
        restarted(ctl, "idle", pid)
    assert_stopped_as_hung(ctl, "idle")
    status, (body,) = chat(ctl, "m-idle", 4)
    assert status == 200, body


def test_the_demo_servers_hang_after_knob_hangs_it_and_the_slot_recovers(ctl: Slotctl) -> None:
    """``--hang-after 3``: three inference requests are served (the readiness probe's
    sentinel and two of ours), the fourth wedges the whole server (no byte more for
    anything, ``/health`` included). Found and replaced as above; the new server serves
    (its count starts again)."""
    slot = SlotDef("wedge", extra=("--hang-after", "3"), options=WATCHED)
    pid = up(ctl, slot)
    for _ in range(2):
        status, (body,) = chat(ctl, "m-wedge", 4)
        assert status == 200, body
    started = time.monotonic()
    status, (body,) = chat(ctl, "m-wedge", 4)
    assert time.monotonic() - started < 15
    assert status in (503, 504), body
    assert body["error"]["code"] in ("slot.upstream_timeout", "slot.health_failed"), body
    restarted(ctl, "wedge", pid)
    assert_stopped_as_hung(ctl, "wedge")
    assert "slotctl-demo hanging: request 4 arrived after 3 served" in _server_logs(ctl.state)
    status, (body,) = chat(ctl, "m-wedge", 4)
    assert status == 200, body


def _server_logs(state: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in state.glob("slots/*/*.log*"))


def test_a_busy_healthy_server_is_never_killed(ctl: Slotctl) -> None:
    """Six long streams at a time, generated as fast as the demo server can, for ~8 s, on
    a slot probed every 0.5 s while ``serving``: the server answers its ``/health`` (a
    busy server is not a silent one), so it is never stopped, and every stream ends whole.
    The probe's timeout here is 2 s so that a machine busy with other work is not mistaken
    for a hung server either."""
    options = (
        ("liveness_interval_s", "0.5"),
        ("liveness_failures", "2"),
        ("liveness_timeout_s", "2"),
        ("upstream_idle_s", "10"),
    )
    slot = SlotDef("busy", extra=("--tokens-per-second", "0"), options=options)
    pid = up(ctl, slot)
    done: list[tuple[int, Any]] = []
    failures: list[BaseException] = []
    deadline = time.monotonic() + 8.0

    def client() -> None:
        try:
            while time.monotonic() < deadline:
                status, events = chat(ctl, "m-busy", 4000, stream=True)
                done.append((status, events[-1]))
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)

    threads = [threading.Thread(target=client) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert done and all(item == (200, "[DONE]") for item in done), done[:3]
    assert ctl.pids()["busy"] == pid and alive(pid)
    assert ctl.states()["busy"] == "ready"
    log = ctl.controller_log()
    assert "the server is hung" not in log, log
    assert "liveness probe failed" not in log, log
