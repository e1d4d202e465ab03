"""The residency tier end to end (issue 22): ``slotctl up`` with demo servers in sleep mode.

The real CLI and controller, the process runtime and demo servers answering vLLM's
dev-mode sleep API (``--enable-sleep-mode``): one GPU (a budget, no GPU probe) that fits
one model, host memory (the ``cpu`` budget) for the sleepers. Requests go through the
router. What the tests read: ``slot list``, ``state.json``, each server's own
``/is_sleeping`` and pid, ``/api/devices``, ``/metrics`` and the event stream.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.test_events_metrics import promtool_check, samples

GIB = 1024**3


def _settings(config: Path, *, gpu_gb: float = 1.5, cpu_gb: float = 8.0) -> None:
    config.mkdir(parents=True, exist_ok=True)
    (config / "controller.toml").write_text(
        f"memory_budget_gb = {{gpu = {gpu_gb}, cpu = {cpu_gb}}}\n"
        "safety_margin_gb = 0.0\nhost_margin_gb = 0.0\nmin_resident_s = 0.0\n"
    )


def _stack(slots: dict[str, dict[str, Any]]) -> str:
    """Demo slots (name -> options: gb, args, device, sleep, autoload); the controller
    chooses their ports (no port two tests could both be handed)."""
    text = '[stack]\nname = "tier"\n'
    for name, o in slots.items():
        text += f'[[model]]\nid = "m-{name}"\nsource = "demo://{name}"\n'
        text += f"memory_gb = {o.get('gb', 1.0)}\n"
    for name, o in slots.items():
        args = ["--load-seconds", str(o.get("load", 1.0)), "--wake-seconds", "0.2"]
        args += o.get("args", [])
        text += (
            f'[[slot]]\nname = "{name}"\nprovider = "demo"\nmodel.default = "m-{name}"\n'
            f'device = "{o.get("device", "gpu")}"\n'
            f"autoload = {json.dumps(o.get('autoload', False))}\n"
            f"sleep = {json.dumps(o.get('sleep', True))}\ndrain_timeout_s = 1.0\n"
            f"wake_timeout_s = {o.get('wake_timeout_s', 10)}\n"
            f"[slot.server]\nextra_args = {json.dumps(args)}\n"
        )
    return text


def _api(ctl: Slotctl, path: str, body: Any = None, *, raw: bool = False) -> Any:
    record = json.loads((ctl.state / "controller.json").read_text())
    token = (ctl.state / "token").read_text().strip()
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{record['listen']}{path}",
        data=data,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            text = answer.read().decode()
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{path}: HTTP {exc.code}: {exc.read().decode()}") from None
    return text if raw else json.loads(text)


def _ask(ctl: Slotctl, name: str) -> dict[str, Any]:
    """One completion through the router for slot ``name``'s model."""
    body = {"model": f"m-{name}", "prompt": "hi", "max_tokens": 2}
    answer: dict[str, Any] = _api(ctl, "/v1/completions", body)
    return answer


class Servers:
    """Each slot's server, where the controller put it (its endpoint, recorded before the
    server started)."""

    def __init__(self, ctl: Slotctl) -> None:
        self.ctl = ctl
        self.known: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        if name not in self.known:
            endpoint = _api(self.ctl, f"/api/slots/{name}")["endpoint"]
            assert endpoint, name
            self.known[name] = str(endpoint)
        return self.known[name]


def _sleeping(endpoint: str) -> bool:
    """What the server itself says (vLLM's GET /is_sleeping)."""
    with urllib.request.urlopen(f"{endpoint}/is_sleeping", timeout=5) as answer:
        return bool(json.load(answer)["is_sleeping"])


def _rows(ctl: Slotctl) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in ctl.json("slot", "list")}


def _state(ctl: Slotctl, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ctl.state / "slots" / name / "state.json").read_text())
    return data


def _up(ctl: Slotctl, slots: dict[str, dict[str, Any]], **settings: float) -> Servers:
    _settings(ctl.config, **settings)
    stack = ctl.tmp / "tier.toml"
    stack.write_text(_stack(slots))
    ctl.ok("stack", "apply", stack)
    ctl.start_up()
    _ready(ctl)
    return Servers(ctl)


def _ready(ctl: Slotctl) -> None:
    """The API answers before the controller has read its desired state (the router would
    not know the models yet): wait for ``/readyz``."""
    ctl.wait_log("API and dashboard on")

    def ready() -> bool:
        try:
            _api(ctl, "/readyz")
        except AssertionError:  # 503 while it recovers
            return False
        return True

    wait_until(ready, "the controller to be ready", 60)


