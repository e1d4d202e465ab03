"""The CRDs: generated from the stack schema, committed, structural, and as strict as the
loader — every example and generated CR is accepted, invalid ones are refused by the
schema or by the CEL rules, and the CEL rules agree with the guard."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.operator.convert import parse_documents, resources_from_state
from controller.operator.crd import crd_documents, crd_files
from controller.spec.loader import load_stacks
from controller.spec.rules import check_slot_payload
from controller.spec.schema import (
    HARDWARE_ENV_VARS,
    HARDWARE_FLAGS,
    MODEL_OWNED_FLAGS,
    MODEL_OWNED_KEYS,
    ModelSpec,
)
from tests.k8s.crdcheck import (
    admission_errors,
    cel_errors,
    schema_errors,
    structural_violations,
    version_schema,
)

REPO = Path(__file__).resolve().parents[2]
CRDS = {d["spec"]["names"]["kind"]: d for d in crd_documents().values()}


def crd_for(obj: dict[str, Any]) -> dict[str, Any]:
    return CRDS[obj["kind"]]


@pytest.mark.parametrize("directory", ["crds", "charts/slotctl/crds"])
def test_committed_crds_are_the_generators_output(directory: str) -> None:
    for name, text in crd_files().items():
        path = REPO / directory / name
        assert path.exists(), f"{path} missing: run `slotctl crd generate`"
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: regenerate it"
    committed = {p.name for p in (REPO / directory).glob("*.yaml")}
    assert committed == set(crd_files()), "crds/ holds files the generator does not write"


@pytest.mark.parametrize("kind", ["Alias", "Model", "Slot"])
def test_crd_is_structural_and_complete(kind: str) -> None:
    crd = CRDS[kind]
    assert structural_violations(version_schema(crd)) == []
    spec = crd["spec"]
    assert spec["group"] == "slotctl.io" and spec["scope"] == "Namespaced"
    assert crd["metadata"]["name"] == f"{spec['names']['plural']}.slotctl.io"
    assert spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    fields = set(conditions["items"]["properties"])
    assert {
        "type",
        "status",
        "observedGeneration",
        "reason",
        "message",
        "lastTransitionTime",
    } <= fields
    assert set(status["lastError"]["properties"]) == {"code", "message"}


def test_slot_printer_columns() -> None:
    columns = CRDS["Slot"]["spec"]["versions"][0]["additionalPrinterColumns"]
    default = [c["name"].upper() for c in columns if not c.get("priority")]
    # NAME comes first; REASON as kubectl get pods shows CrashLoopBackOff
    assert default == ["STATE", "REASON", "MODEL", "PORT", "NODE", "READY", "AGE"]
    slot_status = version_schema(CRDS["Slot"])["properties"]["status"]["properties"]
    keys = ("state", "reason", "model", "endpoint", "memory", "lastError", "observedGeneration")
    for key in keys:
        assert key in slot_status


def test_slot_spec_has_no_model_owned_keys_and_no_name() -> None:
    spec = version_schema(CRDS["Slot"])["properties"]["spec"]
    assert not MODEL_OWNED_KEYS & set(spec["properties"])
    assert not MODEL_OWNED_KEYS & set(spec["properties"]["model"]["properties"])
    assert "name" not in spec["properties"]  # metadata.name is the slot's name
    assert set(spec["required"]) == {"provider"}  # no port: the controller chooses one
    model = version_schema(CRDS["Model"])["properties"]["spec"]
    assert set(model["properties"]) == set(ModelSpec.model_fields)  # id optional: metadata.name


def _example_objects() -> list[dict[str, Any]]:
    objects = []
    for path in sorted((REPO / "examples/k8s").glob("*.yaml")):
        objects += parse_documents(path.read_text(encoding="utf-8"))
    return objects


def _generated_objects() -> list[dict[str, Any]]:
    out = []
    for stack in ("examples/quickstart", "stacks"):
        report = load_stacks([REPO / stack])
        assert report.ok and report.state is not None, report.errors
        out += resources_from_state(report.state, "default")
    return out


def test_examples_and_generated_samples_are_accepted() -> None:
    objects = _example_objects() + _generated_objects()
    assert {o["kind"] for o in objects} == {"Alias", "Model", "Slot"}
    assert len(objects) > 8
    for obj in objects:
        assert admission_errors(crd_for(obj), obj) == [], obj["metadata"]["name"]


def _slot(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"provider": "demo", "port": 18081, "model": {"default": "m"}}
    base.update(spec)
    return {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Slot",
        "metadata": {"name": "chat"},
        "spec": {k: v for k, v in base.items() if v is not None},
    }


SCHEMA_REJECTS = {
    "unknown key": _slot(prio=3),
    "model-owned key": _slot(context_length=4096),
    "model-owned key under model": _slot(model={"default": "m", "temperature": 0.2}),
    "port 0": _slot(port=0),
    "port 65536": _slot(port=65536),
    "port as a string": _slot(port="8081"),
    "priority 101": _slot(priority=101),
    "unknown provider": _slot(provider="ollama"),
    "zero warmup": _slot(warmup_timeout_s=0),
    "env value not a string": _slot(server={"env": {"A": 1}}),
    "name in spec": _slot(name="chat"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_REJECTS))
def test_invalid_slots_are_refused_by_the_schema(case: str) -> None:
    obj = SCHEMA_REJECTS[case]
    assert schema_errors(CRDS["Slot"], obj), case
    payload = {**obj["spec"], "name": obj["metadata"]["name"]}
    if case != "name in spec":  # the loader knows `name`; the operator refuses it in a CR
        assert check_slot_payload(payload).errors, f"the loader accepts {case}"


CEL_REJECTS = {
    "hardware flag": _slot(server={"extra_args": ["-ngl", "99"]}),
    "hardware flag, = form, underscores": _slot(server={"extra_args": ["--n_gpu_layers=99"]}),
    "placement flag": _slot(server={"extra_args": ["--port=9"]}),
    "model-owned flag": _slot(server={"extra_args": ["--ctx-size", "4096"]}),
    "device visibility env": _slot(server={"env": {"CUDA_VISIBLE_DEVICES": "1"}}),
}


@pytest.mark.parametrize("case", sorted(CEL_REJECTS))
def test_cross_field_rules_are_cel_and_agree_with_the_guard(case: str) -> None:
    obj = CEL_REJECTS[case]
    assert schema_errors(CRDS["Slot"], obj) == []
    assert cel_errors(CRDS["Slot"], obj), case
    codes = {p.code for p, _ in check_slot_payload({**obj["spec"], "name": "chat"}).errors}
    assert codes & {"slot.hardware_flag", "slot.model_owned_key"}


def test_slot_name_rule() -> None:
    obj = _slot()
    obj["metadata"]["name"] = "Chat.Room"  # a valid object name, not a slot name
    assert cel_errors(CRDS["Slot"], obj)
    obj["metadata"]["name"] = "chat-room"
    assert cel_errors(CRDS["Slot"], obj) == []


@pytest.mark.parametrize(
    ("source", "ok"),
    [
        ("/models/x.gguf", True),
        ("file:///models/x.gguf", True),
        ("demo://chat", True),
        ("hf://org/repo/file.gguf", True),
        ("hf://org/repo", True),
        ("hf://org", False),
        ("s3://bucket/x", False),
        ("   ", False),
    ],
)
def test_model_source_rule_matches_the_schema_validator(source: str, ok: bool) -> None:
    obj = {
        "apiVersion": "slotctl.io/v1alpha1",
        "kind": "Model",
        "metadata": {"name": "m"},
        "spec": {"source": source},
    }
    assert (admission_errors(CRDS["Model"], obj) == []) is ok
    try:
        ModelSpec.model_validate({"id": "m", "source": source})
        loader_ok = True
    except ValueError:
        loader_ok = False
    assert loader_ok is ok


_ARGS = st.lists(
    st.one_of(
        st.sampled_from(sorted({*HARDWARE_FLAGS, *MODEL_OWNED_FLAGS})).flatmap(
            lambda f: st.sampled_from(
                [f, f + "=1", "--" + f[2:].replace("-", "_") if f[:2] == "--" else f]
            )
        ),
        st.sampled_from(["--parallel", "2", "-v", "--flash-attn", "--jinja", "--", "-"]),
        st.text(alphabet="-_=abcdeglnpt0123", max_size=12),
    ),
    max_size=5,
)


@settings(max_examples=150, deadline=None)
@given(
    args=_ARGS,
    env=st.dictionaries(
        st.sampled_from([*HARDWARE_ENV_VARS, "A", "HF_HOME"]), st.just("1"), max_size=2
    ),
)
def test_cel_rules_refuse_exactly_what_the_guard_refuses(
    args: list[str], env: dict[str, str]
) -> None:
    obj = _slot(server={"extra_args": args, "env": env})
    guard = check_slot_payload({**copy.deepcopy(obj["spec"]), "name": "chat"})
    screened = [
        p for p, _ in guard.errors if p.code in ("slot.hardware_flag", "slot.model_owned_key")
    ]
    assert bool(cel_errors(CRDS["Slot"], obj)) == bool(screened), (args, env, screened)


def test_generated_files_are_valid_yaml_crds() -> None:
    for name, text in crd_files().items():
        doc = yaml.safe_load(text)
        assert doc["kind"] == "CustomResourceDefinition", name
        assert text.startswith("# Generated by `slotctl crd generate`")


REPLICA_REJECTS = {
    "replicas and max_replicas": _slot(replicas=2, max_replicas=3, max_concurrency=2),
    "replicas and min_replicas": _slot(replicas=2, min_replicas=1),
    "min above max": _slot(min_replicas=3, max_replicas=2, max_concurrency=2),
    "scaling without max_concurrency": _slot(min_replicas=1, max_replicas=3),
    "scaling from 1 without max_concurrency": _slot(max_replicas=2),
    "npu replicas": _slot(replicas=2, device="npu"),
    "pinned device spreads": _slot(replicas=2, device="gpu:0"),
    "unit member replicas": _slot(replicas=2, unit="pair"),
}

REPLICA_ACCEPTS = {
    "fixed replicas": _slot(replicas=3),
    "min only": _slot(min_replicas=2),
    "scaling with max_concurrency": _slot(min_replicas=1, max_replicas=4, max_concurrency=2),
    "min equals max": _slot(min_replicas=2, max_replicas=2),
    "pinned device shares": _slot(replicas=2, device="gpu:0", replica_placement="share"),
    "npu without replicas": _slot(replicas=1, device="npu"),
    "unit member alone": _slot(unit="pair"),
}


@pytest.mark.parametrize("case", sorted(REPLICA_REJECTS))
def test_replica_rules_are_cel_and_agree_with_the_loader(case: str) -> None:
    obj = REPLICA_REJECTS[case]
    assert schema_errors(CRDS["Slot"], obj) == [], case
    assert cel_errors(CRDS["Slot"], obj), case
    codes = {p.code for p, _ in check_slot_payload({**obj["spec"], "name": "chat"}).errors}
    assert "slot.invalid_value" in codes, case


@pytest.mark.parametrize("case", sorted(REPLICA_ACCEPTS))
def test_replica_rules_accept_what_the_loader_accepts(case: str) -> None:
    obj = REPLICA_ACCEPTS[case]
    assert admission_errors(CRDS["Slot"], obj) == [], case
    assert check_slot_payload({**obj["spec"], "name": "chat"}).errors == [], case


def test_replica_name_length_rule() -> None:
    obj = _slot(replicas=10)
    obj["metadata"]["name"] = "a" * 60  # its last replica, a...a-r9, is 63 characters
    assert cel_errors(CRDS["Slot"], obj) == []
    obj["metadata"]["name"] = "a" * 61
    assert cel_errors(CRDS["Slot"], obj)
    obj["spec"]["replicas"] = 1  # no replicas: a 61-character name is a slot name
    assert cel_errors(CRDS["Slot"], obj) == []


@settings(max_examples=200, deadline=None)
@given(
    bounds=st.fixed_dictionaries(
        {},
        optional={
            "replicas": st.integers(1, 16),
            "min_replicas": st.integers(1, 16),
            "max_replicas": st.integers(1, 16),
            "max_concurrency": st.integers(1, 4),
            "device": st.sampled_from(["gpu", "cpu", "npu", "gpu:0", "gpu:0,1"]),
            "replica_placement": st.sampled_from(["spread", "share"]),
            "unit": st.just("pair"),
        },
    ),
    name=st.sampled_from(["chat", "a" * 59, "a" * 60, "a" * 61, "a" * 63]),
)
def test_replica_cel_rules_refuse_exactly_what_the_loader_refuses(
    bounds: dict[str, Any], name: str
) -> None:
    obj = _slot(**bounds)
    obj["metadata"]["name"] = name
    loader = check_slot_payload({**copy.deepcopy(obj["spec"]), "name": name})
    assert bool(cel_errors(CRDS["Slot"], obj)) == bool(loader.errors), (bounds, name)
