"""Router costs: added latency and streaming throughput, next to nginx as a reference.

One demo server (started by the controller, as in production) is reached three ways:

* **direct**: the demo server's own port;
* **slotctl**: ``slotctl up --listen 127.0.0.1:0`` (a subprocess), ``/v1/chat/completions``
  through the router (bearer token, slot ranking, lease, proxy, release);
* **nginx**: ``proxy_pass`` to the same port (1 worker, upstream keepalive, HTTP/1.1,
  ``proxy_buffering off``), started from a generated config in a temp dir.

(a) latency of a tiny non-streamed chat completion (``max_tokens`` 1, the demo server
    generating as fast as it can), p50/p99 at 1/10/100 concurrent clients, what each
    proxy adds to the direct p50, and the CPU time each proxy and the backend spend per
    request (user + system, from ``psutil``: unlike latency it barely moves when other
    work shares the machine);
(b) streaming throughput: SSE events per second received by all clients together
    (``max_tokens`` 32 each, one event per token), at 1/10/100 concurrent clients.

Prints a table; never fails on timing. nginx is skipped (with a note) when not installed
(Debian: ``apt-get install -y nginx``).

    python bench/router.py [--scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-router-token"
MODEL = "bench-chat"
CONCURRENCY = (1, 10, 100)
LATENCY_REQUESTS = {1: 400, 10: 1500, 100: 3000}
STREAM_REQUESTS = {1: 40, 10: 150, 100: 400}
STREAM_TOKENS = 32

STACK = """
[stack]
name = "bench"

[[model]]
id = "{model}"
source = "demo://bench"
memory_gb = 0.1

[[slot]]
name = "bench"
provider = "demo"
model.default = "{model}"
device = "cpu"
port = {port}
autoload = true
idle_timeout_s = 0
[slot.server]
extra_args = ["--tokens-per-second", "0"]
"""

NGINX_CONF = """
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream backend {{
        server 127.0.0.1:{backend};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


@dataclass(frozen=True)
class Target:
    name: str
    base: str
    headers: dict[str, str]
    processes: tuple[psutil.Process, ...] = ()  # the proxy's, for its CPU time


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


# ============================================================================ processes


@contextlib.contextmanager
def controller(tmp: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``slotctl up`` on a one-slot stack; stopped with SIGINT (stops its servers too)."""
    stacks = tmp / "stacks"
    stacks.mkdir()
    (stacks / "bench.toml").write_text(STACK.format(model=MODEL, port=free_port()))
    argv = [
        sys.executable,
        "-m",
        "controller",
        "--config-dir",
        str(tmp / "config"),
        "--state-dir",
        str(tmp / "state"),
        "up",
        str(stacks),
        "--listen",
        "127.0.0.1:0",
        "--token",
        TOKEN,
    ]
    log = (tmp / "controller.log").open("wb")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def controller_address(tmp: Path, proc: subprocess.Popen[bytes]) -> str:
    record = tmp / "state" / "controller.json"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"slotctl up exited: {(tmp / 'controller.log').read_text()[-2000:]}")
        with contextlib.suppress(FileNotFoundError, ValueError):
            listen = json.loads(record.read_text()).get("listen") or ""
            if not listen.endswith(":0"):
                return f"http://{listen}"
        await asyncio.sleep(0.05)
    raise SystemExit("slotctl up did not publish its address in 30 s")


async def slot_endpoint(session: aiohttp.ClientSession, base: str) -> str:
    """Wait for the autoload slot to be ready; its endpoint (the backend)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"{base}/api/slots/bench", headers=headers) as resp:
                if resp.status == 200:
                    view = await resp.json()
                    if view["state"] == "ready" and view.get("endpoint"):
                        return str(view["endpoint"])
        await asyncio.sleep(0.1)
    raise SystemExit("the bench slot did not become ready in 60 s")


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    return found or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


@contextlib.contextmanager
def nginx(tmp: Path, backend_port: int) -> Iterator[int | None]:
    binary = nginx_binary()
    if binary is None:
        yield None
        return
    home = tmp / "nginx"
    home.mkdir()
    port = free_port()
    conf = home / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=home, backend=backend_port, port=port))
    argv = [binary, "-p", str(home), "-c", str(conf), "-g", "daemon off;"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if proc.poll() is not None:
                raise SystemExit(f"nginx exited: {(home / 'error.log').read_text()[-2000:]}")
            time.sleep(0.02)
        yield port
    finally:
        proc.send_signal(signal.SIGQUIT)  # graceful stop of master and worker
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def backend_process(router: psutil.Process, port: int) -> psutil.Process:
    """The demo server the controller started on ``port`` (its child process)."""
    for child in router.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            argv = child.cmdline()
            if "controller.demo" in argv and str(port) in argv:
                return child
    raise SystemExit(f"no demo server child on port {port}")


def nginx_pid(tmp: Path) -> int:
    return int((tmp / "nginx" / "nginx.pid").read_text().strip())


# ============================================================================ load


def chat_body(max_tokens: int, *, stream: bool) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "benchmark"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return json.dumps(body).encode()


async def run_clients(
    concurrency: int, total: int, one: Callable[[], Awaitable[float]]
) -> tuple[list[float], float]:
    """``total`` calls of ``one`` by ``concurrency`` sequential clients: results, wall s."""
    per_client = [total // concurrency + (i < total % concurrency) for i in range(concurrency)]
    results: list[float] = []

    async def client(count: int) -> None:
        for _ in range(count):
            results.append(await one())

    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in per_client))
    return results, time.perf_counter() - started


