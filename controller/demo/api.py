"""HTTP handlers of the demo server: the OpenAI-compatible endpoints and ``/health``.

Called by :mod:`controller.demo.httpd` (one thread per connection) through the
:class:`~controller.demo.httpd.App` that :func:`build_app` builds; the lifecycle in
``server`` flips :attr:`DemoState.loaded`, these handlers only read it (and count
inference requests for ``--crash-after``); asleep (:mod:`controller.demo.sleep`), inference
answers 503. Errors leave as OpenAI-style bodies
``{"error": {"message", "type", "param", "code"}}``: 400 bad request, 404 unknown model
or path, 405 wrong method, 413 body over 1 MiB, 503 while loading (``/v1/models``
included, as llama-server does).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from controller.demo.config import MAX_TOKENS_LIMIT, DemoConfig
from controller.demo.generate import count_tokens, embedding, embedding_base64, pseudo_tokens
from controller.demo.httpd import App, Handler, Request, Response, Stream
from controller.demo.prefixcache import PrefixCache

__all__ = [
    "ROUTES",
    "ApiError",
    "DemoState",
    "Generation",
    "build_app",
    "error_response",
    "json_response",
]

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs every start
if TYPE_CHECKING:
    from typing import Any

    JSON = dict[str, Any]
DEFAULT_MAX_TOKENS = 16
CRASH_EXIT_STATUS = 3


class DemoState:
    """What the handlers share: the config, whether loading finished, requests seen."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.created = int(time.time())
        self.loaded = False
        self.inference_requests = 0
        self.ballast: bytearray | None = None  # the --memory-mb allocation (device memory)
        self.lock = threading.Lock()
        self.hung = threading.Event()  # --hang-after: set once the server hangs, for good
        # Sleep mode (controller.demo.sleep): the memory tags asleep, the level, the host
        # RAM a level-1 sleeper holds, and whether a level-2 sleep discarded the weights.
        self.sleep_lock = threading.Lock()
        self.asleep: set[str] = set()
        self.level = 0
        self.host_ballast: bytearray | None = None
        self.weights_lost = False
        # LoRA adapters (controller.demo.lora): name -> path, the loads in progress, and
        # how many loads were made (a test sees that a switch loaded nothing).
        self.adapters: dict[str, str] = {}
        self.adapters_loading: set[str] = set()
        self.adapter_loads = 0
        self.cache = PrefixCache(config.prefix_cache)  # what a KV cache would reuse
        # Generations in flight, and what a sleep does to them (its ``mode``, as vLLM's):
        # ``abort`` bumps ``aborts`` (each generation ends at its next token, finish_reason
        # "abort"); ``wait`` waits for ``generating`` to reach 0; ``keep`` pauses them
        # (``paused``) until the wake.
        self.flight = threading.Condition()
        self.generating = 0
        self.aborts = 0
        self.paused = False

    def stall_if_hung(self) -> None:
        """Once hung, the calling thread never goes on (it waits on an event nobody sets):
        no byte more for its request. SIGTERM still stops the process (the main thread)."""
        if self.hung.is_set():
            threading.Event().wait()

    def served_models(self) -> list[str]:
        """Model ids listed by ``/v1/models`` once loaded: none with --empty-models."""
        if not self.loaded or self.config.empty_models:
            return []
        return [self.config.model]


def json_response(data: object, status: int = 200) -> Response:
    """``data`` as a JSON response (``json.dumps`` defaults, as aiohttp's was)."""
    return Response(status, json.dumps(data).encode())


