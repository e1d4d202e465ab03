"""The CLI's client of the controller API: where the controller is, auth, typed errors, SSE.

Where: ``--server URL`` (or ``$SLOTCTL_SERVER``) names a controller explicitly; otherwise
the local one is found through ``<state_dir>/controller.json`` (its ``listen`` address,
written once the API is bound) and its token through ``<state_dir>/token``. ``--token``
(or ``$SLOTCTL_TOKEN``) overrides the token; the local token file is only ever sent to the
local controller, never to another host.

Errors: a controller that cannot be reached is :class:`ControllerUnreachable`
(``controller.unreachable``); a typed answer of the API becomes :class:`ApiError` with the
code, message and details the server sent, so ``slotctl: error [code]: message`` shows
exactly what the API said. Both exit 2 through ``cli.main``.

Plain ``http.client`` (no new dependency, no event loop): every command is one or a few
requests, and the event stream is read line by line.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, urlencode, urlsplit

from controller.cli.flags import SERVER_ENV, STATE_DIR_ENV, TOKEN_ENV
from controller.model.errors import SlotctlError
from controller.store.runinfo import RECORD, running_controller

__all__ = [
    "ApiClient",
    "ApiError",
    "ControllerUnreachable",
    "Endpoint",
    "SseEvent",
    "error_code",
    "find_controller",
    "quote_segment",
    "reachable_api",
]

DEFAULT_TIMEOUT_S: Final = 30.0
# Waiting for the API of a controller that runs but has not bound its port yet.
_STARTING_WAIT_S: Final = 5.0


class ControllerUnreachable(SlotctlError):
    """No controller answers: none runs on the state dir, or its address does not answer."""

    code = "controller.unreachable"
    http_status = 503


class ApiError(SlotctlError):
    """A typed error answered by the controller (its code, message and details)."""

    def __init__(self, status: int, code: str, message: str, details: Mapping[str, Any]) -> None:
        super().__init__(message, **dict(details))
        self.status = status
        self.remote_code = code

    @classmethod
    def from_response(cls, status: int, reason: str, raw: bytes) -> ApiError:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            details = {k: v for k, v in error.items() if k not in ("code", "message")}
            message = str(error.get("message") or reason)
            return cls(status, error["code"], message, details)
        text = raw.decode("utf-8", "replace").strip()[:200]
        return cls(status, f"http.{status}", f"{reason}{': ' + text if text else ''}", {})


def error_code(exc: SlotctlError) -> str:
    """The code to show for ``exc``: the server's own for an API answer."""
    return exc.remote_code if isinstance(exc, ApiError) else exc.code


def quote_segment(value: str) -> str:
    """A path segment (slot name, model id: ids may hold ``/`` and ``:``)."""
    return quote(value, safe="")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A controller's API: base URL, token and where they came from (for messages)."""

    base: str
    token: str | None
    origin: str
    explicit: bool
    pid: int | None = None  # the local controller's pid (implicit discovery)
    # Where the token came from, as a user would name it: "--token", "$SLOTCTL_TOKEN" or
    # the local token file's path (None: no token is sent).
    token_origin: str | None = None


def _normalise(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ControllerUnreachable(
            f"invalid server URL {url!r}: expected http[s]://HOST:PORT", server=url
        )
    return url


def _listen_url(listen: str) -> str:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):  # noqa: S104 (an address we read, not one we bind)
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _local_token(state_dir: Path) -> str | None:
    try:
        token = (state_dir / "token").read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return token or None


def _same_origin(a: str, b: str) -> bool:
    pa, pb = urlsplit(a), urlsplit(b)
    local = {"localhost", "127.0.0.1", "::1"}
    host_a = "127.0.0.1" if pa.hostname in local else pa.hostname
    host_b = "127.0.0.1" if pb.hostname in local else pb.hostname
    return (pa.scheme, host_a, pa.port) == (pb.scheme, host_b, pb.port)


