"""``make demo`` opens without a setuptools warning (issue 24): the editable install, as
the Makefile runs it, prints nothing at all with ``-q`` — not the 12-line "Editable
installation" BuildBackendWarning pip relays from setuptools' import-hook finder. Offline:
the venv's own setuptools builds it (``--no-build-isolation``), into a throwaway prefix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_editable_install_prints_no_warning(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--prefix",
            str(tmp_path / "prefix"),
            "-e",
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == "", result.stderr
    (pth,) = (tmp_path / "prefix").rglob("__editable__.slotctl-*.pth")
    assert pth.read_text().strip() == str(REPO)  # the root: `import controller` finds it
