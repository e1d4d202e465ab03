"""Shared test hygiene: no leftover child processes or asyncio tasks after any test; and
the grouping of tests for parallel runs (``make test`` runs pytest-xdist workers with
``--dist loadgroup``).

Grouping: a test module whose tests share a fixture of module or session scope the suite
defines (a controller, a real kube-apiserver, the private dockerd) runs as one unit on one
worker, so that fixture is built once, as in a serial run; every Docker test runs on one
worker (one private dockerd for the session, as before). Every other test is scheduled
on its own.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# The Docker engine and image fixtures (session scope), for tests/integration and tests/e2e.
# pytester: the tests of this grouping (tests/unit/test_xdist_grouping.py).
pytest_plugins = ["tests.docker_fixtures", "tests.integration.llama_fixtures", "pytester"]

DOCKER_GROUP = "docker"


def _shared_fixtures(item: pytest.Item) -> set[str]:
    """The fixtures wider than a test that ``item`` uses and the suite itself defines
    (pytest's and plugins' own, such as ``tmp_path_factory``, hold no shared server)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    root = item.config.rootpath
    shared = set()
    for name, defs in info.name2fixturedefs.items():
        fixture = defs[-1]
        if fixture.scope == "function":
            continue
        source = Path(inspect.getsourcefile(fixture.func) or "/")
        if source.is_relative_to(root) and "site-packages" not in source.parts:
            shared.add(name)
    return shared


def _set_node_id(item: pytest.Item, nodeid: str) -> None:
    """Give ``item`` another node id (pytest 9 keeps it as a structured ``_id``, older
    releases as the ``_nodeid`` string that xdist itself rewrites)."""
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


def _unique_node_id(item: pytest.Item) -> None:
    """schemathesis' items (one per API operation) are named ``test[GET /path]`` but all
    carry the bare function's node id; xdist keys tests by node id, so it would run one
    operation in place of every one. Give such an item the id its name says
    (``module::test[GET /path]``), as pytest does for any other parametrized test."""
    parent, _, last = item.nodeid.rpartition("::")
    if parent and last != item.name:
        _set_node_id(item, f"{parent}::{item.name}")


def _group_of(items: list[pytest.Item]) -> dict[str, str]:
    """Module path -> xdist group, for the modules that share a wider fixture."""
    groups: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        shared = _shared_fixtures(item)
        if any(name.startswith("docker_") for name in shared):
            groups[module] = DOCKER_GROUP
        elif shared and module not in groups:
            groups[module] = module
    return groups


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unique node ids, and one ``xdist_group`` per module that shares a fixture wider
    than a test (see above).

    xdist (3.8) puts a test's group into its node id as ``@group`` by assigning the
    ``_nodeid`` string, which pytest 9 no longer reads (ids are structured there): on a
    worker of a ``--dist loadgroup`` run the suffix is applied here instead.
    """
    for item in items:
        _unique_node_id(item)
    groups = _group_of(items)
    suffix = bool(getattr(config.option, "loadgroup", False))  # set on xdist's workers
    for item in items:
        group = groups.get(item.nodeid.split("::", 1)[0])
        if group is None:
            continue
        item.add_marker(pytest.mark.xdist_group(group))
        if suffix and hasattr(item, "_id"):
            _set_node_id(item, f"{item.nodeid}@{group}")


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