def find_controller(
    state_dir: Path,
    server: str | None = None,
    token: str | None = None,
    *,
    wait_s: float = _STARTING_WAIT_S,
) -> Endpoint:
    """The controller to talk to (see the module docstring); raises ControllerUnreachable."""
    origin = "--server" if server else f"${SERVER_ENV}"
    server = server or os.environ.get(SERVER_ENV) or None
    token_origin: str | None = "--token" if token else f"${TOKEN_ENV}"
    token = token or os.environ.get(TOKEN_ENV) or None
    token_file = str(state_dir / "token")
    if server:
        base = _normalise(server)
        if token is None:
            token_origin = None
            local = running_controller(state_dir)
            if local and local.get("listen") and _same_origin(base, _listen_url(local["listen"])):
                token = _local_token(state_dir)
                token_origin = token_file if token else None
        return Endpoint(
            base=base, token=token, origin=origin, explicit=True, token_origin=token_origin
        )
    deadline = time.monotonic() + wait_s
    while True:
        record = running_controller(state_dir)
        if record is None:
            raise ControllerUnreachable(
                f"no controller is running on the state dir {state_dir}: a controller "
                f"started with another one is found with --state-dir DIR (or "
                f"${STATE_DIR_ENV}, as the line `slotctl up` prints sets it); start one "
                f"with `slotctl up`, or name one with --server URL (or ${SERVER_ENV})",
                state_dir=str(state_dir),
            )
        listen: str | None = record.get("listen")
        if not listen:
            raise ControllerUnreachable(
                f"the controller on {state_dir} (pid {record['pid']}) serves no API "
                "(started with --listen none)",
                state_dir=str(state_dir),
            )
        if not listen.endswith(":0"):
            break
        if time.monotonic() >= deadline:  # still binding its port
            raise ControllerUnreachable(
                f"the controller on {state_dir} (pid {record['pid']}) has not opened its API yet",
                state_dir=str(state_dir),
            )
        time.sleep(0.05)
    if token is None:
        token = _local_token(state_dir)
        token_origin = token_file if token else None
    return Endpoint(
        base=_listen_url(listen),
        token=token,
        origin=f"{state_dir / RECORD}",
        explicit=False,
        pid=int(record["pid"]),
        token_origin=token_origin,
    )


