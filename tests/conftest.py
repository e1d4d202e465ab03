"""Shared test hygiene: no leftover child processes or asyncio tasks after any test; the
package's byte code compiled once for the processes the tests start."""

from __future__ import annotations

import compileall
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# The Docker engine and image fixtures (session scope), for tests/integration and tests/e2e.
pytest_plugins = ["tests.docker_fixtures", "tests.integration.llama_fixtures"]


@pytest.fixture(autouse=True)
def _no_leftover_children() -> Iterator[None]:
    """Fail a test that leaves child processes of the test runner behind."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    yield
    leftovers = []
    for proc in me.children(recursive=True):
        if proc.pid in before:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            leftovers.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    assert not leftovers, f"test left child processes behind: {leftovers}"


@pytest.fixture(scope="session", autouse=True)
def _byte_code_for_subprocesses() -> None:
    """Compile ``controller/`` once per session, as an install does.

    The tests start hundreds of ``slotctl``, controller and demo-server processes. Where
    ``PYTHONDONTWRITEBYTECODE`` is set (this sandbox sets it) none of them writes byte
    code, so each would compile every module it imports from source again: 0.15 to 0.2 s of
    CPU per controller start. Up-to-date files are skipped (a stat each).
    """
    compileall.compile_dir(Path(__file__).resolve().parents[1] / "controller", quiet=2)
