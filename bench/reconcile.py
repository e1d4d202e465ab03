"""Reconciler costs: no-op passes, plan computation, GitOps latency, concurrent convergence.

(a) a no-op reconcile pass (``Reconciler.reconcile(name)`` for every slot, all in sync)
    over 100 / 1,000 / 10,000 ready slots on a FakeRuntime: per pass and per slot, and
    the per-slot ratio between sizes (linear scaling: ratios near 1);
(b) ``plans_for`` over a prebuilt 1,000-slot desired/applied/observed state with 10 %
    of the slots changed (half runtime changes: recreate, half scheduling: update),
    median of repeats;
(c) GitOps file-save-to-first-action latency: an in-process ``Controller`` (process
    runtime, demo servers) following a stack dir; a stack file is rewritten with one
    slot's priority changed and the time until the ``plan`` event for that slot is
    taken, ~10 times (p50/max);
(d) convergence of 50 independent demo slots with ``--load-seconds 1`` through an
    in-process Reconciler on the process runtime (what ``stack apply --once`` runs):
    the controller's own CPU per load (this process), the servers' CPU, the converge
    time against the machine's bound ``load time + servers' CPU / cores`` (a server's
    start CPU comes before its load: the last start ends no sooner than all the servers'
    CPU spread over the cores, and that server then loads); next to
    loading the same slots one after another with the same manager
    (``--no-sequential`` skips that).

(a) also times the first pass after the desired state is read again unchanged (new, equal
spec objects: a resync), which compares values once instead of identities.

``--baseline DIR`` runs (a), (b) and (d) a second time against another checkout's
``controller`` package (e.g. ``git archive main | tar -x -C DIR``), in a subprocess, size
by size interleaved with this tree's ((d): the baseline first, then this tree), and prints
both side by side. ``--parts`` picks sections (default ``abcd``).

Prints a table; never fails on timing.

    python bench/reconcile.py [--sizes 100,1000,10000] [--slots 50] [--saves 10]
                              [--parts ab] [--baseline DIR] [--no-sequential]

``SLOTCTL_BENCH_TREE=DIR`` runs every part against another checkout's package.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# The controller package measured: this checkout's, or (the --baseline subprocess) another's.
sys.path.insert(0, os.environ.get("SLOTCTL_BENCH_TREE") or str(Path(__file__).parent.parent))

from controller.daemon.main import Controller, DaemonOptions
from controller.kit import eventloop
from controller.kit.clock import SYSTEM_CLOCK
from controller.model.lifecycle import SlotState
from controller.probes.memory import FakeMemoryProbe
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.reconcile.apply import apply_to_config
from controller.reconcile.reconciler import ObservedSlot, Reconciler, plans_for
from controller.runtime.fake import FakeProber, FakeRuntime
from controller.runtime.process.runtime import ProcessRuntime
from controller.slots.manager import SlotManager
from controller.slots.records import ManagerConfig
from controller.spec.configdir import ConfigSnapshot
from controller.spec.loader import DesiredSlot, DesiredState, load_stacks, normalise
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec
from controller.store.state import SlotStateRecord, StateStore

SETTINGS = ControllerSettings(safety_margin_gb=0.0)
TREE = sys.path[0]

# ============================================================================ helpers


def fast_tmp() -> str | None:
    """A RAM-backed temp dir when there is one (setup writes thousands of state files)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def desired_slots(
    n: int, *, autoload: bool = True, base_port: int = 20000
) -> tuple[dict[str, DesiredSlot], dict[str, ModelSpec]]:
    slots = {}
    models = {}
    for i in range(n):
        name = f"s{i:05d}"
        spec = SlotSpec.model_validate(
            {
                "name": name,
                "provider": "demo",
                "port": base_port + i,
                "model": {"default": f"{name}-m"},
                "device": "cpu",
                "autoload": autoload,
                "server": {"extra_args": ["--load-seconds", "0"]},
            }
        )
        slots[name] = DesiredSlot(spec=normalise(spec, SETTINGS), stack="bench")
        models[f"{name}-m"] = ModelSpec(id=f"{name}-m", source=f"demo://{name}")
    return slots, models


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ============================================================================ (a) no-op passes


