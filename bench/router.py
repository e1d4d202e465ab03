"""Router costs: throughput, CPU and added latency next to nginx, streaming vs direct.

One demo server (started by the controller, as in production) is reached three ways:

* **direct**: the demo server's own port;
* **slotctl**: ``slotctl up --listen 127.0.0.1:0`` (a subprocess), ``/v1/chat/completions``
  through the router's data plane (bearer token, the body's ``model``, slot ranking,
  lease, proxy over a kept-alive upstream connection, release, metrics);
* **nginx**: ``proxy_pass`` to the same port (1 worker, upstream keepalive, HTTP/1.1,
  ``proxy_buffering off``), started from a generated config in a temp dir.

(a) a tiny non-streamed chat completion (``max_tokens`` 1, the demo server generating as
    fast as it can) by 1/10/100 concurrent clients, each sending its next request when the
    previous one is answered: requests/s, p50, what each proxy adds to the direct p50, and
    the CPU time the proxy spends per request (user + system, its threads' time on a CPU
    from ``/proc/<pid>/task/*/schedstat`` in nanoseconds, psutil's 10 ms ticks where
    Linux has none: unlike latency it barely moves when other work shares the machine);
(b) streaming throughput: SSE events per second received by all clients together
    (``max_tokens`` 32 each, one event per token), at 1 and 10 concurrent streams.

The three paths are measured in turn at each step, within one run, so the ratios compare
like with like on a shared machine. Prints ONE table with the ratios; never fails on
timing. nginx is skipped (with a note) when not installed (Debian: ``apt-get install -y
nginx-light``).

    python bench/router.py [--scale 1.0] [--loop auto|asyncio|uvloop] [--code DIR]
                           [--with-asyncio] [--with-floor] [--with-lean]
                           [--baseline DIR [--baseline-loop L]]

``--loop`` sets ``SLOTCTL_EVENT_LOOP`` for the controller (auto: uvloop when installed);
``--code DIR`` runs it from another checkout. Extra columns, measured in the same run:
``--with-asyncio`` the same controller on asyncio's loop, ``--with-floor`` a bare aiohttp
relay (server and keep-alive client, nothing else: the floor of an aiohttp-based router
on the same loop), ``--with-lean`` a lean relay (asyncio protocols on both sides, bytes
passed verbatim, no HTTP library: what a leaner Python data plane could cost),
``--baseline DIR`` another
checkout's controller (``git archive main | tar -x -C DIR`` for a before/after).
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

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-router-token"
MODEL = "bench-chat"
CONCURRENCY = (1, 10, 100)
STREAM_CONCURRENCY = (1, 10)
LATENCY_REQUESTS = {1: 600, 10: 2000, 100: 4000}
STREAM_REQUESTS = {1: 60, 10: 200}
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
    """The processes' CPU time so far: each thread's time on a CPU from Linux's
    ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds: user + system); psutil's user +
    system elsewhere (clock ticks, 10 ms: ±17 % on a lean relay's 1-client run at
    ``--scale 2``)."""
    total = 0.0
    for proc in processes:
        try:
            threads = list(Path(f"/proc/{proc.pid}/task").iterdir())
        except OSError:
            threads = []
        ns = 0
        for thread in threads:
            with contextlib.suppress(OSError, ValueError, IndexError):
                ns += int((thread / "schedstat").read_text().split()[0])
        if ns:
            total += ns / 1e9
            continue
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


# ============================================================================ processes


@contextlib.contextmanager
def controller(tmp: Path, code: Path, loop: str) -> Iterator[subprocess.Popen[bytes]]:
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
    env = {**os.environ, "PYTHONPATH": str(code), "SLOTCTL_EVENT_LOOP": loop}
    proc = subprocess.Popen(argv, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT)
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


def event_loop(proc: psutil.Process) -> str:
    """``uvloop`` when the process mapped uvloop's extension, else ``asyncio``."""
    with contextlib.suppress(psutil.Error):
        if any("uvloop" in m.path for m in proc.memory_maps()):
            return "uvloop"
    return "asyncio"


