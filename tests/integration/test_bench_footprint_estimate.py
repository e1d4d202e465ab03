"""``bench/footprint_estimate.py`` runs once at its smallest size (one panel model, one
context, a short load sequence): the bench keeps working; its figures are not asserted."""

from __future__ import annotations

import pytest

from bench.footprint_estimate import main
from tests.integration.llama_fixtures import require_llama_server


def test_the_footprint_bench_runs_at_its_smallest(capsys: pytest.CaptureFixture[str]) -> None:
    require_llama_server()
    assert main(["--shapes", "1", "--contexts", "512", "--loads", "10"]) == 0
    out = capsys.readouterr().out
    assert "estimate vs observed" in out and "admission of 10 random loads" in out
