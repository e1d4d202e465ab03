"""CLI start-up: wall time of ``slotctl`` commands as a user runs them (one process each).

Runs ``python -m controller ...`` N times per command and prints the median and the
fastest run, next to a bare interpreter (``python -c pass``): ``--help``, ``slot list``
on the files (no controller), and ``slot list`` / ``model list`` through the API of a
real ``slotctl up --listen 127.0.0.1:0`` (empty config) started for the purpose.

Runs with the byte-code cache on (one warm-up run first), from a scratch directory
(``python -m`` would otherwise import the package from the current directory).
``--repo DIR`` measures another checkout (e.g. an older commit exported with ``git
archive``) with the same interpreter, for before/after figures. Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(argv: list[str], env: dict[str, str], runs: int, cwd: str) -> tuple[float, float, int]:
    """Median and fastest of ``runs`` runs, after one warm-up run (byte-code cache), and
    the exit status (an old checkout may fail a command: the figure is still shown)."""
    times = []
    code = 0
    for _ in range(runs + 1):
        started = time.perf_counter()
        result = subprocess.run(argv, env=env, capture_output=True, check=False, cwd=cwd)
        times.append(time.perf_counter() - started)
        code = code or result.returncode
    return statistics.median(times[1:]), min(times[1:]), code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure")
    args = parser.parse_args()
    # As users run it: byte code cached (this sandbox sets PYTHONDONTWRITEBYTECODE).
    drop = ("SLOTCTL_", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = str(args.repo)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = ["--config-dir", f"{tmp}/config", "--state-dir", f"{tmp}/state"]
        cli = [sys.executable, "-m", "controller", *dirs]
        rows = [("python -c pass (bare interpreter)", [sys.executable, "-c", "pass"])]
        rows += [
            ("slotctl --help", [*cli, "--help"]),
            ("slotctl slot list (files, no controller)", [*cli, "slot", "list"]),
        ]
        results = [(name, *timed(argv, env, args.runs, tmp)) for name, argv in rows]
        Path(f"{tmp}/config").mkdir()
        up = subprocess.Popen(
            [*cli, "up", "--listen", "127.0.0.1:0"],
            env=env,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            record = Path(f"{tmp}/state/controller.json")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if not json.loads(record.read_text())["listen"].endswith(":0"):
                        break
                except (OSError, ValueError, KeyError, AttributeError):
                    pass
                time.sleep(0.1)
            time.sleep(1.0)  # ready
            for name, argv in (
                ("slotctl slot list (through the API)", [*cli, "slot", "list"]),
                ("slotctl model list (through the API)", [*cli, "model", "list"]),
            ):
                results.append((name, *timed(argv, env, args.runs, tmp)))
        finally:
            up.terminate()
            up.wait(timeout=30)
    print(f"repo {args.repo}, {args.runs} runs each, {sys.executable} {sys.version.split()[0]}")
    print(f"{'command':<44} {'median':>9} {'fastest':>9}  exit")
    for name, median, fastest, code in results:
        print(f"{name:<44} {median * 1000:7.0f}ms {fastest * 1000:7.0f}ms  {code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
