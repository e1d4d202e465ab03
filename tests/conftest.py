"""Shared test hygiene: no leftover child processes or asyncio tasks after any test."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
