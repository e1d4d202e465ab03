"""The docker SDK's blocking streams, for :class:`~controller.runtime.docker.runtime.DockerRuntime`:
an image pull with progress and a followed container log.

Each stream is iterated on a daemon thread of its own (a stalled registry or a quiet
container can neither exhaust the shared worker pool nor hold up interpreter exit) and what
it yields is handed to the event loop. A pull's events are summed per layer and passed to
the caller's progress callback (the slot shows ``pulling``); failures and the deadline
become :class:`~controller.model.errors.SlotSpawnFailed` (an engine failure is translated by the
runtime, which knows the engine's address). A followed log feeds the readiness probe's
wake-up; any failure just ends it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from controller.model.errors import SlotctlError, SlotSpawnFailed
from controller.runtime.base import ProgressCallback

__all__ = ["follow_logs", "pull_image"]

log = logging.getLogger("slotctl.runtime")


async def pull_image(
    client: Any,
    slot: str,
    image: str,
    *,
    timeout_s: float,
    progress: ProgressCallback | None,
    failed: Callable[[BaseException], SlotctlError],
) -> None:
    """Pull ``image`` through ``client``; ``failed`` turns the stream's exception into the
    error raised. Raises :class:`SlotSpawnFailed` when the engine reports an error or no
    result comes within ``timeout_s``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def emit(kind: str, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    def pump() -> None:
        try:
            for event in _pull_stream(client, image):
                if cancelled.is_set():
                    return
                emit("event", event)
            emit("done", None)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            emit("error", exc)

    threading.Thread(target=pump, name=f"slotctl-pull-{slot}", daemon=True).start()
    layers: dict[str, tuple[int, int]] = {}
    deadline = loop.time() + timeout_s
    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise SlotSpawnFailed(
                    f"cannot pull {image} for slot {slot!r}: no result within {timeout_s:g}s",
                    slot=slot,
                    image=image,
                )
            try:
                kind, value = await asyncio.wait_for(queue.get(), remaining)
            except TimeoutError:
                continue
            if kind == "done":
                return
            if kind == "error":
                raise value if isinstance(value, SlotctlError) else failed(value)
            await _report(slot, image, value, layers, progress)
    finally:
        cancelled.set()


async def _report(
    slot: str,
    image: str,
    event: Mapping[str, Any],
    layers: dict[str, tuple[int, int]],
    progress: ProgressCallback | None,
) -> None:
    if "error" in event:
        detail = event.get("errorDetail") or {}
        raise SlotSpawnFailed(
            f"cannot pull {image} for slot {slot!r}: {detail.get('message') or event['error']}",
            slot=slot,
            image=image,
        )
    layer = str(event.get("id") or "")
    detail = event.get("progressDetail") or {}
    if layer and detail.get("total"):
        layers[layer] = (int(detail.get("current") or 0), int(detail["total"]))
    if progress is None:
        return
    current = sum(c for c, _ in layers.values())
    total = sum(t for _, t in layers.values())
    result = progress(
        {
            "slot": slot,
            "image": image,
            "status": str(event.get("status") or ""),
            "layer": layer or None,
            "current": current,
            "total": total or None,
        }
    )
    if inspect.isawaitable(result):
        await result


def _pull_stream(client: Any, image: str) -> Iterator[Mapping[str, Any]]:
    """The engine's decoded pull events (blocking; a worker/daemon thread only)."""
    stream: Iterator[Mapping[str, Any]] = client.api.pull(image, stream=True, decode=True)
    yield from stream


def follow_logs(
    slot: str, open_stream: Callable[[float], Any], on_text: Callable[[str], None]
) -> Callable[[], None]:
    """Follow a container's output from now on: ``open_stream(since)`` (blocking, run on the
    daemon thread) returns the SDK's followed log stream, or None when there is nothing of
    ours to follow; ``on_text`` is called on the event loop with decoded text. Any failure
    just ends the watch (the probe keeps its schedule). Returns the function that stops it."""
    loop = asyncio.get_running_loop()
    stopped = threading.Event()
    streams: list[Any] = []
    since = time.time()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def deliver(text: str) -> None:
        if not stopped.is_set():
            on_text(text)

    def pump() -> None:
        try:
            stream = open_stream(since)
            if stream is None:
                return
            streams.append(stream)
            for chunk in stream:
                if stopped.is_set():
                    return
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                    loop.call_soon_threadsafe(deliver, decoder.decode(bytes(chunk)))
        except Exception as exc:  # noqa: BLE001 - logged; the probe keeps its schedule
            if not stopped.is_set():
                log.debug("log watch of slot %s ended: %s", slot, exc)
        finally:
            _close_streams(streams)

    threading.Thread(target=pump, name=f"slotctl-logs-{slot}", daemon=True).start()

    def stop() -> None:
        stopped.set()
        _close_streams(streams)

    return stop


def _close_streams(streams: list[Any]) -> None:
    """Close followed log streams (from any thread: it unblocks their reader)."""
    for stream in streams:
        with contextlib.suppress(OSError, AttributeError):
            stream.close()
