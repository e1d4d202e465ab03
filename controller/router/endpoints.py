"""The routed endpoints, in one table: the ``/v1`` paths, what each asks of a slot, how its
``model`` is read, its body limit, and what each slot ``type`` serves.

At the bottom of :mod:`controller.router` (pure data). Its readers: the data plane matches
every ``/v1`` request against it (:func:`match`: the endpoint, or the 404/405 of a path or
method it does not hold), the routed call (:mod:`controller.router.call`) reads the
``model`` as the endpoint says and refuses a model whose slot type does not serve the
endpoint (:data:`SERVES`, before any lease or load), ``/v1/models`` says which endpoints
serve each model (:func:`paths_serving`), and the API lists every endpoint in its route
table and OpenAPI document (:mod:`controller.api.openai`), though only the data plane
serves them.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "AUDIO",
    "AUDIO_MAX_BYTES",
    "AUDIO_TAIL",
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "ENDPOINTS",
    "GET_LIMIT",
    "JSON_MAX_BYTES",
    "MODEL",
    "MODELS",
    "PATHS",
    "SERVES",
    "Endpoint",
    "Match",
    "Read",
    "is_v1",
    "match",
    "path_of",
    "paths_serving",
]

JSON_MAX_BYTES: Final = 8 * 1024 * 1024
AUDIO_MAX_BYTES: Final = 64 * 1024 * 1024  # uploads of a long recording
GET_LIMIT: Final = 1 << 62  # a GET's body is read and dropped, whatever its size
# ``/v1/audio/{path}`` takes plain segments only, so ``..`` or ``%2e%2e`` cannot reach a
# server's other routes (llama-server's ``/slots``, vLLM's admin endpoints).
AUDIO_TAIL: Final = re.compile(r"[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*")


class Read(enum.Enum):
    """How a request's ``model`` is read."""

    JSON = "json"  # a JSON object body's "model"
    FORM_OR_JSON = "form-or-json"  # a multipart/form-data field "model", else as JSON
    NONE = "none"  # a GET: its body (if any) is read and dropped


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One ``/v1`` route."""

    method: str  # "POST" (routed to a slot) or "GET" (answered by the router)
    path: str  # as documented: "{model_id}", "{path}" for the path's argument
    kind: str  # what a POST asks of a slot (SERVES' words); "models" / "model" for GETs
    read: Read
    limit: int  # the body's bytes at most (413 beyond)
    summary: str
    operation: str  # the OpenAPI operation's name

    @property
    def routed(self) -> bool:
        """A request routed to a slot (a lease, the upstream), not answered here."""
        return self.read is not Read.NONE


MODELS: Final = Endpoint(
    "GET",
    "/v1/models",
    "models",
    Read.NONE,
    GET_LIMIT,
    "OpenAI model list: catalogue models with an activated slot",
    "v1_models",
)
MODEL: Final = Endpoint(
    "GET",
    "/v1/models/{model_id}",
    "model",
    Read.NONE,
    GET_LIMIT,
    "OpenAI model retrieve: one model of /v1/models (404 in OpenAI's shape)",
    "v1_model",
)
CHAT: Final = Endpoint(
    "POST",
    "/v1/chat/completions",
    "chat",
    Read.JSON,
    JSON_MAX_BYTES,
    "OpenAI chat completions, routed by model (streaming passes through)",
    "v1_chat_completions",
)
COMPLETIONS: Final = Endpoint(
    "POST",
    "/v1/completions",
    "completions",
    Read.JSON,
    JSON_MAX_BYTES,
    "OpenAI text completions, routed by model (streaming passes through)",
    "v1_completions",
)
EMBEDDINGS: Final = Endpoint(
    "POST",
    "/v1/embeddings",
    "embeddings",
    Read.JSON,
    JSON_MAX_BYTES,
    "OpenAI embeddings, routed by model",
    "v1_embeddings",
)
AUDIO: Final = Endpoint(
    "POST",
    "/v1/audio/{path}",
    "audio",
    Read.FORM_OR_JSON,
    AUDIO_MAX_BYTES,
    "OpenAI audio (speech, transcriptions, translations): body passed through as-is",
    "v1_audio",
)
ENDPOINTS: Final = (MODELS, MODEL, CHAT, COMPLETIONS, EMBEDDINGS, AUDIO)

# The audio tails with an endpoint kind of their own (other tails: "audio").
_AUDIO_KINDS: Final = {t: t for t in ("speech", "transcriptions", "translations")}
# Each routed path a model may be served at, by the kind it asks for (/v1/models says
# them; other /v1/audio/ tails pass to a speech slot too).
PATHS: Final = {
    CHAT.path: CHAT.kind,
    COMPLETIONS.path: COMPLETIONS.kind,
    EMBEDDINGS.path: EMBEDDINGS.kind,
    **{f"/v1/audio/{tail}": kind for tail, kind in _AUDIO_KINDS.items()},
}
# What each slot ``type`` serves. A request for an endpoint its slot's type does not
# serve is refused before any lease or load (a real server would answer it with an error
# of its own, after a cold load). ``image`` (a vision model) is refused audio only: it
# may answer chat and completions, and image embeddings.
SERVES: Final[dict[str, frozenset[str]]] = {
    "llm": frozenset({"chat", "completions"}),
    "embedding": frozenset({"embeddings"}),
    "tts": frozenset({"speech", "audio"}),
    "stt": frozenset({"transcriptions", "translations", "audio"}),
    "image": frozenset({"chat", "completions", "embeddings"}),
}
_AUDIO_PREFIX: Final = "/v1/audio/"
_MODELS_PREFIX: Final = "/v1/models/"
_EXACT: Final = {e.path: e for e in ENDPOINTS if "{" not in e.path}


@dataclass(frozen=True, slots=True)
class Match:
    """What a ``/v1`` path and method are: the endpoint (None: none here: ``allow`` says
    the methods the path takes, empty for a path that is none of the table's), the kind
    it asks of a slot, and the path's argument (a model id, an audio tail)."""

    endpoint: Endpoint | None
    kind: str = ""
    arg: str = ""
    allow: tuple[str, ...] = ()


def is_v1(path: str) -> bool:
    """The router's paths: ``/v1`` and below (the REST API has the rest)."""
    return path == "/v1" or path.startswith("/v1/")


def match(method: str, path: str) -> Match:
    """The endpoint of ``method`` on the (percent-decoded) ``path``."""
    found = _EXACT.get(path)
    arg, kind = "", ""
    if found is None:
        if path.startswith(_MODELS_PREFIX) and len(path) > len(_MODELS_PREFIX):
            found, arg = MODEL, path[len(_MODELS_PREFIX) :]
        elif path.startswith(_AUDIO_PREFIX) and len(path) > len(_AUDIO_PREFIX):
            found, arg = AUDIO, path[len(_AUDIO_PREFIX) :]
            kind = _AUDIO_KINDS.get(arg, "audio")
        else:
            return Match(None)
    if found.method != method:
        return Match(None, allow=(found.method,))
    return Match(found, kind or found.kind, arg)


def path_of(kind: str) -> str:
    """The path a routed request of ``kind`` was sent to, as the refusals name it."""
    if kind == "audio":
        return "/v1/audio/*"
    return next((p for p, k in PATHS.items() if k == kind), "this endpoint")


def paths_serving(slot_type: str) -> list[str]:
    """The routed paths a slot of ``slot_type`` serves (``/v1/models``' ``endpoints``)."""
    kinds = SERVES.get(slot_type, frozenset())
    return [path for path, kind in PATHS.items() if kind in kinds]
