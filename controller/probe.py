"""Health probes: readiness (models list + one sentinel request) and liveness.

Called by the slot manager while a slot is ``warming`` and, once ``ready``, periodically.
Outcomes never say "error" for an ambiguous answer: a refused connection, a timeout or a
5xx while the weights load all read as ``still_warming``; only the server exiting, or
``warmup_timeout_s`` passing, ends warming without success (SPEC §1, §5).

The schedule is proportional to how long the server has been loading: the next attempt
comes after ``clamp(elapsed * 2.5%, 20 ms, 1 s)``. A server that is up within 800 ms is
seen within ~20 ms, one that needs 4 s within ~100 ms; a one-minute load costs about 220
cheap requests and is never seen more than 1 s late (peers poll once a second throughout).

Event-driven readiness: servers announce readiness in their own log (``llama-server``
"server is listening", uvicorn "Uvicorn running on", the demo server's ready line). A
provider declares that line as :attr:`ProbeSpec.ready_log`; when the runtime can follow
the slot's log (:class:`LogWatcher`: the process runtime through inotify, Docker through
the engine's log stream), a matching line wakes the probe at once. The HTTP probe stays
the judge (a woken attempt that finds the server still warming just goes on), and the
schedule stays the fallback: while the wake is armed and has not fired, the schedule's
floor is 250 ms instead of 20 ms (``clamp(elapsed * 2.5%, 250 ms, 1 s)``), so a 1 s load
costs ~5 attempts instead of ~40, and a server whose line never comes is seen at most
250 ms late (1 s after 40 s of loading, as before). After the line, the dense schedule.
A server the runtime has just started, whose log it follows from the first line (the
process runtime: :meth:`LogWatcher.logs_from_start`), is not tried at once either: its
line cannot be missed, so the first attempt is the line's or the fallback's.

A ready attempt's two requests (models list, sentinel) share one connection where the
server keeps it open (HTTP/1.1 keep-alive); nothing is kept between attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, Protocol, runtime_checkable
from urllib.parse import urlsplit

import aiohttp

from controller.clock import SYSTEM_CLOCK, Clock

__all__ = [
    "HttpProber",
    "LogLines",
    "LogWatcher",
    "ProbeOutcome",
    "ProbeResult",
    "ProbeSpec",
    "Prober",
    "SentinelRequest",
    "check_liveness",
    "next_delay",
    "probe_once",
    "wait_ready",
]

BASE_DELAY_S: Final = 0.02
PROPORTION: Final = 0.025
CAP_S: Final = 1.0
# While a log wake is armed (the runtime follows the log and the provider declares its
# ready line) the schedule is only the fallback: its floor rises to this, so a server
# whose line never comes is still seen at most 250 ms late (1 s late after 40 s, as before).
ARMED_BASE_DELAY_S: Final = 0.25


@dataclass(frozen=True, slots=True)
class SentinelRequest:
    """The one request that proves a listed model really answers."""

    method: str
    path: str
    body: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    models_path: str = "/v1/models"
    sentinel: SentinelRequest | None = None
    # A regular expression for the log line with which the server announces readiness
    # (declared per provider); None: the schedule alone.
    ready_log: str | None = None


class ProbeOutcome(StrEnum):
    READY = "ready"  # models listed and the sentinel answered
    NO_MODEL = "no_model"  # server up, models list empty -> idle(no_model)
    STILL_WARMING = "still_warming"  # refused / timeout / 5xx: still loading
    EXITED = "exited"  # the server process/container is gone
    TIMED_OUT = "timed_out"  # still warming after warmup_timeout_s -> error


@dataclass(frozen=True, slots=True)
class ProbeResult:
    outcome: ProbeOutcome
    message: str = ""
    models: tuple[str, ...] = ()
    attempts: int = 1
    elapsed_s: float = 0.0


def next_delay(elapsed_s: float, *, armed: bool = False) -> float:
    """Delay before the next readiness attempt, given time spent warming so far.

    ``armed``: a log wake is armed and has not fired yet, so this is only the fallback
    (floor :data:`ARMED_BASE_DELAY_S` instead of :data:`BASE_DELAY_S`).
    """
    floor = ARMED_BASE_DELAY_S if armed else BASE_DELAY_S
    return max(floor, min(CAP_S, elapsed_s * PROPORTION))


@dataclass(slots=True)
class _Response:
    status: int
    body: Any = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


async def _request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any,
    timeout_s: float,
) -> _Response:
    try:
        async with session.request(
            method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = None
            return _Response(status=resp.status, body=data)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return _Response(status=0, error=f"{type(exc).__name__}: {exc}".rstrip(": "))


MAX_BODY: Final = 8 * 1024 * 1024  # a models list is a few KiB; more is not an answer


async def _get(endpoint: str, path: str, timeout_s: float) -> _Response | None:
    """``GET endpoint + path`` over plain asyncio streams (:func:`_plain`)."""
    return await _plain("GET", endpoint, path, None, timeout_s)


async def _plain(
    method: str, endpoint: str, path: str, body: Any, timeout_s: float
) -> _Response | None:
    """``METHOD endpoint + path`` (``body``, when not None, as JSON) over plain asyncio
    streams: HTTP/1.1, a fresh connection closed after the answer (as the aiohttp
    session's ``force_close``), ``timeout_s`` for the whole exchange, bodies by
    Content-Length, chunked or to EOF. The models list is every attempt's first request,
    and all but the last attempt of a load end there (refused or 503); the sentinel is the
    last. This costs about half the CPU of aiohttp's client (0.26-0.33 ms against
    0.56-0.60 ms an attempt, measured against a loading demo server). None: not a plain
    ``http://`` endpoint (aiohttp then asks)."""
    answers = await _plain_pair(endpoint, (method, path, body), None, timeout_s)
    return answers[0] if answers else None


