"""Models pulled for you, end to end (issue 35): ``slotctl up`` as a subprocess, a stack
whose model is ``hf://org/tiny/tiny.gguf`` served by the hub server of
``tests/integration/hubserver.py`` (the real ``huggingface_hub`` client reaches it through
``HF_ENDPOINT``), the real process runtime and a real ``llama-cpp-python`` server on the
pulled GGUF (the tiny random-weight llama of ``tests/integration/tiny_gguf.py``, padded to
24 MiB so a pull has a middle: the reader writes 4 MiB blocks).

A load goes ``offline -> pulling -> starting -> ready`` with progress events; a controller
killed with SIGKILL at about half of a pull resumes it after a restart (a ranged request,
the rest only), verifies and serves; a models dir on a small tmpfs refuses the pull before
a byte; two slots of one model share one download; a slot deleted mid-pull cancels its
pull; ``model pull --wait|list|rm|gc``, the REST routes and ``/metrics`` against the
running controller. Each test waits on state (the hub's counters, the slot's state, files
on disk), never on time.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Slotctl, wait_until
from tests.integration.helpers import free_port
from tests.integration.hubserver import HubServer
from tests.integration.llama_fixtures import require_llama_server
from tests.integration.test_events_metrics import promtool_check, samples, value

MIB = 1024 * 1024
PAD = 24 * MIB
HOLD = 12 * MIB  # three of the reader's 4 MiB blocks on disk, the rest held


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The tiny llama GGUF, padded with zeros past its last tensor (llama.cpp reads its
    tensors by offset: the padding is never read): a pull big enough to stop halfway."""
    require_llama_server()
    from tests.integration.tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path.read_bytes() + b"\0" * PAD


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server
        server.release()


def use_hub(ctl: Slotctl, hub: HubServer, models: Path) -> None:
    """Every command (and the controller) pulls from ``hub`` into ``models``."""
    ctl.extra_env.update(
        {
            "HF_ENDPOINT": hub.endpoint,
            "HF_HOME": str(ctl.tmp / "hf"),  # no token file of the machine's
            "HF_HUB_DISABLE_TELEMETRY": "1",
            # A held response is not a stalled one while a test looks at it; a stall that
            # outlives the test ends within this, so `slotctl down` is never held longer.
            "HF_HUB_DOWNLOAD_TIMEOUT": "45",
            "SLOTCTL_MODELS_DIR": str(models),
        }
    )


def stack(
    models: dict[str, str], slots: list[tuple[str, str, str]], *, autoload: bool = False
) -> str:
    """``models``: id -> source; ``slots``: (name, model, provider)."""
    out = ['[stack]\nname = "pull"\n']
    for model_id, source in models.items():
        out.append(
            f'\n[[model]]\nid = "{model_id}"\nsource = "{source}"\nmemory_gb = 0.1\n'
            "context_length = 128\n"
        )
    for name, model_id, provider in slots:
        out.append(
            f'\n[[slot]]\nname = "{name}"\nprovider = "{provider}"\nmodel.default = "{model_id}"\n'
            f'device = "cpu"\nport = {free_port()}\nautoload = {str(autoload).lower()}\n'
        )
    return "".join(out)


def write_stack(ctl: Slotctl, text: str) -> Path:
    stacks = ctl.tmp / "stacks"
    stacks.mkdir(exist_ok=True)
    (stacks / "pull.toml").write_text(text)
    return stacks


