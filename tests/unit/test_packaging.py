"""``make demo`` opens without a setuptools warning (issue 24): the editable build, as pip
runs it for ``pip install -q -e .``, emits no warning — pip relays every warning of the
build backend (as a BuildBackendWarning, shown even with ``-q``), and setuptools' import-
hook finder emitted a 12-line "Editable installation" one. The PEP 660 hook is called
here as pip calls it (``setuptools.build_meta.build_editable``, the venv's setuptools,
offline), into a temporary directory: nothing is installed or uninstalled."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_HOOK = """
import sys, warnings
import setuptools.build_meta as backend
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    name = backend.build_editable(sys.argv[1])
for w in caught:
    print("WARNING", w.category.__name__, str(w.message).splitlines()[0])
print("BUILT", name)
"""


def test_the_editable_build_emits_no_warning(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _HOOK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line for line in lines if line.startswith("WARNING")] == []
    (built,) = [line.split(" ", 1)[1] for line in lines if line.startswith("BUILT")]
    with zipfile.ZipFile(tmp_path / built) as wheel:
        (pth,) = [n for n in wheel.namelist() if n.endswith(".pth")]
        assert wheel.read(pth).decode().strip() == str(REPO)  # the root: a plain path entry