_Request = tuple[str, str, Any]  # method, path, JSON body (None: none)


class _Reusable(Exception):
    """A kept-alive connection the server had closed before it answered (retry fresh)."""


async def _plain_pair(
    endpoint: str,
    first: _Request,
    then: Callable[[_Response], _Request | None] | None,
    timeout_s: float,
) -> list[_Response] | None:
    """``first``, then the request ``then(first's answer)`` names (if any), over plain
    asyncio streams (:func:`_plain`), on one connection where the server keeps it open:
    a ready attempt's models list and sentinel cost one connection, not two. ``first``
    asks to keep the connection only when a second request may follow; the second goes on
    a fresh connection when the first answer ends it (``Connection: close``, a body to
    EOF) or when the server closed it before answering (as a client retries a stale
    keep-alive connection). None: not a plain ``http://`` endpoint."""
    url = urlsplit(endpoint + first[1])
    if url.scheme != "http" or not url.hostname:
        return None
    address = (url.hostname, url.port or 80)
    answers: list[_Response] = []
    kept: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    request: _Request | None = first
    try:
        while request is not None:
            follow = then if not answers else None
            answer, kept = await _exchange(endpoint, address, request, kept, follow, timeout_s)
            answers.append(answer)
            request = follow(answer) if follow is not None else None
    finally:
        if kept is not None:
            kept[1].close()
    return answers


async def _exchange(
    endpoint: str,
    address: tuple[str, int],
    request: _Request,
    kept: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None,
    keep: object,
    timeout_s: float,
) -> tuple[_Response, tuple[asyncio.StreamReader, asyncio.StreamWriter] | None]:
    """One request on ``kept`` (else a fresh connection); the answer and the connection
    when it may carry the next request (``keep``: one may follow), else None (closed)."""
    method, path, body = request
    url = urlsplit(endpoint + path)
    target = (url.path or "/") + (f"?{url.query}" if url.query else "")
    payload = b"" if body is None else json.dumps(body).encode()
    content = "" if body is None else "Content-Type: application/json\r\n"
    if payload or method not in ("GET", "HEAD"):
        content += f"Content-Length: {len(payload)}\r\n"
    connection = "keep-alive" if keep else "close"
    data = (
        f"{method} {target} HTTP/1.1\r\nHost: {url.netloc}\r\nAccept: application/json\r\n"
        f"User-Agent: slotctl-probe\r\n{content}Connection: {connection}\r\n\r\n"
    ).encode("latin-1") + payload
    conn = kept
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                if conn is None:
                    conn = await asyncio.open_connection(*address)
                    fresh = True
                else:
                    fresh = False
                reader, writer = conn
                try:
                    writer.write(data)
                    try:
                        head = await reader.readuntil(b"\r\n\r\n")
                    except asyncio.IncompleteReadError as exc:
                        if fresh or exc.partial:
                            raise
                        raise _Reusable from exc
                    except ConnectionError as exc:
                        if fresh:
                            raise
                        raise _Reusable from exc
                    status, headers = _parse_head(head)
                    answer, reusable = await _read_body(reader, status, headers)
                except _Reusable:
                    writer.close()
                    conn = None
                    continue
                except BaseException:
                    writer.close()
                    raise
                break
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        return _Response(status=0, error=f"{type(exc).__name__}: {exc}".rstrip(": ")), None
    except ValueError as exc:  # not HTTP, or a body beyond MAX_BODY
        return _Response(status=0, error=f"bad HTTP answer: {exc}"), None
    if not (keep and reusable and "close" not in headers.get("connection", "").lower()):
        writer.close()
        conn = None
    try:
        parsed = json.loads(answer) if answer.strip() else None
    except ValueError:  # UnicodeDecodeError is one
        parsed = None
    return _Response(status=status, body=parsed), conn


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise ValueError(f"status line {status_line[:80]!r}")
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(rest[:3]), headers


