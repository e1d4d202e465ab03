"""Follow a growing log file from the event loop, woken by inotify (Linux), not by polling.

Used by :meth:`controller.runtime.process.runtime.ProcessRuntime.watch_log` so the readiness
probe (:class:`controller.probes.readiness.HttpProber`) wakes the moment a server writes its "ready"
line into the slot's log file. Only what is appended after :func:`follow` is reported (or,
given an ``offset``, everything from there on: a server's output from its first line); a
truncated file (the runtime's copy-truncate at its size cap) is read again from the top.
Where inotify is missing (not Linux, no libc symbol, out of watches) :func:`follow`
returns None and the probe keeps to its schedule.
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

__all__ = ["follow"]

log = logging.getLogger("slotctl.runtime")

IN_MODIFY: Final = 0x00000002
MAX_READ: Final = 256 * 1024  # more than this at once: only its tail can hold the news


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC: Final = _libc()


class _Follower:
    """One open log file and its inotify descriptor, registered with the loop."""

    def __init__(
        self, path: Path, on_text: Callable[[str], None], notify_fd: int, offset: int | None
    ) -> None:
        self.on_text = on_text
        self.notify_fd = notify_fd
        self.file = path.open("rb")
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(notify_fd, self._readable)
        if offset is None:
            self.file.seek(0, os.SEEK_END)
        else:  # what is there already is news too (the watch is set: nothing is missed)
            self.file.seek(offset)
            self.loop.call_soon(self._read_new)

    def _readable(self) -> None:
        try:
            while os.read(self.notify_fd, 4096):  # drain the events: their kind is known
                pass
        except BlockingIOError:
            pass
        except OSError as exc:
            log.warning("log watch failed (%s); the probe keeps to its schedule", exc)
            self.close()
            return
        self._read_new()

    def _read_new(self) -> None:
        if self.notify_fd < 0:  # closed before a scheduled first read
            return
        size = os.fstat(self.file.fileno()).st_size
        position = self.file.tell()
        if size < position:  # copy-truncated under us: start over
            self.file.seek(0)
            self.decoder.reset()
            position = 0
        if size - position > MAX_READ:
            self.file.seek(size - MAX_READ)
            self.decoder.reset()
        data = self.file.read(MAX_READ)
        if data:
            self.on_text(self.decoder.decode(data))

    def close(self) -> None:
        if self.notify_fd < 0:
            return
        self.loop.remove_reader(self.notify_fd)
        # Closing an inotify descriptor waits for the kernel's SRCU grace period (10-30 ms
        # measured here): done on a worker thread, so the probe's answer is not held up.
        self.loop.run_in_executor(None, os.close, self.notify_fd)
        self.notify_fd = -1
        self.file.close()


def follow(
    path: Path, on_text: Callable[[str], None], *, offset: int | None = None
) -> Callable[[], None] | None:
    """Call ``on_text`` with text appended to ``path`` from now on (``offset``: from that
    byte on, what is already there included, reported soon after this returns); returns
    the function that stops following, or None when the file cannot be followed
    (missing, no inotify). Must be called on the running event loop, where ``on_text``
    is then called."""
    if _LIBC is None:
        return None
    notify_fd = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if notify_fd < 0:
        log.debug("inotify_init1: %s", os.strerror(ctypes.get_errno()))
        return None
    if _LIBC.inotify_add_watch(notify_fd, os.fsencode(path), IN_MODIFY) < 0:
        os.close(notify_fd)
        return None
    try:
        follower = _Follower(path, on_text, notify_fd, offset)
    except OSError:
        os.close(notify_fd)
        return None
    return follower.close
