"""Multi-GPU placement end to end: ``slotctl up`` on a host with three (fake NVML) GPUs.

The real CLI and controller, the process runtime and demo servers; the only fake is the
NVIDIA driver (``tests/fakes/nvml/pynvml.py``, read by the controller's NVML probe as the
real ``nvidia-ml-py`` would be). Each demo server reports the GPU visibility variables it
was started with, so the test reads from each server's own environment which GPUs it was
given — and that a restarted controller keeps every slot where its server runs.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

from tests.e2e.conftest import REPO, Slotctl, wait_until
from tests.integration.helpers import free_port
from tests.integration.test_events_metrics import promtool_check, samples

GIB = 1024**3
UUIDS = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-4000-8000-00000000000{i}" for i in range(3)]


def _host(path: Path, *, lost: int | None = None) -> None:
    gpus = [
        {"uuid": UUIDS[0], "name": "NVIDIA Fake 24G", "total": 24 * GIB},
        {"uuid": UUIDS[1], "name": "NVIDIA Fake 24G", "total": 24 * GIB},
        {"uuid": UUIDS[2], "name": "NVIDIA Fake 48G", "total": 48 * GIB},
    ]
    if lost is not None:
        gpus[lost]["lost"] = True
    path.write_text(json.dumps({"gpus": gpus}))


SLOTS = {
    # name: (memory GiB, priority, extra keys, autoload)
    "embed": (2, 90, 'device = "gpu:0"\n', True),
    "tp": (32, 70, "gpus = 2\n", True),
    "chat": (20, 50, "", True),
    "late": (4, 10, 'device = "gpu:2"\n', False),
}


def _stack(ports: dict[str, int]) -> str:
    text = '[stack]\nname = "gpus"\n'
    for name, (gb, *_rest) in SLOTS.items():
        text += f'[[model]]\nid = "m-{name}"\nsource = "demo://{name}"\nmemory_gb = {gb}\n'
    for name, (_gb, priority, extra, autoload) in SLOTS.items():
        text += (
            f'[[slot]]\nname = "{name}"\nprovider = "demo"\nmodel.default = "m-{name}"\n'
            f"port = {ports[name]}\npriority = {priority}\nautoload = {json.dumps(autoload)}\n"
            f'{extra}[slot.server]\nextra_args = ["--load-seconds", "0.2"]\n'
        )
    return text


def _visible(port: int) -> dict[str, str]:
    """What the server itself reports it was shown (its environment)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as answer:
        body: dict[str, Any] = json.load(answer)
    visible: dict[str, str] = body["data"][0]["meta"]["visible_devices"]
    return visible


def _api(ctl: Slotctl, path: str, *, raw: bool = False) -> Any:
    record = json.loads((ctl.state / "controller.json").read_text())
    token = (ctl.state / "token").read_text().strip()
    request = urllib.request.Request(
        f"http://{record['listen']}{path}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        return answer.read().decode() if raw else json.load(answer)


def _placements(ctl: Slotctl) -> dict[str, list[int]]:
    out = {}
    for name in SLOTS:
        path = ctl.state / "slots" / name / "state.json"
        record = json.loads(path.read_text()) if path.exists() else {"extra": {}}
        out[name] = [g["index"] for g in record["extra"].get("gpus", [])]
    return out


def test_each_server_is_given_its_own_gpus_and_keeps_them_across_a_restart(
    ctl: Slotctl,
) -> None:
    nvml = ctl.tmp / "gpus.json"
    _host(nvml)
    ctl.extra_env = {
        "PYTHONPATH": str(REPO / "tests" / "fakes" / "nvml"),
        "SLOTCTL_TEST_FAKE_NVML": str(nvml),
    }
    ports = {name: free_port() for name in SLOTS}
    stack = ctl.tmp / "gpus.toml"
    stack.write_text(_stack(ports))
    ctl.ok("stack", "apply", stack)
    ctl.start_up()
    ctl.wait_states({"embed": "ready", "tp": "ready", "chat": "ready", "late": "offline"})

    # Restored by priority, each placed by best fit: embed pinned to GPU 0, tp on the two
    # 24 GiB GPUs (16 GiB each; the tightest pair), chat (20 GiB) on the 48 GiB one.
    assert _visible(ports["embed"]) == {"CUDA_VISIBLE_DEVICES": UUIDS[0]}
    assert _visible(ports["tp"]) == {"CUDA_VISIBLE_DEVICES": f"{UUIDS[0]},{UUIDS[1]}"}
    assert _visible(ports["chat"]) == {"CUDA_VISIBLE_DEVICES": UUIDS[2]}
    assert _placements(ctl) == {"embed": [0], "tp": [0, 1], "chat": [2], "late": []}

    table = ctl.ok("slot", "list")
    header, *rows = table.splitlines()
    assert "GPU" in header.split()
    gpu_column = {row.split()[0]: row.split()[header.split().index("GPU")] for row in rows}
    assert gpu_column == {"embed": "0", "tp": "0,1", "chat": "2", "late": "-"}

    devices = {d["device"]: d for d in _api(ctl, "/api/devices")["devices"]}
    assert list(devices)[:3] == ["gpu:0", "gpu:1", "gpu:2"]
    assert devices["gpu:0"]["admitted_bytes"] == 18 * GIB  # embed 2 + tp's half 16
    assert sorted(devices["gpu:0"]["slots"]) == ["embed", "tp"]
    assert devices["gpu:2"]["uuid"] == UUIDS[2] and devices["gpu:2"]["name"] == "NVIDIA Fake 48G"
    assert devices["gpu:2"]["resident_bytes"] == 20 * GIB

    # /metrics: one series set per GPU (a `gpu` label) and which GPUs each slot holds
    metrics = _api(ctl, "/metrics", raw=True)
    promtool_check(metrics)
    table = samples(metrics)
    memory = "slotctl_device_memory_bytes"
    resident = table[(memory, frozenset({("device", "gpu"), ("gpu", "2"), ("kind", "resident")}))]
    assert resident == 20 * GIB
    assert table[("slotctl_slot_gpu", frozenset({("slot", "tp"), ("gpu", "1")}))] == 1

    # The dry run names the GPU a load would use: late is pinned to GPU 2 (28 GiB free).
    dry = ctl.ok("slot", "load", "late", "--dry-run")
    assert "would go on gpu:2" in dry and "would load" in dry, dry

    # kill -9 of the controller: the servers keep running; the next one adopts each where
    # it runs (never re-placed, never restarted), whatever a fresh placement would say.
    pids = ctl.pids()
    proc = ctl.controllers[-1][0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    ctl.start_up()
    ctl.wait_states({"embed": "ready", "tp": "ready", "chat": "ready"})
    wait_until(lambda: "adopted" in ctl.controller_log(), "the adoption")
    assert ctl.pids() == pids
    assert _placements(ctl) == {"embed": [0], "tp": [0, 1], "chat": [2], "late": []}

    # GPU 2 falls off the bus: a load pinned to it is refused with the reason, nothing moves.
    _host(nvml, lost=2)
    refused = ctl.run("slot", "load", "late")
    assert refused.returncode == 2, ctl.explain(refused)
    assert "device.unavailable" in refused.stderr and "GPU is lost" in refused.stderr
    assert ctl.states()["late"] == "offline" and ctl.pids() == pids
