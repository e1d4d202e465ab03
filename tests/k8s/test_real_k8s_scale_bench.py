"""``bench/k8s_scale.py`` at its smallest size (issue 40, item 15: every bench runs), on the
real control plane it needs: one kwok node, one GPU, one Slot. The other benches run in
``tests/integration/test_bench_smoke.py``; this one sits with the real tiers, which the
Makefile runs after their binary is built (``tests/k8s/test_real_*``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_bench_smoke import WALL_S, run_bench
from tests.k8s import realapi, realcluster


@pytest.mark.timeout(WALL_S + 30)
def test_the_k8s_scale_bench_runs_at_its_smallest_size(tmp_path: Path) -> None:
    if realcluster.binaries() is None:
        message = f"the control plane and kwok are not built in {realapi.cache_dir()}"
        if realapi.requested():
            pytest.fail(f"SLOTCTL_K8S_APISERVER=1 but {message} (run tools/k8s/build.sh)")
        pytest.skip(f"{message}: run tools/k8s/build.sh or set SLOTCTL_K8S_APISERVER=1")
    run_bench("k8s_scale", tmp_path)