class Api:
    """The running controller's HTTP API (its address and token from the state dir)."""

    def __init__(self, ctl: Slotctl) -> None:
        def listen() -> str | None:
            with contextlib.suppress(OSError, ValueError):
                value = json.loads((ctl.state / "controller.json").read_text()).get("listen")
                return value if value and not value.endswith(":0") else None
            return None

        host, _, port = wait_until(listen, "the API address").rpartition(":")
        self.host, self.port = host, int(port)
        self.token = (ctl.state / "token").read_text().strip()

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        headers = {"Authorization": f"Bearer {self.token}"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        kind = response.headers.get("Content-Type", "")
        return response.status, (json.loads(raw) if "json" in kind and raw else raw.decode())


def slot_json(ctl: Slotctl, name: str) -> dict[str, Any]:
    rows = {row["name"]: row for row in ctl.json("slot", "list")}
    return dict(rows[name])


def events_until(ctl: Slotctl, predicate: Callable[[dict[str, Any]], bool]) -> list[Any]:
    """``slotctl events --since 1h -o json`` (the history, then live) until an event
    satisfies ``predicate``; every event read."""
    proc = subprocess.Popen(
        ctl.argv("events", "--since", "1h", "-o", "json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ctl.env,
        cwd=ctl.tmp,
    )
    seen: list[Any] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                seen.append(event)
                if predicate(event):
                    return seen
        raise AssertionError(f"the events ended first: {seen[-5:]}")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def partial_bytes(models: Path) -> int:
    return sum(p.stat().st_size for p in (models / ".slotctl/partial").glob("*.part"))


def lfs_gets(hub: HubServer) -> list[Any]:
    return [r for r in hub.requests if r.route == "lfs" and r.method == "GET"]


# ============================================================================ the load


def test_a_load_pulls_the_model_then_a_real_llama_server_serves_it(
    ctl: Slotctl, hub: HubServer, tiny_gguf: bytes
) -> None:
    models = ctl.tmp / "models"
    use_hub(ctl, hub, models)
    hub.add_repo("org/tiny", {"tiny.gguf": tiny_gguf})
    hub.fault("tiny.gguf", hold_at=HOLD)
    stacks = write_stack(
        ctl, stack({"tiny": "hf://org/tiny/tiny.gguf"}, [("tiny", "tiny", "llama-cpp-python")])
    )
    validated = ctl.ok("stack", "validate", stacks)
    assert "model tiny: would pull from hf://org/tiny/tiny.gguf: its size is not known" in (
        validated
    )
    ctl.start_up(stacks)
    ctl.wait_states({"tiny": "offline"})

    dry = ctl.run("slot", "load", "tiny", "--dry-run")
    assert dry.returncode == 0, ctl.explain(dry)
    size = f"{len(tiny_gguf) / 1e6:.1f} MB"
    assert f"model files: would pull {size} from hf://org/tiny/tiny.gguf" in dry.stdout

    loader = subprocess.Popen(
        ctl.argv("slot", "load", "tiny", "--wait", "--timeout", "240"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ctl.env,
        cwd=ctl.tmp,
    )
    try:
        assert hub.held.wait(120), "the pull never reached the hold"
        wait_until(lambda: partial_bytes(models) >= 10 * MIB, "10 MiB on disk", 60)

        def pulling() -> dict[str, Any] | None:
            row = slot_json(ctl, "tiny")
            pull = row.get("pull") or {}
            held = row["state"] == "pulling" and (pull.get("bytes_done") or 0) >= HOLD
            return row if held else None

        row = wait_until(pulling, "slot list showing the pull's percent at the hold", 60)
        assert row["pull"]["bytes_total"] == len(tiny_gguf)
        shown = f"pulling {100 * HOLD / len(tiny_gguf):.0f}%"  # 12 MiB of 25.3 MB: 50%
        assert shown in ctl.ok("slot", "list")
        listed = {m["id"]: m for m in ctl.json("model", "list")["models"]}
        assert listed["tiny"]["files"]["state"] == "pulling"
        assert shown in ctl.ok("model", "list")
        hub.release()
        out, err = loader.communicate(timeout=240)
    finally:
        hub.release()
        if loader.poll() is None:
            loader.kill()
            loader.communicate()
    assert loader.returncode == 0, f"{out}\n{err}\n{ctl.controller_log()}"
    assert "pull" in out and "slot tiny: ready" in out, out  # its bar's lines, then ready

    history = events_until(ctl, lambda e: e.get("kind") == "transition" and e.get("to") == "ready")
    states = [e["to"] for e in history if e.get("kind") == "transition" and e["slot"] == "tiny"]
    assert states[:4] == ["pulling", "starting", "warming", "ready"], states
    progress = [e for e in history if e.get("kind") == "progress" and e.get("slot") == "tiny"]
    phases = [e["details"]["phase"] for e in progress]
    assert "downloading" in phases and phases[-1] == "done", phases
    assert any((e["details"].get("percent") or 0) > 0 for e in progress)

    dest = models / "org/tiny/tiny.gguf"
    assert dest.read_bytes() == tiny_gguf
    api = Api(ctl)
    status, answer = api.call(
        "POST", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
    )
    assert status == 200 and answer["choices"], answer
    status, files = api.call("GET", "/api/models/tiny/files")
    assert status == 200 and files["state"] == "verified" and files["size_bytes"] == len(tiny_gguf)


def test_kill_9_at_half_a_pull_then_the_restart_resumes_verifies_and_serves(
    ctl: Slotctl, hub: HubServer, tiny_gguf: bytes
) -> None:
    models = ctl.tmp / "models"
    use_hub(ctl, hub, models)
    hub.add_repo("org/tiny", {"tiny.gguf": tiny_gguf})
    hub.fault("tiny.gguf", hold_at=HOLD)
    stacks = write_stack(
        ctl,
        stack(
            {"tiny": "hf://org/tiny/tiny.gguf"},
            [("tiny", "tiny", "llama-cpp-python")],
            autoload=True,  # the restarted controller loads it again by itself
        ),
    )
    first = ctl.start_up(stacks)
    assert hub.held.wait(120), "the pull never reached the hold"
    wait_until(lambda: partial_bytes(models) >= 10 * MIB, "10 MiB on disk", 60)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    kept = partial_bytes(models)
    assert 10 * MIB <= kept <= HOLD
    sent_before = hub.sent("tiny.gguf")
    hub.faults.pop("tiny.gguf")
    hub.release()
    record = json.loads((ctl.state / "slots/tiny/state.json").read_text())
    assert record["state"] == "pulling"  # an intent, durable before the pull began

    ctl.start_up(stacks)
    ctl.wait_states({"tiny": "ready"}, timeout=240)
    dest = models / "org/tiny/tiny.gguf"
    assert dest.read_bytes() == tiny_gguf
    resumed = [r for r in lfs_gets(hub) if r.range and not r.range.startswith("bytes=0-")]
    assert resumed, [r.range for r in lfs_gets(hub)]
    assert resumed[-1].range == f"bytes={kept}-"
    fetched_again = hub.sent("tiny.gguf") - sent_before
    assert fetched_again == len(tiny_gguf) - kept  # the rest, and only the rest
    assert not list((models / ".slotctl/partial").glob("*.part"))
    api = Api(ctl)
    status, files = api.call("GET", "/api/models/tiny/files")
    assert files["state"] == "verified"
    status, answer = api.call(
        "POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    )
    assert status == 200, answer
    assert "pull interrupted by a controller restart" in json.dumps(
        events_until(ctl, lambda e: "pull interrupted" in (e.get("message") or ""))[-1]
    )


@pytest.fixture
def small_disk(ctl: Slotctl) -> Iterator[Callable[[int], Path]]:
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        where = ctl.tmp / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs here ({done.stderr.strip()})", pytrace=False)
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_models_dir_too_small_refuses_the_pull_before_a_byte(
    ctl: Slotctl, hub: HubServer, tiny_gguf: bytes, small_disk: Callable[[int], Path]
) -> None:
    disk = small_disk(8 * MIB)
    use_hub(ctl, hub, disk)
    hub.add_repo("org/tiny", {"tiny.gguf": tiny_gguf})
    stacks = write_stack(
        ctl, stack({"tiny": "hf://org/tiny/tiny.gguf"}, [("tiny", "tiny", "llama-cpp-python")])
    )
    ctl.start_up(stacks)
    ctl.wait_states({"tiny": "offline"})

    dry = ctl.run("slot", "load", "tiny", "--dry-run")
    assert dry.returncode == 1, ctl.explain(dry)
    assert "would be refused: [model.insufficient_disk]" in dry.stdout
    refused = ctl.run("slot", "load", "tiny")
    assert refused.returncode == 2, ctl.explain(refused)
    assert "[model.insufficient_disk]" in refused.stderr
    pulled = ctl.run("model", "pull", "tiny", "--wait")
    assert pulled.returncode == 2 and "[model.insufficient_disk]" in pulled.stderr
    status, body = Api(ctl).call("POST", "/api/slots/tiny/load")
    assert status == 507
    error = body["error"]
    assert error["code"] == "model.insufficient_disk"
    assert error["needed_bytes"] == len(tiny_gguf) and error["free_bytes"] <= 8 * MIB
    assert slot_json(ctl, "tiny")["state"] == "offline"  # not started, nothing changed
    assert [p for p in disk.rglob("*") if p.is_file()] == []  # not a byte written
    assert hub.sent("tiny.gguf") == 0 and not lfs_gets(hub)
    assert not [p for p in ctl.owned_processes() if "llama_cpp" in " ".join(p.cmdline())]


# ============================================================================ joins


def test_two_slots_of_one_model_share_one_download_and_apply_wait_shows_it(
    ctl: Slotctl, hub: HubServer, tiny_gguf: bytes
) -> None:
    models = ctl.tmp / "models"
    use_hub(ctl, hub, models)
    hub.add_repo("org/tiny", {"tiny.gguf": tiny_gguf})
    hub.fault("tiny.gguf", hold_at=HOLD)
    ctl.start_up()
    stacks = write_stack(
        ctl,
        stack(
            {"tiny": "hf://org/tiny/tiny.gguf"},
            [("one", "tiny", "demo"), ("two", "tiny", "demo")],
            autoload=True,
        ),
    )
    apply = subprocess.Popen(
        ctl.argv("stack", "apply", stacks, "--wait", "--timeout", "240"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ctl.env,
        cwd=ctl.tmp,
    )
    try:
        assert hub.held.wait(120), "the pull never reached the hold"
        ctl.wait_states({"one": "pulling", "two": "pulling"})
        wait_until(lambda: partial_bytes(models) >= 10 * MIB, "10 MiB on disk", 60)
        wait_until(
            lambda: all(
                (slot_json(ctl, n).get("pull") or {}).get("percent") for n in ("one", "two")
            ),
            "both slots showing the one pull's progress",
        )
        hub.release()
        out, err = apply.communicate(timeout=240)
    finally:
        hub.release()
        if apply.poll() is None:
            apply.kill()
            apply.communicate()
    assert apply.returncode == 0, f"{out}\n{err}\n{ctl.controller_log()}"
    bars = [line for line in out.splitlines() if "  pull  " in line]
    assert bars and any("%" in line and "MB" in line for line in bars), out
    assert "converged in" in out
    assert len(lfs_gets(hub)) == 1 and hub.sent("tiny.gguf") == len(tiny_gguf)
    table = samples(Api(ctl).call("GET", "/metrics")[1])
    assert value(table, "slotctl_model_pulls_total", outcome="pulled") == 1
    assert value(table, "slotctl_model_pull_bytes_total") == len(tiny_gguf)


def test_deleting_a_slot_mid_pull_cancels_the_pull(
    ctl: Slotctl, hub: HubServer, tiny_gguf: bytes
) -> None:
    models = ctl.tmp / "models"
    use_hub(ctl, hub, models)
    hub.add_repo("org/tiny", {"tiny.gguf": tiny_gguf})
    hub.fault("tiny.gguf", hold_at=HOLD)
    stacks = write_stack(
        ctl,
        stack(
            {"tiny": "hf://org/tiny/tiny.gguf"},
            [("doomed", "tiny", "llama-cpp-python")],
            autoload=True,
        ),
    )
    ctl.start_up(stacks)
    assert hub.held.wait(120), "the pull never reached the hold"
    ctl.wait_states({"doomed": "pulling"})
    # GitOps: the slot leaves the stack file; the reconciler removes it
    (stacks / "pull.toml").write_text(stack({"tiny": "hf://org/tiny/tiny.gguf"}, []))
    wait_until(lambda: "doomed" not in ctl.states(), "the slot removed", 60)
    api = Api(ctl)

    def cancelled() -> bool:
        table = samples(api.call("GET", "/metrics")[1])
        return value(table, "slotctl_model_pulls_total", outcome="cancelled") == 1

    wait_until(cancelled, "the pull cancelled", 60)
    assert value(samples(api.call("GET", "/metrics")[1]), "slotctl_model_pulls_in_flight") == 0
    _, files = api.call("GET", "/api/models/tiny/files")
    assert files["state"] == "partial" and files["size_bytes"] >= 10 * MIB  # kept to resume
    assert not (models / "org/tiny/tiny.gguf").exists()
    assert not [p for p in ctl.owned_processes() if "llama_cpp" in " ".join(p.cmdline())]


# ============================================================================ the CLI, REST


def test_model_pull_list_rm_gc_through_the_cli_and_the_rest_routes(
    ctl: Slotctl, hub: HubServer, tiny_gguf: bytes
) -> None:
    models = ctl.tmp / "models"
    use_hub(ctl, hub, models)
    hub.add_repo("org/tiny", {"tiny.gguf": tiny_gguf})
    hub.add_repo("org/gated", {"w.gguf": b"x" * 100_000}, gated=True)
    stacks = write_stack(
        ctl,
        stack(
            {
                "tiny": "hf://org/tiny/tiny.gguf",
                "gated": "hf://org/gated/w.gguf",
                "local": str(ctl.tmp / "nowhere.gguf"),
            },
            [("tiny", "tiny", "demo")],
        ),
    )
    stray = models / "old/stray.gguf"  # a file nobody declares: the GC's
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"s" * 4096)
    ctl.start_up(stacks)
    ctl.wait_states({"tiny": "offline"})

    out = ctl.ok("model", "pull", "tiny", "--wait")
    assert "model tiny: pulling (would pull" in out and "model tiny: pulled" in out, out
    assert (models / "org/tiny/tiny.gguf").read_bytes() == tiny_gguf
    assert "present" in ctl.ok("model", "pull", "tiny")  # nothing to do the second time

    failed = ctl.run("model", "pull", "gated", "--wait")
    assert failed.returncode == 1, ctl.explain(failed)
    assert "[model.access_denied]" in failed.stderr
    missing = ctl.run("model", "pull", "local")
    assert missing.returncode == 2 and "[model.file_missing]" in missing.stderr

    table = ctl.ok("model", "list")
    header, *rows = table.splitlines()
    assert "FILES" in header and "SIZE" in header
    line = next(r for r in rows if r.startswith("tiny "))
    assert "verified" in line
    listed = {m["id"]: m for m in ctl.json("model", "list")["models"]}
    assert listed["tiny"]["files"]["state"] == "verified"
    assert listed["gated"]["files"]["last_pull"]["error"]["code"] == "model.access_denied"
    assert listed["local"]["files"]["state"] == "absent"

    dry = ctl.ok("model", "gc", "--dry-run")
    assert "would remove" in dry and str(stray) in dry, dry
    assert "declared: tiny" in dry
    assert stray.exists()
    gone = ctl.ok("model", "gc")
    assert "removed 1 entry" in gone and not stray.exists()

    api = Api(ctl)
    status, every = api.call("GET", "/api/models/files")
    assert status == 200 and every["disk"]["models_dir"] == str(models)
    assert {m["model"] for m in every["models"]} == {"tiny", "gated", "local"}
    status, doc = api.call("GET", "/api/openapi.json")
    for path in (
        "/api/models/{model_id}/pull",
        "/api/models/{model_id}/files",
        "/api/models/files",
        "/api/models/gc",
    ):
        assert path in doc["paths"], path
    ctl.ok("slot", "load", "tiny", "--wait")
    status, body = api.call("DELETE", "/api/models/tiny/files")
    assert status == 409 and body["error"]["code"] == "model.in_use"
    ctl.ok("slot", "unload", "tiny")
    assert "removed its files" in ctl.ok("model", "rm", "tiny")
    assert not (models / "org/tiny/tiny.gguf").exists()
    status, files = api.call("GET", "/api/models/tiny/files")
    assert files["state"] == "absent"
    metrics = api.call("GET", "/metrics")[1]
    table = samples(metrics)
    assert value(table, "slotctl_model_pulls_total", outcome="access_denied") == 1
    assert value(table, "slotctl_model_pulls_total", outcome="pulled") == 1
    assert value(table, "slotctl_model_pull_bytes_total") == len(tiny_gguf)
    promtool_check(metrics)