def test_swap_by_sleep_and_wake_on_request(ctl: Slotctl) -> None:
    ports = _up(ctl, {"a": {}, "b": {}})
    assert _ask(ctl, "a")["model"] == "m-a"
    assert _ask(ctl, "b")["model"] == "m-b"  # a is put to sleep to make room
    rows = _rows(ctl)
    assert (rows["a"]["state"], rows["a"]["idle_reason"], rows["a"]["residency"]) == (
        "idle",
        "asleep",
        "asleep",
    )
    assert "idle(asleep:1)" in ctl.ok("slot", "list")
    assert _sleeping(ports["a"]) and not _sleeping(ports["b"])
    record = _state(ctl, "a")
    assert record["extra"]["residency"] == "asleep" and record["extra"]["sleep_level"] == 1
    devices = {d["device"]: d for d in _api(ctl, "/api/devices")["devices"]}
    assert devices["gpu:0"]["admitted_bytes"] == GIB  # b only: a released its GPU memory
    assert devices["cpu"]["admitted_bytes"] == GIB and devices["cpu"]["slots"] == ["a"]
    pids = ctl.pids()

    # The dry run of a wake: b would sleep in turn, and what each device gets back.
    dry = ctl.ok("slot", "load", "a", "--dry-run")
    assert "dry run: wake of slot a" in dry and "sleep b" in dry, dry

    # A hundred concurrent requests for the sleeper: one wake, no restart.
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: _ask(ctl, "a"), range(100)))
    assert {a["model"] for a in answers} == {"m-a"}
    assert ctl.pids() == pids  # nobody restarted: a woke, b fell asleep
    assert not _sleeping(ports["a"]) and _sleeping(ports["b"])
    log = ctl.controller_log()
    woke = [line for line in log.splitlines() if "residency" in line and "woke in" in line]
    assert len(woke) == 1 and "(request)" in woke[0], log  # one wake for the hundred

    metrics = _api(ctl, "/metrics", raw=True)
    promtool_check(metrics)
    table = samples(metrics)
    assert table[("slotctl_wake_seconds_count", frozenset({("slot", "a")}))] == 1
    assert table[("slotctl_wakes_total", frozenset({("slot", "a"), ("reason", "request")}))] == 1
    assert table[("slotctl_sleeps_total", frozenset({("slot", "b"), ("reason", "preload")}))] == 1
    assert table[("slotctl_sleeper_host_bytes", frozenset({("device", "cpu")}))] == GIB
    tier = frozenset({("slot", "b"), ("residency", "asleep")})
    assert table[("slotctl_slot_residency", tier)] == 1


@pytest.mark.parametrize(
    "wake",
    [
        {"args": ["--fail-wake"]},  # POST /wake_up answers 500
        {"args": ["--wake-seconds", "5"], "wake_timeout_s": 1},  # it takes too long
    ],
    ids=["fails", "times-out"],
)
def test_a_failed_wake_restarts_the_server_once(ctl: Slotctl, wake: dict[str, Any]) -> None:
    ports = _up(ctl, {"a": wake, "b": {}})
    _ask(ctl, "a")
    _ask(ctl, "b")
    assert _sleeping(ports["a"])
    before = ctl.pids()["a"]
    assert _ask(ctl, "a")["model"] == "m-a"  # the wake fails: restarted, and it answers
    assert ctl.pids()["a"] != before
    log = ctl.controller_log()
    assert log.count("[slot.wake_failed]") == 1, log  # one event
    assert _rows(ctl)["a"]["residency"] == "awake"


def test_a_restarted_controller_adopts_a_sleeper(ctl: Slotctl) -> None:
    ports = _up(ctl, {"a": {}, "b": {}})
    _ask(ctl, "a")
    _ask(ctl, "b")
    pids = ctl.pids()
    proc = ctl.controllers[-1][0]
    os.kill(proc.pid, signal.SIGKILL)  # the servers keep running
    proc.wait(timeout=10)
    ctl.start_up()
    _ready(ctl)
    wait_until(lambda: "adopted a asleep at level 1" in ctl.controller_log(), "the adoption")
    rows = _rows(ctl)
    assert rows["a"]["residency"] == "asleep" and rows["b"]["state"] == "ready"
    assert ctl.pids() == pids
    devices = {d["device"]: d for d in _api(ctl, "/api/devices")["devices"]}
    assert devices["gpu:0"]["admitted_bytes"] == GIB  # counted once: b on the GPU ...
    assert devices["cpu"]["admitted_bytes"] == GIB  # ... and a's weights on the host
    assert _ask(ctl, "a")["model"] == "m-a"  # and it wakes on request
    assert ctl.pids() == pids and _sleeping(ports["b"])


def test_host_memory_pressure_turns_sleepers_into_unloads(ctl: Slotctl) -> None:
    # Host memory (cpu budget 1.5 GiB) holds one sleeper; a CPU slot needs 1 GiB of it.
    slots = {"a": {}, "b": {}, "c": {}, "cpu": {"device": "cpu", "sleep": False}}
    ports = _up(ctl, slots, cpu_gb=1.5)
    _ask(ctl, "a")
    _ask(ctl, "b")  # a sleeps (1 of 1.5 GiB of host memory)
    assert _sleeping(ports["a"])
    _ask(ctl, "c")  # b may sleep only if a gives up the host memory: a is unloaded
    rows = _rows(ctl)
    assert rows["a"]["state"] == "offline" and rows["b"]["residency"] == "asleep"
    assert _sleeping(ports["b"])
    dry = ctl.ok("slot", "load", "cpu", "--dry-run")
    assert "unload b" in dry, dry
    _ask(ctl, "cpu")  # a CPU slot's load: the sleeper is unloaded fully
    rows = _rows(ctl)
    assert rows["b"]["state"] == "offline" and rows["cpu"]["state"] in ("ready", "serving")
    try:
        _sleeping(ports["b"])
    except (urllib.error.URLError, ConnectionError):
        pass  # its server is gone
    else:
        raise AssertionError("b's server still runs after its unload")
    log = ctl.controller_log()
    assert "room in cpu for b to sleep" in log, log  # a: unloaded for b's sleep
    assert "evicted to make room for cpu" in log, log  # b: unloaded for the CPU slot
