"""TOML <-> CR conversion: ``stack export --format crd`` and ``stack import`` round-trip
without changing the desired state, through the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.operator.convert import (
    object_name,
    parse_documents,
    resources_from_state,
    stacks_from_resources,
)
from controller.spec.loader import DesiredState, load_stack_texts, load_stacks
from tests.k8s.crdcheck import admission_errors
from tests.k8s.test_crd import CRDS

REPO = Path(__file__).resolve().parents[2]


def slotctl(
    *args: str, cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controller", *args],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        input=stdin,
        timeout=60,
        check=False,
    )


def _same(a: DesiredState, b: DesiredState) -> None:
    assert dict(a.models) == dict(b.models)
    assert {n: (s.spec, s.stack) for n, s in a.slots.items()} == {
        n: (s.spec, s.stack) for n, s in b.slots.items()
    }
    assert {i: (e.spec, e.stack) for i, e in a.aliases.items()} == {
        i: (e.spec, e.stack) for i, e in b.aliases.items()
    }


@pytest.mark.parametrize("stack", ["examples/quickstart", "stacks"])
def test_round_trip_toml_to_cr_to_toml_changes_nothing(stack: str, tmp_path: Path) -> None:
    before = load_stacks([REPO / stack])
    assert before.ok and before.state is not None
    exported = slotctl(
        "--config-dir",
        str(tmp_path / "cfg"),
        "stack",
        "export",
        "--format",
        "crd",
        "--from",
        str(REPO / stack),
        "--namespace",
        "demo",
    )
    assert exported.returncode == 0, exported.stderr
    objects = parse_documents(exported.stdout)
    assert all(o["metadata"]["namespace"] == "demo" for o in objects)
    for obj in objects:  # what kubectl apply would accept
        assert admission_errors(CRDS[obj["kind"]], obj) == []
    manifest = tmp_path / "stack.yaml"
    manifest.write_text(exported.stdout)
    imported = slotctl("stack", "import", str(manifest), "--output-dir", str(tmp_path / "out"))
    assert imported.returncode == 0, imported.stderr
    after = load_stacks([tmp_path / "out"])
    assert after.ok and after.state is not None, after.errors
    _same(before.state, after.state)
    assert set(after.state.stacks) == set(before.state.stacks)
    if stack == "examples/quickstart":  # its [[alias]] went through an Alias and back
        assert "Alias" in {o["kind"] for o in objects} and after.state.aliases


def _state_of(objects: list[dict[str, Any]]) -> DesiredState:
    result = stacks_from_resources(objects, "k8s")
    assert not result.problems
    report = load_stack_texts(list(result.texts.items()))
    assert report.ok and report.state is not None
    return report.state


def _key(objects: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return sorted(
        (o["kind"], o["metadata"]["name"], yaml.safe_dump(o["spec"], sort_keys=True))
        for o in objects
    )


def test_round_trip_cr_to_toml_to_cr_changes_nothing() -> None:
    objects = []
    for path in sorted((REPO / "examples/k8s").glob("*.yaml")):
        objects += parse_documents(path.read_text())
    first = _state_of(objects)
    again = resources_from_state(first)
    _same(first, _state_of(again))
    # The same objects back, with only what the loader's migrations make explicit
    # (autoload, pinned) and a Model's id spelled out.
    expected = []
    for obj in objects:
        spec = dict(obj["spec"])
        if obj["kind"] in ("Model", "Alias"):
            spec.setdefault("id", obj["metadata"]["name"])
        else:
            slot_spec = first.slots[obj["metadata"]["name"]].spec
            spec.setdefault("autoload", slot_spec.autoload)
            spec.setdefault("pinned", slot_spec.pinned)
        expected.append({**obj, "spec": spec})
    assert _key(again) == _key(expected)


def test_import_refuses_what_the_loader_refuses(tmp_path: Path) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(
        "apiVersion: slotctl.io/v1alpha1\nkind: Slot\nmetadata: {name: chat}\n"
        "spec: {provider: demo, port: 8081, context_length: 4096, model: {default: nope}}\n"
    )
    result = slotctl("stack", "import", str(manifest))
    assert result.returncode == 1
    assert "slot.model_owned_key" in result.stderr
    assert result.stdout == ""


def test_import_reads_stdin_and_lists() -> None:
    text = (
        "apiVersion: v1\nkind: List\nitems:\n"
        "- apiVersion: slotctl.io/v1alpha1\n  kind: Model\n  metadata: {name: m}\n"
        "  spec: {source: 'demo://m'}\n"
        "- apiVersion: slotctl.io/v1alpha1\n  kind: Slot\n  metadata: {name: s}\n"
        "  spec: {provider: demo, port: 18090, model: {default: m}}\n"
        "- apiVersion: v1\n  kind: ConfigMap\n  metadata: {name: ignored}\n"
    )
    result = slotctl("stack", "import", "-", "--stack", "mine", stdin=text)
    assert result.returncode == 0, result.stderr
    report = load_stack_texts([("mine.toml", result.stdout)])
    assert report.ok and report.state is not None
    assert report.state.stacks == ("mine",) and list(report.state.slots) == ["s"]


def test_export_from_the_live_config_dir(tmp_path: Path) -> None:
    config = tmp_path / "config"
    applied = slotctl(
        "--config-dir",
        str(config),
        "--state-dir",
        str(tmp_path / "state"),
        "stack",
        "apply",
        str(REPO / "examples/quickstart"),
        "--dry-run",
    )
    assert applied.returncode == 0, applied.stderr
    applied = slotctl(
        "--config-dir",
        str(config),
        "--state-dir",
        str(tmp_path / "state"),
        "stack",
        "apply",
        str(REPO / "examples/quickstart"),
    )
    assert applied.returncode == 0, applied.stderr
    exported = slotctl("--config-dir", str(config), "stack", "export", "--format", "crd")
    assert exported.returncode == 0, exported.stderr
    kinds = sorted(o["kind"] for o in parse_documents(exported.stdout))
    assert kinds == ["Alias"] + ["Model"] * 3 + ["Slot"] * 3  # the quickstart's alias too
    toml_export = slotctl("--config-dir", str(config), "stack", "export")  # untouched
    assert toml_export.returncode == 0 and "[stack]" in toml_export.stdout


def test_model_ids_that_are_not_object_names() -> None:
    assert object_name("qwen2.5-7b") == "qwen2.5-7b"
    name = object_name("Org/Repo:Q4")
    assert name != object_name("org/repo:q4")  # distinct ids never share an object
    assert len(name) <= 253 and name == name.lower()


def test_crd_generate_check(tmp_path: Path) -> None:
    current = slotctl("crd", "generate", "--check", "--output-dir", "crds")
    assert (
        current.returncode == 0
        and current.stdout == "crds: the 4 CRDs are current (nothing written)\n"
    )
    fresh = slotctl("crd", "generate", "--output-dir", str(tmp_path))
    assert fresh.returncode == 0
    assert fresh.stdout.splitlines() == [
        f"wrote {tmp_path / 'slotctl.io_adapters.yaml'}",
        f"wrote {tmp_path / 'slotctl.io_aliases.yaml'}",
        f"wrote {tmp_path / 'slotctl.io_models.yaml'}",
        f"wrote {tmp_path / 'slotctl.io_slots.yaml'}",
        f"{tmp_path}: 4 written, 0 unchanged",
    ]
    again = slotctl("crd", "generate", "--output-dir", str(tmp_path))  # says so, too
    assert again.stdout == f"{tmp_path}: the 4 CRDs are current (nothing written)\n"
    (tmp_path / "slotctl.io_slots.yaml").write_text("stale")
    result = slotctl("crd", "generate", "--check", "--output-dir", str(tmp_path))
    assert result.returncode == 1 and "out of date" in result.stderr and result.stdout == ""
