"""``slotctl events``: the controller's recent history, then its events as they come.

As ``kubectl events``: what the controller still buffers is printed first (``--since 10m``
keeps the last ten minutes of it, ``--since ID`` resumes after an event id as
``Last-Event-ID`` does), then the stream is followed until Ctrl-C (exit 130, quietly)
or ``-n N`` events (exit 0); ``--watch-only`` prints only what comes from now on. The
lease flips of every request (``ready -> serving -> ready``) are folded into one
``requests`` line a slot and burst (:class:`~controller.model.events.LeaseFold`); ``--all``
prints each flip instead.

The stream is read by a thread (the reader blocks on the socket), so a burst that has
gone quiet is printed while nothing else comes. A stream that drops is resumed by id.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Final

from controller.cli.client import ApiClient, ControllerUnreachable, SseEvent, find_controller
from controller.cli.output import Style
from controller.model.errors import SlotctlError
from controller.model.events import Event, LeaseFold, event_line
from controller.model.exitcode import ExitCode

__all__ = ["cmd_events", "render_line"]

_RECONNECT_S: Final = 5.0  # a stream that cannot be resumed for this long has ended
_TICK_S: Final = 0.25  # how often a quiet burst is looked for
_END: Final = object()


class _Printer:
    """What is printed: events through the fold (unless ``--all``), old ones dropped, as
    text or JSON lines, counted for ``-n``."""

    def __init__(self, args: argparse.Namespace, cutoff: float | None) -> None:
        self.output = args.output
        self.count = args.count
        self.cutoff = cutoff
        self.fold = None if args.all else LeaseFold()
        self.style = Style(sys.stdout)
        self.seen = 0

    def event(self, sse: SseEvent) -> bool:
        """Print what ``sse`` makes printable now; True once ``-n`` is reached."""
        try:
            event = Event.from_dict(json.loads(sse.data))
        except (ValueError, TypeError, AttributeError):  # not an event of ours: as it came
            return self._line(sse.data if self.output == "json" else f"{sse.event}: {sse.data}")
        if self.cutoff is not None and event.time < self.cutoff:
            return False  # older than --since
        shown = [event] if self.fold is None else self.fold.feed(event)
        return any(self._show(e, sse.data if e is event else None) for e in shown)

    def quiet(self) -> bool:
        if self.fold is None:
            return False
        return any(self._show(e, None) for e in self.fold.quiet(time.time()))

    def flush(self) -> None:
        """The bursts still folded (the stream ended)."""
        for event in self.fold.flush() if self.fold is not None else ():
            if self._show(event, None):
                return

    def _show(self, event: Event, raw: str | None) -> bool:
        return self._line(render_line(event, raw, self.output, self.style))

    def _line(self, text: str) -> bool:
        print(text, flush=True)
        self.seen += 1
        return bool(self.count) and self.seen >= self.count


def render_line(event: Event, raw: str | None, output: str, style: Style) -> str:
    """One event as printed: its wire form as it came (``raw``; made for a folded one)
    with ``-o json``, else :func:`event_line`'s text, as ``slotctl up`` prints it."""
    if output == "json":
        return raw if raw is not None else _compact(event)
    return event_line(event, red=style.red)


def _compact(event: Event) -> str:
    """An event's wire form, as the stream's ``data`` lines carry it."""
    return json.dumps(event.to_dict(), separators=(",", ":"), default=str)


def _stream(client: ApiClient, last_id: str | None, out: queue.Queue[object]) -> None:
    """The reader thread: events into ``out`` (resumed by id when the stream drops), then
    ``_END``; a failure to reach the controller is put there for the main thread."""
    lost_at: float | None = None
    try:
        while True:
            try:
                for event in client.events(last_event_id=last_id):
                    lost_at = None
                    if event.id:
                        last_id = event.id
                    out.put(event)
            except ControllerUnreachable as exc:
                if lost_at is None:
                    out.put(exc)  # not reached (not a stream that dropped): it fails
                    return
            now = time.monotonic()
            lost_at = lost_at or now
            if now - lost_at > _RECONNECT_S:
                break
            time.sleep(0.2)
    except SlotctlError as exc:  # e.g. a typed API error (401): the main thread raises it
        out.put(exc)
        return
    out.put(_END)


def _items(out: queue.Queue[object], reader: threading.Thread) -> Iterator[object]:
    """What the reader put, or None every ``_TICK_S`` while it puts nothing (``_END``
    too should the reader die of a bug: it says so on stderr itself)."""
    while True:
        try:
            yield out.get(timeout=_TICK_S)
        except queue.Empty:
            yield None if reader.is_alive() or not out.empty() else _END


def cmd_events(args: argparse.Namespace) -> ExitCode:
    event_id, seconds = args.since if args.since is not None else (None, None)
    cutoff = time.time() - seconds if seconds is not None else None
    if event_id is not None:
        last_id: str | None = str(event_id)
    else:
        last_id = None if args.watch_only else "0"  # 0: the buffered history first
    endpoint = find_controller(
        args.state_dir, getattr(args, "api_server", None), getattr(args, "api_token", None)
    )
    printer = _Printer(args, cutoff)
    out: queue.Queue[object] = queue.Queue()
    reader = threading.Thread(
        target=_stream, args=(ApiClient(endpoint, timeout=30.0), last_id, out), daemon=True
    )
    reader.start()
    # The history is what the controller still keeps: the gap it opens with is no news.
    history_gap = last_id == "0"
    # Ctrl-C ends it like ``slot logs -f``: quietly, exit 130 (``cli.main``).
    for item in _items(out, reader):
        if item is _END:
            printer.flush()
            print("slotctl: the event stream ended (the controller stopped)", file=sys.stderr)
            return ExitCode.OK
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, SseEvent):
            opening, history_gap = history_gap, False
            if item.event == "gap" and opening:
                continue
            if printer.event(item):
                return ExitCode.OK
        elif printer.quiet():
            return ExitCode.OK
    return ExitCode.OK  # pragma: no cover (the items never end)
