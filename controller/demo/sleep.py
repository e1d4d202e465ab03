"""The demo server's sleep mode: vLLM's dev-mode sleep API, so slotctl's residency tier is
tested against a real server.

Served only with ``--enable-sleep-mode`` (vLLM serves these only with
``VLLM_SERVER_DEV_MODE=1`` and sleeps only with ``--enable-sleep-mode``; see
docs/design/0011-sleep-tier.md for the vLLM documentation this follows):

``POST /sleep?level=1|2[&mode=abort|wait|keep]``
    level 1: the weights move to host RAM (``--sleep-memory-mb``, allocated and touched)
    and the device memory (``--memory-mb``) is released; level 2: both are released, the
    weights are gone. Sleeping while asleep is a no-op. 200 once asleep. ``mode``, as
    vLLM's (its docs/features/sleep_mode.md: "The default is ``mode="abort"``, which aborts
    in-flight requests before memory is released"): ``abort`` (the default) ends the
    generations in flight at their next token (``finish_reason: abort``), ``wait`` lets
    them finish first, ``keep`` pauses them until the wake.
``POST /wake_up[?tags=weights&tags=kv_cache]``
    takes ``--wake-seconds``, then wakes the tags named (every one when none is): the
    device memory is held again, the host RAM released once nothing sleeps. After a level-2
    sleep the weights are empty until ``reload_weights``: inference answers 500 meanwhile.
    ``--fail-wake``: 500 after the delay, still asleep.
``POST /collective_rpc`` ``{"method": "reload_weights"}``
    reloads the weights in place (``--reload-seconds``).
``GET /is_sleeping``
    ``{"is_sleeping": true}`` while any tag sleeps.

Asleep, inference answers 503 (``code: sleeping``); ``/v1/models`` and ``/health`` answer
as when awake (the process is up). Each change prints one line (``slotctl-demo asleep
level=N``, ``slotctl-demo awake model=ID t=UNIX_TIME``).
"""

from __future__ import annotations

import json
import time
from urllib.parse import parse_qs

from controller.demo.api import ApiError, DemoState, StateHandler, json_response
from controller.demo.httpd import Request, Response

__all__ = ["SLEEP_ROUTES", "TAGS", "hold_memory"]

MIB = 1 << 20
PAGE_SIZE = 4096
TAGS = ("weights", "kv_cache")
MODES = ("abort", "wait", "keep")  # what a sleep does to the requests in flight (vLLM's)


def hold_memory(mb: int) -> bytearray:
    """Allocate ``mb`` MiB and write one byte per page, so it is resident, not just reserved."""
    buffer = bytearray(mb * MIB)
    pages = len(range(0, len(buffer), PAGE_SIZE))
    buffer[::PAGE_SIZE] = b"\x01" * pages
    return buffer


def _say(line: str) -> None:
    print(line, flush=True)


def handle_sleep(state: DemoState, request: Request) -> Response:
    query = parse_qs(request.query)
    values = query.get("level", ["1"])
    if values[-1] not in ("1", "2"):
        raise ApiError(400, "level must be 1 or 2", param="level")
    level = int(values[-1])
    mode = query.get("mode", ["abort"])[-1]  # vLLM's default: abort what is in flight
    if mode not in MODES:
        raise ApiError(400, f"mode must be {', '.join(MODES)}", param="mode")
    config = state.config
    with state.flight:
        if mode == "abort":
            state.aborts += 1  # each generation in flight ends at its next token
        elif mode == "wait":
            while state.generating:  # the generations in flight finish first
                state.flight.wait()
        else:
            state.paused = True  # keep: they pause, and go on after the wake
        state.flight.notify_all()
    with state.sleep_lock:
        if state.asleep:
            return Response(200, b"")
        state.asleep = set(TAGS)
        state.level = level
        state.ballast = None  # the device memory is released
        if level == 1:
            state.host_ballast = hold_memory(config.sleep_memory_mb)
        else:
            state.weights_lost = True  # level 2: the weights are discarded
    _say(f"slotctl-demo asleep level={level} model={config.model}")
    return Response(200, b"")


def handle_wake_up(state: DemoState, request: Request) -> Response:
    tags = parse_qs(request.query).get("tags") or list(TAGS)
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise ApiError(400, f"unknown tags {unknown}: {', '.join(TAGS)}", param="tags")
    config = state.config
    time.sleep(config.wake_seconds)
    if config.fail_wake:
        raise ApiError(500, "wake up failed (--fail-wake)", kind="internal_error")
    with state.sleep_lock:
        was_asleep = bool(state.asleep)
        if "weights" in tags and "weights" in state.asleep:
            state.ballast = hold_memory(config.memory_mb)  # the device memory is back
        state.asleep -= set(tags)
        if not state.asleep:
            state.host_ballast = None
    if not state.asleep:
        with state.flight:
            state.paused = False  # mode=keep: the paused generations go on
            state.flight.notify_all()
    if was_asleep and not state.asleep:
        _say(f"slotctl-demo awake model={config.model} t={time.time():.6f}")
    return Response(200, b"")


def handle_collective_rpc(state: DemoState, request: Request) -> Response:
    try:
        body = json.loads(request.body.decode("utf-8") or "{}")
    except ValueError as err:
        raise ApiError(400, f"request body is not valid JSON: {err}") from None
    method = body.get("method") if isinstance(body, dict) else None
    if method != "reload_weights":
        raise ApiError(400, f"unsupported method {method!r} (reload_weights)", param="method")
    time.sleep(state.config.reload_seconds)
    with state.sleep_lock:
        state.weights_lost = False
    return json_response({"results": [None]})


def handle_is_sleeping(state: DemoState, request: Request) -> Response:
    return json_response({"is_sleeping": bool(state.asleep)})


SLEEP_ROUTES: tuple[tuple[str, str, StateHandler], ...] = (
    ("POST", "/sleep", handle_sleep),
    ("POST", "/wake_up", handle_wake_up),
    ("POST", "/collective_rpc", handle_collective_rpc),
    ("GET", "/is_sleeping", handle_is_sleeping),
)
