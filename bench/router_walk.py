"""The router's per-request walk, in one process, without sockets: where each microsecond of
a routed request goes.

The data plane (``controller/dataplane``) serves ``POST /v1/chat/completions`` for K
kept-alive client connections at once, on fake transports, against a real ``SlotManager``
on ``FakeRuntime`` with the API's metrics wired as ``slotctl up`` wires them, each answer
fed back as a model server's (the demo server's head, ``Content-Length``). A round: each
of the K clients sends its request, then each upstream connection answers. With K = 1 the
slot flips ``ready`` -> ``serving`` -> ``ready`` every request (two transitions, two
events); with K = 10 or 100 it stays ``serving`` for a round. What it measures is the
Python work of the walk alone — no syscall, no event loop turn — so it is the part of
``bench/router.py``'s "proxy CPU per request" that the data plane's code decides (the rest
is the kernel's and the loop's, which a lean relay pays too).

    python bench/router_walk.py [--clients 1 10 100] [--requests 60000] [--rounds 3]
                                [--spy] [--cold MIB] [--count]

Prints CPU µs per request (the best of ``--rounds`` runs: the machine may be shared).
``--spy`` samples each K's walk with py-spy (``pip install py-spy``) and prints the
microseconds per request by stage and by function (self time). ``--cold MIB`` rewrites a
scratch buffer of MIB MiB after the clients' sends and after the answers, its own time not
counted: what the client and the model server do to the caches between two turns of a
live router's loop (8 MiB: the walk at 1 client runs ~5 times its warm time, as the live
router's Python does). ``--count`` traces a few rounds per K instead of timing them: the
distinct Python functions a request touches, its Python calls and its bytecodes
(``sys.setprofile``, then ``f_trace_opcodes``), the bytecodes by function. Never fails on
timing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.api.app import ApiContext  # noqa: E402
from controller.api.assembly import build_app  # noqa: E402
from controller.dataplane.answers import address  # noqa: E402
from controller.dataplane.plane import DataPlane  # noqa: E402
from controller.dataplane.upstream import Upstream  # noqa: E402
from controller.model.sizes import GIB  # noqa: E402
from controller.probes.memory import FakeMemoryProbe  # noqa: E402
from controller.router.hosts import HostPolicy  # noqa: E402
from controller.runtime.fake import FakeProber, FakeRuntime, FakeSleeper  # noqa: E402
from controller.slots.manager import SlotManager  # noqa: E402
from controller.spec.loader import DesiredSlot, DesiredState, normalise  # noqa: E402
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec  # noqa: E402

TOKEN = "bench-router-token"
MODEL = "bench-chat"
BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "benchmark"}],
        "max_tokens": 1,
        "stream": False,
    }
).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8800\r\nAuthorization: Bearer "
    + TOKEN.encode()
    + b"\r\nContent-Type: application/json\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
    b"User-Agent: Python/3.11 aiohttp/3.14\r\nContent-Length: %d\r\n\r\n" % len(BODY)
) + BODY
ANSWER_BODY = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
).encode()
ANSWER = (
    b"HTTP/1.1 200 OK\r\nServer: BaseHTTP/0.6 Python/3.11\r\nDate: Fri, 04 Dec 2026 21:00:00 GMT"
    b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(ANSWER_BODY)
) + ANSWER_BODY

# Where a function's self time is counted, by the file it is in (the first that matches).
STAGES = (
    ("read the request (llhttp, recalled heads)", ("dataplane/request.py",)),
    ("the connection (callbacks, answers' bytes)", ("dataplane/connection.py",)),
    ("the data plane's own answers and heads", ("dataplane/answers.py",)),
    ("the upstream client (recalled answers, pool)", ("dataplane/upstream.py", "recall.py")),
    ("the routed call: model, candidates, key", ("router/",)),
    ("lease flips: transitions, events, state lag", ("slots/table.py", "eventbus.py")),
    ("lease flips: stamps", ("store/files.py", "model/events.py")),
    ("leases (acquire, release)", ("slots/",)),
    ("metrics and the recorder", ("api/", "prometheus_client")),
    ("dataclass instances (events, ranking candidates)", ("<string>",)),
    ("the walk's fake transports", ("router_walk.py",)),
)


class FakeTransport:
    def __init__(self) -> None:
        self.written = 0
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def writelines(self, data: list[bytes]) -> None:
        self.written += sum(map(len, data))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def start(tmp: Path) -> tuple[SlotManager, DataPlane]:
    runtime = FakeRuntime()
    settings = ControllerSettings(memory_budget_gb={"cpu": 8})
    manager = SlotManager(
        runtime=runtime,
        state_dir=tmp / "state",
        config_dir=tmp / "config",
        settings=settings,
        prober=FakeProber(runtime),
        memory=FakeMemoryProbe({"cpu": 64 * GIB}),
        sleeper=FakeSleeper(runtime),
    )
    spec = SlotSpec.model_validate(
        {
            "name": "bench",
            "provider": "demo",
            "port": 18999,
            "model": {"default": MODEL},
            "device": "cpu",
            "idle_timeout_s": 0,
        }
    )
    await manager.set_desired(
        DesiredState(
            stacks=("bench",),
            models={MODEL: ModelSpec(id=MODEL, source="demo://bench", memory_gb=0.1)},
            slots={"bench": DesiredSlot(spec=normalise(spec, settings), stack="bench")},
        )
    )
    await manager.load("bench")
    ctx = ApiContext(
        manager=manager,
        reconciler=None,
        config_dir=tmp / "config",
        state_dir=tmp / "state",
        token=TOKEN,
        events=manager.events,
    )
    build_app(ctx)  # the metrics, as `slotctl up` wires them
    return manager, DataPlane(ctx, lambda: None, hosts=HostPolicy("127.0.0.1"))  # type: ignore[arg-type,return-value]


async def walk(plane: DataPlane, clients: int, rounds: int, cold: bytearray | None = None) -> float:
    """``rounds`` rounds of ``clients`` requests (see the module docstring): the CPU seconds
    of the walk alone. ``cold``: a scratch buffer rewritten whole after the clients' sends
    and after the answers (what the other processes on the cores do between two turns of
    a live router's loop: the caches left cold), its own time not counted."""
    plane.pool.close()
    plane.pool.closed = False
    endpoint = plane.ctx.manager.endpoint("bench")
    assert endpoint is not None
    key = address(endpoint)[0]
    fronts, upstreams = [], []
    for _ in range(clients):
        front = plane()
        front.connection_made(FakeTransport())  # type: ignore[arg-type]
        upstream = Upstream(plane.pool, key)
        upstream.connection_made(FakeTransport())  # type: ignore[arg-type]
        plane.pool.put(key, upstream)
        fronts.append(front)
        upstreams.append(upstream)
    clock = time.process_time
    spent = 0.0
    fill = bytes(len(cold)) if cold is not None else b""
    for turn in range(rounds):
        began = clock()
        for front in fronts:
            front.data_received(REQUEST)
        if cold is not None:
            spent += clock() - began
            cold[:] = fill
            began = clock()
        for upstream in upstreams:
            upstream.data_received(ANSWER)
        spent += clock() - began
        if cold is not None:
            cold[:] = fill
        if turn % 16 == 0:
            await asyncio.sleep(0)  # the loop's own work (the state lag writer) gets a turn
    if plane.in_flight:
        raise SystemExit(f"{plane.in_flight} requests still in flight: the walk broke")
    return spent


async def measure(
    clients: list[int], requests: int, rounds: int, cold_mib: float = 0.0
) -> dict[int, float]:
    out: dict[int, float] = {}
    cold = bytearray(int(cold_mib * 2**20)) if cold_mib else None
    with tempfile.TemporaryDirectory(prefix="slotctl-router-walk-") as name:
        manager, plane = await start(Path(name))
        try:
            for k in clients:
                await walk(plane, k, max(3, 300 // k))  # warm
                best = float("inf")
                for _ in range(rounds):
                    spent = await walk(plane, k, max(1, requests // k), cold)
                    best = min(best, 1e6 * spent / (max(1, requests // k) * k))
                out[k] = best
        finally:
            await plane.shutdown(0.1)
            await manager.close()
    return out


async def count(clients: list[int], rounds: int = 20) -> dict[int, tuple[int, float, float]]:
    """Per K, after a warm round on the same connections: ``(functions, calls, bytecodes)``
    a request (a function counted when at least half the requests touch it), printed
    with the bytecodes by function."""
    out: dict[int, tuple[int, float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="slotctl-router-walk-") as name:
        manager, plane = await start(Path(name))
        try:
            for k in clients:
                await walk(plane, k, 3)  # warm
                calls: collections.Counter[str] = collections.Counter()
                ops: collections.Counter[str] = collections.Counter()

                def profile(frame: Any, event: str, arg: Any, calls: Any = calls) -> None:
                    if event == "call":
                        code = frame.f_code
                        where = "/".join(code.co_filename.split("/")[-2:])
                        calls[f"{code.co_qualname} ({where})"] += 1

                def trace(frame: Any, event: str, arg: Any, ops: Any = ops) -> Any:
                    frame.f_trace_opcodes = True
                    code = frame.f_code
                    name = f"{code.co_qualname} ({'/'.join(code.co_filename.split('/')[-2:])})"

                    def local(frame: Any, event: str, arg: Any) -> Any:
                        if event == "opcode":
                            ops[name] += 1
                        return local

                    return local

                # requests traced: each walk's new connections read their first head
                # through llhttp, 1 in ``turns`` of the requests (2 % at 100 clients)
                turns = max(50, rounds * 10 // k)
                walked = turns * k
                sys.setprofile(profile)
                try:
                    await walk(plane, k, turns)
                finally:
                    sys.setprofile(None)
                sys.settrace(trace)
                try:
                    await walk(plane, k, turns)
                finally:
                    sys.settrace(None)
                touched = sum(1 for n in calls.values() if n >= walked / 2)
                out[k] = (touched, sum(calls.values()) / walked, sum(ops.values()) / walked)
                print(
                    f"\n{k} clients: {touched} functions, {out[k][1]:.1f} Python calls, "
                    f"{out[k][2]:.0f} bytecodes a request (the walk's own included)"
                )
                for function, n in ops.most_common(25):
                    print(f"  {n / walked:7.1f}  {function}")
        finally:
            await plane.shutdown(0.1)
            await manager.close()
    return out


def breakdown(raw: Path, us: float) -> None:
    """py-spy's samples of the walk (self time), as µs per request by stage and function."""
    by_stage: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith("walk (")), None)
        if at is None or at == len(frames) - 1:
            continue
        n = int(count)
        total += n
        frame = frames[-1]
        name, _, where = frame.partition(" (")
        path = where.split(":")[0]
        stage = next((s for s, files in STAGES if any(f in path for f in files)), "other")
        by_stage[stage] += n
        by_function[f"{name} ({path.rsplit('/', 1)[-1]})"] += n
    if not total:
        print("  (no samples)")
        return
    for stage, n in by_stage.most_common():
        print(f"  {us * n / total:6.2f} µs  {stage}")
    print("  top functions (self):")
    for function, n in by_function.most_common(15):
        print(f"    {us * n / total:6.2f} µs  {function}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--requests", type=int, default=60000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spy", action="store_true", help="a py-spy breakdown per K")
    parser.add_argument(
        "--cold",
        type=float,
        default=0.0,
        metavar="MIB",
        help="rewrite a scratch buffer of MIB MiB between the sends and the answers (caches cold)",
    )
    parser.add_argument(
        "--count",
        action="store_true",
        help="count functions, calls and bytecodes a request (traced: no timing)",
    )
    args = parser.parse_args()
    if args.count:
        print(f"bench/router_walk.py --count: Python {sys.version.split()[0]}")
        asyncio.run(count(args.clients))
        return
    figures = asyncio.run(measure(args.clients, args.requests, args.rounds, args.cold))
    cold = f", caches cold ({args.cold:g} MiB rewritten between turns)" if args.cold else ""
    print(f"bench/router_walk.py: Python {sys.version.split()[0]}, {args.requests} requests{cold}")
    for k, us in figures.items():
        print(f"  {k:>3} clients: {us:6.1f} µs CPU per request (the walk alone, best of rounds)")
    if not args.spy:
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("\n  py-spy is not installed (pip install py-spy): no breakdown")
        return
    for k in args.clients:
        with tempfile.TemporaryDirectory() as name:
            raw = Path(name) / "samples.txt"
            argv = [sys.executable, __file__, "--clients", str(k), "--rounds", "1"]
            argv += ["--requests", str(args.requests)]
            record = [spy, "record", "-r", "2000", "--nonblocking", "--format", "raw"]
            subprocess.run(
                [*record, "-o", str(raw), "--", *argv],
                check=False,
                capture_output=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            print(f"\n{k} clients ({figures[k]:.1f} µs a request):")
            breakdown(raw, figures[k])


if __name__ == "__main__":
    main()
