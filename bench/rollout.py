"""A config change under steady load: surge against recreate, side by side (issue 25).

A real ``slotctl up`` (process runtime, one demo slot whose server takes
``--load-seconds`` to load) serves a steady open-loop load of ``--rate`` requests/s
THROUGH THE ROUTER'S HTTP PORT (each request sent on schedule, whether or not the ones
before it were answered). After a few seconds of steady load the slot's config changes
(its server's args), and the load goes on until the controller has converged on one server
of the new config, plus a few seconds. The same run is made with ``rollout = "recreate"``
(stop, then start: the baseline, what every slot did before) and ``rollout = "surge"``
(the new server started beside the old one, switched to when ready).

Printed per way: requests sent, failed (not 200), waited more than 1 s, p50 / p99 / max
latency, and the ratio of the two. Never fails on timing.

    python bench/rollout.py [--rate 20] [--load-seconds 2] [--steady 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from controller.reconcile.apply import apply_to_config  # noqa: E402
from controller.spec.configdir import read_settings  # noqa: E402
from controller.spec.loader import load_stacks  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stack(way: str, load_s: float, marker: int) -> str:
    return (
        '[stack]\nname = "bench"\n\n'
        '[[model]]\nid = "chat-m"\nsource = "demo://chat"\nmemory_gb = 0.01\n\n'
        '[[slot]]\nname = "chat"\nprovider = "demo"\nmodel.default = "chat-m"\n'
        f'device = "cpu"\nautoload = true\nrollout = "{way}"\ndrain_timeout_s = 10\n'
        "[slot.server]\n"
        f'extra_args = ["--load-seconds", "{load_s:g}", "--embedding-dim", "{8 + marker}"]\n'
    )


class Controller:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.config_dir, self.state_dir = root / "config", root / "state"
        self.config_dir.mkdir()
        self.state_dir.mkdir()
        self.listen = f"127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen[bytes] | None = None

    def apply(self, text: str) -> None:
        path = self.root / "bench.toml"
        path.write_text(text)
        settings, problems = read_settings(self.config_dir)
        assert not problems, problems
        report = load_stacks([path], settings)
        assert report.ok and report.state is not None, report.errors
        apply_to_config(report.state, self.config_dir, prune=True)

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTCTL_")}
        env["PYTHONPATH"] = str(REPO)
        argv = [sys.executable, "-m", "controller", "--config-dir", str(self.config_dir)]
        argv += ["--state-dir", str(self.state_dir), "up", "--listen", self.listen]
        log = (self.root / "controller.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def settled(self, marker: int) -> bool:
        """One ready server of the config with ``marker``, no rollout in progress."""
        slot_dir = self.state_dir / "slots" / "chat"
        try:
            state = json.loads((slot_dir / "state.json").read_bytes())
            record = json.loads((slot_dir / "process.json").read_bytes())
        except (OSError, ValueError):
            return False
        if (slot_dir / "rollout.json").exists() or (slot_dir / "retiring.json").exists():
            return False
        argv = " ".join(record.get("argv", []))
        return (
            state.get("state") in ("ready", "serving") and f"--embedding-dim {8 + marker}" in argv
        )

    @property
    def token(self) -> str:
        return (self.state_dir / "token").read_text().strip()


async def _one(session: aiohttp.ClientSession, url: str, out: list[tuple[float, bool]]) -> None:
    body = {"model": "chat-m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    started = time.perf_counter()
    ok = False
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with session.post(url, json=body) as resp:
            await resp.read()
            ok = resp.status == 200
    out.append((time.perf_counter() - started, ok))


async def _wait(check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit("the controller did not settle in time (see its log)")
        await asyncio.sleep(0.05)


async def run(way: str, args: argparse.Namespace) -> list[tuple[float, bool]]:
    with tempfile.TemporaryDirectory(prefix=f"rollout-{way}-") as tmp:
        ctl = Controller(Path(tmp))
        ctl.apply(stack(way, args.load_seconds, 0))
        ctl.start()
        try:
            await _wait(lambda: ctl.settled(0), 60)
            url = f"http://{ctl.listen}/v1/chat/completions"
            headers = {"Authorization": f"Bearer {ctl.token}"}
            out: list[tuple[float, bool]] = []
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
                tasks: list[asyncio.Task[None]] = []
                every = 1.0 / args.rate
                start = time.monotonic()
                changed_at: float | None = None
                settled_at: float | None = None
                tick = 0
                while True:
                    now = time.monotonic()
                    if changed_at is None and now - start >= args.steady:
                        ctl.apply(stack(way, args.load_seconds, 1))  # the config change
                        changed_at = now
                    if changed_at is not None and settled_at is None and ctl.settled(1):
                        settled_at = now
                    if settled_at is not None and now - settled_at >= args.steady:
                        break
                    if now - start > 120:
                        raise SystemExit(f"{way}: no convergence within 120 s")
                    tasks.append(asyncio.create_task(_one(session, url, out)))
                    tick += 1
                    await asyncio.sleep(max(0.0, start + tick * every - time.monotonic()))
                await asyncio.gather(*tasks)
            return out
        finally:
            ctl.stop()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--load-seconds", type=float, default=2.0, help="the server's load")
    parser.add_argument("--steady", type=float, default=3.0, help="seconds before and after")
    args = parser.parse_args()
    results = {way: asyncio.run(run(way, args)) for way in ("recreate", "surge")}
    print(
        f"config change under {args.rate:g} requests/s through the router "
        f"(server load {args.load_seconds:g} s)"
    )
    print(f"{'':<10}{'sent':>7}{'failed':>8}{'>1 s':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    figures: dict[str, tuple[float, float]] = {}
    for way, out in results.items():
        times = [t for t, _ok in out]
        failed = sum(1 for _t, ok in out if not ok)
        slow = sum(1 for t, ok in out if ok and t > 1.0)
        p50, p99, worst = _pct(times, 0.5) * 1e3, _pct(times, 0.99) * 1e3, max(times) * 1e3
        figures[way] = (failed + slow, p99)
        print(f"{way:<10}{len(out):>7}{failed:>8}{slow:>7}{p50:>9.1f}{p99:>9.1f}{worst:>9.1f}")
    bad_r, p99_r = figures["recreate"]
    bad_s, p99_s = figures["surge"]
    print(
        f"surge / recreate: failed or > 1 s {bad_s} vs {bad_r}; "
        f"p99 {p99_s / p99_r if p99_r else float('nan'):.3f}x"
    )


if __name__ == "__main__":
    main()