def reachable_api(
    state_dir: Path, server: str | None, token: str | None, *, timeout: float = DEFAULT_TIMEOUT_S
) -> ApiClient | None:
    """The one backend choice of the commands that also work without a controller.

    An explicit ``--server``/``$SLOTCTL_SERVER`` is used (and must answer: errors exit 2);
    otherwise the local controller of ``state_dir`` when its API answers ``/healthz``
    promptly; otherwise None: the command works on the config and state dirs directly
    (a stopped or wedged controller does not answer, and the files are the same contract).
    """
    server = server or os.environ.get(SERVER_ENV) or None
    if server:
        return ApiClient(find_controller(state_dir, server, token), timeout=timeout)
    try:
        endpoint = find_controller(state_dir, None, token)
    except ControllerUnreachable:
        return None
    client = ApiClient(endpoint, timeout=timeout)
    return client if client.healthy() else None


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One server-sent event: ``data`` is the (joined) data lines."""

    id: str | None
    event: str
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


class ApiClient:
    """Requests to one controller; see the module docstring for errors."""

    def __init__(self, endpoint: Endpoint, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        parts = urlsplit(endpoint.base)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")

    # ------------------------------------------------------------------ plumbing

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "slotctl-cli"}
        if self.endpoint.token:
            headers["Authorization"] = f"Bearer {self.endpoint.token}"
        headers.update(extra or {})
        return headers

    def _unreachable(self, exc: BaseException, timeout: float | None) -> ControllerUnreachable:
        where = f"{self.endpoint.base} (from {self.endpoint.origin})"
        if isinstance(exc, TimeoutError | socket.timeout):
            return ControllerUnreachable(
                f"the controller at {where} did not answer within {timeout:g}s",
                server=self.endpoint.base,
            )
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return ControllerUnreachable(
            f"cannot reach the controller at {where}: {reason}", server=self.endpoint.base
        )

    def _open(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        timeout: float | None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        target = self._prefix + path
        if query:
            pairs = {k: _query_value(v) for k, v in query.items() if v is not None}
            if pairs:
                target += "?" + urlencode(pairs)
        payload = None if body is None else json.dumps(body).encode()
        extra = dict(headers or {})
        if payload is not None:
            extra["Content-Type"] = "application/json"
        # A controller that runs locally but has not bound its API yet refuses the
        # connection: the request was not sent, so trying again is safe.
        deadline = time.monotonic() + (0.0 if self.endpoint.explicit else _STARTING_WAIT_S)
        while True:
            conn = self._connection(timeout)
            try:
                conn.request(method, target, body=payload, headers=self._headers(extra))
                return conn, conn.getresponse()
            except ConnectionRefusedError as exc:
                conn.close()
                if time.monotonic() >= deadline or not _alive(self.endpoint.pid):
                    raise self._unreachable(exc, timeout) from None
                time.sleep(0.1)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise self._unreachable(exc, timeout) from None

    # ------------------------------------------------------------------ requests

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        """``(status, decoded JSON)`` of a 2xx answer; ApiError for any other."""
        wait = self.timeout if timeout is None else timeout
        conn, response = self._open(method, path, body=body, query=query, timeout=wait)
        try:
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise self._unreachable(exc, wait) from None
        finally:
            conn.close()
        if not 200 <= response.status < 300:
            error = ApiError.from_response(response.status, response.reason, raw)
            if response.status == 401:
                error.message = f"{error.message} ({self._token_hint()})"
            raise error
        if not raw:
            return response.status, None
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode("utf-8", "replace")

    def _token_hint(self) -> str:
        """Which token the controller refused and where it came from (a 401's words)."""
        where = self.endpoint.base
        origin = self.endpoint.token_origin
        if not self.endpoint.token or origin is None:
            return f"no token was sent to {where}: pass --token or set ${TOKEN_ENV}"
        if origin.startswith(("--", "$")):
            return (
                f"the token from {origin} was refused by {where}: pass the right one, or "
                f"leave it out to use the local controller's token file"
            )
        return (
            f"the token of {origin} was refused by {where} (a file left by an earlier "
            f"controller?): pass --token or set ${TOKEN_ENV}"
        )

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)[1]

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self.request("POST", path, body=body, **kw)

    def healthy(self, timeout: float = 2.0) -> bool:
        """``/healthz`` answers within ``timeout`` (a paused or wedged controller does not)."""
        try:
            status, _ = self.request("GET", "/healthz", timeout=timeout)
        except SlotctlError:
            return False
        return status == 200

    # ------------------------------------------------------------------ event stream

    def events(
        self, path: str = "/api/events", last_event_id: str | None = None
    ) -> Iterator[SseEvent]:
        """Follow a server-sent event stream until the server ends it."""
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        # No read timeout: the stream may be quiet for as long as nothing happens.
        conn, response = self._open("GET", path, timeout=None, headers=headers)
        try:
            if response.status != 200:
                raise ApiError.from_response(response.status, response.reason, response.read())
            yield from _parse_sse(response)
        finally:
            conn.close()


def _parse_sse(stream: http.client.HTTPResponse) -> Iterator[SseEvent]:
    event_id: str | None = None
    event_type = ""
    data: list[str] = []
    while True:
        try:
            raw = stream.readline()
        except (OSError, http.client.HTTPException):
            return
        if not raw:
            return
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield SseEvent(id=event_id, event=event_type or "message", data="\n".join(data))
            event_type, data = "", []
            continue
        if line.startswith(":"):
            continue  # a comment (keep-alive)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event_type = value
        elif name == "id":
            event_id = value


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; it is not ours to signal
    return True
