"""Which asyncio event loop ``slotctl up`` and ``stack apply --once`` run on: uvloop when
installed, else asyncio's.

At the bottom of the layers (no controller import). uvloop (libuv, written in C) is an
optional dependency (``pip install -e '.[fast]'`` in a checkout): when it is importable it is the
default, because the router's per-request cost is mostly event-loop and socket work
(docs/performance.md, router section). ``SLOTCTL_EVENT_LOOP=asyncio`` turns it off;
``SLOTCTL_EVENT_LOOP=uvloop`` insists on it (a typed error when it is not installed).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from controller.model.errors import SlotConfigError

__all__ = ["ENV", "loop_factory", "run"]

ENV: Final = "SLOTCTL_EVENT_LOOP"
_CHOICES: Final = ("auto", "asyncio", "uvloop")

T = TypeVar("T")

log = logging.getLogger("slotctl.eventloop")


def loop_factory(choice: str | None = None) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """(the loop's name, a factory for it) for ``choice`` (default: ``$SLOTCTL_EVENT_LOOP``,
    else ``auto``)."""
    wanted = (choice if choice is not None else os.environ.get(ENV, "auto")).strip().lower()
    if wanted not in _CHOICES:
        raise SlotConfigError(
            f"{ENV}={wanted!r}: expected one of {', '.join(_CHOICES)}", keys=[ENV]
        )
    if wanted != "asyncio":
        try:
            uvloop = importlib.import_module("uvloop")
        except ImportError:
            if wanted == "uvloop":
                raise SlotConfigError(
                    f"{ENV}=uvloop but uvloop is not installed (pip install uvloop)", keys=[ENV]
                ) from None
        else:
            factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
            return "uvloop", factory
    return "asyncio", asyncio.new_event_loop


def run(
    main: Callable[[], Coroutine[Any, Any, T]],
    choice: str | tuple[str, Callable[[], asyncio.AbstractEventLoop]] | None = None,
) -> T:
    """``asyncio.run(main())`` on the loop :func:`loop_factory` picks (or has picked:
    ``choice`` may be its answer, taken early to refuse a bad setting before any work).
    ``main`` is called only once the loop is chosen: a refused choice creates no
    coroutine to leak."""
    name, factory = choice if isinstance(choice, tuple) else loop_factory(choice)
    log.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())
