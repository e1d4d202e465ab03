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
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Protocol, runtime_checkable

import aiohttp

from controller.kit.clock import SYSTEM_CLOCK, Clock
from controller.probes.http import (
    HttpCall,
    Response,
    aiohttp_request,
    first_bytes,
    get,
    plain_pair,
)

__all__ = [
    "HttpProber",
    "LogLines",
    "LogWatcher",
    "ProbeOutcome",
    "ProbeResult",
    "ProbeSpec",
    "Prober",
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
class ProbeSpec:
    models_path: str = "/v1/models"
    # The one request that proves a listed model really answers.
    sentinel: HttpCall | None = None
    # A regular expression for the log line with which the server announces readiness
    # (declared per provider); None: the schedule alone.
    ready_log: str | None = None
    # The server's own cheap liveness endpoint (llama-server's, vLLM's and the demo
    # server's ``/health``); None: the models list.
    liveness_path: str | None = None


class ProbeOutcome(StrEnum):
    READY = "ready"  # models listed and the sentinel answered
    NO_MODEL = "no_model"  # server up, models list empty -> idle(no_model)
    STILL_WARMING = "still_warming"  # refused / timeout / 5xx: still loading
    EXITED = "exited"  # the server process/container is gone
    TIMED_OUT = "timed_out"  # still warming after warmup_timeout_s -> error
    HUNG = "hung"  # liveness: not one byte within the probe's timeout (a wedged server)


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


async def _list_models(
    session: aiohttp.ClientSession, endpoint: str, spec: ProbeSpec, timeout_s: float
) -> Response:
    listed = await get(endpoint, spec.models_path, timeout_s)
    if listed is None:
        listed = await aiohttp_request(session, "GET", endpoint + spec.models_path, None, timeout_s)
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

    def then(listed: Response) -> HttpCall | None:
        if sentinel is None or not 0 < listed.status < 300 or not _model_ids(listed.body):
            return None
        return sentinel

    answers = await plain_pair(
        endpoint, HttpCall("GET", spec.models_path), then if sentinel else None, timeout_s
    )
    if answers is None:  # not a plain http:// endpoint: aiohttp asks
        answers = [
            await aiohttp_request(session, "GET", endpoint + spec.models_path, None, timeout_s)
        ]
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
        answer = await aiohttp_request(
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
    """Liveness of a loaded slot: does the server still answer at all?

    ``GET`` of its liveness endpoint (``spec.liveness_path``, else the models list).
    Only silence is a miss (:attr:`ProbeOutcome.HUNG`: not one byte within
    ``timeout_s``): a busy server may answer slowly or with a 503 ("no slot available"),
    and that is alive; a refused connection is not counted either (a server that exited
    is the exit check's, within a second).
    """
    path = spec.liveness_path or spec.models_path
    answer = await first_bytes(endpoint, path, timeout_s)
    if answer is None:  # not a plain http:// endpoint: aiohttp asks (a timeout is silence)
        answer = await aiohttp_request(session, "GET", endpoint + path, None, timeout_s)
        if answer.status == 0 and answer.error.startswith("TimeoutError"):
            answer.extra["hung"] = True
    if answer.extra.get("hung"):
        return ProbeResult(ProbeOutcome.HUNG, f"liveness: {path}: {answer.error}")
    if answer.status == 0:
        return ProbeResult(ProbeOutcome.STILL_WARMING, f"liveness: {path}: {answer.error}")
    return ProbeResult(ProbeOutcome.READY, f"alive ({path}: HTTP {answer.status})")


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

    async def liveness(
        self, endpoint: str, spec: ProbeSpec, *, slot: str, timeout_s: float | None = None
    ) -> ProbeResult:
        """:func:`check_liveness` (``timeout_s``: the slot's ``liveness_timeout_s``)."""
        ...

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

    async def liveness(
        self, endpoint: str, spec: ProbeSpec, *, slot: str, timeout_s: float | None = None
    ) -> ProbeResult:
        if self._closed:  # not a miss: nobody is looking any more
            return ProbeResult(ProbeOutcome.READY, "the prober is closed")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return await check_liveness(self._client(), endpoint, spec, timeout_s=timeout)

    async def close(self) -> None:
        """Close the session; a probe still running after this opens no new one."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
