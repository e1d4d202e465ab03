"""Controller footprint: resident memory of a running ``slotctl up`` by slot count.

For each size N (default 10, 100, 1,000) a config dir with N demo slots (``autoload =
false``: the controller knows them, no server starts; a loaded slot's memory is its
server's, not the controller's) is written by ``apply_to_config``; then ``python -m
controller up --listen 127.0.0.1:0`` runs as its own process, as a user starts it. Once
its API answers, one ``slotctl slot list`` goes through the API (the request path is
imported and used), the controller resyncs once more, and its ``VmRSS`` and ``VmHWM``
(the peak) are read from ``/proc``. For scale, the RSS of an interpreter that only
imports what the controller imports (``controller.daemon``) is shown first.

Prints a table; never fails on memory or timing.

    python bench/footprint.py [--sizes 10,100,1000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.reconcile.apply import apply_to_config
from controller.spec.loader import DesiredState, load_stack_texts

REPO = Path(__file__).resolve().parents[1]


def stack_text(n: int, base_port: int = 40000) -> str:
    out = ['[stack]\nname = "fp"\n']
    for i in range(n):
        out.append(f'[[model]]\nid = "fp-m{i:05d}"\nsource = "demo://m{i:05d}"\n')
    for i in range(n):
        out.append(
            f'[[slot]]\nname = "fp-s{i:05d}"\nprovider = "demo"\nmodel.default = "fp-m{i:05d}"\n'
            f'device = "cpu"\nport = {base_port + i}\nautoload = false\n'
        )
    return "\n".join(out)


def desired(n: int) -> DesiredState:
    report = load_stack_texts([("fp.toml", stack_text(n))])
    assert report.ok and report.state is not None, report.errors[:3]
    return report.state


def status_kib(text: str) -> tuple[int, int]:
    """(VmRSS, VmHWM) in KiB from the text of a ``/proc/PID/status``."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()[0] if value.split() else "0"
    return int(fields["VmRSS"]), int(fields["VmHWM"])


def memory_kib(pid: int) -> tuple[int, int]:
    return status_kib(Path(f"/proc/{pid}/status").read_text())


def env() -> dict[str, str]:
    drop = ("SLOTCTL_",)
    out = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    out["PYTHONPATH"] = str(REPO)
    return out


def imports_only() -> tuple[int, int]:
    code = "import controller.daemon; print(open('/proc/self/status').read())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env(), capture_output=True, text=True, check=True
    ).stdout
    return status_kib(out)


def measure(n: int, settle_s: float) -> tuple[int, int, float]:
    """(VmRSS KiB, VmHWM KiB, seconds until the API answered) of ``up`` with ``n`` slots."""
    with tempfile.TemporaryDirectory(prefix="slotctl-fp-") as tmp:
        config, state = Path(tmp, "config"), Path(tmp, "state")
        apply_to_config(desired(n), config, prune=True)
        cli = [sys.executable, "-m", "controller", "--config-dir", str(config)]
        cli += ["--state-dir", str(state)]
        started = time.perf_counter()
        up = subprocess.Popen(
            [*cli, "up", "--listen", "127.0.0.1:0"],
            env=env(),
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            record = state / "controller.json"
            deadline = time.monotonic() + 120
            while True:
                assert time.monotonic() < deadline, "the controller did not come up"
                assert up.poll() is None, f"the controller exited ({up.returncode})"
                try:
                    if not json.loads(record.read_text())["listen"].endswith(":0"):
                        listed = subprocess.run(
                            [*cli, "slot", "list"], env=env(), cwd=tmp, capture_output=True
                        )
                        if listed.returncode == 0 and listed.stdout.count(b"fp-s") == n:
                            break
                except (OSError, ValueError, KeyError, AttributeError):
                    pass
                time.sleep(0.1)
            ready = time.perf_counter() - started
            time.sleep(settle_s)  # the reconciler's first passes, the API's first answers
            rss, hwm = memory_kib(up.pid)
        finally:
            up.terminate()
            up.wait(timeout=60)
    return rss, hwm, ready


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the API answers")
    args = parser.parse_args()
    print(
        f"slotctl bench/footprint.py — {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}"
    )
    rss, hwm = imports_only()
    print(f"{'what':<40} {'RSS':>9} {'peak':>9}  {'up to API':>9}")
    print(f"{'imports only (controller.daemon)':<40} {rss / 1024:7.1f}MB {hwm / 1024:7.1f}MB")
    for n in (int(s) for s in args.sizes.split(",")):
        rss, hwm, ready = measure(n, args.settle)
        label = f"slotctl up, {n:,} slots (offline)"
        print(f"{label:<40} {rss / 1024:7.1f}MB {hwm / 1024:7.1f}MB  {ready:8.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
