"""The stack backend protocol (``cli.backend``): one apply/diff/wait flow, both backends.

The same flow runs against :class:`~controller.cli.backend_local.LocalBackend` (the config
and state dirs, the process runtime) and :class:`~controller.cli.backend_api.ApiBackend`
(a real ``slotctl up --listen 127.0.0.1:0``, found through its ``controller.json``), each
on a running controller with demo servers: diff before, a dry run that writes nothing,
the apply, ``wait`` until converged (its progress lines), the slots observed, in sync
after. Then what differs by design: the local backend without a controller never
converges (the wait reports the stuck slots), and the API refuses an invalid stack with
its located problems (``StackRejected``: exit 1, like an invalid stack checked here).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from controller.cli.backend import StackBackend, StackRejected, StackRequest
from controller.cli.backend_api import ApiBackend
from controller.cli.backend_local import LocalBackend
from controller.cli.client import reachable_api
from controller.cli.declarative import wait
from controller.spec.loader import load_stacks
from tests.e2e.conftest import Slotctl, SlotDef, stack_text


@pytest.fixture(autouse=True)
def _no_server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLOTCTL_SERVER", "SLOTCTL_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def request_for(ctl: Slotctl, slots: list[SlotDef]) -> StackRequest:
    path = ctl.tmp / "stacks" / "flow.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stack_text("flow", slots))
    report = load_stacks([path])
    assert report.ok, report.errors
    return StackRequest.from_report(report)


@contextmanager
def backend_of(kind: str, ctl: Slotctl) -> Iterator[StackBackend]:
    backend: StackBackend
    if kind == "api":
        api = reachable_api(ctl.state, None, None, timeout=60.0)
        assert api is not None, "the controller's API does not answer"
        backend = ApiBackend(api)
    else:
        backend = LocalBackend(ctl.config, ctl.state, "process")
    with backend:
        yield backend


@pytest.mark.parametrize("kind", ["local", "api"])
def test_apply_diff_wait_flow(kind: str, ctl: Slotctl, capsys: pytest.CaptureFixture[str]) -> None:
    ctl.start_up()
    request = request_for(ctl, [SlotDef("f1"), SlotDef("f2", autoload=False)])
    with backend_of(kind, ctl) as backend:
        assert backend.remote is (kind == "api")

        diff = backend.diff(request, prune=True)
        assert not diff.plan.in_sync
        assert {a.slot: a.kind for a in diff.plan.actions} == {"f1": "create", "f2": "create"}
        assert {op["op"] for op in diff.json_patch} == {"add"}
        assert {op["path"] for op in diff.json_patch} == {"/slots/f1", "/slots/f2"}
        assert set(diff.plan.config_diffs) == {"f1", "f2"}

        dry = backend.apply(request, prune=False, force=False, dry_run=True)
        assert dry.changed == []
        assert {a.slot: a.kind for a in dry.actions} == {"f1": "create", "f2": "create"}
        assert not (ctl.config / "slots" / "f1.toml").exists()

        applied = backend.apply(request, prune=False, force=False, dry_run=False)
        assert applied.changed == ["models", "f1", "f2"]
        assert (ctl.config / "slots" / "f1.toml").exists()

        capsys.readouterr()
        assert wait(backend, request, prune=False, timeout=60.0), ctl.controller_log()
        lines = capsys.readouterr().out.splitlines()
        assert lines[-1].startswith("converged in "), lines
        f1 = [line for line in lines if " f1 " in line]
        assert f1 and f1[-1].split()[1:3] == ["transition", "f1"], lines
        assert "-> ready" in f1[-1] and f1[0].split()[1:3] == ["state", "f1"], lines
        assert not any("- -> " in line for line in lines), lines  # no fake transition

        observed = backend.observe(["f1", "f2", "nobody"])
        # A slot never started has no state.json: only the controller knows it is offline.
        assert {n: s.state for n, s in observed.items()} == {
            "f1": "ready",
            "f2": "offline" if kind == "api" else "pending",
            "nobody": "pending",
        }
        after = backend.diff(request, prune=True)
        assert after.plan.in_sync and after.json_patch == []
        again = backend.apply(request, prune=False, force=False, dry_run=False)
        assert again.changed == [] and {a.kind for a in again.actions} == {"noop"}


def test_the_local_backend_without_a_controller_reports_the_stuck_slots(
    ctl: Slotctl, capsys: pytest.CaptureFixture[str]
) -> None:
    request = request_for(ctl, [SlotDef("s1")])
    with backend_of("local", ctl) as backend:
        assert backend.apply(request, prune=False, force=False, dry_run=False).changed == [
            "models",
            "s1",
        ]
        assert not wait(backend, request, prune=False, timeout=0.5)
    captured = capsys.readouterr()
    assert "pending" in captured.out and "converged" not in captured.out
    assert "not converged; stuck slots:" in captured.err and "  s1: " in captured.err


def test_the_api_refuses_an_invalid_stack_with_its_problems(ctl: Slotctl) -> None:
    ctl.start_up()
    valid = request_for(ctl, [SlotDef("v1")])
    broken = StackRequest(
        state=valid.state,
        files=(("broken.toml", '[[slot]]\nname = "v1"\n'),),  # no provider
    )
    with backend_of("api", ctl) as backend, pytest.raises(StackRejected) as refused:
        backend.apply(broken, prune=False, force=False, dry_run=False)
    assert refused.value.located, "the controller's located problems"
    assert all(p.file == "broken.toml" for p in refused.value.located)
    assert not (ctl.config / "slots" / "v1.toml").exists()
