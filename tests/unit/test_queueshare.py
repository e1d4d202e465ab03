"""Each flow's share of a slot's line (issue 40, item 3): the pure admission rule of
:mod:`controller.scheduling.queueshare`. The line itself is tested against real demo
servers in tests/integration/test_keys.py (test_one_keys_flood_cannot_take_...)."""

from __future__ import annotations

from collections import Counter

from controller.scheduling.queueshare import Place, place_for


def test_room_admits_everyone() -> None:
    assert place_for({}, "a", 2) == Place(True)
    assert place_for({"a": 1}, "a", 2) == Place(True)


def test_a_full_line_takes_the_largest_flows_newest_place_for_a_smaller_flow() -> None:
    assert place_for({"flood": 64}, "ui", 64) == Place(True, "flood")
    assert place_for({"flood": 63, "ui": 1}, "ui", 64) == Place(True, "flood")
    assert place_for({"flood": 64}, "flood", 64) == Place(False)  # its own newest: refused


def test_equal_flows_never_push_each_other_out() -> None:
    assert place_for({"a": 2, "b": 2}, "b", 4) == Place(False)
    assert place_for({"a": 3, "b": 2}, "b", 5) == Place(False)  # 3 vs 2+1: no churn
    assert place_for({"a": 4, "b": 2}, "b", 6) == Place(True, "a")


def test_ties_among_the_largest_are_stable_and_an_empty_line_of_no_room_refuses() -> None:
    assert place_for({"b": 3, "a": 3}, "c", 6) == Place(True, "a")
    assert place_for({}, "a", 0) == Place(False)


def test_a_flood_ends_with_every_flow_holding_its_share() -> None:
    """Three keys flood a line of 64 in turn, 200 requests each, after one key filled it:
    each ends holding its share (64 / 3, give or take one), and a fourth key's first
    request still gets in."""
    line: list[str] = []
    for flow in ["flood"] * 200 + ["b", "c"] * 200:
        decided = place_for(Counter(line), flow, 64)
        if decided.admitted:
            if decided.evict is not None:
                newest = len(line) - 1 - line[::-1].index(decided.evict)
                del line[newest]
            line.append(flow)
    held = Counter(line)
    assert len(line) == 64 and max(held.values()) - min(held.values()) <= 1, held
    assert place_for(held, "first-timer", 64).admitted


async def test_the_bench_runs_at_its_smallest_size() -> None:
    """bench/queue_share.py, once, small: the shares let every other key in, the line
    without them none (the figures are the bench's, not asserted beyond that)."""
    from bench.queue_share import main

    figures = await main(flood=12, others=2, max_queue=4, service_ms=0.5)
    assert figures["each key its share"]["others_in"] == 2
    assert figures["no shares (baseline)"]["others_in"] == 0
