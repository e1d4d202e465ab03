"""The atomic writers of the state dir and the sweep of their temp files.

Every write is a temp file in the same directory (``.NAME.PID.TID.tmp``), fsync,
``os.replace``, then fsync of the directory: a reader, or a controller restarted after
SIGKILL, sees the old file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from controller.model.errors import SlotConfigError
from controller.model.names import SLOT_NAME_PATTERN, is_valid_slot_name

__all__ = [
    "atomic_write_bytes",
    "atomic_write_json",
    "check_slot_name",
    "iso_of",
    "sweep_temp_files",
    "utcnow",
]

_TMP_SUFFIX = ".tmp"


# The UTC second last formatted and its text: a slot's ``since`` is stamped on every
# transition, two a routed request (its lease flips), mostly within one second.
_SECOND: tuple[int, str] = (-1, "")


def utcnow() -> str:
    """Now in UTC, ISO 8601 to the millisecond with a ``Z``: what
    ``datetime.now(UTC).isoformat(timespec="milliseconds")`` says (``...+00:00`` as ``Z``;
    it floors the system clock's nanoseconds too), its second formatted once."""
    # iso_of(time.time_ns()), in line: twice a routed request (its lease flips)
    global _SECOND
    second, rest = divmod(time.time_ns(), 1_000_000_000)
    cached = _SECOND
    if cached[0] != second:
        cached = _SECOND = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{cached[1]}.{rest // 1_000_000:03d}Z"


def iso_of(ns: int) -> str:
    """:func:`utcnow` of the POSIX time ``ns`` (nanoseconds)."""
    global _SECOND
    second, rest = divmod(ns, 1_000_000_000)
    cached = _SECOND
    if cached[0] != second:
        cached = _SECOND = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{cached[1]}.{rest // 1_000_000:03d}Z"


def check_slot_name(name: str) -> str:
    """Refuse anything that is not a DNS-1123 label before it touches a path."""
    if not is_valid_slot_name(name):
        raise SlotConfigError(
            f"invalid slot name {name!r}: must match {SLOT_NAME_PATTERN}",
            keys=["name"],
        )
    return name


def _fsync_dir(directory: Path | str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically; ``durable`` also fsyncs file and dir.

    Without ``durable`` the write is still atomic (readers see old or new, never torn)
    but may be lost on power failure; used for high-rate, low-value transitions.

    The temp file is named by process and thread (``.NAME.PID.TID.tmp``): one writer
    thread writes it at a time, so no random name is needed (``mkstemp`` cost more than
    a quarter of a non-durable write); one a killed writer left is truncated and reused.
    """
    parent = os.fspath(path.parent)
    tmp = f"{parent}/.{path.name}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:  # the first write there (a mkdir every time cost ~0.5 ms)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, mode)
    try:
        try:
            os.fchmod(fd, mode)  # exactly ``mode`` (not masked by the umask)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # noqa: PTH105  (str paths: no Path built per write)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # noqa: PTH108
        raise
    if durable:
        _fsync_dir(parent)


def atomic_write_json(
    path: Path, data: Any, *, mode: int = 0o644, durable: bool = True, indent: int | None = 2
) -> None:
    """``data`` as JSON, keys sorted; ``indent=None`` writes one line, through json's C
    encoder (an indented dump takes the pure-Python one: ~3x the CPU of a small record;
    the slots' state and process records, written at every transition, are one line)."""
    text = json.dumps(data, indent=indent, sort_keys=True) + "\n"
    atomic_write_bytes(path, text.encode(), mode=mode, durable=durable)


def sweep_temp_files(directory: Path) -> int:
    """Remove temp files a killed writer left behind; returns how many."""
    removed = 0
    if not directory.is_dir():
        return 0
    for tmp in directory.rglob(f".*{_TMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed += 1
    return removed
