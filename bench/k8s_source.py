"""The operator's desired-state path at scale, without kopf, a cluster or servers: what a
custom resource's event costs the operator's event loop, from the handler to the slot
names on the reconciler's queue.

An :class:`~controller.operator.run.Operator` is built (the controller core not run), its
reconciler made over a stand-in manager (the catalogue and the queue are real, nothing
loads), and the CR events of a ``kubectl apply`` of ``--slots`` Slots (one Model first)
are handed to it as kopf would, one at a time, each followed by what the operator does
with it, then ``--edits`` edits of one Slot's ``priority`` with every Slot in force:

* **this tree** (issue 41): each event is handled as it comes — the source judges the one
  resource (and what it touches) in memory, the cache merges it, the reconciler queues
  the slots it changed;
* **a baseline tree** (``--baseline DIR``, run in a subprocess with ``DIR`` first on the
  path; the tree before issue 41): each handler asks for a judging of every resource,
  shared by the handlers of a burst and paced by its cost (``SyncPacer``: no sooner than
  four times the last judging's cost after it, at most 1 s, at least 50 ms after the first
  ask); a judging writes the config dir through the guard, reads it back and queues
  every slot. The events come at ``--rate`` a second (a ``kubectl apply`` of 1,000 Slots
  took ~40 s on the scale bench's API server); the pacer's waits are simulated on that
  clock, the judgings' work is real.

Measured: the CPU seconds of the whole burst and per event, the longest the event loop
is held by one step (a handler, or a judging), the judgings run, and per edit at
``--slots`` in force the CPU seconds and the slots queued. Prints a table; never fails on
timing.

    python bench/k8s_source.py [--slots 1000] [--edits 20] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("SLOTCTL_BENCH_TREE") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))


class StubManager:
    """What the reconciler asks of a manager when it is only queued to (nothing runs)."""

    def __init__(self) -> None:
        self.models: dict[str, Any] = {}
        self.aliases: dict[str, Any] = {}
        self.adapters: dict[str, Any] = {}

    def set_models(self, models: Any, order: Any = None) -> None:
        self.models = dict(models)

    def set_aliases(self, aliases: Any) -> None:
        self.aliases = dict(aliases)

    def set_adapters(self, adapters: Any) -> None:
        self.adapters = dict(adapters)

    def names(self) -> list[str]:
        return []


def body(kind: str, name: str, spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "scale",
            "generation": generation,
            "creationTimestamp": f"2026-12-04T00:{len(name):02d}:00Z",
            "uid": name,
        },
        "spec": spec,
    }


def slot(i: int, priority: int = 50, generation: int = 1) -> dict[str, Any]:
    spec = {
        "provider": "demo",
        "model": {"default": "m"},
        "device": "gpu",
        "port": 20000 + i,
        "autoload": True,
        "priority": priority,
        "idle_timeout_s": 0,
    }
    return body("Slot", f"s{i:04d}", spec, generation)


class Index:
    """kopf's index of one kind, as the handlers see it (a store per key)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}

    def put(self, essence: dict[str, Any]) -> None:
        meta = essence["metadata"]
        self.objects[(meta["namespace"], meta["name"])] = essence

    def values(self) -> list[list[dict[str, Any]]]:
        return [[v] for v in self.objects.values()]


def essence(raw: dict[str, Any]) -> dict[str, Any]:
    meta = raw["metadata"]
    return {
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "generation": meta["generation"],
            "creationTimestamp": meta["creationTimestamp"],
            "deleting": False,
        },
        "spec": dict(raw["spec"]),
    }


def queued(reconciler: Any) -> set[str]:
    """The names waiting on the reconciler's queue (either tree's), then emptied."""
    queue = getattr(reconciler, "queue", None)
    if queue is not None:  # this tree: a WorkQueue
        names = set(queue._dirty)
        queue._queue.clear()
        queue._dirty.clear()
        return names
    names = set(reconciler._queued)
    reconciler._queued.clear()
    while not reconciler._queue.empty():
        reconciler._queue.get_nowait()
    return names


