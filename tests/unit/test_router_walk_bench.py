"""``bench/router_walk.py`` at its smallest size, caches warm and cold: the walk serves
every request it sends (it raises when one is left in flight), and ``--count`` traces it.
No timing is asserted."""

from __future__ import annotations

import asyncio

from bench.router_walk import count, measure


def test_the_router_walk_runs_warm_and_cold() -> None:
    figures = asyncio.run(measure([1, 3], requests=12, rounds=1, cold_mib=0.25))
    assert sorted(figures) == [1, 3]


def test_the_router_walk_counts_functions_calls_and_bytecodes() -> None:
    figures = asyncio.run(count([1, 2], rounds=1))
    assert sorted(figures) == [1, 2]
    for functions, calls, bytecodes in figures.values():
        assert 0 < functions <= calls < bytecodes
