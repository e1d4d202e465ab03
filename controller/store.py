"""Observed-state persistence: atomic files under the state dir (and residency.json).

The only module that writes state files. Every write goes through :func:`atomic_write_bytes`:
a temp file in the same directory, fsync, ``os.replace``, then fsync of the directory, so
a reader (or a controller restarted after SIGKILL) sees the old file or the new one, never
a torn one. Slot names are validated before they become part of a path. A state write the
filesystem refuses (ENOSPC, EROFS, EIO) is :class:`~controller.errors.StateWriteFailed`,
naming the path and the errno; the old file stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.errors import (
    ControllerAlreadyRunning,
    SlotConfigError,
    SlotctlError,
    StateWriteFailed,
)
from controller.lifecycle import SlotState
from controller.names import SLOT_NAME_PATTERN, is_valid_slot_name
from controller.runinfo import RECORD, running_controller

__all__ = [
    "ControllerLock",
    "ControllerRecord",
    "PlacedGpu",
    "ReloadCosts",
    "ResidencyEntry",
    "ResidencyStore",
    "SlotStateRecord",
    "StateExtra",
    "StateStore",
    "atomic_write_bytes",
    "atomic_write_json",
    "check_slot_name",
    "ensure_private_dir",
    "ensure_token",
    "utcnow",
]

_TMP_SUFFIX = ".tmp"
_PATHS_KEPT = 10_000  # slot names whose paths a store keeps (more: it starts over)


def utcnow() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


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


class PlacedGpu(BaseModel):
    """One GPU of a slot's placement, as ``state.json`` records it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    index: int
    uuid: str | None = None
    vendor: str | None = None
    node: str | None = None  # on a cluster: the node the controller placed the slot on


class ReloadCosts(BaseModel):
    """What bringing a slot's model back costs, measured: moving averages of its cold loads
    (admitted -> ready) and wakes (``/wake_up`` -> ready), in seconds (None: not measured
    yet). The eviction order's reload-cost score divides idle time by them."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str  # the model they were measured with (another model starts over)
    load_s: float | None = None
    wake_s: float | None = None


class StateExtra(BaseModel):
    """``state.json``'s ``extra``: the facts beyond the state itself, each one named.

    Unknown keys (a newer or older controller's) are ignored; defaults are left out of
    the file, so a slot with nothing to say has ``"extra": {}``.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    idle_reason: str | None = None  # no_model | timeout, while idle
    failures: int = 0  # the crash-loop breaker's count ...
    retry_after_s: float = 0.0  # ... its backoff when the record was written ...
    retry_at: float = 0.0  # ... and when it ends (wall clock), so a restart keeps it
    adopted: str | None = None  # the server adopted after a restart (pid, container)
    config_drift: bool = False  # the adopted server runs an older config
    waiting: str | None = None  # waiting_for_memory: a background load waits for room
    # The GPUs the slot was placed on (while admitted): a restart, an adoption or a
    # `stack diff` never re-places a running slot.
    gpus: tuple[PlacedGpu, ...] = ()
    # The residency tier of an idle slot (issue 22): "asleep" (its server sleeps, its
    # device memory released) or "waking" (a wake holds its device memory again);
    # None: awake. ``sleep_level``: 1 (weights in host memory) or 2 (weights dropped).
    residency: str | None = None
    sleep_level: int = 0
    reload: ReloadCosts | None = None  # measured reload costs (the eviction order)


class SlotStateRecord(BaseModel):
    """``slots/<name>/state.json``: the persisted observed state of one slot."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    state: SlotState
    model_id: str = ""
    port: int | None = None
    updated_at: str = Field(default_factory=utcnow)
    message: str = ""
    extra: StateExtra = Field(default_factory=StateExtra)

    def to_json(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude={"extra"})
        data["extra"] = self.extra.model_dump(mode="json", exclude_defaults=True)
        return data


class StateStore:
    """Reads and atomically writes ``<state_dir>/slots/<name>/state.json``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.slots_dir = self.state_dir / "slots"
        # Validated names -> their dirs and state files (a Path join costs microseconds,
        # and every transition, probe and record read asks for one).
        self._dirs: dict[str, tuple[Path, Path]] = {}

    def _paths(self, name: str) -> tuple[Path, Path]:
        paths = self._dirs.get(name)
        if paths is None:
            directory = self.slots_dir / check_slot_name(name)
            paths = (directory, directory / "state.json")
            if len(self._dirs) >= _PATHS_KEPT:
                self._dirs.clear()
            self._dirs[name] = paths
        return paths

    def path_for(self, name: str) -> Path:
        return self._paths(name)[1]

    def write(self, record: SlotStateRecord, *, durable: bool = True) -> None:
        """Raises :class:`StateWriteFailed` (the old file stays) when the disk says no."""
        path = self.path_for(record.name)
        try:
            atomic_write_json(path, record.to_json(), durable=durable, indent=None)
        except OSError as exc:  # ENOSPC, EROFS, EIO, ...: typed, with path and errno
            raise StateWriteFailed(str(path), exc) from exc

    def read(self, name: str) -> SlotStateRecord | None:
        path = self.path_for(name)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: absurd nesting
            raise SlotctlError(f"unreadable state file {path}: {exc}", path=str(path)) from exc
        try:
            return SlotStateRecord.model_validate(data)
        except ValidationError as exc:
            raise SlotctlError(f"invalid state file {path}: {exc}", path=str(path)) from exc

    def names(self) -> list[str]:
        if not self.slots_dir.is_dir():
            return []
        return sorted(
            p.name for p in self.slots_dir.iterdir() if is_valid_slot_name(p.name) and p.is_dir()
        )

    def read_all(self) -> Iterator[SlotStateRecord]:
        for name in self.names():
            record = self.read(name)
            if record is not None:
                yield record

    def delete(self, name: str) -> None:
        """A removed slot's state and chosen port (a new slot of its name starts afresh)."""
        path = self.path_for(name)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.delete_aux(name, PORT_FILE)
        with contextlib.suppress(OSError):
            path.parent.rmdir()

    def sweep(self) -> int:
        return sweep_temp_files(self.slots_dir)

    # Runtime records (e.g. the process runtime's ``process.json``) live beside state.json
    # so one slot's observed state stays in one directory.

    def slot_dir(self, name: str) -> Path:
        return self._paths(name)[0]

    def write_aux(
        self, name: str, filename: str, data: Mapping[str, Any], *, durable: bool = True
    ) -> None:
        """Atomically; ``durable`` as :func:`atomic_write_bytes` (a record that only a
        crash of the controller must survive, and not one of the machine, need not be)."""
        path = self.slot_dir(name) / _aux_name(filename)
        try:
            atomic_write_json(path, dict(data), durable=durable, indent=None)
        except OSError as exc:
            raise StateWriteFailed(str(path), exc) from exc

    def read_aux(self, name: str, filename: str) -> dict[str, Any] | None:
        path = self.slot_dir(name) / _aux_name(filename)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError):
            return None  # a torn aux file cannot exist (atomic writes); treat as absent
        return data if isinstance(data, dict) else None

    def delete_aux(self, name: str, filename: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.slot_dir(name) / _aux_name(filename)).unlink()

    # The port the controller chose for a slot that leaves it to the controller (``port``
    # absent or "auto"): kept beside its state, so a restart gives it the same one.

    def read_port(self, name: str) -> int | None:
        data = self.read_aux(name, PORT_FILE)
        port = data.get("port") if data else None
        valid = isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
        return port if valid else None

    def write_port(self, name: str, port: int) -> None:
        """Durably, before a server is started on it (an intent, SPEC §3)."""
        self.write_aux(name, PORT_FILE, {"port": port})


