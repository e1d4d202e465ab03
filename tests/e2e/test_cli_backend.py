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


@pytest.mark.parametrize("kind", ["local", "api"])
def test_what_an_apply_without_prune_leaves_behind_is_said(kind: str, ctl: Slotctl) -> None:
    """Issue 40, item 9: ``stack apply`` without ``--prune`` said "(no changes)" while
    ``stack diff`` showed the removed slot as a deletion, and a model removed from a stack
    stayed in the catalogue with ``stack diff`` "in sync". The apply names what it leaves
    behind; the diff reports the model; ``--prune`` removes both."""
    ctl.start_up()
    both = [SlotDef("k1", autoload=False), SlotDef("k2", autoload=False)]
    with backend_of(kind, ctl) as backend:
        backend.apply(request_for(ctl, both), prune=False, force=False, dry_run=False)
        one = request_for(ctl, both[:1])  # k2 and its model m-k2 gone from the file

        kept = backend.apply(one, prune=False, force=False, dry_run=False)
        assert kept.changed == [] and kept.left_behind == ["slot k2"]
        assert (ctl.config / "slots" / "k2.toml").exists()

        diff = backend.diff(one, prune=True).plan
        assert not diff.in_sync and "k2" in diff.config_diffs
        assert diff.models_unused == ["m-k2"]  # used by nothing once k2 is pruned

        pruned = backend.apply(one, prune=True, force=False, dry_run=False)
        assert pruned.changed == ["models", "k2"] and pruned.left_behind == []
        models = (ctl.config / "models.toml").read_text()
        assert "m-k2" not in models and "m-k1" in models
        assert backend.diff(one, prune=True).plan.in_sync

        # k1 bound to another model: its old one is the stack's no more, and said so
        path = ctl.tmp / "stacks" / "flow.toml"
        path.write_text(path.read_text().replace('"m-k1"', '"m-k1b"'))
        moved = StackRequest.from_report(load_stacks([path]))
        left = backend.apply(moved, prune=False, force=False, dry_run=True)
        assert left.left_behind == ["model m-k1"]
        assert backend.diff(moved, prune=True).plan.models_unused == ["m-k1"]
        done = backend.apply(moved, prune=True, force=False, dry_run=False)
        assert done.changed == ["models", "k1"] and done.left_behind == []
        assert '"m-k1"' not in (ctl.config / "models.toml").read_text()
        assert backend.diff(moved, prune=True).plan.in_sync


SOLO = '\n[[model]]\nid = "m-solo"\nsource = "demo://solo"\nmemory_gb = 0.05\n'


@pytest.mark.parametrize("kind", ["local", "api"])
def test_a_model_declared_alone_is_left_behind_then_pruned(kind: str, ctl: Slotctl) -> None:
    """Issue 40, item 9, the last gap: a model a stack declares alone (no slot or alias of
    it uses it) and then drops was kept silently, with ``stack diff`` "in sync" (the
    catalogue had no owner). The catalogue now stores the declaring stack: the apply says
    the model is left behind, the diff reports it, ``--prune`` removes it."""
    ctl.start_up()
    path = ctl.tmp / "stacks" / "flow.toml"
    k1 = [SlotDef("k1", autoload=False)]
    request_for(ctl, k1)
    path.write_text(path.read_text() + SOLO)
    catalogue = ctl.config / "models.toml"
    with backend_of(kind, ctl) as backend:
        first = StackRequest.from_report(load_stacks([path]))
        assert backend.apply(first, prune=False, force=False, dry_run=False).changed == [
            "models",
            "k1",
        ]
        assert "m-solo" in catalogue.read_text()
        assert backend.diff(first, prune=True).plan.in_sync

        alone = request_for(ctl, k1)  # m-solo gone from the file
        dry = backend.apply(alone, prune=False, force=False, dry_run=True)
        assert dry.left_behind == ["model m-solo"]
        kept = backend.apply(alone, prune=False, force=False, dry_run=False)
        assert kept.changed == [] and kept.left_behind == ["model m-solo"]
        assert "m-solo" in catalogue.read_text()

        for prune in (False, True):
            diff = backend.diff(alone, prune=prune).plan
            assert not diff.in_sync and diff.models_unused == ["m-solo"]

        pruned = backend.apply(alone, prune=True, force=False, dry_run=False)
        assert pruned.changed == ["models"] and pruned.left_behind == []
        text = catalogue.read_text()
        assert "m-solo" not in text and "m-k1" in text
        assert backend.diff(alone, prune=True).plan.in_sync


def test_apply_and_diff_say_what_is_left_behind(ctl: Slotctl) -> None:
    """The same, as printed (no controller: the files)."""
    path = ctl.tmp / "stacks" / "flow.toml"
    request_for(ctl, [SlotDef("k1", autoload=False), SlotDef("k2", autoload=False)])
    ctl.ok("stack", "apply", path)
    request_for(ctl, [SlotDef("k1", autoload=False)])
    out = ctl.ok("stack", "apply", path)
    assert "left behind: slot k2 — the stack no longer declares it" in out, out
    assert "`stack apply --prune` removes it" in out, out
    diff = ctl.run("stack", "diff", path, "--exit-code")
    assert diff.returncode == 1, diff
    assert "=== slot k2: delete" in diff.stdout and "m-k2" in diff.stdout, diff.stdout
    assert "used by no slot or alias: m-k2" in diff.stdout, diff.stdout
    ctl.ok("stack", "apply", path, "--prune")
    assert ctl.run("stack", "diff", path, "--exit-code").returncode == 0


def test_apply_and_diff_say_a_model_declared_alone_is_left_behind(ctl: Slotctl) -> None:
    """The declared-alone model, as printed (no controller: the files)."""
    path = ctl.tmp / "stacks" / "flow.toml"
    request_for(ctl, [SlotDef("k1", autoload=False)])
    path.write_text(path.read_text() + SOLO)
    ctl.ok("stack", "apply", path)
    request_for(ctl, [SlotDef("k1", autoload=False)])
    out = ctl.ok("stack", "apply", path)
    assert "left behind: model m-solo" in out, out
    diff = ctl.run("stack", "diff", path, "--exit-code")
    assert diff.returncode == 1, diff
    assert "used by no slot or alias: m-solo" in diff.stdout, diff.stdout
    ctl.ok("stack", "apply", path, "--prune")
    assert "m-solo" not in (ctl.config / "models.toml").read_text()
    assert ctl.run("stack", "diff", path, "--exit-code").returncode == 0
