"""The adapter protocol of a slot's server: load and unload a LoRA adapter at run time, by
capability (the slot's ``lora_api``), over plain HTTP (:func:`controller.probes.http.plain`).

What each engine documents (docs/adapters.md cites the sources):

- vLLM: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``; the routes exist only when the server
  runs with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set (else 404), started with
  ``--enable-lora``, ``--max-loras`` and ``--max-lora-rank``. A request then names the
  adapter in ``model``.
- SGLang: ``POST /load_lora_adapter`` ``{"lora_name", "lora_path"}`` (200 on success,
  400 with ``success: false`` and a message otherwise) and ``POST /unload_lora_adapter``
  ``{"lora_name"}``; a request names ``base:adapter`` in ``model``.

llama.cpp's ``llama-server`` and llama-cpp-python's server are given their adapters at
start (the launch, :mod:`controller.providers.templates`): nothing is loaded here.
"""

from __future__ import annotations

from typing import Final, Protocol

import aiohttp

from controller.probes.http import aiohttp_request, plain

__all__ = ["RUNTIME_PATHS", "AdapterLoader", "HttpAdapterLoader"]

# api -> (load path, unload path)
RUNTIME_PATHS: Final[dict[str, tuple[str, str]]] = {
    "vllm": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
    "sglang": ("/load_lora_adapter", "/unload_lora_adapter"),
}


def _said(body: object) -> str:
    """What an error answer says: vLLM's ``{"error": {"message"}}`` (or its older flat
    ``message``), SGLang's ``error_message``, FastAPI's ``detail``."""
    if not isinstance(body, dict):
        return ""
    error = body.get("error")
    if isinstance(error, dict):
        body = error
    for key in ("message", "error_message", "detail"):
        said = body.get(key)
        if isinstance(said, str) and said:
            return said
    return ""


class AdapterLoader(Protocol):
    """Loads and unloads adapters in a running server; each call answers "" on success,
    else what failed."""

    async def load(
        self, endpoint: str, api: str, name: str, path: str, timeout_s: float
    ) -> str: ...

    async def unload(self, endpoint: str, api: str, name: str, timeout_s: float) -> str: ...


class HttpAdapterLoader:
    """The real loader (plain HTTP/1.1; aiohttp for an endpoint that is not ``http://``)."""

    async def _post(self, endpoint: str, path: str, body: dict[str, str], timeout_s: float) -> str:
        answer = await plain("POST", endpoint, path, body, timeout_s)
        if answer is None:
            async with aiohttp.ClientSession() as session:
                answer = await aiohttp_request(session, "POST", endpoint + path, body, timeout_s)
        if 200 <= answer.status < 300:
            return ""
        detail = answer.error or f"HTTP {answer.status}"
        said = _said(answer.body)
        if said:
            detail += f": {said[:300]}"
        if answer.status == 404 and path.startswith("/v1/"):
            detail += (
                " (vLLM serves its adapter routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                "set in the server's environment)"
            )
        return f"POST {path}: {detail}"

    async def load(self, endpoint: str, api: str, name: str, path: str, timeout_s: float) -> str:
        if api not in RUNTIME_PATHS:
            return f"the {api} adapter API loads adapters at start, not at run time"
        body = {"lora_name": name, "lora_path": path}
        return await self._post(endpoint, RUNTIME_PATHS[api][0], body, timeout_s)

    async def unload(self, endpoint: str, api: str, name: str, timeout_s: float) -> str:
        if api not in RUNTIME_PATHS:
            return f"the {api} adapter API unloads adapters with a restart only"
        return await self._post(endpoint, RUNTIME_PATHS[api][1], {"lora_name": name}, timeout_s)
