"""The test suite's own parallel run (``make test``: pytest-xdist, ``--dist loadgroup``):
``tests/conftest.py`` keeps a module that shares a module-scoped fixture on one worker
(the fixture is built once, as in a serial run) and gives every test a node id of its
own (xdist schedules by node id: duplicates would silently run once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SHARED = """
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def server():
    with (Path(__file__).parent / "built.log").open("a") as log:
        log.write(f"{os.getpid()}\\n")
    return os.getpid()


@pytest.mark.parametrize("i", range(8))
def test_uses_the_shared_server(server, i):
    assert server == os.getpid()
"""

FREE = """
import pytest


@pytest.mark.parametrize("i", range(8))
def test_free(i):
    pass
"""


def test_a_module_sharing_a_fixture_runs_on_one_worker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # for -p tests.conftest in the workers
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # only what this needs
    pytester.makepyfile(test_shared=SHARED, test_free=FREE)
    result = pytester.runpytest_subprocess(
        *("-p", "xdist.plugin", "-p", "tests.conftest", "-p", "no:cacheprovider"),
        *("-n", "2", "--dist", "loadgroup", "-v"),
    )
    result.assert_outcomes(passed=16)
    workers = {
        line.split()[0]
        for line in result.outlines
        if "PASSED" in line and "test_uses_the_shared_server" in line
    }
    assert len(workers) == 1, result.outlines
    built = (pytester.path / "built.log").read_text().split()
    assert len(built) == 1, f"the module fixture was built {len(built)} times"
    free = {line.split()[0] for line in result.outlines if "PASSED" in line and "test_free" in line}
    assert free, result.outlines  # the others are scheduled one by one, on any worker


def test_every_collected_test_has_a_node_id_of_its_own() -> None:
    """schemathesis makes one test per API operation; each must have its own id."""
    module = "tests/integration/test_api_schemathesis.py"
    plugins = ["schemathesis.pytest.plugin", "_hypothesis_pytestplugin"]
    plugins += ["pytest_asyncio.plugin", "pytest_timeout", "no:cacheprovider"]  # the ini's
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", module]
        + [arg for plugin in plugins for arg in ("-p", plugin)],
        cwd=REPO,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},  # only what this needs
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    operations = [i for i in ids if "test_api_conforms_to_its_openapi_document" in i]
    assert len(operations) > 10, ids
    assert all(i.endswith("]") for i in operations), operations[:3]
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)[:3]
