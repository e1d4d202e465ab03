"""``<config_dir>/residency.json``: runtime residency wishes, apart from stack files.

An API load sets a slot resident, an unload clears it; a re-apply of a stack never
changes them. Restored at start in catalogue order (SPEC §3).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.model.errors import SlotctlError, StateWriteFailed
from controller.model.names import is_valid_slot_name
from controller.store.files import (
    atomic_write_json,
    check_slot_name,
    utcnow,
)

__all__ = ["ResidencyEntry", "ResidencyStore"]


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
