"""Adapter CRs as a source (issue 37), without kopf: the loader's codes, the last good
spec kept, the newcomer of a duplicate id refused, a stack file's adapter id taken, a
rank judged again when a slot's limit moves, deletion, and the status mapping; nothing
is written."""

from __future__ import annotations

from pathlib import Path

from controller.operator.source import STACK
from controller.operator.source_adapters import adapter_status
from controller.operator.status import Verdict
from controller.reconcile.apply import apply_to_config
from controller.spec.configdir import read_config_dir
from controller.spec.loader import load_stack_texts
from controller.spec.problems import Problem
from tests.k8s.test_source import Crs, cr, slot_spec, source_with

KEY = ("Adapter", "default", "sql")


def codes(crs: Crs) -> dict[str, list[str]]:
    verdicts = crs.source.verdicts
    return {k[2]: [p.code for p in v.problems] for k, v in verdicts.items() if k[0] == "Adapter"}


def test_an_adapter_cr_is_the_kubernetes_stacks_adapter(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081, max_loras=2, max_lora_rank=16))])
    change = crs.load("Adapter", [cr("sql", {"base": "m", "source": "/a/sql", "rank": 8})])
    assert change.adapters == {"sql"}
    entry = crs.cache.snapshot.adapters["sql"]
    assert entry.stack == STACK and entry.spec.base == "m" and entry.spec.rank == 8
    assert crs.source.verdicts[KEY].accepted and not crs.source.verdicts[KEY].problems
    assert crs.source.adapter_ids == {KEY: "sql"}
    assert not crs.load("Adapter", [cr("sql", {"base": "m", "source": "/a/sql", "rank": 8})])
    assert read_config_dir(crs.config).adapters == {}  # in memory: nothing written

    # an invalid edit (a rank over the slot's limit): the last good spec stays
    crs.load("Adapter", [cr("sql", {"base": "m", "source": "/a/sql", "rank": 64})])
    verdict = crs.source.verdicts[KEY]
    assert [p.code for p in verdict.problems] == ["adapter.rank_over_limit"]
    assert verdict.accepted and not verdict.current
    assert crs.cache.snapshot.adapters["sql"].spec.rank == 8
    crs.load("Adapter", [cr("sql", {"base": "m", "source": "demo://x"})])
    assert codes(crs) == {"sql": ["adapter.invalid_value"]}

    # deleted: gone from the desired state
    assert crs.load("Adapter", []).adapters == {"sql"}
    assert crs.cache.snapshot.adapters == {}
    assert KEY not in crs.source.verdicts


def test_a_slots_rank_limit_judges_its_bases_adapters_again(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081, max_loras=2, max_lora_rank=16))])
    crs.load("Adapter", [cr("sql", {"base": "m", "source": "/a/sql", "rank": 32})])
    assert codes(crs) == {"sql": ["adapter.rank_over_limit"]}
    assert crs.cache.snapshot.adapters == {}
    change = crs.load("Slot", [cr("chat", slot_spec(18081, max_loras=2, max_lora_rank=64))])
    assert change.adapters == {"sql"} and codes(crs) == {"sql": []}
    assert crs.cache.snapshot.adapters["sql"].spec.rank == 32


def test_ids_taken_duplicates_and_unknown_bases_are_refused(tmp_path: Path) -> None:
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081))])
    crs.load("Alias", [cr("assistant", {"models": ["m"]})])
    crs.load(
        "Adapter",
        [
            cr("a", {"id": "same", "base": "m", "source": "/a/x"}, created="1"),
            cr("b", {"id": "same", "base": "m", "source": "/a/y"}, created="2"),  # newcomer
            cr("m", {"base": "m", "source": "/a/z"}),  # the catalogue model's id
            cr("chat", {"base": "m", "source": "/a/z"}),  # a slot's name
            cr("assistant", {"base": "m", "source": "/a/z"}),  # an alias' id
            cr("lost", {"base": "nosuch", "source": "/a/z"}),
        ],
    )
    assert codes(crs) == {
        "a": [],
        "b": ["adapter.duplicate_id"],
        "m": ["adapter.id_taken"],
        "chat": ["adapter.id_taken"],
        "assistant": ["adapter.id_taken"],
        "lost": ["adapter.unknown_base"],
    }
    assert set(crs.cache.snapshot.adapters) == {"same"}
    # the Model of the unknown base arrives: the refused Adapter is judged again
    crs.load("Model", [cr("m", {"source": "demo://m"}), cr("nosuch", {"source": "demo://n"})])
    assert codes(crs)["lost"] == [] and "lost" in crs.cache.snapshot.adapters


