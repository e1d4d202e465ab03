"""The demo server's LoRA adapters: vLLM's and SGLang's runtime adapter APIs as
documented-contract doubles, so slotctl's adapter residency is tested against a server.

Served with ``--max-loras N`` (N > 0; vLLM's ``--enable-lora --max-loras N``); see
docs/adapters.md for the engine documentation each route follows:

``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (vLLM)
    only while ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set in the server's environment (as
    vLLM attaches these routes only then: else the path is unknown, 404). 200 once loaded
    (after ``--lora-load-seconds``); 400 for a name already loaded, a path that does not
    exist, or no place left (this double is stricter than vLLM: it refuses what would
    exceed ``--max-loras``, so a controller that overfills a slot is caught).
``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (vLLM)
    200 once unloaded; 404 for a name not loaded.
``POST /load_lora_adapter``, ``POST /unload_lora_adapter`` (SGLang)
    the same bodies; 200 with ``{"success": true}``, 400 with ``{"success": false,
    "error_message"}`` otherwise.

A request naming a loaded adapter in ``model`` (vLLM) or ``base:adapter`` (SGLang) is
answered with text that starts ``[adapter]`` and ``model`` the name asked for, so a test
can tell which weights answered; ``/v1/models`` lists each adapter with ``parent`` (the
base model) and ``root`` (its path), as vLLM's does.
"""

from __future__ import annotations

import json
import os
import threading
import time

from controller.demo.api import ApiError, DemoState, StateHandler, json_response
from controller.demo.httpd import Request, Response

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs every start
if TYPE_CHECKING:
    from typing import Any

__all__ = ["LORA_ROUTES", "lora_routes"]

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_LOCK = threading.Lock()


def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(request.body.decode("utf-8") or "{}")
    except ValueError as err:
        raise ApiError(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
        raise ApiError(400, "lora_name (a string) is required", param="lora_name")
    return body


def _load(state: DemoState, body: dict[str, Any]) -> str:
    """Load ``body``'s adapter; "" on success, else why not (a 400)."""
    name, path = body["lora_name"], body.get("lora_path")
    if not isinstance(path, str) or not path:
        return "lora_path (a string) is required"
    with _LOCK:
        if name in state.adapters:
            return f"The lora adapter '{name}' has already been loaded."
        if len(state.adapters) + len(state.adapters_loading) >= state.config.max_loras:
            return f"no room: {state.config.max_loras} adapters are loaded (--max-loras)"
        if not os.path.exists(path):  # noqa: PTH110 (no pathlib: the demo starts cheaply)
            return f"No adapter found for {path}"
        state.adapters_loading.add(name)
    try:
        if state.config.lora_load_seconds:
            time.sleep(state.config.lora_load_seconds)
    finally:
        with _LOCK:
            state.adapters_loading.discard(name)
            state.adapters[name] = path
            state.adapter_loads += 1
    print(f"slotctl-demo adapter loaded name={name}", flush=True)
    return ""


def _unload(state: DemoState, body: dict[str, Any]) -> bool:
    with _LOCK:
        gone = state.adapters.pop(body["lora_name"], None) is not None
    if gone:
        print(f"slotctl-demo adapter unloaded name={body['lora_name']}", flush=True)
    return gone


def handle_vllm_load(state: DemoState, request: Request) -> Response:
    body = _body(request)
    why = _load(state, body)
    if why:
        raise ApiError(400, why, param="lora_name")
    name = body["lora_name"]
    return Response(200, f"Success: LoRA adapter '{name}' added successfully.".encode())


def handle_vllm_unload(state: DemoState, request: Request) -> Response:
    body = _body(request)
    if not _unload(state, body):
        message = f"The lora adapter '{body['lora_name']}' cannot be found."
        raise ApiError(404, message, code="not_found", param="lora_name")
    name = body["lora_name"]
    return Response(200, f"Success: LoRA adapter '{name}' removed successfully.".encode())


def handle_sglang_load(state: DemoState, request: Request) -> Response:
    why = _load(state, _body(request))
    return json_response({"success": not why, "error_message": why}, 400 if why else 200)


def handle_sglang_unload(state: DemoState, request: Request) -> Response:
    body = _body(request)
    gone = _unload(state, body)
    why = "" if gone else f"LoRA adapter {body['lora_name']} is not loaded"
    return json_response({"success": gone, "error_message": why}, 200 if gone else 400)


LORA_ROUTES: tuple[tuple[str, str, StateHandler], ...] = (
    ("POST", "/load_lora_adapter", handle_sglang_load),
    ("POST", "/unload_lora_adapter", handle_sglang_unload),
)
_VLLM_ROUTES: tuple[tuple[str, str, StateHandler], ...] = (
    ("POST", "/v1/load_lora_adapter", handle_vllm_load),
    ("POST", "/v1/unload_lora_adapter", handle_vllm_unload),
)


def lora_routes(state: DemoState) -> tuple[tuple[str, str, StateHandler], ...]:
    """The adapter routes this server serves (none without ``--max-loras``; vLLM's only
    with :data:`RUNTIME_ENV` set)."""
    if state.config.max_loras <= 0:
        return ()
    runtime = os.environ.get(RUNTIME_ENV, "").lower() not in ("", "0", "false")
    return (*LORA_ROUTES, *(_VLLM_ROUTES if runtime else ()))
