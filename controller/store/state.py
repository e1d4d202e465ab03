"""Each slot's observed state on disk: ``slots/<name>/state.json`` and its aux files.

The state record (:class:`SlotStateRecord`, with its ``extra``: placement, reload costs,
the idle reason...) and :class:`StateStore`, which reads and writes it and the slot's
other files (process records, the chosen port) through the atomic writers of
:mod:`controller.store.files`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.model.errors import SlotctlError, StateWriteFailed
from controller.model.lifecycle import SlotState
from controller.model.names import is_valid_slot_name
from controller.store.files import (
    atomic_write_json,
    check_slot_name,
    sweep_temp_files,
    utcnow,
)

__all__ = [
    "PORT_FILE",
    "PlacedGpu",
    "ReloadCosts",
    "SeenUse",
    "SlotStateRecord",
    "StateExtra",
    "StateStore",
]

_PATHS_KEPT = 10_000  # slot names whose paths a store keeps (more: it starts over)


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


class SeenUse(BaseModel):
    """The most a slot's server was seen to hold (issue 36): per model and launch config
    (its config hash; another starts over), on its device and in host memory, in bytes.
    Admission counts the larger of this and the estimate
    (docs/design/0022-footprints.md)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str
    config_hash: str
    device_bytes: int = 0
    host_bytes: int = 0
    source: str = ""  # nvml | rss | fake
    samples: int = 0
    at: str = ""  # when the peak was seen


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
    seen: SeenUse | None = None  # the most its server was seen to hold (admission)


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
