"""bench/adapters.py at its smallest size: it runs, switching between resident adapters
loads nothing, and no soak request is answered by the wrong adapter (the figures are the
bench's to print, never asserted here)."""

from __future__ import annotations

from bench.adapters import parser, report, run


async def test_the_adapter_bench_runs_at_its_smallest_size(capsys: object) -> None:
    args = parser().parse_args(["--requests", "5", "--soak", "40", "--concurrency", "4"])
    fig = await run(args)
    report(fig, args)
    assert fig.switch_loads == 0
    assert fig.soak == 40 and fig.wrong == 0 and fig.other == 0
    assert fig.answered + fig.refused == 40 and fig.answered > 0
