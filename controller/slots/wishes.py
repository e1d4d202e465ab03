"""Runtime wishes about keeping slots loaded: residency and pauses (``residency.json``).

A *residency* wish (``slotctl slot load``/``swap``, the API's loads) keeps a slot's model
loaded across restarts; a *pause* (a user's ``slotctl slot unload`` of an autoload slot)
keeps an autoload slot unloaded until a user's load resumes it. Both live in
:class:`~controller.store.ResidencyStore`, separate from the stack-derived config, so a
re-apply never changes them. This object is their in-memory copy and only writer.
"""

from __future__ import annotations

from pathlib import Path

from controller.store.files import utcnow
from controller.store.residency import ResidencyStore

__all__ = ["Wishes"]


class Wishes:
    def __init__(self, config_dir: Path) -> None:
        self.store = ResidencyStore(config_dir)
        self.resident: dict[str, str] = {n: e.model_id for n, e in self.store.read().items()}
        self.paused: dict[str, str] = self.store.read_paused()

    def is_resident(self, name: str) -> bool:
        return name in self.resident

    def is_paused(self, name: str) -> bool:
        return name in self.paused

    def keeps_loaded(self, name: str, autoload: bool) -> bool:
        """Autoload (unless a user paused it) or a residency wish: keep it loaded."""
        return (autoload and name not in self.paused) or name in self.resident

    def set_resident(self, name: str, model_id: str) -> None:
        if self.resident.get(name) != model_id:
            self.store.set(name, model_id)
            self.resident[name] = model_id

    # Each change is written first and kept in memory only once the file has it, so a
    # refused write (a full disk: StateWriteFailed) leaves both as they were.

    def clear_resident(self, name: str) -> bool:
        """Forget the wish; True when there was one."""
        if name not in self.resident:
            return False
        self.store.clear(name)
        del self.resident[name]
        return True

    def pause(self, name: str) -> bool:
        """Pause an autoload slot; True when it was not paused yet."""
        if name in self.paused:
            return False
        self.store.pause(name)
        self.paused[name] = utcnow()
        return True

    def resume(self, name: str) -> bool:
        if name not in self.paused:
            return False
        self.store.resume(name)
        del self.paused[name]
        return True
