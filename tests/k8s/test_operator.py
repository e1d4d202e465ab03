"""The operator end to end against KMock's Kubernetes API emulator: real kopf, the real
controller core, the process runtime and real demo servers.

One scenario per test, as a user meets it: ``kubectl apply`` -> the server starts and
answers, status Ready with conditions; a spec edit restarts only that slot; a priority
edit restarts nothing; an invalid spec is Degraded with the loader's code while the
server keeps running; a killed server shows in status and comes back; an operator
restart adopts (no duplicate); delete stops the server before the finalizer goes. Each
test also checks the chart's RBAC against every request the operator sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from controller.daemon.main import stop_everything
from controller.operator.run import Operator, OperatorOptions
from tests.integration.helpers import free_ports
from tests.k8s.chart import assert_rbac_allows_exactly
from tests.k8s.conftest import Cluster, eventually

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def model(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": name},
        "spec": {"source": f"demo://{name}", "memory_gb": 0.05},
    }


def alias(name: str, *models: str, namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Alias",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"models": list(models)},
    }


def adapter(
    name: str, base: str, source: str, namespace: str = "default", **spec: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Adapter",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"base": base, "source": source, **spec},
    }


async def adapter_ready(
    cluster: Cluster, name: str, namespace: str = "default"
) -> dict[str, Any] | None:
    obj = await cluster.get("adapters", name, namespace)
    return obj if condition(obj, "Ready").get("status") == "True" else None


async def alias_ready(
    cluster: Cluster, name: str, namespace: str = "default"
) -> dict[str, Any] | None:
    obj = await cluster.get("aliases", name, namespace)
    return obj if condition(obj, "Ready").get("status") == "True" else None


def slot(name: str, model_id: str, port: int, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "provider": "demo",
        "model": {"default": model_id},
        "device": "cpu",
        "port": port,
        "autoload": True,
        "server": {"extra_args": ["--load-seconds", "0.2"]},
    }
    body.update(spec)
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Slot",
        "metadata": {"name": name},
        "spec": body,
    }


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


async def ready(cluster: Cluster, name: str, generation: int = 1) -> dict[str, Any] | None:
    obj = await cluster.get("slots", name)
    cond = condition(obj, "Ready")
    if cond.get("status") == "True" and cond.get("observedGeneration") == generation:
        return obj
    return None


def server_pid(port: int) -> int | None:
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return conn.pid
    return None


def servers_on(port: int) -> list[int]:
    return [
        c.pid
        for c in psutil.net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid
    ]


async def answers(endpoint: str) -> bool:
    async with aiohttp.ClientSession() as session, session.get(f"{endpoint}/v1/models") as resp:
        data = await resp.json()
        return resp.status == 200 and bool(data["data"])


@contextlib.asynccontextmanager
async def running_operator(
    cluster: Cluster,
    state: Path,
    monkeypatch: pytest.MonkeyPatch,
    listen: str | None = None,
    **options: Any,
) -> AsyncIterator[Operator]:
    """The operator on KMock; ``options``: more :class:`OperatorOptions`."""
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    op = Operator(
        OperatorOptions(
            state_dir=state,
            config_dir=state / "config",
            namespaces=["default"],
            listen=listen,
            token="operator-test-token",
            **options,
        )
    )
    task = asyncio.create_task(op.run())
    try:
        await eventually(lambda: _flag(op.kopf_ready), "kopf ready", timeout=20)
        yield op
    finally:
        op.kopf_stop.set()
        op.controller.stop.set()
        await task


async def _flag(event: asyncio.Event) -> bool:
    return event.is_set()


@pytest.fixture
def state(tmp_path: Path) -> Any:
    """The operator's state dir; every server it leaves running is stopped at the end."""
    path = tmp_path / "state"
    yield path
    asyncio.run(stop_everything(path / "config", path, "process", lambda _: None))


