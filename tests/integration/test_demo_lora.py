"""The demo server's LoRA adapter doubles (vLLM's and SGLang's documented APIs) against
slotctl's real adapter loader (:class:`controller.probes.adapters.HttpAdapterLoader`, what
the manager uses): vLLM's routes answer 404 without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``,
loads and unloads by name, a duplicate or a load past ``--max-loras`` refused, SGLang's
answers, ``/v1/models``' ``parent``, and answers that name the adapter that made them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.probes.adapters import HttpAdapterLoader
from tests.integration.test_demo_server import MODEL, Demo, Spawn


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    started: list[Demo] = []

    def start(*knobs: str) -> Demo:
        started.append(Demo(knobs, MODEL))
        return started[-1]

    yield start
    for demo in started:
        demo.stop()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name in ("sql", "poem", "code"):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"adapter")
        out[name] = str(path)
    return out


async def _chat(base: str, model: str) -> tuple[int, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with (
        aiohttp.ClientSession() as http,
        http.post(base + "/v1/chat/completions", json=body) as r,
    ):
        return r.status, await r.json(content_type=None)


async def _models(base: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(base + "/v1/models") as r:
        data: list[dict[str, Any]] = (await r.json())["data"]
        return data


async def test_vllm_routes_are_404_without_the_environment_variable(
    spawn: Spawn, files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    demo = spawn("--max-loras", "2")
    await demo.ready()
    error = await HttpAdapterLoader().load(demo.base, "vllm", "sql", files["sql"], 5)
    assert "HTTP 404" in error and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in error
    # SGLang's routes need no variable
    assert await HttpAdapterLoader().load(demo.base, "sglang", "sql", files["sql"], 5) == ""


async def test_vllm_load_unload_and_the_answers_name_the_adapter(
    spawn: Spawn, files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    demo = spawn("--max-loras", "2")
    await demo.ready()
    loader = HttpAdapterLoader()
    assert await loader.load(demo.base, "vllm", "sql", files["sql"], 5) == ""
    again = await loader.load(demo.base, "vllm", "sql", files["sql"], 5)
    assert "HTTP 400" in again and "already been loaded" in again
    assert await loader.load(demo.base, "vllm", "poem", files["poem"], 5) == ""
    full = await loader.load(demo.base, "vllm", "code", files["code"], 5)
    assert "HTTP 400" in full and "--max-loras" in full  # the double is strict: caught
    missing = await loader.load(demo.base, "vllm", "x", "/no/such/file", 5)
    assert "HTTP 400" in missing
    listed = {m["id"]: m for m in await _models(demo.base)}
    assert listed["sql"]["parent"] == MODEL and listed["sql"]["root"] == files["sql"]
    status, body = await _chat(demo.base, "sql")
    assert status == 200 and body["model"] == "sql"
    assert body["choices"][0]["message"]["content"].startswith("[sql]")
    status, body = await _chat(demo.base, MODEL)  # the base: no adapter's mark
    assert status == 200 and "[" not in body["choices"][0]["message"]["content"]
    assert await loader.unload(demo.base, "vllm", "sql", 5) == ""
    gone = await loader.unload(demo.base, "vllm", "sql", 5)
    assert "HTTP 404" in gone
    status, body = await _chat(demo.base, "sql")
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_sglang_answers_and_the_base_colon_adapter_spelling(
    spawn: Spawn, files: dict[str, str]
) -> None:
    demo = spawn("--max-loras", "1", "--lora-load-seconds", "0.1")
    await demo.ready()
    async with aiohttp.ClientSession() as http:
        body = {"lora_name": "poem", "lora_path": files["poem"]}
        async with http.post(demo.base + "/load_lora_adapter", json=body) as r:
            assert r.status == 200 and (await r.json())["success"] is True
        async with http.post(demo.base + "/load_lora_adapter", json=body) as r:
            answer = await r.json()
            assert r.status == 400 and answer["success"] is False and answer["error_message"]
    status, reply = await _chat(demo.base, f"{MODEL}:poem")
    assert status == 200 and reply["choices"][0]["message"]["content"].startswith("[poem]")
    assert await HttpAdapterLoader().unload(demo.base, "sglang", "poem", 5) == ""
    error = await HttpAdapterLoader().unload(demo.base, "sglang", "poem", 5)
    assert "HTTP 400" in error and "not loaded" in error