def error_response(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> Response:
    """An OpenAI-style error body."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    return json_response({"error": error}, status=status)


class ApiError(Exception):
    """A refusal rendered as an OpenAI-style error body by :func:`build_app`'s routes."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param

    def response(self) -> Response:
        return error_response(
            self.status, self.message, kind=self.kind, code=self.code, param=self.param
        )


# --- request admission and parameters -------------------------------------------------


def admit(state: DemoState, request: Request) -> tuple[JSON, str]:
    """Gate an inference request: loaded? crash due? valid JSON? served model?"""
    if not state.loaded:
        raise ApiError(503, "the model is still loading", kind="unavailable_error", code="loading")
    if state.asleep:
        raise ApiError(503, "the engine is sleeping", kind="unavailable_error", code="sleeping")
    if state.weights_lost:
        message = "the weights were discarded by a level-2 sleep: reload_weights first"
        raise ApiError(500, message, kind="internal_error", code="weights_discarded")
    _count_inference(state)
    body = _json_body(request)
    return body, _served_model(state, body)


def _count_inference(state: DemoState) -> None:
    with state.lock:
        state.inference_requests += 1
        count = state.inference_requests
    hang = state.config.hang_after
    if hang and count > hang:
        if not state.hung.is_set():
            print(
                f"slotctl-demo hanging: request {count} arrived after {hang} served (--hang-after)",
                file=sys.stderr,
                flush=True,
            )
            state.hung.set()
        state.stall_if_hung()
    limit = state.config.crash_after
    if limit and count > limit:
        print(
            f"slotctl-demo crashing: request {count} arrived after {limit} served (--crash-after)",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(CRASH_EXIT_STATUS)  # abrupt on purpose: no cleanup, sockets just drop


def _json_body(request: Request) -> JSON:
    try:
        body = json.loads(request.body.decode("utf-8"))
    except ValueError as err:
        raise ApiError(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def adapter_of(state: DemoState, model: str) -> str | None:
    """The loaded adapter a request's ``model`` names: its name (vLLM) or ``base:name``
    (SGLang); None: the base model (or nothing served)."""
    if model in state.adapters:
        return model
    base, sep, name = model.rpartition(":")
    if sep and base == state.config.model and name in state.adapters:
        return name
    return None


def _served_model(state: DemoState, body: JSON) -> str:
    served = state.served_models()
    requested = body.get("model")
    if requested is None and served:
        return served[0]
    if requested is not None and not isinstance(requested, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if served and requested is not None and adapter_of(state, requested) is not None:
        return requested
    if requested not in served:
        message = f"The model '{requested}' does not exist" if requested else "no model is loaded"
        raise ApiError(404, message, code="model_not_found", param="model")
    return requested


def _max_tokens(state: DemoState, body: JSON, *names: str) -> int:
    """A request's token budget: its own, else the server's default (``--sampling``'s
    ``max_tokens``, as llama-server's ``--n-predict``), else :data:`DEFAULT_MAX_TOKENS`."""
    name = next((n for n in names if body.get(n) is not None), names[0])
    value = body.get(name, state.config.sampling.get("max_tokens", DEFAULT_MAX_TOKENS))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    if not 0 <= value <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"'{name}' must be between 0 and {MAX_TOKENS_LIMIT}", param=name)
    return value


def _flag(body: JSON, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", param=name)
    return value


def _include_usage(body: JSON) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return _flag(options, "include_usage")


def _strings(value: object, name: str) -> list[str]:
    """A string or a non-empty list of strings, as a list."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise ApiError(400, f"'{name}' must be a string or a non-empty list of strings", param=name)


def _message_text(message: object) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, "each message must be an object with a 'role'", param="messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ApiError(400, "message 'content' must be a string or a list of parts", param="messages")


def _messages_text(body: JSON) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    return "\n".join(_message_text(m) for m in messages)


# --- generation -----------------------------------------------------------------------


class Generation:
    """One response being generated: its envelope fields and its paced tokens."""

    def __init__(
        self,
        kind: str,
        model: str,
        tokens: list[str],
        prompt_tokens: int,
        rate: float,
        state: DemoState | None = None,
        cached: int | None = None,
    ) -> None:
        self.kind = kind  # "text_completion" or "chat.completion"
        self.model = model
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.tokens_per_second = rate
        self.state = state  # a stream in flight stalls once the server hangs
        self.cached = cached  # prompt tokens the prefix cache held (None: no cache)
        self.id = os.urandom(12).hex()
        self.created = int(time.time())
        self.aborted = False  # a sleep (mode=abort) ended it early

    @property
    def finish_reason(self) -> str:
        return "abort" if self.aborted else "length"

    def envelope(self, obj: str) -> JSON:
        prefix = "chatcmpl-" if self.kind.startswith("chat") else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> JSON:
        completion = len(self.tokens)
        total = self.prompt_tokens + completion
        usage: JSON = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": total,
        }
        if self.cached is not None:  # as OpenAI's Chat Completions say it
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return usage

    def timings(self) -> JSON:
        """llama.cpp's ``timings``' token counts: cached and evaluated prompt tokens."""
        cached = self.cached or 0
        return {
            "cache_n": cached,
            "prompt_n": self.prompt_tokens - cached,
            "predicted_n": len(self.tokens),
        }

    def answer(self, obj: str, choices: list[JSON]) -> JSON:
        """A whole (non-streamed) answer: the envelope, ``choices``, ``usage`` and, with a
        prefix cache, llama.cpp's ``timings``."""
        out = {**self.envelope(obj), "choices": choices, "usage": self.usage()}
        if self.cached is not None:
            out["timings"] = self.timings()
        return out

    def paced(self) -> Iterator[str]:
        """Yield the tokens at ``tokens_per_second`` (token i is due at (i+1)/rate); a
        generation in flight counts in ``state.generating`` and heeds a sleep's mode."""
        state = self.state
        if state is None:
            yield from self._paced(None, 0)
            return
        with state.flight:
            state.generating += 1
            epoch = state.aborts
        try:
            yield from self._paced(state, epoch)
        finally:
            with state.flight:
                state.generating -= 1
                state.flight.notify_all()

    def _paced(self, state: DemoState | None, epoch: int) -> Iterator[str]:
        start = time.monotonic()
        for i, token in enumerate(self.tokens):
            if self.tokens_per_second:
                delay = start + (i + 1) / self.tokens_per_second - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if state is not None:
                state.stall_if_hung()
                with state.flight:
                    while state.paused and state.aborts == epoch:  # mode=keep: until woken
                        state.flight.wait()
                    if state.aborts != epoch:  # mode=abort: it ends here
                        self.aborted = True
                        return
            yield token

    def text(self) -> str:
        return "".join(self.paced())


def _generation(state: DemoState, kind: str, model: str, prompt: str, count: int) -> Generation:
    adapter = adapter_of(state, model)
    tokens = pseudo_tokens(model, prompt, count)
    if adapter is not None and tokens:  # the answer names the weights that made it
        tokens[0] = f" [{adapter}]" + tokens[0]
    if kind.startswith("chat") and tokens:
        tokens[0] = tokens[0].lstrip()  # chat content starts without the joining space
    cached: int | None = None
    cache = state.cache
    if cache.entries:
        words = tuple(prompt.split())
        cached = cache.lookup(words)
        cache.store(words + tuple("".join(tokens).split()))
    return Generation(
        kind,
        model,
        tokens,
        count_tokens(prompt),
        state.config.tokens_per_second,
        state,
        cached,
    )


def _stream(events: Iterator[JSON]) -> Stream:
    """``events`` as server-sent events, one write (one flush) each, then ``[DONE]``."""

    def chunks() -> Iterator[bytes]:
        for event in events:
            yield b"data: " + json.dumps(event).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return Stream(chunks(), "text/event-stream", {"Cache-Control": "no-cache"})


# --- handlers -------------------------------------------------------------------------


def handle_models(state: DemoState, request: Request) -> Response:
    if not state.loaded:
        # Like llama-server: 503 "Loading model" until the weights are in. An empty list
        # is reserved for a server that is up without a model (--empty-models).
        raise ApiError(503, "Loading model", kind="unavailable_error", code="loading")
    meta = {"visible_devices": visible_devices()}
    data = [
        {
            "id": model,
            "object": "model",
            "created": state.created,
            "owned_by": "slotctl-demo",
            "meta": meta,
        }
        for model in state.served_models()
    ]
    base = state.served_models()
    for name, path in list(state.adapters.items()) if base else []:
        entry = {"id": name, "object": "model", "created": state.created}
        entry.update(owned_by="slotctl-demo", root=path, parent=base[0])
        data.append(entry)
    return json_response({"object": "list", "data": data})


# What a server is shown of the host's GPUs (the controller sets these from its placement);
# the demo server reports them, so a test sees which GPUs a server was given.
_VISIBILITY = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)


def visible_devices() -> dict[str, str]:
    """The GPU visibility variables of this server's environment (those set)."""
    return {name: os.environ[name] for name in _VISIBILITY if name in os.environ}


def handle_health(state: DemoState, request: Request) -> Response:
    if state.loaded:
        return json_response({"status": "ok"})
    return json_response({"status": "loading"}, status=503)


def handle_props(state: DemoState, request: Request) -> Response:
    """llama-server's ``GET /props``, the part a test reads: the sampling defaults the
    server was started with (``default_generation_settings.params``)."""
    settings = {"params": dict(state.config.sampling)}
    return json_response(
        {"default_generation_settings": settings, "model_alias": state.config.model}
    )


def handle_completions(state: DemoState, request: Request) -> Response | Stream:
    body, model = admit(state, request)
    prompt = "\n".join(_strings(body.get("prompt"), "prompt"))
    gen = _generation(
        state, "text_completion", model, prompt, _max_tokens(state, body, "max_tokens")
    )
    if _flag(body, "stream"):
        return _stream(_completion_events(gen, _include_usage(body)))
    text = gen.text()
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
    return json_response(gen.answer("text_completion", [choice]))


def _completion_events(gen: Generation, include_usage: bool) -> Iterator[JSON]:
    def chunk(text: str, finish: str | None) -> JSON:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**gen.envelope("text_completion"), "choices": [choice]}

    for token in gen.paced():
        yield chunk(token, None)
    yield chunk("", gen.finish_reason)
    if include_usage:
        yield gen.answer("text_completion", [])


def handle_chat(state: DemoState, request: Request) -> Response | Stream:
    body, model = admit(state, request)
    count = _max_tokens(state, body, "max_completion_tokens", "max_tokens")
    gen = _generation(state, "chat.completion", model, _messages_text(body), count)
    if _flag(body, "stream"):
        return _stream(_chat_events(gen, _include_usage(body)))
    message = {"role": "assistant", "content": gen.text()}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": gen.finish_reason}
    return json_response(gen.answer("chat.completion", [choice]))


def _chat_events(gen: Generation, include_usage: bool) -> Iterator[JSON]:
    def chunk(delta: JSON, finish: str | None) -> JSON:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**gen.envelope("chat.completion.chunk"), "choices": [choice]}

    yield chunk({"role": "assistant", "content": ""}, None)
    for token in gen.paced():
        yield chunk({"content": token}, None)
    yield chunk({}, gen.finish_reason)
    if include_usage:
        yield gen.answer("chat.completion.chunk", [])


def handle_embeddings(state: DemoState, request: Request) -> Response:
    body, model = admit(state, request)
    texts = _strings(body.get("input"), "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(
            400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
        )
    data = []
    for index, text in enumerate(texts):
        vector = embedding(model, text, state.config.embedding_dim)
        value = embedding_base64(vector) if encoding == "base64" else vector
        data.append({"object": "embedding", "index": index, "embedding": value})
    tokens = sum(count_tokens(text) for text in texts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return json_response({"object": "list", "data": data, "model": model, "usage": usage})


StateHandler = Callable[[DemoState, Request], "Response | Stream"]

ROUTES: tuple[tuple[str, str, StateHandler], ...] = (
    ("GET", "/v1/models", handle_models),
    ("GET", "/health", handle_health),
    ("GET", "/props", handle_props),
    ("POST", "/v1/completions", handle_completions),
    ("POST", "/v1/chat/completions", handle_chat),
    ("POST", "/v1/embeddings", handle_embeddings),
)


def _bound(state: DemoState, handler: StateHandler) -> Handler:
    def handle(request: Request) -> Response | Stream:
        state.stall_if_hung()  # a hung server answers nothing, /health included
        try:
            return handler(state, request)
        except ApiError as err:
            return err.response()

    return handle


def build_app(state: DemoState, extra: tuple[tuple[str, str, StateHandler], ...] = ()) -> App:
    """The HTTP app serving ``state``: :data:`ROUTES` (and ``extra``: the sleep mode's),
    errors as OpenAI-style bodies."""
    routes: dict[str, dict[str, Handler]] = {}
    for method, path, handler in (*ROUTES, *extra):
        routes.setdefault(path, {})[method] = _bound(state, handler)
    return App(routes, error_response)