async def test_slot_lifecycle_through_custom_resources(
    cluster: Cluster, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chat_port, embed_port, api_port = free_ports(3)
    api = f"127.0.0.1:{api_port}"
    async with running_operator(cluster, state, monkeypatch, listen=api) as op:
        await cluster.create(model("m-chat"))
        await cluster.create(model("m-embed"))
        await cluster.create(slot("chat", "m-chat", chat_port))
        await cluster.create(slot("embed", "m-embed", embed_port))

        # kubectl apply -> Ready with the three conditions, and the server answers
        chat = await eventually(lambda: ready(cluster, "chat"), "chat Ready")
        await eventually(lambda: ready(cluster, "embed"), "embed Ready")
        status = chat["status"]
        assert status["state"] == "ready" and status["model"] == "m-chat"
        assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded"}
        assert condition(chat, "Degraded")["status"] == "False"
        assert all(c["observedGeneration"] == 1 for c in status["conditions"])
        assert status["memory"] == {"device": "cpu", "gb": 0.05, "admitted": True}
        assert await answers(status["endpoint"])
        model_obj = await cluster.get("models", "m-chat")
        assert model_obj is not None and condition(model_obj, "Ready")["status"] == "True"
        assert "kopf" not in (chat.get("status") or {})  # kopf keeps its state in annotations
        notes = chat["metadata"]["annotations"]
        assert "slotctl.io/last-handled-configuration" in notes
        chat_pid, embed_pid = server_pid(chat_port), server_pid(embed_port)
        assert chat_pid and embed_pid
        # the same router as `slotctl up`: a request for the model reaches the CR's slot
        headers = {"Authorization": "Bearer operator-test-token"}
        request = {"model": "m-chat", "messages": [{"role": "user", "content": "hi"}]}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://{api}/v1/chat/completions", json=request, headers=headers) as r,
        ):
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["message"]["content"]
        since = condition(chat, "Ready")["lastTransitionTime"]

        # an Alias: declared (Ready), and a request for it reaches its member's slot
        await cluster.create(alias("assistant", "m-nosuch-model", "m-chat"))
        bad = await eventually(
            lambda: _degraded_alias(cluster, "assistant"), "the Alias refused: unknown member"
        )
        assert bad["status"]["lastError"]["code"] == "alias.unknown_member"
        await cluster.edit("aliases", "assistant", {"models": ["m-chat", "m-embed"]})
        found = await eventually(lambda: alias_ready(cluster, "assistant"), "the Alias Ready")
        assert found["status"]["id"] == "assistant"
        assert condition(found, "Degraded")["status"] == "False"
        request["model"] = "assistant"  # both members are loaded: the first one serves
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://{api}/v1/chat/completions", json=request, headers=headers) as r,
        ):
            assert r.status == 200, await r.text()
            assert (await r.json())["model"] == "m-chat"
        await cluster.delete("aliases", "assistant")
        await eventually(
            lambda: _true("assistant" not in op.manager.aliases), "the alias gone from the router"
        )
        # an Adapter of m-chat: declared (tests/k8s/test_operator_adapters.py serves one)
        await cluster.create(adapter("sql", "m-chat", "/adapters/sql.safetensors"))
        await eventually(lambda: adapter_ready(cluster, "sql"), "the Adapter Ready")

        # priority: applied in place, nothing restarts
        await cluster.edit("slots", "chat", {"priority": 90})
        await eventually(lambda: ready(cluster, "chat", 2), "generation 2 observed")
        await eventually(lambda: _true(op.manager.view("chat").priority == 90), "priority")
        assert server_pid(chat_port) == chat_pid and server_pid(embed_port) == embed_pid
        chat = await cluster.get("slots", "chat")
        assert condition(chat, "Ready")["lastTransitionTime"] == since  # no flip, no move

        # a runtime change: only that slot is recreated
        await cluster.edit("slots", "chat", {"server": {"extra_args": ["--load-seconds", "0.3"]}})
        await eventually(lambda: _true(server_pid(chat_port) not in (None, chat_pid)), "restart")
        await eventually(lambda: ready(cluster, "chat", 3), "chat Ready again")
        assert server_pid(embed_port) == embed_pid
        chat_pid = server_pid(chat_port)
        # each resource's Applied Event names its own part of a sync, not the burst's
        applied = await eventually(lambda: _events(cluster, "chat", "Applied"), "Applied")
        assert {e["message"] for e in applied} == {"applied: slot chat"}, applied
        # embed's own Event is posted by its own status timer: waited for, not assumed
        applied = await eventually(lambda: _events(cluster, "embed", "Applied"), "embed Applied")
        assert {e["message"] for e in applied} == {"applied: slot embed"}, applied

        # invalid spec (an API server without the CEL rules lets it through): Degraded with
        # the loader's code and an Event; the running server is untouched
        await cluster.edit("slots", "chat", {"server": {"extra_args": ["-ngl", "99"]}})

        async def degraded() -> dict[str, Any] | None:
            obj = await cluster.get("slots", "chat")
            cond = condition(obj, "Degraded")
            return obj if cond.get("status") == "True" and cond["observedGeneration"] == 4 else None

        chat = await eventually(degraded, "Degraded")
        assert condition(chat, "Degraded")["reason"] == "InvalidSpec"
        assert chat["status"]["lastError"]["code"] == "slot.hardware_flag"
        assert "slot.hardware_flag" in condition(chat, "Degraded")["message"]
        assert condition(chat, "Ready")["status"] == "True"  # the last good spec still serves
        assert server_pid(chat_port) == chat_pid
        events = await eventually(lambda: _events(cluster, "chat", "InvalidSpec"), "an Event")
        assert events[0]["type"] == "Warning" and "slot.hardware_flag" in events[0]["message"]
        await cluster.edit("slots", "chat", {"server": {"extra_args": ["--load-seconds", "0.3"]}})
        await eventually(lambda: ready(cluster, "chat", 5), "valid again")
        chat = await cluster.get("slots", "chat")
        assert condition(chat, "Degraded")["status"] == "False"
        assert server_pid(chat_port) == chat_pid  # the same spec as before: no restart

        # the server dies: status shows it with no CR change, and it is restored
        os.kill(chat_pid, signal.SIGKILL)

        async def shows_error() -> bool:
            obj = await cluster.get("slots", "chat")
            return condition(obj, "Ready").get("status") == "False" and (obj or {}).get(
                "status", {}
            ).get("state") in ("error", "offline", "starting", "warming")

        await eventually(shows_error, "the dead server in status")
        await eventually(lambda: ready(cluster, "chat", 5), "restored")
        assert server_pid(chat_port) not in (None, chat_pid)
        chat = await cluster.get("slots", "chat")
        assert chat is not None and chat["status"]["lastError"]["code"]
        assert await _events(cluster, "chat", "Error")  # the transition became an Event

        # delete: the finalizer holds the object until the server is stopped
        final_pid = server_pid(chat_port)
        await cluster.delete("slots", "chat")
        await eventually(lambda: _gone(cluster, "chat"), "Slot removed")
        assert (
            not psutil.pid_exists(final_pid or -1) or psutil.Process(final_pid).status() == "zombie"
        )
        assert server_pid(chat_port) is None
        assert op.manager.known("chat") is None
        assert server_pid(embed_port) == embed_pid
        # kopf's own INFO lines ("Handler ... succeeded") are not posted as Events
        assert not [e for e in await cluster.events() if e.get("reason") == "Logging"]
    assert_rbac_allows_exactly(cluster.operator_requests(), namespaces=["default"])


