"""The llama-cpp-python provider in Docker, against the real engine and the real server.

The slot runs ``python -m llama_cpp.server`` (the host's interpreter, ``server.binary``)
in a container of the tiny imported image (``docker_test_image``): the runtime bind-mounts
``/usr``, ``/etc`` and the Python installs read-only, the provider mounts the model file
read-only, and the container uses the host network, so the server answers on
``127.0.0.1:<port>``. The model is the ~120 KB random-weight llama from ``tiny_gguf``.
Every container a test makes carries its ``docker_stack`` name and is removed afterwards.

A model file that does not exist on the host cannot be bind-mounted: the engine refuses
the container at create time, so ``start`` raises a typed ``SlotSpawnFailed`` naming the
path and no container is left (the slot manager refuses even earlier, before the runtime
is asked). A model file that exists but cannot be loaded gets as far as the server: the
container starts, the server exits, and the probe reads ``EXITED``.

Mandatory: ``llama-cpp-python[server]`` and ``gguf`` are part of the ``test`` extra.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.model.errors import SlotSpawnFailed
from controller.probes.readiness import ProbeOutcome, ProbeResult, probe_once, wait_ready
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.runtime.base import STACK_LABEL, LaunchSpec, Mount, RunStatus
from controller.runtime.docker.runtime import DockerRuntime, container_name
from controller.spec.schema import ModelSpec, SlotSpec
from tests.integration.docker_engine import Engine
from tests.integration.helpers import free_port

pytestmark = pytest.mark.docker

WARMUP_TIMEOUT_S = 60.0
MODEL_ID = "tiny"
# The container runs the host's binaries and interpreter (the venv and its base install).
BASE_MOUNTS = tuple(
    Mount(path, path) for path in dict.fromkeys(("/usr", "/etc", sys.base_prefix, sys.prefix))
)


@pytest.fixture
async def runtime(docker_engine: Engine, docker_stack: str) -> AsyncIterator[DockerRuntime]:
    # Requesting docker_stack first makes its cleanup (force-remove every container of
    # the stack) run after this runtime is closed.
    rt = DockerRuntime(base_url=docker_engine.base_url, base_mounts=BASE_MOUNTS)
    yield rt
    await rt.close()


def _launch(name: str, source: str, *, stack: str, image: str) -> LaunchSpec:
    slot = SlotSpec.model_validate(
        {
            "name": f"{name}-{stack}",
            "provider": "llama-cpp-python",
            "device": "cpu",
            "port": free_port(),
            "model": {"default": MODEL_ID},
            "server": {"image": image, "binary": sys.executable},
        }
    )
    model = ModelSpec.model_validate(
        {"id": MODEL_ID, "source": source, "kind": "llm", "context_length": 128}
    )
    return build_launch(slot, model, BuildContext(runtime="docker", stack=stack))


async def _settle(
    runtime: DockerRuntime, launch: LaunchSpec, outcomes: list[ProbeOutcome] | None = None
) -> ProbeResult:
    async with aiohttp.ClientSession() as session:

        async def attempt() -> ProbeResult:
            result = await probe_once(session, launch.endpoint, launch.probe)
            if outcomes is not None:
                outcomes.append(result.outcome)
            return result

        async def alive() -> bool:
            return (await runtime.inspect(launch.slot)).running

        return await wait_ready(attempt, alive=alive, warmup_timeout_s=WARMUP_TIMEOUT_S)


async def _completion(endpoint: str) -> None:
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(endpoint + "/v1/completions", json=body) as resp,
    ):
        text = await resp.text()
        assert resp.status == 200, text
    data: dict[str, Any] = json.loads(text)
    assert data["object"] == "text_completion"
    assert data["model"] == MODEL_ID
    assert len(data["choices"]) == 1
    choice = data["choices"][0]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("length", "stop")
    usage = data["usage"]
    assert usage["prompt_tokens"] > 0
    assert 0 < usage["completion_tokens"] <= 4 or choice["finish_reason"] == "stop"
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def _streamed_chat(endpoint: str) -> None:
    # The tiny model carries no chat template: the server falls back to llama-2.
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    chunks: list[dict[str, Any]] = []
    done = False
    async with (
        aiohttp.ClientSession() as session,
        session.post(endpoint + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue  # blank separators, ": ping" comments
            payload = line.removeprefix("data:").strip()
            assert not done, f"data after [DONE]: {payload}"
            if payload == "[DONE]":
                done = True
                continue
            chunks.append(json.loads(payload))
    assert done, "the stream did not end with [DONE]"
    assert len(chunks) >= 2, chunks
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["model"] == MODEL_ID for c in chunks)
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


# ---------------------------------------------------------------------- (a) serving


async def test_warming_then_ready_then_inference_in_docker(
    runtime: DockerRuntime,
    gguf_path: Path,
    docker_stack: str,
    docker_test_image: str,
    docker_client: Any,
) -> None:
    launch = _launch("lcpd", str(gguf_path), stack=docker_stack, image=docker_test_image)
    assert launch.image == docker_test_image
    assert launch.argv[:3] == (sys.executable, "-m", "llama_cpp.server")
    assert launch.model_path == str(gguf_path)
    observed = await runtime.start(launch)
    assert observed.status is RunStatus.RUNNING and observed.managed
    assert observed.stack == docker_stack
    # The server imports llama_cpp and loads the model before it binds its port: right
    # after the container starts the connection is refused, i.e. still warming.
    async with aiohttp.ClientSession() as session:
        early = await probe_once(session, launch.endpoint, launch.probe)
    assert early.outcome is ProbeOutcome.STILL_WARMING, early

    outcomes: list[ProbeOutcome] = []
    result = await _settle(runtime, launch, outcomes)
    assert result.outcome is ProbeOutcome.READY, (result, await runtime.logs(launch.slot))
    assert result.models == (MODEL_ID,)
    assert result.message == "/v1/completions answered"
    assert outcomes[-1] is ProbeOutcome.READY
    assert set(outcomes[:-1]) <= {ProbeOutcome.STILL_WARMING}
    assert (await runtime.inspect(launch.slot)).running

    # What the engine was asked for: host network, every bind read-only, the model file
    # among them.
    container = docker_client.containers.get(container_name(launch.slot))
    assert container.attrs["HostConfig"]["NetworkMode"] == "host"
    binds = {m["Destination"]: m for m in container.attrs["Mounts"]}
    assert binds[str(gguf_path)]["Source"] == str(gguf_path)
    assert {m.target for m in BASE_MOUNTS} <= set(binds)
    assert all(not m["RW"] for m in binds.values())

    await _completion(launch.endpoint)
    await _streamed_chat(launch.endpoint)
    logs = await runtime.logs(launch.slot, tail=0)
    assert any("Using fallback chat format: llama-2" in line for line in logs), logs[-20:]

    stopped = await runtime.stop(launch.slot, timeout=5)
    assert stopped.status is RunStatus.EXITED
    assert (await runtime.inspect(launch.slot)).status is RunStatus.MISSING


# ---------------------------------------------------------------------- (b) faults


async def test_missing_model_file_is_refused_at_create_time(
    docker_engine: Engine,
    tmp_path: Path,
    docker_stack: str,
    docker_test_image: str,
    docker_client: Any,
) -> None:
    # As a user hits it: the models directory exists (and is even mounted into the
    # container), the file the model names inside it does not. The provider binds the
    # model *file* read-only, and the engine cannot bind a source that does not exist:
    # the container is refused at create time, never started, and nothing is left.
    models = tmp_path / "models"
    models.mkdir()
    (models / "other.gguf").write_bytes(b"")
    missing = models / "missing.gguf"
    runtime = DockerRuntime(
        base_url=docker_engine.base_url, base_mounts=(*BASE_MOUNTS, Mount(str(models), str(models)))
    )
    try:
        launch = _launch("lcpd-missing", str(missing), stack=docker_stack, image=docker_test_image)
        assert launch.model_path == str(missing)
        with pytest.raises(SlotSpawnFailed) as caught:
            await runtime.start(launch)
        assert str(missing) in str(caught.value), caught.value
        assert "does not exist" in str(caught.value), caught.value
        assert caught.value.details["slot"] == launch.slot
        assert (await runtime.inspect(launch.slot)).status is RunStatus.MISSING
        assert await runtime.logs(launch.slot) == []
        left = docker_client.containers.list(
            all=True, filters={"label": f"{STACK_LABEL}={docker_stack}"}
        )
        assert left == []
    finally:
        await runtime.close()


async def test_unloadable_model_file_exits_with_the_servers_error(
    runtime: DockerRuntime, tmp_path: Path, docker_stack: str, docker_test_image: str
) -> None:
    # A model file that exists (so it can be mounted) but is no GGUF: the container
    # starts, the server fails to load it and exits; the probe reads EXITED.
    broken = tmp_path / "models" / "broken.gguf"
    broken.parent.mkdir()
    broken.write_bytes(b"this is not a gguf file\n" * 64)
    launch = _launch("lcpd-broken", str(broken), stack=docker_stack, image=docker_test_image)
    started = await runtime.start(launch)
    assert started.managed
    result = await _settle(runtime, launch)
    assert result.outcome is ProbeOutcome.EXITED, (result, await runtime.logs(launch.slot))
    observed = await runtime.inspect(launch.slot)
    assert observed.status is RunStatus.EXITED
    assert observed.exit_code not in (None, 0), observed
    assert f"exited with code {observed.exit_code}" in observed.message
    logs = await runtime.logs(launch.slot)
    assert any(f"Failed to load model from file: {broken}" in line for line in logs), logs