async def latency(
    session: aiohttp.ClientSession, target: Target, concurrency: int, total: int
) -> list[float]:
    url = target.base + "/v1/chat/completions"
    body = chat_body(1, stream=False)
    headers = {**target.headers, "Content-Type": "application/json"}

    async def one() -> float:
        started = time.perf_counter()
        async with session.post(url, data=body, headers=headers) as resp:
            await resp.read()
            if resp.status != 200:
                raise SystemExit(f"{target.name}: HTTP {resp.status}")
        return time.perf_counter() - started

    await run_clients(concurrency, min(total, 5 * concurrency), one)  # warm the pools
    samples, _ = await run_clients(concurrency, total, one)
    return sorted(samples)


async def streaming(
    session: aiohttp.ClientSession, target: Target, concurrency: int, total: int
) -> tuple[float, float]:
    """(events per second over all clients, mean time to the first event in ms)."""
    url = target.base + "/v1/chat/completions"
    body = chat_body(STREAM_TOKENS, stream=True)
    headers = {**target.headers, "Content-Type": "application/json"}
    firsts: list[float] = []

    async def one() -> float:
        started = time.perf_counter()
        events = 0
        async with session.post(url, data=body, headers=headers) as resp:
            async for chunk in resp.content.iter_any():
                if not events:
                    firsts.append(time.perf_counter() - started)
                events += chunk.count(b"\n\n")
        if events != STREAM_TOKENS + 3:  # role, tokens, finish, [DONE]
            raise SystemExit(f"{target.name}: {events} events")
        return float(events)

    await run_clients(concurrency, concurrency, one)
    firsts.clear()
    counts, wall = await run_clients(concurrency, total, one)
    return sum(counts) / wall, 1000 * statistics.fmean(firsts)


# ============================================================================ main


async def measure(
    targets: list[Target], backend: psutil.Process, scale: float
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {t.name: {} for t in targets}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for c in CONCURRENCY:
            n = max(c, int(LATENCY_REQUESTS[c] * scale))
            for target in targets:
                proxy_before = cpu_seconds(target.processes)
                backend_before = cpu_seconds([backend])
                samples = await latency(session, target, c, n)
                warm = min(n, 5 * c)  # latency() warms up with these first
                proxy_cpu = (cpu_seconds(target.processes) - proxy_before) / (n + warm)
                backend_cpu = (cpu_seconds([backend]) - backend_before) / (n + warm)
                out[target.name][f"lat{c}"] = (
                    1000 * percentile(samples, 0.5),
                    1000 * percentile(samples, 0.99),
                    n,
                    1e6 * proxy_cpu,
                    1e6 * backend_cpu,
                )
        for c in CONCURRENCY:
            n = max(c, int(STREAM_REQUESTS[c] * scale))
            for target in targets:
                out[target.name][f"stream{c}"] = (*await streaming(session, target, c, n), n)
    return out


def report(results: dict[str, dict[str, Any]], nginx_note: str) -> None:
    direct = results["direct"]
    print()
    print("(a) non-streamed chat completion, max_tokens 1: latency in ms; CPU µs per request")
    print(
        f"  {'path':8s} {'clients':>7s} {'requests':>8s} {'p50':>8s} {'p99':>8s} {'+p50':>8s}"
        f" {'proxy CPU':>10s} {'backend CPU':>12s}"
    )
    for c in CONCURRENCY:
        for name, figures in results.items():
            p50, p99, n, proxy_cpu, backend_cpu = figures[f"lat{c}"]
            added = "" if name == "direct" else f"{p50 - direct[f'lat{c}'][0]:+8.2f}"
            proxy = "" if name == "direct" else f"{proxy_cpu:10.0f}"
            print(
                f"  {name:8s} {c:7d} {n:8d} {p50:8.2f} {p99:8.2f} {added:>8s}"
                f" {proxy:>10s} {backend_cpu:12.0f}"
            )
    print()
    print(f"(b) streaming, {STREAM_TOKENS} tokens each: SSE events/s (all clients), first event")
    print(f"  {'path':8s} {'clients':>7s} {'requests':>8s} {'events/s':>10s} {'first ms':>9s}")
    for c in CONCURRENCY:
        for name, figures in results.items():
            rate, first, n = figures[f"stream{c}"]
            print(f"  {name:8s} {c:7d} {n:8d} {rate:10.0f} {first:9.2f}")
    if nginx_note:
        print(f"\n  {nginx_note}")


async def main_async(args: argparse.Namespace) -> None:
    print(
        f"bench/router.py: {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="slotctl-bench-router-") as name:
        tmp = Path(name)
        with controller(tmp) as proc:
            base = await controller_address(tmp, proc)
            async with aiohttp.ClientSession() as probe:
                endpoint = await slot_endpoint(probe, base)
            backend_port = int(endpoint.rsplit(":", 1)[1])
            router = psutil.Process(proc.pid)
            backend = backend_process(router, backend_port)
            targets = [
                Target("direct", endpoint, {}),
                Target("slotctl", base, {"Authorization": f"Bearer {TOKEN}"}, (router,)),
            ]
            with nginx(tmp, backend_port) as nginx_port:
                note = ""
                if nginx_port is None:
                    note = "nginx not installed: no reference column (apt-get install -y nginx)"
                else:
                    master = psutil.Process(nginx_pid(tmp))
                    workers = tuple(master.children())
                    url = f"http://127.0.0.1:{nginx_port}"
                    targets.append(Target("nginx", url, {}, (master, *workers)))
                    version = subprocess.run(
                        [nginx_binary() or "nginx", "-v"],
                        capture_output=True,
                        text=True,
                        check=False,
                    ).stderr.strip()
                    print(f"reference: {version}, 1 worker, upstream keepalive")
                started = time.perf_counter()
                results = await measure(targets, backend, args.scale)
                elapsed = time.perf_counter() - started
        report(results, note)
        print(f"\n  measured in {elapsed:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
