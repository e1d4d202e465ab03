"""Sleep mode: what a server that can sleep declares, and the HTTP that sleeps, wakes and asks.

A *capability*, not a provider name (DESIGN.md): a provider template hands the manager a
:class:`SleepMode` in the slot's launch (``LaunchSpec.sleep``) when its server can sleep;
the manager asks that, never ``provider == "vllm"``. The HTTP is vLLM's dev-mode API, as its
docs give it (docs/design/0011-sleep-tier.md cites them)::

    POST /sleep?level=1|2&mode=wait
                               level 1: weights to host RAM, KV cache dropped; level 2:
                               both dropped (the buffers stay in host RAM); 200 when done.
                               mode=wait: requests in flight finish first (vLLM's default
                               mode, abort, aborts them; see docs/design/0011-sleep-tier.md)
    POST /wake_up              wake every memory tag (level 1: that is the whole wake)
    POST /wake_up?tags=weights  level 2, step 1: reallocate the weights' memory ...
    POST /collective_rpc {"method": "reload_weights"}   ... step 2: load them in place ...
    POST /wake_up?tags=kv_cache                         ... step 3: reallocate the KV cache
    GET  /is_sleeping          {"is_sleeping": true|false}

vLLM serves them only with ``VLLM_SERVER_DEV_MODE=1`` in its environment and sleeps only when
started with ``--enable-sleep-mode``: both are in :class:`SleepMode` (``env``, ``argv``), set
by the provider, never by a user. slotctl's demo server (``controller.demo``) answers the same
calls, so the tier is tested for real.

:class:`HttpSleeper` is the seam's real side (beside
:class:`controller.probes.readiness.HttpProber`); :class:`controller.runtime.fake.FakeSleeper` the
in-memory one for unit tests.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

import aiohttp

from controller.probes.http import HttpCall, Response, aiohttp_request, plain

__all__ = [
    "VLLM_SLEEP",
    "HttpSleeper",
    "SleepMode",
    "Sleeper",
]


@dataclass(frozen=True, slots=True)
class SleepMode:
    """How a provider's server sleeps, wakes and says whether it sleeps."""

    levels: tuple[int, ...]  # the levels it offers
    sleep: HttpCall
    wake: Mapping[int, tuple[HttpCall, ...]]  # per level: the calls of a wake, in order
    ask: HttpCall  # answers {"is_sleeping": bool}
    argv: tuple[str, ...] = ()  # added to the server's command line (hashed: in argv)
    env: Mapping[str, str] = field(default_factory=dict)  # added to its environment
    default_on: bool = True  # a slot that does not say `sleep` sleeps


_WAKE: Final = HttpCall("POST", "/wake_up")

VLLM_SLEEP: Final = SleepMode(
    levels=(1, 2),
    # mode=wait: requests in flight finish before the memory is released (vLLM's default,
    # abort, would cut them); a vLLM without the parameter ignores it (its handler reads
    # only the query parameters it knows).
    sleep=HttpCall("POST", "/sleep?level={level}&mode=wait"),
    wake={
        1: (_WAKE,),
        2: (
            HttpCall("POST", "/wake_up?tags=weights"),
            HttpCall("POST", "/collective_rpc", {"method": "reload_weights"}),
            HttpCall("POST", "/wake_up?tags=kv_cache"),
        ),
    },
    ask=HttpCall("GET", "/is_sleeping"),
    argv=("--enable-sleep-mode",),
    env={"VLLM_SERVER_DEV_MODE": "1"},
)


class Sleeper(Protocol):
    """The seam the manager sleeps, wakes and asks servers through."""

    async def sleep(self, endpoint: str, mode: SleepMode, level: int, timeout_s: float) -> str:
        """Put the server to sleep at ``level``; "" when done, else what went wrong."""
        ...

    async def wake(self, endpoint: str, mode: SleepMode, level: int, timeout_s: float) -> str:
        """Wake the server (every call of ``level``'s wake); "" when done, else why not."""
        ...

    async def asleep(self, endpoint: str, mode: SleepMode, timeout_s: float) -> bool | None:
        """Whether the server sleeps now (None: it does not say)."""
        ...


def _path(call: HttpCall, level: int) -> str:
    return call.path.replace("{level}", str(level))


def _failure(call: HttpCall, path: str, answer: Response) -> str:
    if 200 <= answer.status < 300:
        return ""
    detail = answer.error or f"HTTP {answer.status}"
    return f"{call.method} {path}: {detail}"


class HttpSleeper:
    """The real sleeper: plain HTTP/1.1 (:func:`controller.probes.http.plain`), aiohttp for an
    endpoint that is not plain ``http://``."""

    async def _call(self, endpoint: str, call: HttpCall, level: int, timeout_s: float) -> str:
        path = _path(call, level)
        answer = await plain(call.method, endpoint, path, call.body, timeout_s)
        if answer is None:
            async with aiohttp.ClientSession() as session:
                answer = await aiohttp_request(
                    session, call.method, endpoint + path, call.body, timeout_s
                )
        return _failure(call, path, answer)

    async def sleep(self, endpoint: str, mode: SleepMode, level: int, timeout_s: float) -> str:
        return await self._call(endpoint, mode.sleep, level, timeout_s)

    async def wake(self, endpoint: str, mode: SleepMode, level: int, timeout_s: float) -> str:
        """Every call of the level's wake within ``timeout_s`` in all (level 2 makes three)."""
        deadline = time.monotonic() + timeout_s
        for call in mode.wake.get(level, mode.wake.get(1, (_WAKE,))):
            left = deadline - time.monotonic()
            if left <= 0:
                return f"{call.method} {_path(call, level)}: TimeoutError ({timeout_s:g}s spent)"
            failed = await self._call(endpoint, call, level, left)
            if failed:
                return failed
        return ""

    async def asleep(self, endpoint: str, mode: SleepMode, timeout_s: float) -> bool | None:
        call = mode.ask
        answer = await plain(call.method, endpoint, call.path, call.body, timeout_s)
        if answer is None:
            async with aiohttp.ClientSession() as session:
                answer = await aiohttp_request(
                    session, call.method, endpoint + call.path, None, timeout_s
                )
        body = answer.body
        if not 200 <= answer.status < 300 or not isinstance(body, dict):
            return None
        value = body.get("is_sleeping")
        return value if isinstance(value, bool) else None