async def noop_pass(tmp: Path, n: int, passes: int) -> tuple[float, int, float]:
    """Median seconds of one pass over ``n`` ready, in-sync slots; the slot count; and the
    seconds of the first pass after the desired state is read again, unchanged.

    Setup as after a controller restart: ``n`` fake servers run and every state.json
    says ``ready``; the manager adopts them (``recover``), so every plan is ``noop``.
    """
    slots, models = desired_slots(n)
    runtime = FakeRuntime(SYSTEM_CLOCK)
    store = StateStore(tmp / "state")
    ctx = BuildContext(runtime="process", stack="bench")
    for name, slot in slots.items():
        model = models[slot.spec.model_id]
        await runtime.start(build_launch(slot.spec, model, ctx))
        record = SlotStateRecord(
            name=name, state=SlotState.READY, model_id=model.id, port=slot.spec.port
        )
        store.write(record, durable=False)
    manager = SlotManager(
        runtime=runtime,
        state_dir=tmp / "state",
        config_dir=tmp / "config",
        settings=SETTINGS,
        prober=FakeProber(runtime),
        memory=FakeMemoryProbe({"cpu": 1 << 50}),
        config=ManagerConfig(stop_timeout_s=1.0),
    )
    await manager.set_desired(DesiredState(stacks=("bench",), models=models, slots=slots))
    await manager.recover()
    reconciler = Reconciler(manager, tmp / "config")
    reconciler.refresh(ConfigSnapshot(settings=SETTINGS, models=models, slots=slots))
    names = reconciler.all_names()
    kinds = {reconciler.plan(name).kind for name in names}
    assert kinds == {"noop"}, f"not in sync: {kinds}"
    times = []
    for _ in range(passes):
        gc.collect()
        t0 = time.perf_counter()
        for name in names:
            await reconciler.reconcile(name)
        times.append(time.perf_counter() - t0)
    # A resync that reads the same files again: equal values in new objects.
    reread = {
        name: DesiredSlot(spec=SlotSpec.model_validate(slot.spec.model_dump()), stack=slot.stack)
        for name, slot in slots.items()
    }
    reconciler.refresh(ConfigSnapshot(settings=SETTINGS, models=models, slots=reread))
    gc.collect()
    t0 = time.perf_counter()
    for name in names:
        await reconciler.reconcile(name)
    first = time.perf_counter() - t0
    assert {reconciler.plan(name).kind for name in names} == {"noop"}
    await manager.close()
    return statistics.median(times), len(names), first


