"""A catalogue model's owner stacks (issue 40, item 9): ``models.toml`` stores the stack
that declared each ``[[model]]`` (``stack``), so a model a stack drops is known as its
own, even one no slot or alias used. Real files in a temporary config dir, written through
the guard (:func:`~controller.reconcile.apply.apply_to_config`)."""

from __future__ import annotations

from pathlib import Path

from controller.reconcile.apply import apply_to_config, changed_models, unused_models
from controller.spec.configdir import read_config_dir
from controller.spec.guard import write_catalogue
from controller.spec.loader import DesiredState, load_stack_texts
from controller.spec.schema import ModelSpec


def model(model_id: str) -> str:
    return f'[[model]]\nid = "{model_id}"\nsource = "demo://{model_id}"\nmemory_gb = 0.05\n'


def stack(name: str, *models: str) -> DesiredState:
    text = f'[stack]\nname = "{name}"\n' + "".join(model(m) for m in models)
    report = load_stack_texts([(f"{name}.toml", text)])
    assert report.state is not None, report.errors
    return report.state


def test_each_model_is_stored_with_the_stack_that_declared_it(tmp_path: Path) -> None:
    assert apply_to_config(stack("a", "m1", "m2"), tmp_path, prune=False) == ["models"]
    assert 'stack = "a"' in (tmp_path / "models.toml").read_text()
    snap = read_config_dir(tmp_path)
    assert snap.errors == [] and set(snap.models) == {"m1", "m2"}
    assert snap.model_owners == {"m1": ("a",), "m2": ("a",)}
    assert apply_to_config(stack("a", "m1", "m2"), tmp_path, prune=False) == []


def test_a_model_declared_alone_then_dropped_is_left_behind_then_pruned(tmp_path: Path) -> None:
    apply_to_config(stack("a", "m1", "solo"), tmp_path, prune=False)
    dropped = stack("a", "m1")
    snap = read_config_dir(tmp_path)
    assert unused_models(dropped, snap, set()) == ["solo"]
    assert apply_to_config(dropped, tmp_path, prune=False) == []  # kept, with its owner
    snap = read_config_dir(tmp_path)
    assert "solo" in snap.models and snap.model_owners["solo"] == ("a",)
    assert apply_to_config(dropped, tmp_path, prune=True) == ["models"]
    assert set(read_config_dir(tmp_path).models) == {"m1"}


def test_a_model_two_stacks_declare_stays_until_neither_does(tmp_path: Path) -> None:
    apply_to_config(stack("a", "shared", "a1"), tmp_path, prune=False)
    apply_to_config(stack("b", "shared"), tmp_path, prune=False)
    assert 'stack = ["a", "b"]' in (tmp_path / "models.toml").read_text()
    assert read_config_dir(tmp_path).model_owners["shared"] == ("a", "b")

    a_only = stack("a", "a1")  # a drops it: b still declares it
    assert unused_models(a_only, read_config_dir(tmp_path), set()) == []
    assert apply_to_config(a_only, tmp_path, prune=True) == ["models"]  # a's claim goes
    snap = read_config_dir(tmp_path)
    assert "shared" in snap.models and snap.model_owners["shared"] == ("b",)

    b_none = stack("b")
    assert unused_models(b_none, snap, set()) == ["shared"]
    apply_to_config(b_none, tmp_path, prune=True)
    assert set(read_config_dir(tmp_path).models) == {"a1"}


def test_a_catalogue_without_owners_loads_and_its_models_are_never_pruned(
    tmp_path: Path,
) -> None:
    (tmp_path / "models.toml").write_text(model("old") + model("m1"))  # before owners
    snap = read_config_dir(tmp_path)
    assert snap.errors == [] and set(snap.models) == {"old", "m1"} and snap.model_owners == {}
    state = stack("a", "m1")
    assert apply_to_config(state, tmp_path, prune=True) == ["models"]  # m1 gets its owner
    snap = read_config_dir(tmp_path)
    assert set(snap.models) == {"old", "m1"} and snap.model_owners == {"m1": ("a",)}
    assert unused_models(state, snap, set()) == []  # "old" is nobody's: kept


def test_a_stack_file_may_not_name_a_models_owner() -> None:
    text = '[stack]\nname = "a"\n' + model("m1") + 'stack = "b"\n'
    report = load_stack_texts([("a.toml", text)])
    assert not report.ok
    assert any(p.key is not None and p.key.endswith("stack") for p in report.errors), report.errors


def test_a_catalogue_write_without_owners_keeps_the_stored_ones(tmp_path: Path) -> None:
    apply_to_config(stack("a", "m1"), tmp_path, prune=False)
    spec = ModelSpec.model_validate({"id": "m2", "source": "demo://m2", "memory_gb": 0.05})
    write_catalogue(tmp_path, [*read_config_dir(tmp_path).models.values(), spec])
    assert read_config_dir(tmp_path).model_owners == {"m1": ("a",)}


def test_an_unowned_models_first_owner_is_not_drift(tmp_path: Path) -> None:
    """A catalogue written before owners: the stack declaring its models unchanged is in
    sync (``stack diff --exit-code`` stays clean after an upgrade); the next apply writes
    the owner; an owner change after that is a change."""
    write_catalogue(tmp_path, [ModelSpec(id="m1", source="demo://m1", memory_gb=0.05)])
    snap = read_config_dir(tmp_path)
    assert snap.model_owners == {}
    assert changed_models(stack("a", "m1"), snap) == []
    assert apply_to_config(stack("a", "m1"), tmp_path, prune=False) == ["models"]
    snap = read_config_dir(tmp_path)
    assert snap.model_owners == {"m1": ("a",)}
    assert changed_models(stack("a", "m1"), snap) == []
    assert changed_models(stack("b", "m1"), snap) == ["m1"]  # b claims it too
