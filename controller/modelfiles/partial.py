"""One file's bytes as they arrive: appended to a partial file, hashed on the way in,
renamed into place only when complete and verified — never torn, never unverified.

A :class:`PartialFile` is opened by one writer at a time (an exclusive ``flock`` on a
``.lock`` beside it, so two processes on one models dir — a controller and a
``slotctl model pull``, two pods' init containers on one node cache — never interleave).
Opening hashes the bytes an interrupted pull left (they are resumed, not fetched again).
A transfer appends (:meth:`PartialFile.append`, from its reader thread) and hashes
(:meth:`PartialFile.absorb`, the same bytes in the same order, from a hashing thread, so the
hash overlaps the reads and writes); :meth:`PartialFile.write` does both at once. Appends
are refused once cancelled (:meth:`PartialFile.cancel` also calls what the transfer asked
to be woken with), and ``ENOSPC`` becomes :class:`~controller.model.errors.InsufficientDisk`.
:meth:`PartialFile.restart` starts from zero (a server ignored a ``Range``, or the file
changed under ``If-Range``). :meth:`PartialFile.finish` compares size and digests (the
bytes on disk are hashed again if the hash missed any, which a failed transfer can leave);
the caller then commits (rename) or quarantines. Used by :mod:`controller.modelfiles.stream`
and :mod:`controller.modelfiles.pull`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from controller.model.errors import InsufficientDisk
from controller.modelfiles.digests import Digest, Hasher, feed_file, new_hasher

__all__ = ["PartialBusy", "PartialFile", "PullCancelled", "Verdict", "fsync_dir"]


class PullCancelled(Exception):
    """Raised inside a transfer once its pull was cancelled (no waiter is left)."""


class PartialBusy(Exception):
    """Another process holds this partial file's lock (it is pulling the same file)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What :meth:`PartialFile.finish` found."""

    size: int
    expected_size: int | None
    found: tuple[Digest, ...]  # one per expected digest, in its algorithm
    mismatched: tuple[tuple[Digest, Digest], ...]  # (expected, found)

    @property
    def ok(self) -> bool:
        size_ok = self.expected_size is None or self.size == self.expected_size
        return size_ok and not self.mismatched


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PartialFile:
    """The partial file at ``path`` for bytes expected to hash to ``expected``."""

    def __init__(
        self,
        path: Path,
        *,
        expected: Sequence[Digest],
        size: int | None,
        on_bytes: Callable[[int], None] = lambda n: None,
        free_bytes: Callable[[], int] = lambda: 0,
    ) -> None:
        self.path = path
        self.expected = tuple(expected)
        self.expected_size = size
        self._on_bytes = on_bytes
        self._free_bytes = free_bytes
        self._lock = threading.Lock()
        self._hash_lock = threading.Lock()
        self._cancel = threading.Event()
        self._wakers: list[Callable[[], None]] = []
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._hashers: dict[str, Hasher] = {}
        self._size = 0
        self._hashed = 0  # bytes fed to the hashers (== _size once a transfer is done)
        self.resumed = 0  # bytes found on disk when opened
        self.written = 0  # bytes written through this object

    # -- opening (blocking) -------------------------------------------------------------

    def open(self) -> int:
        """Lock, open for appending and hash what is there; returns the resume offset.

        Raises :class:`PartialBusy` when another process holds the lock. A partial file
        longer than the expected size is started afresh (it can not be this file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise PartialBusy(str(self.path)) from None
        self._lock_fd = lock_fd
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._fd = fd
            size = os.fstat(fd).st_size
            if self.expected_size is not None and size > self.expected_size:
                os.ftruncate(fd, 0)
                size = 0
            self._reset_hashers()
            if size:
                for hasher in self._hashers.values():
                    feed_file(self.path, hasher, size)
            self._size = self._hashed = size
            self.resumed = size
            os.lseek(fd, size, os.SEEK_SET)
        except BaseException:
            self.close()
            raise
        return size

    def _reset_hashers(self) -> None:
        self._hashers = {
            d.algorithm: new_hasher(d.algorithm, self.expected_size) for d in self.expected
        }

    # -- the file object a transfer writes into (any thread) ----------------------------

    @property
    def size(self) -> int:
        return self._size

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """No byte more: every later :meth:`append` raises :class:`PullCancelled`, and what
        :meth:`on_cancel` registered is called (a transfer's socket shut, to wake it)."""
        with self._lock:
            self._cancel.set()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def on_cancel(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakers.append(wake)
            cancelled = self._cancel.is_set()
        if cancelled:
            wake()

    def wait_cancelled(self, seconds: float) -> bool:
        """Sleep ``seconds`` (a transfer's back-off), or less if cancelled meanwhile."""
        return self._cancel.wait(seconds)

    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` at the end, unhashed: the caller hands the same bytes, in the
        same order, to :meth:`absorb`."""
        view = memoryview(data)
        n = len(view)
        with self._lock:
            if self._cancel.is_set():
                raise PullCancelled(str(self.path))
            fd = self._fd
            if fd is None:
                raise ValueError("write to a closed partial file")
            try:
                left = view
                while left:
                    left = left[os.write(fd, left) :]
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._disk_full() from exc
                raise
            self._size += n
            self.written += n
        self._on_bytes(n)
        return n

    def absorb(self, data: bytes | bytearray | memoryview) -> None:
        """Hash ``data``, the next bytes :meth:`append` wrote (any thread but its own).
        (Starting each block's write-out here with ``sync_file_range``, to shorten the
        ``fsync`` of :meth:`finish`, made the writes 3-4x slower in CPU and time on the
        development machine's disk: measured, dropped.)"""
        view = memoryview(data)
        with self._hash_lock:
            for hasher in self._hashers.values():
                hasher.update(view)
            self._hashed += len(view)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append and hash."""
        n = self.append(data)
        self.absorb(data)
        return n

    def _disk_full(self) -> InsufficientDisk:
        free = self._free_bytes()
        left = None if self.expected_size is None else self.expected_size - self._size
        return InsufficientDisk(
            f"the disk filled up while pulling into {self.path.parent} "
            f"({self._size} bytes are kept to resume)",
            needed_bytes=left or 0,
            free_bytes=free,
            path=str(self.path.parent),
        )

    def truncate(self, keep: int) -> None:
        """Drop the bytes from ``keep`` on and rehash the rest (no transfer is running)."""
        with self._lock, self._hash_lock:
            fd = self._fd
            if fd is None:
                raise ValueError("truncate of a closed partial file")
            dropped = self._size - keep
            os.ftruncate(fd, keep)
            os.lseek(fd, keep, os.SEEK_SET)
            self._rehash(keep)
            self._size = keep
            self.resumed = min(self.resumed, keep)
        if dropped > 0:
            self._on_bytes(-dropped)

    def _rehash(self, length: int) -> None:
        self._reset_hashers()
        if length:
            for hasher in self._hashers.values():
                feed_file(self.path, hasher, length)
        self._hashed = length

    def restart(self) -> None:
        """Start again from zero (the upstream changed under a resume)."""
        self.truncate(0)

    # -- the end (blocking) -------------------------------------------------------------

    def finish(self) -> Verdict:
        """Sync the bytes to disk and compare size and digests with the expected ones."""
        with self._lock, self._hash_lock:
            if self._fd is not None:
                os.fsync(self._fd)
            if self._hashed != self._size:  # a transfer failed between write and hash
                self._rehash(self._size)
            found = tuple(
                Digest(d.algorithm, self._hashers[d.algorithm].hexdigest()) for d in self.expected
            )
        mismatched = tuple((e, f) for e, f in zip(self.expected, found, strict=True) if e != f)
        return Verdict(self._size, self.expected_size, found, mismatched)

    def commit(self, dest: Path) -> None:
        """Rename the verified bytes into place (atomic: same filesystem) and close."""
        self._close_fd()
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.path.replace(dest)
        fsync_dir(dest.parent)
        self.close()

    def _close_fd(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close the file and release the lock (the bytes stay for a later resume)."""
        self._close_fd()
        lock_fd, self._lock_fd = self._lock_fd, None
        if lock_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
            os.close(lock_fd)
