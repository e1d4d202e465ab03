"""Default locations of the config dir and the state dir (overridable everywhere).

Pure apart from reading the environment. ``--config-dir``/``--state-dir`` and the env vars
``SLOTCTL_CONFIG_DIR``/``SLOTCTL_STATE_DIR`` win, so several controllers can run side by side.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["default_config_dir", "default_state_dir"]


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def default_config_dir(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("SLOTCTL_CONFIG_DIR"):
        return Path(env["SLOTCTL_CONFIG_DIR"])
    if env.get("XDG_CONFIG_HOME"):
        return Path(env["XDG_CONFIG_HOME"]) / "slotctl"
    if _is_root():
        return Path("/etc/slotctl")
    return Path.home() / ".config" / "slotctl"


def default_state_dir(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("SLOTCTL_STATE_DIR"):
        return Path(env["SLOTCTL_STATE_DIR"])
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "slotctl"
    if _is_root():
        return Path("/var/lib/slotctl")
    return Path.home() / ".local" / "state" / "slotctl"
