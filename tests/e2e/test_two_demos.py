"""Two demos on one box (issue 24): examples/quickstart leaves its ports to the controller,
so two ``slotctl up examples/quickstart`` side by side (their own state dirs and API
addresses) both converge with six distinct ports; each keeps its ports across a restart,
and ``stack diff`` says in sync (a chosen port is no drift).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, Slotctl
from tests.integration.test_api import Api, start_api

QUICKSTART = REPO / "examples" / "quickstart"


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Slotctl, Slotctl]]:
    pair = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        pair.append(Slotctl(tmp_path / name))
    try:
        yield pair[0], pair[1]
    finally:
        leftovers = [problem for ctl in pair for problem in ctl.close()]
    assert not leftovers, f"left running after `slotctl down`: {leftovers}"


def ports(api: Api) -> dict[str, int]:
    slots = api.ok("GET", "/api/slots")["slots"]
    return {s["name"]: int(s["endpoint"].rsplit(":", 1)[1]) for s in slots if s["endpoint"]}


def ask(api: Api, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    reply = api.call("POST", "/v1/chat/completions", body, timeout=60)
    assert reply.status == 200, reply


def test_two_quickstarts_side_by_side(two: tuple[Slotctl, Slotctl]) -> None:
    apis = [start_api(ctl, str(QUICKSTART)) for ctl in two]
    for api in apis:
        api.wait_state("chat", "ready", timeout=60)
        api.wait_state("embed", "ready", timeout=60)
        ask(api, "demo-chat")
        ask(api, "demo-coder")  # loads the on-demand slot too
    seen = [ports(api) for api in apis]
    assert all(set(p) == {"chat", "coder", "embed"} for p in seen), seen
    every = [port for p in seen for port in p.values()]
    assert len(set(every)) == 6, seen
    for ctl in two:
        result = ctl.run("stack", "diff", QUICKSTART, "--exit-code")
        assert result.returncode == 0 and "in sync" in result.stdout, ctl.explain(result)

    # a restart: the same ports again
    first = two[0]
    first.ok("down")
    again = start_api(first, str(QUICKSTART))
    again.wait_state("chat", "ready", timeout=60)
    assert ports(again)["chat"] == seen[0]["chat"]
    assert ports(again)["embed"] == seen[0]["embed"]
    ask(again, "demo-coder")
    assert ports(again)["coder"] == seen[0]["coder"]
