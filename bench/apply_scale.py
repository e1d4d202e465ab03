"""Stack apply at scale: O(N) config writes, and an API that answers during a big apply.

(a) ``apply_to_config`` of N new slots into an empty config dir (one stack, one model per
    slot): the batch path (one lock, one cross-slot check, each file read once) next to
    the old per-slot path, emulated with ``write_slot_config`` per slot, which re-reads
    and re-parses the whole config dir at every write (O(N²)). The old path runs only up
    to ``--old-max`` slots (it takes minutes beyond);
(b) GitOps: an in-process ``Controller`` (process runtime, API on 127.0.0.1) follows a
    stack dir; a stack file of N non-autoload slots is saved into it, and the time until
    every slot is known to the manager is taken while ``GET /healthz`` is polled every
    20 ms from a thread: its worst latency says whether the event loop stayed free (the
    file is parsed and written off the loop). (Polled from a task on the loop, as until
    issue 40, a stalled loop stalled the poller too: it never saw a stall.)

Prints a table; never fails on timing.

With ``--auto-ports`` the slots of (b) leave their port to the controller (the default):
every slot's launch hash then chooses and records one (issue 40: it re-read every other
slot's port file for each, on the loop — O(N²), two minutes at 1,000).

    python bench/apply_scale.py [--sizes 100,200,1000] [--old-max 200] [--gitops 1000]
        [--auto-ports]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.daemon.main import Controller, DaemonOptions
from controller.reconcile.apply import apply_to_config
from controller.spec.configdir import read_config_dir
from controller.spec.guard import write_catalogue, write_slot_config
from controller.spec.loader import DesiredState, load_stack_texts


def stack_text(
    n: int, *, name: str = "scale", base_port: int = 40000, auto_ports: bool = False
) -> str:
    out = [f'[stack]\nname = "{name}"\n']
    for i in range(n):
        out.append(f'[[model]]\nid = "{name}-m{i:05d}"\nsource = "demo://m{i:05d}"\n')
    for i in range(n):
        port = "" if auto_ports else f"port = {base_port + i}\n"  # none: the controller's
        out.append(
            f'[[slot]]\nname = "{name}-s{i:05d}"\nprovider = "demo"\n'
            f'model.default = "{name}-m{i:05d}"\ndevice = "cpu"\n{port}'
            "autoload = false\n"
        )
    return "\n".join(out)


def desired(n: int) -> DesiredState:
    report = load_stack_texts([("scale.toml", stack_text(n))])
    assert report.ok and report.state is not None, report.errors[:3]
    return report.state


def fast_tmp() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def apply_new(state: DesiredState, config_dir: Path) -> float:
    t0 = time.perf_counter()
    apply_to_config(state, config_dir, prune=True)
    return time.perf_counter() - t0


def apply_old(state: DesiredState, config_dir: Path) -> float:
    """What apply did before: one guarded write per slot, each re-reading the config dir."""
    t0 = time.perf_counter()
    write_catalogue(config_dir, list(state.models.values()))
    final = {n: s.spec for n, s in state.slots.items()}
    for name, slot in state.slots.items():
        payload = slot.spec.model_dump(mode="json", exclude_unset=True, exclude_none=True)
        others = [spec for n, spec in final.items() if n != name]
        write_slot_config(config_dir, payload, stack=slot.stack or None, others=others)
    return time.perf_counter() - t0


def bench_apply(sizes: list[int], old_max: int) -> Iterator[str]:
    yield "(a) apply_to_config of N new slots into an empty config dir"
    yield f"  {'N':>6}  {'batch (now)':>12}  {'per-slot (before)':>18}  {'ratio':>6}"
    for n in sizes:
        state = desired(n)
        with tempfile.TemporaryDirectory(prefix="slotctl-bench-", dir=fast_tmp()) as tmp:
            new = apply_new(state, Path(tmp) / "new")
            assert len(read_config_dir(Path(tmp) / "new").slots) == n
            old = apply_old(state, Path(tmp) / "old") if n <= old_max else None
        shown = f"{old:>17.2f}s" if old is not None else f"{'(skipped)':>18}"
        ratio = f"{old / new:>5.0f}x" if old is not None else f"{'':>6}"
        yield f"  {n:>6}  {new:>11.2f}s  {shown}  {ratio}"


async def bench_gitops(n: int, *, auto_ports: bool = False) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="slotctl-bench-", dir=fast_tmp()) as tmp:
        root = Path(tmp)
        stack_dir = root / "stacks"
        stack_dir.mkdir()
        (stack_dir / "a-seed.toml").write_text(stack_text(1, name="seed", base_port=39000))
        opts = DaemonOptions(
            config_dir=root / "config",
            state_dir=root / "state",
            stack_dir=stack_dir,
            out=io.StringIO(),
            listen="127.0.0.1:0",
            token="bench",
        )
        controller = Controller(opts)
        runner = asyncio.create_task(controller.run())
        await asyncio.wait_for(controller.ready.wait(), 60)
        manager = controller.manager
        assert manager is not None
        record = controller.lock.read()
        assert record is not None and record.listen
        url = f"http://{record.listen}/healthz"
        latencies: list[float] = []
        done = threading.Event()

        def poll() -> None:  # a thread of its own: a poller on the loop stalls with it
            while not done.is_set():
                t0 = time.perf_counter()
                with urllib.request.urlopen(url, timeout=600) as response:
                    response.read()
                latencies.append(time.perf_counter() - t0)
                done.wait(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        text = stack_text(n, auto_ports=auto_ports)
        t0 = time.perf_counter()
        staged = stack_dir / "scale.staged"
        staged.write_text(text)
        staged.replace(stack_dir / "scale.toml")
        deadline = time.monotonic() + 600
        names = [f"scale-s{i:05d}" for i in range(n)]

        def ported() -> bool:  # auto ports: every slot's chosen (its launch hash asked)
            return not auto_ports or all(manager.store.read_port(x) for x in names)

        while len(manager.names()) < n + 1 or not ported():
            if time.monotonic() > deadline:
                raise SystemExit(f"not applied after 600 s:\n{opts.out.getvalue()[-3000:]}")  # type: ignore[attr-defined]
            await asyncio.sleep(0.05)
        took = time.perf_counter() - t0
        done.set()
        await asyncio.to_thread(poller.join, 600)
        controller.stop.set()
        await asyncio.wait_for(runner, 120)
    ms = [x * 1e3 for x in latencies]
    return [
        f"(b) GitOps: a {n}-slot stack file ({len(text) // 1024} KiB"
        f"{', ports left to the controller' if auto_ports else ''}) saved into the stack "
        "dir of an in-process controller",
        f"  every slot known to the manager after {took:.2f}s",
        f"  GET /healthz meanwhile ({len(ms)} calls): p50 {statistics.median(ms):.0f} ms, "
        f"max {max(ms):.0f} ms",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,200,1000")
    parser.add_argument("--old-max", type=int, default=200)
    parser.add_argument("--gitops", type=int, default=1000, help="0: skip (b)")
    parser.add_argument(
        "--auto-ports", action="store_true", help="(b): slots without a port (issue 40)"
    )
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    print(
        f"slotctl apply scale  ({platform.python_implementation()} {platform.python_version()})",
        flush=True,
    )
    for line in bench_apply(sizes, args.old_max):
        print(line, flush=True)
    if args.gitops:
        for line in asyncio.run(bench_gitops(args.gitops, auto_ports=args.auto_ports)):
            print(line, flush=True)


if __name__ == "__main__":
    main()