async def measure(slots: int, edits: int, rate: float) -> dict[str, Any]:
    from controller.operator import run as operator_run
    from controller.operator.run import Operator, OperatorOptions
    from controller.reconcile.reconciler import Reconciler

    old = hasattr(Operator, "_sync")
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp) / "state"
        config = state_dir / "config"
        config.mkdir(parents=True)
        op = Operator(OperatorOptions(state_dir=state_dir, config_dir=config))
        reconciler = Reconciler(StubManager(), config, desired=op.controller.desired)  # type: ignore[arg-type]
        op.controller.reconciler = reconciler
        indexes = {"models_index": Index(), "slots_index": Index(), "aliases_index": Index()}
        events = [body("Model", "m", {"source": "demo://m", "memory_gb": 1})]
        events += [slot(i) for i in range(slots)]
        steps: list[float] = []  # seconds the loop was held by each step
        judgings = 0
        cpu0 = time.process_time()
        if old:
            pacer = operator_run.SyncPacer()
            clock, pending_since = 0.0, None
            i = 0
            while i < len(events) or pending_since is not None:
                arrive = i / rate if i < len(events) else float("inf")
                due = None
                if pending_since is not None:
                    due = max(
                        pending_since + operator_run.SYNC_BATCH_S,
                        pacer.ended
                        + min(operator_run.SYNC_GAP_MAX_S, operator_run.SYNC_SPACING * pacer.cost),
                    )
                if due is None or arrive <= due:
                    raw = events[i]
                    index = "models_index" if raw["kind"] == "Model" else "slots_index"
                    indexes[index].put(essence(raw))
                    clock = max(clock, arrive)
                    pending_since = clock if pending_since is None else pending_since
                    i += 1
                    continue
                clock = max(clock, due)
                started = time.perf_counter()
                op._sync(indexes)
                took = time.perf_counter() - started
                steps.append(took)
                pacer.took(clock, clock + took)
                clock += took
                judgings += 1
                pending_since = None
                queued(reconciler)
        else:
            for raw in events:
                kind = raw["kind"]
                index = "models_index" if kind == "Model" else "slots_index"
                indexes[index].put(essence(raw))
                started = time.perf_counter()
                op._prime(indexes)
                op.source.apply(kind, raw)
                op.board.wake(op.source.woken)
                steps.append(time.perf_counter() - started)
                queued(reconciler)
            judgings = op.source.judged
        burst_cpu = time.process_time() - cpu0
        in_force = len(reconciler.snapshot.slots)
        edit_cpu: list[float] = []
        edit_queued: list[int] = []
        for n in range(edits):
            raw = slot(7, priority=60 + n, generation=2 + n)
            indexes["slots_index"].put(essence(raw))
            cpu = time.process_time()
            if old:
                op._sync(indexes)
            else:
                op.source.apply("Slot", raw)
                op.board.wake(op.source.woken)
            edit_cpu.append(time.process_time() - cpu)
            edit_queued.append(len(queued(reconciler)))
        return {
            "tree": "baseline (judging every CR, paced)" if old else "this tree (per key)",
            "slots": slots,
            "in_force": in_force,
            "burst_cpu_s": burst_cpu,
            "cpu_per_event_ms": burst_cpu / len(events) * 1000,
            "longest_step_ms": max(steps) * 1000,
            "judgings": judgings,
            "edit_cpu_ms": statistics.median(edit_cpu) * 1000,
            "edit_queued": statistics.median(edit_queued),
            "config_files": len(list((config / "slots").glob("*.toml")))
            if (config / "slots").is_dir()
            else 0,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=1000)
    parser.add_argument("--edits", type=int, default=20)
    parser.add_argument("--rate", type=float, default=25.0, help="CR events a second")
    parser.add_argument("--baseline", type=Path, help="another tree, measured first")
    parser.add_argument("--json", action="store_true", help="one JSON line (for --baseline)")
    args = parser.parse_args()
    results = []
    if args.baseline is not None:
        env = {**os.environ, "SLOTCTL_BENCH_TREE": str(args.baseline.resolve())}
        env["PYTHONPATH"] = str(args.baseline.resolve())
        command = [
            sys.executable,
            __file__,
            "--slots",
            str(args.slots),
            "--edits",
            str(args.edits),
            "--rate",
            str(args.rate),
            "--json",
        ]
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    results.append(asyncio.run(measure(args.slots, args.edits, args.rate)))
    if args.json:
        print(json.dumps(results[-1]))
        return
    print(f"# bench/k8s_source.py --slots {args.slots} --edits {args.edits} --rate {args.rate}")
    print(f"# {platform.python_version()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    rows = [
        ("Slots in force after the burst", "in_force", "{:d}"),
        ("burst: operator CPU (s)", "burst_cpu_s", "{:.2f}"),
        ("burst: CPU per CR event (ms)", "cpu_per_event_ms", "{:.2f}"),
        ("burst: longest the loop is held (ms)", "longest_step_ms", "{:.1f}"),
        ("burst: judgings (of every CR) / CRs judged", "judgings", "{:d}"),
        ("an edit at full size: CPU (ms, median)", "edit_cpu_ms", "{:.2f}"),
        ("an edit at full size: slots queued", "edit_queued", "{:.0f}"),
        ("slot files written to the config dir", "config_files", "{:d}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  " + "  ".join(f"{r['tree']:>36}" for r in results))
    for label, key, fmt in rows:
        print(f"{label:<{width}}  " + "  ".join(f"{fmt.format(r[key]):>36}" for r in results))
    if len(results) == 2:
        base, this = results
        print(
            f"CPU per event x{this['cpu_per_event_ms'] / base['cpu_per_event_ms']:.3f}, "
            f"an edit x{this['edit_cpu_ms'] / base['edit_cpu_ms']:.4f}"
        )


if __name__ == "__main__":
    main()
