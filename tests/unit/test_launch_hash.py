"""One launch hash (issue 27, item 4): ``stack diff``/``apply`` (controller.reconcile.apply) and the
manager the reconciler drives hash a slot alike, on every runtime and with a configured
models dir.

Before, ``plan_stack`` hashed every runtime but process and docker as ``process`` and
never with the manager's models dir: a running kubernetes slot, or one whose model
resolves into a configured models dir, was "recreate" in ``stack diff`` while the
reconciler saw it in sync.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.providers.launch import launch_context, launch_hash
from controller.reconcile.apply import apply_to_config, plan_stack
from controller.runtime.base import RuntimeKind
from controller.slots.records import ManagerConfig
from controller.spec.loader import DesiredSlot, DesiredState
from controller.spec.schema import ModelSpec
from tests.unit.manager_fixtures import Harness, slot_spec

MODEL = ModelSpec(id="m", source="hf://org/repo/m.gguf", memory_gb=1.0)


def state_of(name: str) -> DesiredState:
    spec = slot_spec(
        name, "m", provider="llamacpp", autoload=False, server={"image": "llama:server"}
    )
    return DesiredState(
        stacks=("t",), models={"m": MODEL}, slots={name: DesiredSlot(spec=spec, stack="t")}
    )


@pytest.mark.parametrize("kind", list(RuntimeKind))
@pytest.mark.parametrize("configured", [False, True], ids=["default-dir", "configured-dir"])
async def test_stack_diff_hashes_a_running_slot_as_the_manager_does(
    tmp_path: Path, kind: RuntimeKind, configured: bool
) -> None:
    models_dir = tmp_path / "models" if configured else None
    h = Harness(tmp_path, config=ManagerConfig(stop_timeout_s=1.0, models_dir=models_dir))
    h.runtime.kind = kind  # the fake runtime, standing for each kind
    state = state_of("s")
    apply_to_config(state, tmp_path / "config", prune=False)
    await h.manager.set_desired(state)
    record = h.manager.core.table.records["s"]
    launch = h.manager.core.build_launch(record)
    await h.runtime.start(launch)  # running with the manager's own launch
    assert h.manager.launch_hash(state.slots["s"]) == launch.config_hash()

    plan = await plan_stack(
        state,
        tmp_path / "config",
        tmp_path / "state",
        h.runtime,
        prune=False,
        models_dir=h.manager.models_dir,
    )
    assert [a.kind for a in plan.actions if a.slot == "s"] != ["recreate"], plan.actions
    assert not plan.drift["s"] or "config" not in " ".join(plan.drift["s"]), plan.drift


def test_the_runtimes_hash_differently_and_the_fake_one_as_process(tmp_path: Path) -> None:
    """The hash names what runs: the kinds are not all one (so the test above can fail),
    and a configured models dir is in it."""
    spec = state_of("s").slots["s"].spec
    hashes = {k: launch_hash(spec, MODEL, launch_context(k, "t", tmp_path)) for k in RuntimeKind}
    assert hashes[RuntimeKind.FAKE] == hashes[RuntimeKind.PROCESS]
    assert len({hashes[k] for k in RuntimeKind if k is not RuntimeKind.FAKE}) == 3
    other = launch_hash(spec, MODEL, launch_context(RuntimeKind.PROCESS, "t", tmp_path / "x"))
    assert other != hashes[RuntimeKind.PROCESS]