async def serve_floor(port: int, backend: str, loop_name: str) -> None:
    """The aiohttp floor: a bare aiohttp server relaying to a keep-alive aiohttp client,
    no auth, no body parsing, no lease — what any aiohttp-based router costs at least."""
    from aiohttp import web

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0), auto_decompress=False
    )

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.post(backend + request.path, data=body, headers=headers) as up:
            if up.content_type != "text/event-stream":
                data = await up.read()
                return web.Response(status=up.status, body=data, content_type=up.content_type)
            response = web.StreamResponse(status=up.status)
            response.content_type = up.content_type
            await response.prepare(request)
            while chunk := await up.content.readany():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"floor proxy on {port} ({loop_name})", flush=True)
    await asyncio.Event().wait()


class _LeanUpstream(asyncio.Protocol):
    """One kept-alive connection to the backend: forwards every byte to the client as it
    arrives and only tracks the framing (Content-Length or chunked) to see the end."""

    def __init__(self, pool: list[_LeanUpstream]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client: _LeanClient | None = None
        self.head = b""
        self.remaining = -1  # body bytes still to come; -2: chunked, watch the tail
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def send(self, client: _LeanClient, request: bytes) -> None:
        self.client, self.head, self.remaining, self.tail = client, b"", -1, b""
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        client = self.client
        assert client is not None and client.transport is not None
        client.transport.write(data)
        if self.remaining == -1:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, body = self.head[:end].lower(), self.head[end + 4 :]
            length = head.find(b"content-length:")
            if length >= 0:
                line = head[length + 15 :].split(b"\r\n", 1)[0]
                self.remaining = int(line) - len(body)
            else:
                self.remaining, self.tail = -2, body[-5:]
        elif self.remaining >= 0:
            self.remaining -= len(data)
        else:
            self.tail = (self.tail + data)[-5:]
        if self.remaining == 0 or (self.remaining == -2 and self.tail == b"0\r\n\r\n"):
            self.client = None
            self.pool.append(self)
            client.done()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)


class _LeanClient(asyncio.Protocol):
    """One client connection of the lean relay: a request head and its Content-Length body
    (no chunked uploads, no pipelining), then the backend's answer verbatim."""

    def __init__(self, backend: tuple[str, int], pool: list[_LeanUpstream]) -> None:
        self.backend, self.pool = backend, pool
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.busy = False
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].lower()
        at = head.find(b"content-length:")
        size = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
        if len(self.buffer) < end + 4 + size:
            return
        request, self.buffer = self.buffer[: end + 4 + size], self.buffer[end + 4 + size :]
        self.busy = True
        if self.pool:
            self.pool.pop().send(self, request)
        else:
            self.connecting = asyncio.ensure_future(self._connect(request))

    async def _connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(lambda: _LeanUpstream(self.pool), *self.backend)
        upstream.send(self, request)

    def done(self) -> None:
        self.busy = False
        self._next()


async def serve_lean(port: int, backend: str, loop_name: str) -> None:
    """A lean relay: asyncio protocols on both sides, no HTTP library, bytes passed
    verbatim, keep-alive upstream pool — what a leaner Python data plane could cost."""
    host, _, backend_port = backend.removeprefix("http://").partition(":")
    pool: list[_LeanUpstream] = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _LeanClient((host, int(backend_port)), pool), "127.0.0.1", port
    )
    print(f"lean proxy on {port} ({loop_name})", flush=True)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def floor_proxy(
    backend: str, loop: str, kind: str = "floor"
) -> Iterator[tuple[int, psutil.Process]]:
    port = free_port()
    argv = [sys.executable, __file__, f"--serve-{kind}", str(port), backend, "--loop", loop]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            time.sleep(0.02)
        yield port, psutil.Process(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def nginx_pid(tmp: Path) -> int:
    """The master's pid, once nginx wrote it (its port may open before: waited for)."""
    deadline = time.monotonic() + 5
    while True:
        with contextlib.suppress(FileNotFoundError):
            text = (tmp / "nginx" / "nginx.pid").read_text().strip()
            if text:
                return int(text)
        if time.monotonic() > deadline:
            raise SystemExit("nginx wrote no pid file in 5 s")
        time.sleep(0.02)


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
) -> tuple[list[float], float]:
    """Sorted latencies in s and requests/s of ``total`` requests (after a warm-up)."""
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
    samples, wall = await run_clients(concurrency, total, one)
    return sorted(samples), total / wall


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


@dataclass
class Figures:
    rps: dict[int, float]
    p50_ms: dict[int, float]
    cpu_us: dict[int, float]  # the proxy's CPU per request (none for direct)
    events: dict[int, float]  # SSE events/s over all streams
    first_ms: dict[int, float]