async def _true(value: bool) -> bool:
    return value


async def _degraded_alias(cluster: Cluster, name: str) -> dict[str, Any] | None:
    obj = await cluster.get("aliases", name)
    return obj if condition(obj, "Degraded").get("status") == "True" else None


async def _gone(cluster: Cluster, name: str) -> bool:
    return await cluster.get("slots", name) is None


async def _events(cluster: Cluster, name: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in await cluster.events()
        if e.get("involvedObject", {}).get("name") == name and e.get("reason") == reason
    ]


def _start_operator(cluster: Cluster, state: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONPATH": str(REPO)}
    env.pop("SLOTCTL_CONFIG_DIR", None)
    env.pop("SLOTCTL_STATE_DIR", None)
    command = [
        sys.executable,
        "-m",
        "controller",
        "operator",
        "--all-namespaces",
        "--runtime",
        "process",
        "--state-dir",
        str(state),
        "--config-dir",
        str(state / "config"),
    ]
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


async def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    for _ in range(300):
        if proc.poll() is not None:
            return proc.returncode
        await asyncio.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError("the operator did not stop on SIGTERM")


async def test_operator_subprocess_restart_adopts_and_delete_stops(
    cluster: Cluster, state: Path, tmp_path: Path
) -> None:
    """``slotctl operator -A`` as a user runs it, against a kubeconfig."""
    (port,) = free_ports(1)
    log = tmp_path / "operator.log"
    proc = _start_operator(cluster, state, log)
    try:
        await cluster.create(
            {**model("m-chat"), "metadata": {"name": "m-chat", "namespace": "team-a"}}
        )
        body = slot("chat", "m-chat", port)
        body["metadata"]["namespace"] = "team-a"
        await cluster.create(body)

        async def ready_in(generation: int) -> dict[str, Any] | None:
            obj = await cluster.get("slots", "chat", "team-a")
            cond = condition(obj, "Ready")
            ok = cond.get("status") == "True" and cond.get("observedGeneration") == generation
            return obj if ok else None

        obj = await eventually(lambda: ready_in(1), "Ready (subprocess operator)", timeout=60)
        assert await answers(obj["status"]["endpoint"])
        await cluster.create(alias("assistant", "m-chat", namespace="team-a"))
        await eventually(lambda: alias_ready(cluster, "assistant", "team-a"), "Alias Ready")
        await cluster.create(adapter("sql", "m-chat", "/adapters/sql.gguf", namespace="team-a"))
        await eventually(lambda: adapter_ready(cluster, "sql", "team-a"), "Adapter Ready")
        pid = server_pid(port)
        assert pid is not None

        # restart the operator: the server keeps running and is adopted, not duplicated
        assert await _stop(proc) == 0, log.read_text()
        assert server_pid(port) == pid
        proc = _start_operator(cluster, state, log)
        await cluster.edit("slots", "chat", {"priority": 70}, namespace="team-a")
        await eventually(lambda: ready_in(2), "Ready after the restart", timeout=60)
        assert servers_on(port) == [pid]
        slot_processes = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(port) in " ".join(p.info["cmdline"] or [])
        ]
        assert [p.pid for p in slot_processes] == [pid]

        # delete: the server is stopped, then the finalizer goes
        await cluster.delete("slots", "chat", namespace="team-a")
        await eventually(
            lambda: _missing(cluster, "chat", "team-a"), "Slot removed (subprocess)", timeout=60
        )
        assert server_pid(port) is None
        assert await _stop(proc) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_rbac_allows_exactly(cluster.operator_requests(), namespaces=[])


async def _missing(cluster: Cluster, name: str, namespace: str) -> bool:
    return await cluster.get("slots", name, namespace) is None
