"""Shared by the llama-cpp-python tests (process and Docker): the mandatory-dependency
check and the generated tiny GGUF model."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

INSTALL_HINT = "it is part of the test extra: pip install -e '.[test]'"


def require_llama_server() -> None:
    """The server's interpreter (ours) must import ``llama_cpp.server``.

    Checked in a child: importing llama_cpp here leaks two /dev/null handles
    (``llama_cpp._utils``), a ResourceWarning at exit under ``-W error``.
    """
    probe = subprocess.run(
        [sys.executable, "-c", "import llama_cpp.server"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0:
        tail = probe.stderr.strip().splitlines()[-1:] or [f"exit {probe.returncode}"]
        pytest.fail(
            f"llama_cpp.server is not importable ({tail[0]}); {INSTALL_HINT}", pytrace=False
        )


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight llama GGUF, written once per module (mandatory deps)."""
    try:
        importlib.import_module("gguf")
    except ImportError as exc:
        pytest.fail(f"gguf is not importable ({exc}); {INSTALL_HINT}", pytrace=False)
    require_llama_server()
    from tests.integration.tiny_gguf import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