async def measure(targets: list[Target], scale: float) -> dict[str, Figures]:
    out = {t.name: Figures({}, {}, {}, {}, {}) for t in targets}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for c in CONCURRENCY:
            n = max(c, int(LATENCY_REQUESTS[c] * scale))
            for target in targets:
                before = cpu_seconds(target.processes)
                samples, rps = await latency(session, target, c, n)
                warm = min(n, 5 * c)  # latency() warms up with these first
                figures = out[target.name]
                figures.cpu_us[c] = 1e6 * (cpu_seconds(target.processes) - before) / (n + warm)
                figures.rps[c], figures.p50_ms[c] = rps, 1000 * percentile(samples, 0.5)
        for c in STREAM_CONCURRENCY:
            n = max(c, int(STREAM_REQUESTS[c] * scale))
            for target in targets:
                rate, first = await streaming(session, target, c, n)
                out[target.name].events[c], out[target.name].first_ms[c] = rate, first
    return out


def report(results: dict[str, Figures], nginx_note: str) -> None:
    """ONE table: a row per figure, a column per path, then slotctl's ratios."""
    names = list(results)
    direct, slot, ref = results["direct"], results["slotctl"], results.get("nginx")
    rows: list[tuple[str, list[str], str, str, str]] = []

    def ratio(a: float, b: float | None) -> str:
        return f"{a / b:.2f}x" if b else ""

    for c in CONCURRENCY:
        cells = [f"{results[n].rps[c]:,.0f}" for n in names]
        target = "≥0.5x nginx" if c == 100 else ""
        rows.append(
            (
                f"requests/s, {c} clients",
                cells,
                ratio(slot.rps[c], ref and ref.rps[c]),
                ratio(slot.rps[c], direct.rps[c]),
                target,
            )
        )
    for c in CONCURRENCY:
        cells = [f"{results[n].p50_ms[c]:.2f}" for n in names]
        rows.append((f"p50 ms, {c} clients", cells, "", "", ""))
    for c in CONCURRENCY:
        cells = [
            "" if n == "direct" else f"{results[n].p50_ms[c] - direct.p50_ms[c]:+.2f}"
            for n in names
        ]
        rows.append((f"+p50 ms, {c} clients", cells, "", "", "≤0.5 ms" if c == 1 else ""))
    for c in CONCURRENCY:
        cells = ["" if n == "direct" else f"{results[n].cpu_us[c]:,.0f}" for n in names]
        target = "≤150 µs" if c > 1 else ""
        rows.append(
            (
                f"proxy CPU µs/req, {c} clients",
                cells,
                ratio(slot.cpu_us[c], ref and ref.cpu_us[c]),
                "",
                target,
            )
        )
    for c in STREAM_CONCURRENCY:
        cells = [f"{results[n].events[c]:,.0f}" for n in names]
        target = "≥0.5x direct" if c == 1 else "≥0.8x direct"
        rows.append(
            (
                f"stream events/s, {c} streams",
                cells,
                ratio(slot.events[c], ref and ref.events[c]),
                ratio(slot.events[c], direct.events[c]),
                target,
            )
        )
    for c in STREAM_CONCURRENCY:
        cells = [f"{results[n].first_ms[c]:.2f}" for n in names]
        rows.append((f"first event ms, {c} streams", cells, "", "", ""))
    head = ["figure", *names, "slotctl/nginx", "slotctl/direct", "target"]
    table = [[label, *cells, r1, r2, t] for label, cells, r1, r2, t in rows]
    widths = [max(len(row[i]) for row in [head, *table]) for i in range(len(head))]
    print()
    for row in [head, ["-" * w for w in widths], *table]:
        first, *rest = row
        print(
            "  "
            + first.ljust(widths[0])
            + "".join("  " + cell.rjust(w) for cell, w in zip(rest, widths[1:], strict=True))
        )
    if nginx_note:
        print(f"\n  {nginx_note}")


async def start_controller(
    stack: contextlib.ExitStack, tmp: Path, code: Path, loop: str
) -> tuple[str, str, psutil.Process]:
    """A ``slotctl up`` in ``tmp``: (its base URL, its slot's endpoint, its process)."""
    tmp.mkdir()
    proc = stack.enter_context(controller(tmp, code, loop))
    base = await controller_address(tmp, proc)
    async with aiohttp.ClientSession() as probe:
        endpoint = await slot_endpoint(probe, base)
    return base, endpoint, psutil.Process(proc.pid)


