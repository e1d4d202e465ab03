"""CLI start-up: wall time of ``slotctl`` commands as a user runs them (one process each).

Runs ``python -m controller ...`` N times per command and prints the median and the
fastest run, next to a bare interpreter (``python -c pass``): ``--help``, ``slot list``
on the files (no controller), and ``slot list`` / ``model list`` through the API of a
real ``slotctl up --listen 127.0.0.1:0`` (empty config) started for the purpose.

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


def timed(argv: list[str], env: dict[str, str], runs: int) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, check=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times), min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTCTL_")}
    env["PYTHONPATH"] = str(args.repo)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = ["--config-dir", f"{tmp}/config", "--state-dir", f"{tmp}/state"]
        cli = [sys.executable, "-m", "controller", *dirs]
        rows = [("python -c pass (bare interpreter)", [sys.executable, "-c", "pass"])]
        rows += [
            ("slotctl --help", [*cli, "--help"]),
            ("slotctl slot list (files, no controller)", [*cli, "slot", "list"]),
        ]
        results = [(name, *timed(argv, env, args.runs)) for name, argv in rows]
        Path(f"{tmp}/config").mkdir()
        up = subprocess.Popen(
            [*cli, "up", "--listen", "127.0.0.1:0"],
            env=env,
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
                results.append((name, *timed(argv, env, args.runs)))
        finally:
            up.terminate()
            up.wait(timeout=30)
    print(f"repo {args.repo}, {args.runs} runs each, {sys.executable} {sys.version.split()[0]}")
    print(f"{'command':<44} {'median':>9} {'fastest':>9}")
    for name, median, fastest in results:
        print(f"{name:<44} {median * 1000:7.0f}ms {fastest * 1000:7.0f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
