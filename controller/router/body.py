"""Reading a routed request's body: its ``model``, and the body as an alias' member's
server must see it.

Part of :mod:`controller.router`, called by the routed call (:mod:`.call`). Parses only
what routing needs: the body is read whole by the data plane (bounded: 413 beyond the
endpoint's limit) and passed upstream unchanged; the router reads its ``model`` (a JSON
object, or a multipart form field where the endpoint takes forms: ``/v1/audio/*``) and
nothing else.
"""

from __future__ import annotations

import json
import json.scanner
import re
from email.message import Message
from typing import Any, Final

from controller.router.refusals import Refusal

__all__ = ["is_form", "model_of", "with_model"]


def is_form(content_type: str) -> bool:
    """A ``multipart/form-data`` body (an upload's)."""
    return (
        content_type != "application/json"
        and content_type.partition(";")[0].strip().lower() == "multipart/form-data"
    )


def model_of(content_type: str, body: bytes, forms: bool = True) -> str:
    """``model`` of a body whose ``Content-Type`` header is ``content_type``: a form
    field where the endpoint takes forms (``forms``) and the body is one, else a JSON
    object's key (400 otherwise)."""
    if forms and is_form(content_type):
        model = _multipart_field(content_type, body, "model")
    else:
        # _json_object(body), in line: a request's code runs from cold caches, where each
        # function more it touches costs (docs/performance.md, the router)
        data: Any = None
        if body[:1] == b"{" and body[1:2] != b"\x00":  # else json.loads would take UTF-16/32
            try:
                text = body.decode("utf-8")
                data, end = _SCAN(text, 0)
            except (StopIteration, ValueError, RecursionError):
                data = None
            else:
                if end != len(text):  # (the common case ends where the text does)
                    space = _SPACE.match(text, end)
                    if space is None or space.end() != len(text):
                        data = None
                if not isinstance(data, dict):
                    data = None
        if data is None:
            if not body.strip():
                raise Refusal(400, "a JSON request body is required", code="invalid_body")
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                raise Refusal(
                    400, f"request body is not valid JSON: {exc}", code="invalid_json"
                ) from None
        if not isinstance(data, dict):
            raise Refusal(400, "request body must be a JSON object", code="invalid_body")
        model = data.get("model")
    if not isinstance(model, str) or not model:
        raise Refusal(
            400,
            "'model' is required and must be a non-empty string",
            code="invalid_model",
            param="model",
        )
    return model


# json.loads' own scanner (C); typeshed types make_scanner's argument as itself
_SCAN: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_SPACE: Final = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body parsed as ``json.loads`` would, when it is a UTF-8 JSON object (the common
    case: the scanner is called directly, without ``loads``' wrappers); None otherwise,
    and for anything ``loads`` would refuse, which then says why itself."""
    if body[:1] != b"{" or body[1:2] == b"\x00":  # json.loads would take UTF-16 or -32
        return None
    try:
        text = body.decode("utf-8")
        data, end = _SCAN(text, 0)
    except (StopIteration, ValueError, RecursionError):
        return None
    if end != len(text):  # (the common case ends where the text does: no regex run)
        space = _SPACE.match(text, end)
        if space is None or space.end() != len(text):
            return None
    return data if isinstance(data, dict) else None


def _delimiter(content_type: str) -> bytes:
    """A multipart/form-data body's part delimiter (``--`` and its boundary)."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise Refusal(400, "multipart body without a boundary", code="invalid_body")
    return b"--" + boundary.encode("latin-1")


def _multipart_field(content_type: str, body: bytes, name: str) -> str | None:
    """The value of one text field of a multipart/form-data body (None when absent)."""
    delimiter = _delimiter(content_type)
    position = body.find(delimiter)
    while position >= 0:
        start = position + len(delimiter)
        if body.startswith(b"--", start):
            return None  # the closing delimiter
        end = body.find(delimiter, start)
        part = body[start : end if end >= 0 else len(body)]
        head, sep, value = part.lstrip(b"\r\n").partition(b"\r\n\r\n")
        if sep and _form_name(head) == name:
            return value.removesuffix(b"\r\n").decode("utf-8", errors="replace").strip()
        position = end
    return None


def _form_name(head: bytes) -> str | None:
    for line in head.decode("latin-1").split("\r\n"):
        key, _, value = line.partition(":")
        if key.strip().lower() == "content-disposition":
            disposition = Message()
            disposition["content-disposition"] = value.strip()
            found = disposition.get_param("name", header="content-disposition")
            return found if isinstance(found, str) else None
    return None


def with_model(content_type: str, body: bytes, model: str, *, forms: bool = True) -> bytes:
    """``body`` with its ``model`` set to ``model`` (a JSON object's key, or a multipart
    form's field, read as :func:`model_of` read it): an alias's member
    (:mod:`controller.router.aliases`); the router read the body already, so it is there
    and well formed."""
    if forms and is_form(content_type):
        return _multipart_with(content_type, body, model)
    data = json.loads(body)
    data["model"] = model
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _multipart_with(content_type: str, body: bytes, model: str) -> bytes:
    delimiter = _delimiter(content_type)
    position = body.find(delimiter)
    while position >= 0:
        start = position + len(delimiter)
        end = body.find(delimiter, start)
        part = body[start : end if end >= 0 else len(body)]
        head, sep, value = part.partition(b"\r\n\r\n")
        if sep and _form_name(head) == "model":
            trailer = value[len(value.rstrip(b"\r\n")) :]
            head_end = start + len(head) + len(sep)
            return body[:head_end] + model.encode() + trailer + body[head_end + len(value) :]
        position = end
    return body