async def _read_body(
    reader: asyncio.StreamReader, status: int, headers: dict[str, str]
) -> tuple[bytes, bool]:
    """The body, and whether the connection may carry another request after it (not
    when the body ran to EOF)."""
    if status in (204, 304) or status < 200:
        return b"", True
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return bytes(body), True
            if len(body) + size > MAX_BODY:
                raise ValueError("body too large")
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    if "content-length" in headers:
        length = int(headers["content-length"])
        if not 0 <= length <= MAX_BODY:
            raise ValueError(f"Content-Length {length}")
        return await reader.readexactly(length), True
    rest = await reader.read(MAX_BODY + 1)  # no length given: the body ends at EOF
    while len(rest) <= MAX_BODY and (more := await reader.read(MAX_BODY + 1 - len(rest))):
        rest += more
    if len(rest) > MAX_BODY:
        raise ValueError("body too large")
    return rest, False


async def _list_models(
    session: aiohttp.ClientSession, endpoint: str, spec: ProbeSpec, timeout_s: float
) -> _Response:
    listed = await _get(endpoint, spec.models_path, timeout_s)
    if listed is None:
        listed = await _request(session, "GET", endpoint + spec.models_path, None, timeout_s)
    return listed


def _model_ids(body: Any) -> tuple[str, ...]:
    if isinstance(body, dict) and isinstance(body.get("data"), list):
        return tuple(str(m.get("id")) for m in body["data"] if isinstance(m, dict))
    return ()


async def probe_once(
    session: aiohttp.ClientSession,
    endpoint: str,
    spec: ProbeSpec,
    *,
    timeout_s: float = 5.0,
) -> ProbeResult:
    """One readiness attempt: models list, then the sentinel (on the same connection
    where the server keeps it open). Never raises."""
    sentinel = spec.sentinel

    def then(listed: _Response) -> _Request | None:
        if sentinel is None or not 0 < listed.status < 300 or not _model_ids(listed.body):
            return None
        return (sentinel.method, sentinel.path, sentinel.body)

    answers = await _plain_pair(
        endpoint, ("GET", spec.models_path, None), then if sentinel else None, timeout_s
    )
    if answers is None:  # not a plain http:// endpoint: aiohttp asks
        answers = [await _request(session, "GET", endpoint + spec.models_path, None, timeout_s)]
    listed = answers[0]
    if listed.status == 0:
        return ProbeResult(ProbeOutcome.STILL_WARMING, f"models list: {listed.error}")
    if listed.status >= 300:
        return ProbeResult(ProbeOutcome.STILL_WARMING, f"models list: HTTP {listed.status}")
    models = _model_ids(listed.body)
    if not models:
        return ProbeResult(ProbeOutcome.NO_MODEL, "server is up but lists no model")
    if sentinel is None:
        return ProbeResult(ProbeOutcome.READY, "models listed", models)
    if len(answers) > 1:
        answer = answers[1]
    else:
        answer = await _request(
            session, sentinel.method, endpoint + sentinel.path, sentinel.body, timeout_s
        )
    if 200 <= answer.status < 300:
        return ProbeResult(ProbeOutcome.READY, f"{sentinel.path} answered", models)
    detail = answer.error or f"HTTP {answer.status}"
    return ProbeResult(ProbeOutcome.STILL_WARMING, f"sentinel {sentinel.path}: {detail}", models)