def test_an_adapter_a_stack_file_declares_is_not_taken_over(tmp_path: Path) -> None:
    config = tmp_path / "config"
    text = '[stack]\nname = "files"\n[[model]]\nid = "m"\nsource = "demo://m"\n'
    text += '[[adapter]]\nid = "sql"\nbase = "m"\nsource = "/a/sql"\n'
    report = load_stack_texts([("files.toml", text)])
    assert report.state is not None
    apply_to_config(report.state, config, prune=True)
    crs = source_with(tmp_path, [])
    crs.load("Adapter", [cr("sql", {"base": "m", "source": "/a/other"})])
    assert codes(crs) == {"sql": ["adapter.duplicate_id"]}
    entry = crs.cache.snapshot.adapters["sql"]
    assert entry.stack == "files" and entry.spec.source == "/a/sql"


def test_adapter_status() -> None:
    ok = adapter_status("sql", Verdict(generation=2, accepted=True, current=True), None)
    ready = {c["type"]: c for c in ok["conditions"]}["Ready"]
    assert ok["id"] == "sql" and ok["observedGeneration"] == 2
    assert ready["status"] == "True" and ready["reason"] == "Declared" and "lastError" not in ok
    problem = Problem(code="adapter.unknown_base", message="no")
    bad = adapter_status(None, Verdict(generation=1, problems=(problem,)), ok)
    conditions = {c["type"]: c for c in bad["conditions"]}
    assert conditions["Ready"]["status"] == "False" and conditions["Degraded"]["status"] == "True"
    assert bad["lastError"]["code"] == "adapter.unknown_base"


def test_every_judging_that_moves_a_verdict_is_told(tmp_path: Path) -> None:
    """``on_moved`` hears every judging that moves a verdict, whatever judged it — a
    resource's own change, a listing, the config dir's files — and no judging that moves
    none (the operator wakes its status timers there)."""
    crs = source_with(tmp_path, [cr("chat", slot_spec(18081))])
    told: list[set[str]] = []
    crs.source.on_moved = told.append
    crs.load("Adapter", [cr("sql", {"base": "m", "source": "/a/sql"})])
    assert told == [set()] and codes(crs) == {"sql": []}
    crs.load("Adapter", [cr("sql", {"base": "m", "source": "/a/sql"})])  # the same again
    crs.load("Slot", [cr("chat", slot_spec(18081))])
    assert told == [set()]
    # a stack file takes its id: the files' refresh judges it again, and says so
    text = '[stack]\nname = "files"\n[[model]]\nid = "m"\nsource = "demo://m"\n'
    text += '[[adapter]]\nid = "sql"\nbase = "m"\nsource = "/a/files"\n'
    report = load_stack_texts([("files.toml", text)])
    assert report.state is not None
    apply_to_config(report.state, crs.config, prune=True)
    crs.cache.refresh()
    assert told == [set(), set()] and codes(crs) == {"sql": ["adapter.duplicate_id"]}
    # a Slot's verdict moved (an edit: a new generation): its slot named
    edited = cr("chat", slot_spec(18081, priority=70))
    edited["metadata"]["generation"] = 2
    crs.load("Slot", [edited])
    assert told[-1] == {"chat"}
