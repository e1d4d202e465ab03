"""Demo server start cost: CPU (user+sys) and wall time from exec to a served ``/health``.

Starts ``python -m controller.demo --port 0 --load-seconds 0`` N times in a row, waits
for its ``listening`` line, polls ``GET /health`` until it answers 200, then reads the
child's CPU time (the sum over its threads of ``/proc/PID/task/*/schedstat``, nanosecond
precision; psutil's 10 ms ticks elsewhere) and stops it with SIGTERM (the CPU until exit comes from
``os.wait4``). ``--compare DIR`` runs the same against another source tree (for example
an unpacked ``git archive`` of the commit before a change) and prints both side by side.
Prints medians and p90; never fails on timing.

    python bench/demo_start.py [--runs 20] [--compare /tmp/old-src]
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Start:
    cpu_to_ready_ms: float  # user+sys of the child when /health first answered 200
    wall_to_ready_ms: float  # exec to that answer
    cpu_total_ms: float  # user+sys until it exited after SIGTERM


def _health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def _cpu_ms(pid: int) -> float:
    """CPU time (user+sys) of ``pid`` so far, in ms: its live threads' scheduler clocks."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e6
    except (OSError, ValueError, IndexError):
        times = psutil.Process(pid).cpu_times()
        return (times.user + times.system) * 1000


def start_once(src: Path) -> Start:
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [sys.executable, "-m", "controller.demo", "--port", "0", "--model", "m"]
    began = time.perf_counter()
    proc = subprocess.Popen(
        [*argv, "--load-seconds", "0"], cwd=src, env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("slotctl-demo listening "):
        proc.kill()
        raise SystemExit(f"unexpected first line from the demo server: {line!r}")
    port = int(line.split(" port=", 1)[1].split()[0])
    while _health(port) != 200:
        time.sleep(0.001)
    wall = time.perf_counter() - began
    cpu_to_ready = _cpu_ms(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    return Start(
        cpu_to_ready_ms=cpu_to_ready,
        wall_to_ready_ms=wall * 1000,
        cpu_total_ms=(usage.ru_utime + usage.ru_stime) * 1000,
    )


def _p90(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.9 * len(values)) - 1)]


def summary(label: str, starts: list[Start]) -> str:
    cols = []
    for values in (
        [s.cpu_to_ready_ms for s in starts],
        [s.wall_to_ready_ms for s in starts],
        [s.cpu_total_ms for s in starts],
    ):
        cols.append(f"{statistics.median(values):7.1f} {_p90(values):7.1f}")
    return f"{label:<10} " + "   ".join(cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--compare", type=Path, help="another source tree to run first")
    args = parser.parse_args()
    trees = [("this tree", REPO_ROOT)]
    if args.compare:
        trees.insert(0, ("compare", args.compare.resolve()))
    results: dict[str, list[Start]] = {label: [] for label, _ in trees}
    for _ in range(args.runs):  # interleaved, so a busy moment hits both alike
        for label, src in trees:
            results[label].append(start_once(src))
    print(f"{args.runs} starts each, {os.cpu_count()} cores; milliseconds, median and p90")
    print(f"{'':<10} {'CPU to ready':>15}   {'wall to ready':>15}   {'CPU until exit':>15}")
    for label, _ in trees:
        print(summary(label, results[label]))


if __name__ == "__main__":
    main()