Attempt = Callable[[], Awaitable[ProbeResult]]
MAX_PARTIAL_LINE: Final = 64 * 1024


class LogLines:
    """Fed a server's output in chunks, calls ``on_match`` for each line matching ``pattern``.

    Lines end at ``\\n`` or ``\\r`` (progress bars); an unfinished line waits for the next
    chunk, and is cut to its last 64 KiB so a log without newlines cannot grow it.
    """

    def __init__(self, pattern: re.Pattern[str], on_match: Callable[[], None]) -> None:
        self.pattern = pattern
        self.on_match = on_match
        self._partial = ""

    def __call__(self, text: str) -> None:
        *lines, partial = (self._partial + text).replace("\r", "\n").split("\n")
        self._partial = partial[-MAX_PARTIAL_LINE:]
        for line in lines:
            if self.pattern.search(line):
                self.on_match()


@runtime_checkable
class LogWatcher(Protocol):
    """A runtime that can follow a slot's server output (process and Docker runtimes can)."""

    def watch_log(self, slot: str, on_text: Callable[[str], None]) -> Callable[[], None] | None:
        """Call ``on_text`` (on the event loop) with what the server writes from now on
        (from its first line, when :meth:`logs_from_start`); returns the function that
        stops watching, or None when the log cannot be followed."""
        ...

    def logs_from_start(self, slot: str) -> bool:
        """True when :meth:`watch_log` reports the server's output from its first line
        (a server the runtime has just started): its ready line cannot be missed, so the
        probe need not try before the line (or the fallback schedule) says so."""
        ...


async def wait_ready(
    attempt: Attempt,
    *,
    alive: Callable[[], Awaitable[bool]],
    warmup_timeout_s: float,
    clock: Clock = SYSTEM_CLOCK,
    wake: asyncio.Event | None = None,
    first_now: bool = True,
) -> ProbeResult:
    """Probe on the proportional schedule until ready, no_model, exited or timed out.

    ``wake`` (set when the server's log announced readiness) cuts the current wait short:
    the next attempt comes at once. Until it first fires the schedule is only the fallback
    and keeps the sparser floor (``next_delay(armed=True)``); once it has fired (the server
    says it is ready, so an attempt that still finds it warming is a matter of moments) the
    dense schedule goes on from there.

    ``first_now=False`` (with a ``wake`` that cannot miss the line: it reports the
    server's output from its first line) skips the attempt at once: a server just
    started is not ready yet, so the first attempt waits for the line or the fallback.
    """
    start = clock.monotonic()
    attempts = 0
    armed = wake is not None
    last = ProbeResult(ProbeOutcome.STILL_WARMING, "not probed yet", attempts=0)
    if (
        wake is not None
        and not first_now
        and await _pause(clock, next_delay(0.0, armed=True), wake)
    ):
        armed = False
    while True:
        if not await alive():
            return _final(
                ProbeOutcome.EXITED, "the server exited while warming", attempts, start, clock
            )
        attempts += 1
        last = await attempt()
        if last.outcome in (ProbeOutcome.READY, ProbeOutcome.NO_MODEL):
            return ProbeResult(
                last.outcome, last.message, last.models, attempts, clock.monotonic() - start
            )
        elapsed = clock.monotonic() - start
        if elapsed >= warmup_timeout_s:
            return _final(
                ProbeOutcome.TIMED_OUT,
                f"still warming after {warmup_timeout_s:g}s ({last.message})",
                attempts,
                start,
                clock,
            )
        delay = min(next_delay(elapsed, armed=armed), max(0.0, warmup_timeout_s - elapsed))
        if await _pause(clock, delay, wake):
            armed = False


