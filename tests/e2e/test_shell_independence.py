"""The suite does not depend on the shell that runs it (issue 24): from a shell that
ignores SIGINT (a background job, ``nohup``), the tests that interrupt a follower with
Ctrl-C still pass — their children get their signal dispositions explicitly
(tests/children.py) — and a timed-out child leaves no pipe open.

Runs those tests in a pytest of its own, started with SIGINT ignored as such a shell
starts its jobs (an ignored signal stays ignored across exec).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import REPO


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `cmd &` in a script starts `cmd`


def test_ctrl_c_tests_pass_from_a_shell_that_ignores_sigint(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "-q",
            "--basetemp",
            str(tmp_path / "basetemp"),
            "tests/e2e/test_cli_ux.py::test_ctrl_c_of_a_follower_exits_130_quietly",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
        check=False,
        preexec_fn=_ignore_sigint,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout, result.stdout[-2000:]
