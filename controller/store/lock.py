"""One controller per state dir: the lock, ``controller.json``, the private state dir and
the API token."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.model.errors import ControllerAlreadyRunning, SlotctlError
from controller.store.files import atomic_write_bytes, atomic_write_json, utcnow
from controller.store.runinfo import RECORD, running_controller

__all__ = ["ControllerLock", "ControllerRecord", "ensure_private_dir", "ensure_token"]


class ControllerRecord(BaseModel):
    """``<state_dir>/controller.json`` while a controller runs on that state dir."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    pid: int
    create_time: float
    started_at: str = Field(default_factory=utcnow)
    runtime: str = "process"
    listen: str | None = None
    config_dir: str = ""
    version: str = ""


class ControllerLock:
    """One controller per state dir: an exclusive ``flock`` plus ``controller.json``.

    The lock dies with the process (kill -9 included), so a stale ``controller.json``
    never blocks the next start; :meth:`running` checks pid *and* start time.
    """

    LOCK = "controller.lock"
    RECORD = RECORD

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self._fd: int | None = None
        self.tightened = False  # acquire() made an existing state dir private (0700)

    def acquire(self, record: ControllerRecord) -> None:
        import fcntl

        if ensure_private_dir(self.state_dir):
            self.tightened = True
        fd = os.open(self.state_dir / self.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            other = self.read()
            who = f" (pid {other.pid}, started {other.started_at})" if other else ""
            raise ControllerAlreadyRunning(
                f"another controller already runs on {self.state_dir}{who}",
                state_dir=str(self.state_dir),
            ) from None
        self._fd = fd
        atomic_write_json(self.state_dir / self.RECORD, record.model_dump(mode="json"))

    def update(self, record: ControllerRecord) -> None:
        """Rewrite ``controller.json`` (e.g. with the API's real port) while holding the lock."""
        if self._fd is None:
            raise SlotctlError("the controller lock is not held")
        atomic_write_json(self.state_dir / self.RECORD, record.model_dump(mode="json"))

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / self.RECORD).unlink()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self) -> ControllerRecord | None:
        try:
            data = json.loads((self.state_dir / self.RECORD).read_bytes())
            return ControllerRecord.model_validate(data)
        except (OSError, ValueError, ValidationError):
            return None

    def running(self) -> ControllerRecord | None:
        """The live controller's record, or None (absent, dead, or a recycled pid)."""
        data = running_controller(self.state_dir)
        if data is None:
            return None
        try:
            return ControllerRecord.model_validate(data)
        except ValidationError:
            return None


def ensure_private_dir(path: Path) -> bool:
    """``path`` as a directory only its owner may enter (0700, as etcd keeps its data
    dir): the state dir holds the token, the servers' logs and the state files, which
    other local users have no business reading. Created so; an existing one with group or
    other bits is tightened (True: it was; the caller says so)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_mode & 0o077 and info.st_uid == os.geteuid():
        path.chmod(0o700)
        return True
    return False


def ensure_token(state_dir: Path) -> str:
    """The API bearer token in ``<state_dir>/token`` (mode 0600), generated on first use."""
    import secrets

    path = Path(state_dir) / "token"
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        token = ""
    if token:
        return token
    token = secrets.token_urlsafe(32)
    while token.startswith("-"):  # `--token -x…` reads as a flag to argparse (and to curl users)
        token = secrets.token_urlsafe(32)
    atomic_write_bytes(path, (token + "\n").encode(), mode=0o600)
    return token