async def main_async(args: argparse.Namespace) -> None:
    print(
        f"bench/router.py: {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
        f"controller code {args.code}, SLOTCTL_EVENT_LOOP={args.loop}"
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with tempfile.TemporaryDirectory(prefix="slotctl-bench-router-") as name:
        tmp = Path(name)
        with contextlib.ExitStack() as stack:
            base, endpoint, router = await start_controller(
                stack, tmp / "main", args.code, args.loop
            )
            targets = [Target("direct", endpoint, {}), Target("slotctl", base, auth, (router,))]
            # Side by side in the same run: the same router on asyncio's own loop, and
            # another checkout's router (each with its own, identical demo server).
            if args.with_asyncio:
                other, _, proc = await start_controller(
                    stack, tmp / "asyncio", args.code, "asyncio"
                )
                targets.append(Target("asyncio", other, auth, (proc,)))
            if args.baseline is not None:
                other, _, proc = await start_controller(
                    stack, tmp / "baseline", args.baseline, args.baseline_loop
                )
                targets.append(Target("baseline", other, auth, (proc,)))
            if args.with_floor:
                port, proc = stack.enter_context(floor_proxy(endpoint, args.loop))
                targets.append(Target("floor", f"http://127.0.0.1:{port}", {}, (proc,)))
            if args.with_lean:
                port, proc = stack.enter_context(floor_proxy(endpoint, args.loop, "lean"))
                targets.append(Target("lean", f"http://127.0.0.1:{port}", {}, (proc,)))
            backend_port = int(endpoint.rsplit(":", 1)[1])
            nginx_port = stack.enter_context(nginx(tmp, backend_port))
            note = ""
            if nginx_port is None:
                note = "nginx not installed: no reference column (apt-get install nginx-light)"
            else:
                master = psutil.Process(nginx_pid(tmp))
                deadline = time.monotonic() + 5
                while not master.children() and time.monotonic() < deadline:
                    time.sleep(0.02)  # the worker forks after the port opens
                workers = tuple(master.children())
                url = f"http://127.0.0.1:{nginx_port}"
                targets.append(Target("nginx", url, {}, (master, *workers)))
                version = subprocess.run(
                    [nginx_binary() or "nginx", "-v"], capture_output=True, text=True, check=False
                ).stderr.strip()
                print(f"reference: {version}, 1 worker, upstream keepalive")
            if args.baseline is not None:
                print(f"baseline: the controller from {args.baseline}, loop {args.baseline_loop}")
            started = time.perf_counter()
            results = await measure(targets, args.scale)
            elapsed = time.perf_counter() - started
            loops = {t.name: event_loop(t.processes[0]) for t in targets[1:] if t.name != "nginx"}
        report(results, note)
        print(f"\n  measured in {elapsed:.1f} s; event loops: {loops}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    parser.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="the controller's SLOTCTL_EVENT_LOOP (auto: uvloop when installed)",
    )
    parser.add_argument(
        "--code", type=Path, default=ROOT, help="run the controller from this checkout"
    )
    parser.add_argument(
        "--with-asyncio",
        action="store_true",
        help="add a column: the same controller on asyncio's own loop (SLOTCTL_EVENT_LOOP)",
    )
    parser.add_argument(
        "--baseline", type=Path, help="add a column: the controller of another checkout"
    )
    parser.add_argument("--baseline-loop", default="auto", help="its SLOTCTL_EVENT_LOOP")
    parser.add_argument(
        "--with-floor",
        action="store_true",
        help="add a column: a bare aiohttp relay (server + client, nothing else)",
    )
    parser.add_argument(
        "--with-lean",
        action="store_true",
        help="add a column: a lean relay (asyncio protocols, no HTTP library)",
    )
    for kind in ("floor", "lean"):  # the relay processes themselves
        parser.add_argument(
            f"--serve-{kind}", nargs=2, metavar=("PORT", "BACKEND"), help=argparse.SUPPRESS
        )
    args = parser.parse_args()
    if args.serve_floor or args.serve_lean:
        port, backend = args.serve_floor or args.serve_lean
        serve = serve_floor if args.serve_floor else serve_lean
        sys.path.insert(0, str(ROOT))
        from controller.kit import eventloop

        with contextlib.suppress(KeyboardInterrupt):
            eventloop.run(lambda: serve(int(port), backend, args.loop), args.loop)
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
