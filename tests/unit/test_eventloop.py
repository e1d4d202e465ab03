"""The event loop of ``slotctl up`` (controller.kit.eventloop): uvloop when installed, asyncio
when asked (``SLOTCTL_EVENT_LOOP=asyncio``), a typed error for a value it does not know."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from collections.abc import Coroutine
from typing import Any

import pytest

from controller.kit import eventloop
from controller.model.errors import SlotConfigError

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop is not installed (pip install uvloop)")
def test_uvloop_is_the_default_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(eventloop.ENV, raising=False)
    assert eventloop.loop_factory()[0] == "uvloop"
    assert eventloop.run(loop_module).startswith("uvloop")


def test_asyncio_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "asyncio")
    assert eventloop.loop_factory()[0] == "asyncio"
    assert eventloop.run(loop_module).startswith("asyncio")


def test_an_unknown_choice_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "tokio")
    with pytest.raises(SlotConfigError, match="SLOTCTL_EVENT_LOOP"):
        eventloop.loop_factory()


def test_a_refused_choice_creates_no_coroutine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad setting is refused before ``main`` is called (no 'never awaited' warning)."""
    monkeypatch.setenv(eventloop.ENV, "tokio")
    called: list[bool] = []

    async def main() -> None:
        called.append(True)

    def make() -> Coroutine[Any, Any, None]:
        called.append(False)
        return main()

    with pytest.raises(SlotConfigError):
        eventloop.run(make)
    assert called == []


def test_uvloop_asked_for_but_missing_is_a_typed_error() -> None:
    """In a child whose import of uvloop fails (a blocked module), not this process."""
    code = (
        "import sys; sys.modules['uvloop'] = None\n"
        "from controller.kit import eventloop\n"
        "from controller.model.errors import SlotConfigError\n"
        "assert eventloop.loop_factory('auto')[0] == 'asyncio'\n"
        "try:\n    eventloop.loop_factory('uvloop')\n"
        "except SlotConfigError as exc:\n    print('refused:', exc.message)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "refused: SLOTCTL_EVENT_LOOP=uvloop but uvloop is not installed" in out.stdout