async def measure_noop(sizes: Sequence[int]) -> dict[int, tuple[float, float, int]]:
    """Per size: (µs a slot of a no-op pass, µs a slot of the first pass after a re-read,
    passes)."""
    out = {}
    for n in sizes:
        passes = max(5, min(20, 20_000 // n))
        with tempfile.TemporaryDirectory(prefix="slotctl-bench-", dir=fast_tmp()) as tmp:
            seconds, count, first = await noop_pass(Path(tmp), n, passes)
        out[n] = (seconds / count * 1e6, first / count * 1e6, passes)
    return out


def baseline(tree: str, parts: str, sizes: Sequence[int]) -> dict[str, object]:
    """Run (a)/(b) of this script against the controller package in ``tree``."""
    env = {**os.environ, "SLOTCTL_BENCH_TREE": tree, "PYTHONPATH": tree}
    argv = [sys.executable, __file__, "--json", "--parts", parts]
    argv += ["--sizes", ",".join(str(n) for n in sizes)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def bench_noop(sizes: Sequence[int], base_tree: str | None) -> list[str]:
    lines = ["(a) no-op reconcile pass: reconcile(name) for every slot, all ready and in sync"]
    if base_tree:
        lines.append(f"    before = {base_tree}; after = {TREE}; µs a slot, median of the passes")
    per_slot: list[float] = []
    for n in sizes:
        before = baseline(base_tree, "a", [n])["noop"] if base_tree else None
        us, first, passes = (await measure_noop([n]))[n]
        per_slot.append(us)
        line = (
            f"  {n:>6,} slots: pass {us * n / 1e3:9.1f} ms   per slot {us:7.1f} µs   "
            f"first pass after an unchanged re-read {first:6.1f} µs a slot   "
            f"(median of {passes} passes)"
        )
        if isinstance(before, dict):
            b_us, b_first, _ = before[str(n)]
            line += (
                f"\n          before: per slot {b_us:7.1f} µs (x{b_us / us:.1f} now), "
                f"after a re-read {b_first:6.1f} µs"
            )
        lines.append(line)
    for (n0, u0), (n1, u1) in zip(
        zip(sizes, per_slot, strict=True), list(zip(sizes, per_slot, strict=True))[1:], strict=False
    ):
        lines.append(
            f"  per-slot ratio {n1:,}/{n0:,} slots: x{u1 / u0:.2f} (1.00 = linear scaling)"
        )
    return lines


# ============================================================================ (b) plans


def measure_plans(
    n: int = 1000, changed_frac: float = 0.10, repeats: int = 50
) -> tuple[float, dict[str, int]]:
    """Median seconds of ``plans_for`` over ``n`` slots with ``changed_frac`` changed."""
    want, _ = desired_slots(n)
    have = {name: slot.spec for name, slot in want.items()}
    hashes: dict[str, str | None] = {name: f"h{i:011d}" for i, name in enumerate(want)}
    observed = {
        name: ObservedSlot(name=name, state=SlotState.READY, running=True, config_hash=hashes[name])
        for name in want
    }
    names = list(want)
    step = round(1 / changed_frac)
    for i, name in enumerate(names[::step]):
        spec = want[name].spec
        if i % 2 == 0:  # runtime config: a new hash -> recreate
            server = spec.server.model_copy(update={"extra_args": ["--load-seconds", "1"]})
            want[name] = DesiredSlot(spec=spec.model_copy(update={"server": server}), stack="bench")
            hashes[name] = f"x{i:011d}"
        else:  # scheduling only -> update in place
            want[name] = DesiredSlot(spec=spec.model_copy(update={"priority": 90}), stack="bench")
    times = []
    actions = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        actions = plans_for(names, want, have, observed, hashes)
        times.append(time.perf_counter() - t0)
    kinds: dict[str, int] = {}
    for action in actions:
        kinds[action.kind] = kinds.get(action.kind, 0) + 1
    return statistics.median(times), dict(sorted(kinds.items()))


def bench_plans(base_tree: str | None, n: int = 1000) -> list[str]:
    before = baseline(base_tree, "b", [n])["plan"] if base_tree else None
    median, kinds = measure_plans(n)
    lines = [
        f"(b) plans_for over {n:,} slots, 10% changed, median of 50",
        f"  {median * 1e3:.2f} ms per plan ({median / n * 1e6:.1f} µs per slot); actions {kinds}",
    ]
    if isinstance(before, float):
        lines.append(f"  before: {before * 1e3:.2f} ms per plan (x{before / median:.1f} now)")
    return lines


# ============================================================================ (c) GitOps latency


def stack_text(slots: Sequence[tuple[str, int, int]]) -> str:
    out = ['[stack]\nname = "gitops"\n']
    for name, _, _ in slots:
        out.append(f'[[model]]\nid = "m-{name}"\nsource = "demo://{name}"\n')
    for name, port, priority in slots:
        out.append(
            f'[[slot]]\nname = "{name}"\nprovider = "demo"\nmodel.default = "m-{name}"\n'
            f'device = "cpu"\nport = {port}\npriority = {priority}\nautoload = true\n'
            '[slot.server]\nextra_args = ["--load-seconds", "0"]\n'
        )
    return "\n".join(out)


def free_ports(count: int) -> list[int]:
    import socket

    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


async def bench_gitops(saves: int) -> list[str]:
    ports = free_ports(3)
    slots = [(f"g{i}", port, 50) for i, port in enumerate(ports)]
    with tempfile.TemporaryDirectory(prefix="slotctl-bench-") as tmp:
        root = Path(tmp)
        stack_dir = root / "stacks"
        stack_dir.mkdir()
        stack_file = stack_dir / "gitops.toml"
        stack_file.write_text(stack_text(slots))
        opts = DaemonOptions(
            config_dir=root / "config",
            state_dir=root / "state",
            stack_dir=stack_dir,
            out=io.StringIO(),
            listen=None,
        )
        controller = Controller(opts)
        runner = asyncio.create_task(controller.run())
        await asyncio.wait_for(controller.ready.wait(), 30)
        manager = controller.manager
        assert manager is not None
        with manager.events.subscribe() as events:

            async def wait_for(kind: str, slot: str, to_state: str | None = None) -> float:
                async for event in events:
                    wanted = to_state is None or event.to_state == to_state
                    if event.kind == kind and event.slot == slot and wanted:
                        return time.perf_counter()
                raise AssertionError("event stream ended")

            deadline = time.monotonic() + 60
            while not all(v.state is SlotState.READY for v in manager.views()):
                assert time.monotonic() < deadline, "the GitOps stack did not become ready"
                await asyncio.sleep(0.05)
            latencies = []
            for i in range(saves):
                await asyncio.sleep(0.3)  # let the previous change settle (its config write)
                slot = slots[i % len(slots)][0]
                slots = [(n, p, (60 + i) if n == slot else prio) for n, p, prio in slots]
                waiter = asyncio.create_task(wait_for("plan", slot))
                await asyncio.sleep(0)
                staged = stack_file.with_suffix(".staged")
                staged.write_text(stack_text(slots))
                t0 = time.perf_counter()
                staged.replace(stack_file)  # the "save": an atomic rename, as editors do
                seen = await asyncio.wait_for(waiter, 30)
                latencies.append(seen - t0)
        controller.stop.set()
        await asyncio.wait_for(runner, 60)
    ms = [x * 1e3 for x in latencies]
    return [
        f"(c) GitOps: stack file saved -> `plan` event for the changed slot ({saves} saves, "
        f"in-process Controller, watch debounce {opts.watch_debounce_ms} ms)",
        f"  p50 {statistics.median(ms):.0f} ms   max {max(ms):.0f} ms   min {min(ms):.0f} ms",
    ]


# ============================================================================ (d) convergence


def threads_cpu(pid: int) -> float:
    """CPU seconds of ``pid``'s live threads (scheduler clocks, ns), as bench/demo_start.py
    reads them; a thread that has ended (the demo's load thread, which sleeps) is gone."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError):
            total += int(stat.read_text().split()[0])
    return total / 1e9


async def bench_converge(
    count: int, load_seconds: float, workers: int | None, sequential_too: bool = True
) -> list[str]:
    ports = free_ports(count)
    with tempfile.TemporaryDirectory(prefix="slotctl-bench-") as tmp:
        root = Path(tmp)
        out = ['[stack]\nname = "conv"\n']
        for i in range(count):
            out.append(f'[[model]]\nid = "m{i}"\nsource = "demo://m{i}"\n')
        for i, port in enumerate(ports):
            out.append(
                f'[[slot]]\nname = "c{i:02d}"\nprovider = "demo"\nmodel.default = "m{i}"\n'
                f'device = "cpu"\nport = {port}\nautoload = true\n'
                f'[slot.server]\nextra_args = ["--load-seconds", "{load_seconds:g}"]\n'
            )
        stack = root / "conv.toml"
        stack.write_text("\n".join(out))
        report = load_stacks([stack], SETTINGS)
        assert report.ok and report.state is not None, report.errors
        config_dir, state_dir = root / "config", root / "state"
        apply_to_config(report.state, config_dir, prune=True)
        manager = SlotManager(
            runtime=ProcessRuntime(state_dir),
            state_dir=state_dir,
            config_dir=config_dir,
            settings=SETTINGS,
        )
        reconciler = (
            Reconciler(manager, config_dir, workers=workers)
            if workers
            else Reconciler(manager, config_dir)
        )
        try:
            await manager.set_desired(reconciler.refresh().desired())
            await manager.recover()
            cpu0, t0 = time.process_time(), time.perf_counter()
            loop0, times0 = time.thread_time(), os.times()
            converged = await reconciler.converge(timeout=300, poll_s=0.05)
            concurrent = time.perf_counter() - t0
            controller_cpu = time.process_time() - cpu0
            loop_cpu, times1 = time.thread_time() - loop0, os.times()
            kernel_cpu = times1.system - times0.system
            assert converged, reconciler.errors
            servers_cpu = 0.0
            for name in manager.names():
                ident = (await manager.runtime.inspect(name)).ident
                servers_cpu += threads_cpu(int(ident)) if ident else 0.0
            await manager.stop_all(reason="bench")
            names = sorted(manager.names())
            t0 = time.perf_counter()
            for name in names if sequential_too else ():
                await manager.load(name, resident=False)
            sequential = time.perf_counter() - t0
        finally:
            await manager.stop_all(reason="bench done")
            await manager.close()
    cores = len(os.sched_getaffinity(0))
    # A server spends its start CPU (interpreter, imports, bind) *before* its load begins,
    # and the load itself is a wait: no start can end before all of them have had the
    # cores (servers' CPU / cores), and the server whose start ends last then still loads
    # for load_seconds. max(load, CPU / cores), used before, treated the two as if they
    # could overlap within one server, which they cannot.
    bound = load_seconds + servers_cpu / cores
    overlapped = max(load_seconds, servers_cpu / cores)
    lines = [
        f"(d) {count} independent demo slots, --load-seconds {load_seconds:g}, process runtime "
        f"(reconciler workers: {reconciler.workers})",
        f"  reconciler (apply --once path): {concurrent:6.2f} s to converge",
        f"  controller CPU (this process, all threads): {controller_cpu * 1e3:.0f} ms, "
        f"{controller_cpu / count * 1e3:.1f} ms a load "
        f"(event loop {loop_cpu / count * 1e3:.1f}, worker threads "
        f"{(controller_cpu - loop_cpu) / count * 1e3:.1f}; in the kernel "
        f"{kernel_cpu / count * 1e3:.1f})",
        f"  servers' CPU until converged: {servers_cpu:.2f} s "
        f"({servers_cpu / count * 1e3:.0f} ms a server)",
        f"  machine bound load {load_seconds:g} s + servers' CPU / {cores} cores: "
        f"{bound:.2f} s; converge / bound: x{concurrent / bound:.2f}",
        f"  (the earlier, unreachable max(load, servers' CPU / cores): {overlapped:.2f} s, "
        f"x{concurrent / overlapped:.2f})",
    ]
    if sequential_too:
        lines += [
            f"  one load after another:         {sequential:6.2f} s "
            f"({sequential / count:.2f} s per load)",
            f"  ratio sequential / reconciler:  x{sequential / concurrent:.1f}",
        ]
    return lines


def converge_baseline(args: argparse.Namespace) -> list[str]:
    """(d) against the ``--baseline`` tree, in a subprocess (its lines, headed so)."""
    env = {**os.environ, "SLOTCTL_BENCH_TREE": args.baseline, "PYTHONPATH": args.baseline}
    argv = [sys.executable, __file__, "--parts", "d", "--slots", str(args.slots)]
    argv += ["--load-seconds", f"{args.load_seconds:g}", "--loop", args.loop]
    argv += ["--no-sequential"] if args.no_sequential else []
    argv += ["--workers", str(args.workers)] if args.workers else []
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    body = [line for line in done.stdout.splitlines() if line.startswith(("(d)", "  "))]
    return [f"before: {args.baseline}", *body, f"after: {TREE}"]


# ============================================================================ main


async def main_async(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.json:  # the --baseline subprocess: figures only, one JSON line
        out: dict[str, object] = {"tree": TREE}
        if "a" in args.parts:
            out["noop"] = await measure_noop(sizes)
        if "b" in args.parts:
            out["plan"] = measure_plans()[0]
        print(json.dumps(out))
        return
    print(
        f"slotctl bench/reconcile.py — {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}"
    )
    started = time.perf_counter()
    sections = []
    if "a" in args.parts:
        sections.append(await bench_noop(sizes, args.baseline))
    if "b" in args.parts:
        sections.append(bench_plans(args.baseline))
    if "c" in args.parts:
        sections.append(await bench_gitops(args.saves))
    if "d" in args.parts:
        if args.baseline:
            sections.append(converge_baseline(args))
        sections.append(
            await bench_converge(
                args.slots, args.load_seconds, args.workers, not args.no_sequential
            )
        )
    for lines in sections:
        print()
        for line in lines:
            print(line)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--slots", type=int, default=50)
    parser.add_argument("--load-seconds", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=None, help="(d): reconciler workers")
    parser.add_argument("--no-sequential", action="store_true", help="(d): skip the baseline")
    parser.add_argument("--parts", default="abcd", help="sections to run (default abcd)")
    parser.add_argument("--baseline", default=None, help="(a), (b), (d): also measure this tree")
    parser.add_argument(
        "--loop",
        default="auto",
        choices=("auto", "asyncio", "uvloop"),
        help="event loop (default auto: uvloop when installed, as slotctl up and apply run)",
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        eventloop.run(lambda: main_async(args), args.loop)


if __name__ == "__main__":
    main()