async def _pause(clock: Clock, seconds: float, wake: asyncio.Event | None) -> bool:
    """Sleep ``seconds`` on ``clock``, or until ``wake`` is set (which it then clears);
    True when the wake ended the pause."""
    if wake is None:
        await clock.sleep(seconds)
        return False
    woken = wake.is_set()
    if not woken:
        sleeper = asyncio.ensure_future(clock.sleep(seconds))
        waiter = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waiter):
                task.cancel()
            for task in (sleeper, waiter):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        woken = wake.is_set()
    wake.clear()
    return woken


def _final(
    outcome: ProbeOutcome, message: str, attempts: int, start: float, clock: Clock
) -> ProbeResult:
    return ProbeResult(outcome, message, (), attempts, clock.monotonic() - start)


async def check_liveness(
    session: aiohttp.ClientSession, endpoint: str, spec: ProbeSpec, *, timeout_s: float = 5.0
) -> ProbeResult:
    """Liveness for a ready slot: the models list still answers and is non-empty."""
    listed = await _list_models(session, endpoint, spec, timeout_s)
    if listed.status == 0 or listed.status >= 300:
        reason = listed.error or f"HTTP {listed.status}"
        return ProbeResult(ProbeOutcome.STILL_WARMING, f"liveness: {reason}")
    models = _model_ids(listed.body)
    if not models:
        return ProbeResult(ProbeOutcome.NO_MODEL, "liveness: models list is empty")
    return ProbeResult(ProbeOutcome.READY, "alive", models)


class Prober(Protocol):
    """The slot-HTTP seam the manager uses (real: :class:`HttpProber`)."""

    async def wait_ready(
        self,
        endpoint: str,
        spec: ProbeSpec,
        *,
        slot: str,
        alive: Callable[[], Awaitable[bool]],
        warmup_timeout_s: float,
        clock: Clock,
    ) -> ProbeResult: ...

    async def probe(self, endpoint: str, spec: ProbeSpec, *, slot: str) -> ProbeResult: ...

    async def liveness(self, endpoint: str, spec: ProbeSpec, *, slot: str) -> ProbeResult: ...

    async def close(self) -> None:
        """Release the prober's connections."""
        ...


class HttpProber:
    """Probes real servers over HTTP with one shared aiohttp session.

    ``logs``: the runtime, when it can follow a slot's log (:class:`LogWatcher`); then a
    line matching the launch's ``ready_log`` wakes :meth:`wait_ready` at once.
    """

    def __init__(self, timeout_s: float = 5.0, *, logs: object = None) -> None:
        self.timeout_s = timeout_s
        self.logs = logs if isinstance(logs, LogWatcher) else None
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection pooling across probes: a restarted server must not be probed
            # through a stale keep-alive socket.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._session

    async def wait_ready(
        self,
        endpoint: str,
        spec: ProbeSpec,
        *,
        slot: str,
        alive: Callable[[], Awaitable[bool]],
        warmup_timeout_s: float,
        clock: Clock,
    ) -> ProbeResult:
        wake = asyncio.Event()
        unwatch = None
        from_start = False
        if self.logs is not None and spec.ready_log:
            lines = LogLines(re.compile(spec.ready_log), wake.set)
            from_start = self.logs.logs_from_start(slot)
            unwatch = self.logs.watch_log(slot, lines)
        try:
            return await wait_ready(
                lambda: self.probe(endpoint, spec, slot=slot),
                alive=alive,
                warmup_timeout_s=warmup_timeout_s,
                clock=clock,
                wake=wake if unwatch is not None else None,
                first_now=not (unwatch is not None and from_start),
            )
        finally:
            if unwatch is not None:
                unwatch()

    async def probe(self, endpoint: str, spec: ProbeSpec, *, slot: str) -> ProbeResult:
        if self._closed:  # shutting down: no new session that nobody would close
            return ProbeResult(ProbeOutcome.STILL_WARMING, "the prober is closed")
        return await probe_once(self._client(), endpoint, spec, timeout_s=self.timeout_s)

    async def liveness(self, endpoint: str, spec: ProbeSpec, *, slot: str) -> ProbeResult:
        if self._closed:  # not a miss: nobody is looking any more
            return ProbeResult(ProbeOutcome.READY, "the prober is closed")
        return await check_liveness(self._client(), endpoint, spec, timeout_s=self.timeout_s)

    async def close(self) -> None:
        """Close the session; a probe still running after this opens no new one."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
