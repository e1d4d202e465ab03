"""``bench/replicas.py`` runs once at its smallest size (its figures are printed, never
judged here: performance is the benchmark's to report)."""

from __future__ import annotations

import pytest

from bench.replicas import main_async


async def test_the_replicas_bench_runs_at_its_smallest_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    await main_async(0.25)
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[2:7]]
    assert rows == ["ideal", "prefix", "round-robin", "least-loaded", "prefix"], out
    assert "goals: prefix hit ratio" in out
