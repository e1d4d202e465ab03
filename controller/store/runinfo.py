"""Which controller runs on a state dir: ``controller.json`` read without pydantic.

Sits at the store's level: ``store.ControllerLock`` writes the record (and holds the
lock) and reads it through :func:`running_controller`; the CLI's API client calls it
directly, so finding the local controller does not import the spec and store models
(``slotctl`` starts faster). A record counts only while its process lives with the same
start time (a recycled pid is not the controller).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

__all__ = ["RECORD", "running_controller"]

RECORD: Final = "controller.json"
_START_TOLERANCE_S: Final = 0.05


def running_controller(state_dir: Path) -> dict[str, Any] | None:
    """The live controller's record as written (``pid``, ``create_time``, ``listen``,
    ``runtime``...), or None: absent, unreadable, dead, or a recycled pid."""
    import psutil

    try:
        data = json.loads((Path(state_dir) / RECORD).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid, created = data.get("pid"), data.get("create_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(created, int | float):
        return None
    try:
        if abs(psutil.Process(pid).create_time() - created) > _START_TOLERANCE_S:
            return None
    except psutil.Error:
        return None
    listen = data.get("listen")
    if listen is not None and not isinstance(listen, str):
        return None
    return data
