"""``/api/traffic``'s samples (issue 24): what the router's cumulative counters gained per
interval, per slot — requests, 5xx, mean latency and quantiles from the histogram buckets'
difference — with nothing added to the request path."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.api.app import ApiContext
from controller.api.metrics import REQUEST_BUCKETS, metrics_of
from controller.api.traffic import SAMPLES, Traffic, quantile
from controller.kit.eventbus import EventBus


def test_quantile_interpolates_inside_the_bucket_as_histogram_quantile() -> None:
    counts = [0.0] * (len(REQUEST_BUCKETS) + 1)
    assert quantile(0.5, counts) is None
    i = REQUEST_BUCKETS.index(0.1)  # the (0.05, 0.1] bucket
    counts[i] = 10
    assert quantile(0.5, counts) == pytest.approx(0.075)
    assert quantile(1.0, counts) == pytest.approx(0.1)
    counts[-1] = 90  # beyond the last bound: the largest finite one
    assert quantile(0.95, counts) == REQUEST_BUCKETS[-1]


def test_a_sample_is_what_the_counters_gained_since_the_last(tmp_path: Path) -> None:
    ctx = ApiContext(None, None, tmp_path, tmp_path, "t", EventBus())
    metrics = metrics_of(ctx)
    traffic = Traffic(ctx)
    traffic.sample(100.0)  # the baseline: nothing yet
    for seconds in (0.02, 0.02, 0.04):
        metrics.request_done("chat", "m", 200, seconds)
    metrics.request_done("chat", "m", 502, 0.3)
    metrics.request_done("", "m", 404, 0.001)  # refused before a slot was chosen
    traffic.sample(102.0)
    traffic.sample(104.0)  # quiet
    (chat,) = traffic.snapshot()["slots"]
    series = chat["series"]
    assert chat["slot"] == "chat" and chat["requests_total"] == 4
    assert series["t"] == [102.0, 104.0]
    assert series["requests"] == [4, 0] and series["errors"] == [1, 0]
    assert series["mean_s"][0] == pytest.approx(0.095) and series["mean_s"][1] is None
    assert 0.01 < series["p50_s"][0] <= 0.025 and series["p95_s"][0] > 0.25
    assert series["p50_s"][1] is None
    for _ in range(SAMPLES + 5):
        traffic.sample(200.0)
    assert len(traffic.snapshot()["slots"][0]["series"]["t"]) == SAMPLES  # a ring
