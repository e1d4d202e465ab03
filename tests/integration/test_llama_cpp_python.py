"""The llama-cpp-python provider against the real server (``python -m llama_cpp.server``).

Everything goes through slotctl's own pieces: the provider template builds the argv,
the process runtime starts it, the real probe sees it warm up and become ready. The
model is a ~120 KB random-weight llama written by ``tiny_gguf`` (loads in milliseconds).

Mandatory: ``llama-cpp-python[server]`` and ``gguf`` are part of the ``test`` extra.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.probes.readiness import ProbeOutcome, ProbeResult, probe_once, wait_ready
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.runtime.base import LaunchSpec, RunStatus
from controller.runtime.process.runtime import ProcessRuntime
from controller.spec.schema import ModelSpec, SlotSpec
from tests.integration.helpers import free_port

WARMUP_TIMEOUT_S = 60.0
MODEL_ID = "tiny"


@pytest.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[ProcessRuntime]:
    rt = ProcessRuntime(tmp_path / "state", kill_grace_s=5.0)
    yield rt
    for observed in await rt.list_managed():
        await rt.stop(observed.slot, timeout=5.0)


def _launch(name: str, source: str, *, slot_type: str = "llm") -> LaunchSpec:
    slot = SlotSpec.model_validate(
        {
            "name": name,
            "provider": "llama-cpp-python",
            "device": "cpu",
            "port": free_port(),
            "type": slot_type,
            "model": {"default": MODEL_ID},
        }
    )
    model = ModelSpec.model_validate(
        {"id": MODEL_ID, "source": source, "kind": slot_type, "context_length": 128}
    )
    return build_launch(slot, model, BuildContext(runtime="process"))


async def _settle(
    runtime: ProcessRuntime, launch: LaunchSpec, outcomes: list[ProbeOutcome] | None = None
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


async def _ready(runtime: ProcessRuntime, launch: LaunchSpec) -> None:
    await runtime.start(launch)
    result = await _settle(runtime, launch)
    assert result.outcome is ProbeOutcome.READY, (result, await runtime.logs(launch.slot))


async def _post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        data: dict[str, Any] = json.loads(text)
        return data


# ---------------------------------------------------------------------- (a) warming -> ready


async def test_warming_then_ready_through_the_real_probe(
    runtime: ProcessRuntime, gguf_path: Path
) -> None:
    launch = _launch("lcp", str(gguf_path))
    assert launch.argv[1:3] == ("-m", "llama_cpp.server")
    assert "--n_ctx" in launch.argv and "--embedding" not in launch.argv
    observed = await runtime.start(launch)
    assert observed.status is RunStatus.RUNNING
    # The server loads the model before it binds its port: right after the spawn the
    # connection is refused, which the probe reads as still warming, never as an error.
    async with aiohttp.ClientSession() as session:
        early = await probe_once(session, launch.endpoint, launch.probe)
    assert early.outcome is ProbeOutcome.STILL_WARMING, early
    outcomes: list[ProbeOutcome] = []
    result = await _settle(runtime, launch, outcomes)
    assert result.outcome is ProbeOutcome.READY, (result, await runtime.logs("lcp"))
    assert result.models == (MODEL_ID,)
    assert outcomes[-1] is ProbeOutcome.READY
    assert set(outcomes[:-1]) <= {ProbeOutcome.STILL_WARMING}
    assert result.message == "/v1/completions answered"
    assert (await runtime.inspect("lcp")).running


# ---------------------------------------------------------------------- (b) inference


async def test_completion_through_the_slot_endpoint(
    runtime: ProcessRuntime, gguf_path: Path
) -> None:
    launch = _launch("lcp-complete", str(gguf_path))
    await _ready(runtime, launch)
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    data = await _post_json(launch.endpoint + "/v1/completions", body)
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


async def test_streamed_chat_completion(runtime: ProcessRuntime, gguf_path: Path) -> None:
    # The tiny model carries no chat template: the server falls back to its default
    # chat format (llama-2), so no ModelSpec.chat_template is needed.
    launch = _launch("lcp-chat", str(gguf_path))
    await _ready(runtime, launch)
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
        session.post(launch.endpoint + "/v1/chat/completions", json=body) as resp,
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
    logs = await runtime.logs("lcp-chat", tail=0)
    assert any("Using fallback chat format: llama-2" in line for line in logs), logs[-20:]


# ---------------------------------------------------------------------- (c) embeddings


async def test_embedding_slot(runtime: ProcessRuntime, gguf_path: Path) -> None:
    launch = _launch("lcp-embed", str(gguf_path), slot_type="embedding")
    assert "--embedding" in launch.argv
    assert launch.argv[launch.argv.index("--embedding") + 1] == "true"
    assert launch.probe.sentinel is not None
    assert launch.probe.sentinel.path == "/v1/embeddings"
    await _ready(runtime, launch)
    body = {"model": MODEL_ID, "input": ["hello", "world"]}
    data = await _post_json(launch.endpoint + "/v1/embeddings", body)
    assert data["object"] == "list"
    assert data["model"] == MODEL_ID
    assert [item["index"] for item in data["data"]] == [0, 1]
    for item in data["data"]:
        assert item["object"] == "embedding"
        vector = item["embedding"]
        assert len(vector) == 32  # the tiny model's width, mean-pooled
        assert all(isinstance(x, float) for x in vector)
    assert data["data"][0]["embedding"] != data["data"][1]["embedding"]
    assert data["usage"]["prompt_tokens"] > 0


# ---------------------------------------------------------------------- (d) faults


async def test_missing_model_file_exits(runtime: ProcessRuntime, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "missing.gguf"
    launch = _launch("lcp-missing", str(missing))
    await runtime.start(launch)
    result = await _settle(runtime, launch)
    assert result.outcome is ProbeOutcome.EXITED, result
    observed = await runtime.inspect("lcp-missing")
    assert observed.status is RunStatus.EXITED
    assert observed.exit_code not in (None, 0), observed
    logs = await runtime.logs("lcp-missing")
    assert any(f"Model path does not exist: {missing}" in line for line in logs), logs
