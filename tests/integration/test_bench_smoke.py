"""Every benchmark runs (issue 40, item 15): each ``bench/*.py`` once, at its smallest size.

A bench is only run by hand, so one can rot unseen: ``bench/manager.py`` crashed with
``EvictionCandidate.__init__() got an unexpected keyword argument 'device'`` for as long as
nobody ran it. Here each one runs as its own process with the arguments of
:data:`SMALLEST` (a few requests, one size, fractions of a second of load) and must exit 0
having printed something; the figures are not looked at (performance is never asserted in
tests). A bench added to ``bench/`` without its entry here fails
:func:`test_every_bench_has_its_smallest_size`, so none is left out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.children import CHILD

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

# Each bench's smallest run: its size flags at their least.
SMALLEST: dict[str, tuple[str, ...]] = {
    "admit_walk": (),
    "aliases": ("--requests", "4", "--cold", "1", "--load-seconds", "0.05"),
    "apply_scale": ("--sizes", "5", "--old-max", "5", "--gitops", "5", "--auto-ports"),
    "cli_startup": ("--runs", "1"),
    "demo_start": ("--runs", "1"),
    "fairness": ("--seconds", "0.5", "--service-ms", "5"),
    "footprint": ("--sizes", "1", "--settle", "0"),
    "footprint_estimate": ("--shapes", "1", "--contexts", "512", "--loads", "5"),
    "k8s_operator": ("--edits", "1"),
    "k8s_runtime": ("--edits", "1"),
    "k8s_source": ("--slots", "2", "--edits", "1"),
    "manager": (
        *("--pairs", "50", "--writing-pairs", "50", "--acquirers", "3"),
        *("--load-seconds", "0.01", "--candidates", "10", "--repeats", "2"),
    ),
    "placement": ("--mixes", "2"),
    "pull": ("--mib", "1", "--runs", "1"),
    "queue_share": ("--flood", "8", "--others", "2", "--max-queue", "4", "--service-ms", "1"),
    "replicas": ("--scale", "0.02"),
    "reconcile": (
        *("--sizes", "10", "--saves", "1", "--slots", "2", "--load-seconds", "0.05"),
        "--no-sequential",
    ),
    "rollout": ("--rate", "5", "--load-seconds", "0.1", "--steady", "0.3"),
    "router": ("--scale", "0.01"),
    "router_walk": ("--clients", "1", "--requests", "50", "--rounds", "1"),
    "swap": ("--swaps", "1", "--load-seconds", "0.05", "--wake-seconds", "0.01"),
    "thrash": ("--seconds", "0.5"),
    "time_to_ready": ("--servers", "1", "--load-seconds", "0.1"),
}

# Run by a test of their own: with the real Kubernetes tiers, its floor beside it
# (tests/k8s/test_real_scale_bench.py); the adapters' soak checking its answers
# (tests/integration/test_bench_adapters.py).
ELSEWHERE = frozenset({"adapters", "k8s_scale"})

WALL_S = 180  # one bench at its smallest, on a loaded 2-core machine


def benches() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


def test_every_bench_has_its_smallest_size() -> None:
    assert benches() == sorted(set(SMALLEST) | ELSEWHERE), (
        "a bench without its smallest size here (or its test elsewhere), or gone"
    )


def run_bench(name: str, cwd: Path) -> None:
    """``bench/NAME.py`` at its smallest: exit 0, having printed its figures."""
    result = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *SMALLEST[name]],
        capture_output=True,
        text=True,
        timeout=WALL_S,
        cwd=cwd,
        check=False,
        **CHILD,
    )
    said = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, said
    assert result.stdout.strip(), said


@pytest.mark.timeout(WALL_S + 30)
@pytest.mark.parametrize("name", sorted(set(SMALLEST) - ELSEWHERE))
def test_the_bench_runs_at_its_smallest_size(name: str, tmp_path: Path) -> None:
    run_bench(name, tmp_path)
