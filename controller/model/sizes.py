"""Memory sizes in words: the one format of every message and CLI table (pure).

``5.20 GiB``: binary gigabytes with two decimals, whatever the size, so figures line up
and compare at a glance (a slot's ``memory_gb`` is in GiB too).
"""

from __future__ import annotations

from typing import Final

__all__ = ["GIB", "MIB", "format_gib"]

GIB: Final = 1024**3
MIB: Final = 1024**2


def format_gib(value: float) -> str:
    """``value`` bytes as ``0.25 GiB``."""
    return f"{value / GIB:.2f} GiB"
