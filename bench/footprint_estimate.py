"""Footprint estimates against what real servers hold (issue 36).

Part 1, estimate vs observed: for each generated GGUF of the panel
(``tests/integration/panel_gguf.py``: widths, depths and weight types f32, f16, q8_0) at
each context, the real llama-cpp-python server is started on CPU (the provider's own argv),
given one completion whose prompt fills the context less 24 tokens (the compute buffer
used as a long prompt uses it), and its process tree's peak RSS is read
(``controller.probes.usage``: VmHWM). Beside it, slotctl's estimate from the file's header
and the same argv (``controller.scheduling.footprint``), part by part. Goal: within ±10 %.

Part 2, admission: a randomized sequence of loads of those (model, context) entries onto a
host whose budget holds a few of them; each load evicts the least recently used until it
fits (``controller.scheduling.fit.check_admission``), once by the estimates alone and once
by the measured figures. Reported: loads, evictions, and the loads admitted by the
estimates that the measured figures say did not fit (goal: none).

Prints tables; never fails on a figure.

    python bench/footprint_estimate.py [--shapes 4] [--contexts 512,1536] [--loads 200]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.model.sizes import MIB
from controller.model.weights import GgufModel
from controller.modelfiles.headers import read_model
from controller.probes.usage import ProcessUsage
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.scheduling.fit import check_admission
from controller.scheduling.footprint import Estimate, estimate_gguf, launch_facts
from controller.spec.schema import ModelSpec, SlotSpec
from tests.integration.panel_gguf import PANEL, Shape, write_llama

DEADLINE_S = 600.0


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    context: int
    estimate: Estimate
    measured: int

    @property
    def error(self) -> float:
        return (self.estimate.device - self.measured) / self.measured


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def measure(path: Path, shape: Shape, context: int) -> Row:
    spec = SlotSpec.model_validate(
        {
            "name": "bench",
            "provider": "llama-cpp-python",
            "device": "cpu",
            "port": _port(),
            "model": {"default": "m"},
        }
    )
    model = ModelSpec(id="m", source=str(path), context_length=context)
    launch = build_launch(spec, model, BuildContext(runtime="process"))
    header = read_model(path)
    assert isinstance(header, GgufModel)
    estimate = estimate_gguf(header, launch_facts("llama-cpp-python", "cpu", launch.argv))
    proc = subprocess.Popen(list(launch.argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not _get(launch.endpoint + "/v1/models"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server of {shape.label} did not start")
            time.sleep(0.2)
        body = json.dumps({"prompt": "a" * (context - 24), "max_tokens": 1}).encode()
        request = urllib.request.Request(
            launch.endpoint + "/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as resp:
            resp.read()
        usage = ProcessUsage().measure(proc.pid, "cpu")
        assert usage is not None
        return Row(shape.label, context, estimate, usage.host_bytes)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _mib(n: int) -> str:
    return f"{n / MIB:8.1f}"


def part_one(rows: list[Row]) -> None:
    print("== estimate vs observed (llama-cpp-python 0.3.36 on CPU; MiB; goal ±10 %)")
    head = ("model", "ctx", "weights", "KV", "buffers", "engine", "estimate", "measured", "error")
    print(f"{head[0]:<24}{head[1]:>6}" + "".join(f"{h:>10}" for h in head[2:]))
    for r in rows:
        e = r.estimate
        print(
            f"{r.label:<24}{r.context:>6}  {_mib(e.weights)}  {_mib(e.kv)}  {_mib(e.buffers)}"
            f"  {_mib(e.engine)}  {_mib(e.device)}  {_mib(r.measured)}  {r.error * 100:+7.1f}%"
        )
    worst = max((abs(r.error) for r in rows), default=0.0)
    print(f"worst error {worst * 100:.1f} % over {len(rows)} (goal: within 10 %)")


def admit_sequence(sizes: list[int], budget: int, order: list[int]) -> tuple[list[set[int]], int]:
    """Loads in ``order`` by ``sizes``; LRU eviction until each fits: the loaded set after
    each load, and the evictions."""
    loaded: list[int] = []  # least recently used first
    after: list[set[int]] = []
    evictions = 0
    for item in order:
        if item in loaded:
            loaded.remove(item)
            loaded.append(item)
            after.append(set(loaded))
            continue
        while True:
            held = sum(sizes[i] for i in loaded)
            verdict = check_admission("cpu", sizes[item], held, None, budget, 0)
            if verdict.ok or not loaded:
                break
            loaded.pop(0)
            evictions += 1
        if verdict.ok:
            loaded.append(item)
        after.append(set(loaded))
    return after, evictions


def part_two(rows: list[Row], loads: int, seed: int) -> None:
    estimates = [r.estimate.device for r in rows]
    measured = [r.measured for r in rows]
    budget = int(sorted(measured)[-1] * 2.5)  # a few at once, never all
    rng = random.Random(seed)
    order = [rng.randrange(len(rows)) for _ in range(loads)]
    by_estimate, ev_estimate = admit_sequence(estimates, budget, order)
    _, ev_measured = admit_sequence(measured, budget, order)
    over = sum(1 for held in by_estimate if sum(measured[i] for i in held) > budget)
    print(
        f"\n== admission of {loads} random loads of {len(rows)} entries, budget "
        f"{budget / MIB:.0f} MiB (LRU eviction)"
    )
    print(f"{'admitted by':<14}{'evictions':>10}{'over budget by measured':>26}")
    print(f"{'estimates':<14}{ev_estimate:>10}{over:>26}")
    print(f"{'measured':<14}{ev_measured:>10}{0:>26}")
    print("goal: no load admitted by the estimates that the measured figures say does not fit")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", type=int, default=len(PANEL), help="panel entries, smallest first"
    )
    parser.add_argument("--contexts", default="512,1536")
    parser.add_argument("--loads", type=int, default=200)
    parser.add_argument("--seed", type=int, default=36)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="slotctl-footprint-") as tmp:
        for shape in PANEL[: args.shapes]:
            path = write_llama(Path(tmp) / f"{shape.name}.gguf", shape)
            for context in contexts:
                rows.append(measure(path, shape, context))
    part_one(rows)
    part_two(rows, args.loads, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
