"""Logging setup for the CLI: human lines or one JSON object per line (``--log-format``).

Lifecycle events are logged by ``controller.model.events`` on the ``slotctl.lifecycle`` logger
with the structured fields under ``extra={"slotctl": {...}}``; the JSON formatter lifts
them to top-level keys (``op``, ``slot``, ``model``, ``from``, ``to``, ``error``).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

__all__ = ["JsonFormatter", "setup_logging"]

_RENAMES: dict[str, str] = {"from_state": "from", "to_state": "to"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "slotctl", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                data[_RENAMES.get(str(key), str(key))] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def setup_logging(fmt: str, level: str = "info", stream: TextIO | None = None) -> None:
    """``text``: warnings and errors as plain lines; ``json``: every record as JSON."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
        threshold = getattr(logging, level.upper(), logging.INFO)
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
        threshold = max(getattr(logging, level.upper(), logging.INFO), logging.WARNING)
    root = logging.getLogger("slotctl")
    root.handlers[:] = [handler]
    root.setLevel(threshold)
    root.propagate = False