PORT_FILE: Final = "port.json"  # the port chosen for an auto-port slot


def _aux_name(filename: str) -> str:
    if not filename or "/" in filename or filename.startswith(".") or filename == "state.json":
        raise ValueError(f"invalid aux file name {filename!r}")
    return filename


class ResidencyEntry(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model_id: str
    since: str = Field(default_factory=utcnow)


class ResidencyStore:
    """``<config_dir>/residency.json``: runtime wishes about keeping slots loaded.

    ``slots``: the residency wishes (``slotctl slot load``/``swap``, the API's loads): keep
    this slot's model loaded, across restarts. ``paused``: autoload slots a user unloaded
    (``slotctl slot unload``): not reloaded until ``slotctl slot load`` resumes them.
    Separate from the stack-derived config so a re-apply never changes them.
    """

    FILE = "residency.json"

    def __init__(self, config_dir: Path) -> None:
        self.path = Path(config_dir) / self.FILE

    def _read_raw(self) -> Mapping[str, Any]:
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            raise SlotctlError(f"unreadable residency file {self.path}: {exc}") from exc
        return data if isinstance(data, Mapping) else {}

    @staticmethod
    def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        section = data.get(key)
        return section if isinstance(section, Mapping) else {}

    def read(self) -> dict[str, ResidencyEntry]:
        out: dict[str, ResidencyEntry] = {}
        for name, entry in self._section(self._read_raw(), "slots").items():
            if is_valid_slot_name(name):
                with contextlib.suppress(ValidationError):
                    out[name] = ResidencyEntry.model_validate(entry)
        return out

    def read_paused(self) -> dict[str, str]:
        """Paused autoload slots -> since when (ISO time)."""
        out: dict[str, str] = {}
        for name, entry in self._section(self._read_raw(), "paused").items():
            since = entry.get("since") if isinstance(entry, Mapping) else None
            if is_valid_slot_name(name):
                out[name] = since if isinstance(since, str) else ""
        return out

    def _write(
        self, entries: Mapping[str, ResidencyEntry], paused: Mapping[str, str] | None = None
    ) -> None:
        paused = self.read_paused() if paused is None else paused
        payload: dict[str, Any] = {
            "slots": {k: v.model_dump(mode="json") for k, v in sorted(entries.items())}
        }
        if paused:
            payload["paused"] = {k: {"since": v} for k, v in sorted(paused.items())}
        try:
            atomic_write_json(self.path, payload)
        except OSError as exc:  # full, read-only: typed, nothing changed
            raise StateWriteFailed(str(self.path), exc) from exc

    def set(self, slot: str, model_id: str) -> None:
        entries = self.read()
        entries[check_slot_name(slot)] = ResidencyEntry(model_id=model_id)
        self._write(entries)

    def clear(self, slot: str) -> bool:
        entries = self.read()
        if entries.pop(check_slot_name(slot), None) is None:
            return False
        self._write(entries)
        return True

    def pause(self, slot: str) -> None:
        paused = self.read_paused()
        paused[check_slot_name(slot)] = utcnow()
        self._write(self.read(), paused)

    def resume(self, slot: str) -> bool:
        paused = self.read_paused()
        if paused.pop(check_slot_name(slot), None) is None:
            return False
        self._write(self.read(), paused)
        return True


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
    atomic_write_bytes(path, (token + "\n").encode(), mode=0o600)
    return token
