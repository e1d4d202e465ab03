"""LoRA adapters (issue 37), the pure parts: ``[[adapter]]`` tables and their typed
problems, the guard's write and the config dir's read, the TOML <-> CR round trip, the
residency decision, what each engine is started with, and the body each engine is sent.
(The residency carried out against real servers: tests/e2e/test_adapters.py; the demo
server's adapter doubles: tests/integration/test_demo_lora.py; a real llama.cpp engine:
tests/integration/test_lora_llamacpp.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.operator.convert import resources_from_state, stacks_from_resources
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.reconcile.apply import adapter_changes, apply_to_config
from controller.router.adapters import adapter_body
from controller.scheduling.adapters import Resident, adapter_reserve, decide_adapter, evictable
from controller.slots.records import AdapterHold
from controller.spec.configdir import read_config_dir
from controller.spec.loader import DesiredState, LoadReport, load_stack_texts
from controller.spec.render import render_stack
from controller.spec.schema import AdapterSpec, SlotSpec

MODELS = (
    '[[model]]\nid = "base"\nsource = "/m/base.gguf"\n\n'
    '[[model]]\nid = "other"\nsource = "/m/o.gguf"\n'
)
SLOT = (
    '[[slot]]\nname = "s1"\nprovider = "vllm"\nmodel.default = "base"\nport = 9001\nmax_loras = 2\n'
)
ADAPTER = '[[adapter]]\nid = "sql"\nbase = "base"\nsource = "/a/sql"\nrank = 8\n'


def stack(body: str, name: str = "s", models: str = MODELS) -> str:
    return f'[stack]\nname = "{name}"\n\n{models}\n{body}'


def load(*texts: str) -> LoadReport:
    return load_stack_texts([(f"f{i}.toml", t) for i, t in enumerate(texts)])


def state(*texts: str) -> DesiredState:
    report = load(*texts)
    assert report.ok and report.state is not None, report.errors
    return report.state


def codes(report: LoadReport) -> list[str]:
    return [p.code for p in report.errors]


# ------------------------------------------------------------------ schema and problems


def test_an_adapter_loads_with_its_defaults() -> None:
    spec = state(stack(SLOT + ADAPTER)).adapters["sql"].spec
    assert (spec.base, spec.rank, spec.scale, spec.priority, spec.pinned) == (
        "base",
        8,
        1.0,
        50,
        False,
    )
    assert state(stack(SLOT + ADAPTER)).adapters["sql"].stack == "s"


@pytest.mark.parametrize(
    ("body", "code", "line"),
    [
        (ADAPTER.replace('base = "base"', 'base = "bsae"'), "adapter.unknown_base", 20),
        (ADAPTER.replace('id = "sql"', 'id = "other"'), "adapter.id_taken", 19),
        (ADAPTER.replace('id = "sql"', 'id = "s1"'), "adapter.id_taken", 19),
        (ADAPTER + ADAPTER, "adapter.duplicate_id", 24),
        (ADAPTER.replace("rank = 8", "rank = 64"), "adapter.rank_over_limit", 22),
        (ADAPTER + "colour = 1\n", "adapter.unknown_key", 23),
        (ADAPTER.replace('"/a/sql"', '"demo://x"'), "adapter.invalid_value", 21),
        (ADAPTER.replace("rank = 8", "rank = 0"), "adapter.invalid_value", 22),
    ],
)
def test_adapter_problems_are_typed_and_located(body: str, code: str, line: int) -> None:
    report = load(stack(SLOT + body))
    found = [p for p in report.errors if p.code == code]
    assert found, report.errors
    assert found[0].line == line, found[0]


def test_the_unknown_base_hint_names_the_close_model() -> None:
    report = load(stack(SLOT + ADAPTER.replace('base = "base"', 'base = "bsae"')))
    (problem,) = [p for p in report.errors if p.code == "adapter.unknown_base"]
    assert problem.hint == "did you mean 'base'?"


def test_an_adapter_id_that_is_an_alias_is_taken() -> None:
    alias = '[[alias]]\nid = "sql"\nmodels = ["base"]\n'
    assert "adapter.id_taken" in codes(load(stack(SLOT + ADAPTER + alias)))


def test_a_slots_start_adapters_are_declared_and_within_its_engine() -> None:
    cpp = (
        '[[slot]]\nname = "c"\nprovider = "llama-cpp-python"\nmodel.default = "base"\nport = 9002\n'
    )
    assert "slot.unknown_adapter" in codes(load(stack(cpp + 'adapters = ["nope"]\n' + ADAPTER)))
    two = ADAPTER + ADAPTER.replace('id = "sql"', 'id = "poem"')
    report = load(stack(cpp + 'adapters = ["sql", "poem"]\n' + two))
    assert "slot.adapters_over_capacity" in codes(report)  # its server takes one
    other = ADAPTER.replace('base = "base"', 'base = "other"')
    assert "slot.unknown_adapter" in codes(load(stack(cpp + 'adapters = ["sql"]\n' + other)))
    assert load(stack(cpp + 'adapters = ["sql"]\n' + ADAPTER)).ok


def test_adapter_must_be_an_array_of_tables() -> None:
    assert "adapter.invalid_value" in codes(load('adapter = "x"\n[stack]\nname = "s"\n'))


# ------------------------------------------------------------------ writes, reads, round trips


def test_apply_writes_adapters_and_removes_the_ones_dropped(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    changed = apply_to_config(state(stack(SLOT + ADAPTER)), config, prune=True)
    assert "adapters" in changed
    snap = read_config_dir(config)
    assert not snap.errors, snap.errors
    assert snap.adapters["sql"].spec.rank == 8 and snap.adapters["sql"].stack == "s"
    assert adapter_changes(state(stack(SLOT + ADAPTER)), snap) == []
    again = state(stack(SLOT))
    assert adapter_changes(again, snap) == ["- sql"]
    apply_to_config(again, config, prune=True)
    assert read_config_dir(config).adapters == {}


def test_stack_toml_and_adapter_resources_round_trip_losslessly() -> None:
    full = ADAPTER.replace("rank = 8", "rank = 8\nscale = 0.5\npriority = 70\npinned = true")
    full += 'memory_gb = 0.25\nsha256 = "' + "a" * 64 + '"\n'
    before = state(stack(SLOT + full))
    resources = resources_from_state(before)
    kinds = [r["kind"] for r in resources]
    assert "Adapter" in kinds
    result = stacks_from_resources(resources, "s")
    assert not result.problems, result.problems
    after = state(*result.texts.values())
    assert after.adapters["sql"].spec == before.adapters["sql"].spec
    rendered = render_stack(
        "s", before.models.values(), before.slots.values(), adapters=[before.adapters["sql"].spec]
    )
    assert state(rendered).adapters["sql"].spec == before.adapters["sql"].spec


# ------------------------------------------------------------------ the residency decision


def test_a_resident_adapter_needs_nothing_and_room_needs_no_victim() -> None:
    held = [Resident("a")]
    assert decide_adapter("a", held, 2).resident
    decision = decide_adapter("b", held, 2)
    assert decision.ok and decision.victims == ()


def test_eviction_takes_the_lowest_priority_then_the_least_recently_used() -> None:
    held = [Resident("hi", priority=90, last_used=1), Resident("old", 50, last_used=1)]
    held += [Resident("new", 50, last_used=5)]
    assert decide_adapter("x", held, 3).victims == ("old",)
    assert decide_adapter("x", held, 2).victims == ("old", "new")
    assert [r.id for r in evictable(held)] == ["old", "new", "hi"]


def test_pinned_and_in_flight_adapters_are_never_evicted() -> None:
    held = [Resident("p", priority=0, pinned=True), Resident("busy", priority=0, in_flight=1)]
    decision = decide_adapter("x", held, 2)
    assert not decision.ok and decision.retry_after_s > 0
    assert "1 pinned" in decision.reason and "1 with requests in flight" in decision.reason
    assert decide_adapter("x", [*held, Resident("idle", priority=99)], 3).victims == ("idle",)
    assert not decide_adapter("x", [], 0).ok


def test_a_slots_reserve_is_its_largest_adapters() -> None:
    assert adapter_reserve(2, [5, 1, 9, 3]) == 14
    assert adapter_reserve(0, [5]) == 0


# ------------------------------------------------------------------ engines


def _launch(slot: str, adapters: dict[str, AdapterSpec] | None = None) -> list[str]:
    spec = SlotSpec.model_validate(json.loads(slot))
    loaded = state(stack(""))
    ctx = BuildContext(models_dir=Path("/models"), adapters=adapters or {})
    launch = build_launch(spec, loaded.models[spec.model_id], ctx)
    return [*launch.argv, *(f"{k}={v}" for k, v in launch.env.items())]


def test_vllm_is_started_for_runtime_adapters() -> None:
    argv = _launch('{"name": "v", "provider": "vllm", "model": {"default": "base"}, "port": 1,'
                   ' "max_loras": 4, "max_lora_rank": 32}')  # fmt: skip
    text = " ".join(argv)
    assert "--enable-lora --max-loras 4 --max-lora-rank 32" in text
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in argv
    plain = _launch('{"name": "v", "provider": "vllm", "model": {"default": "base"}, "port": 1}')
    assert "--enable-lora" not in plain


def test_start_time_engines_are_given_their_adapters_files() -> None:
    adapters = {
        "sql": AdapterSpec(id="sql", base="base", source="/a/sql.gguf"),
        "poem": AdapterSpec(id="poem", base="base", source="hf://org/repo/poem.gguf"),
    }
    argv = _launch(
        '{"name": "c", "provider": "llamacpp", "model": {"default": "base"}, "port": 1,'
        ' "adapters": ["sql", "poem"]}',
        adapters,
    )
    text = " ".join(argv)
    assert "--lora /a/sql.gguf --lora /models/org/repo/poem.gguf --lora-init-without-apply" in text
    argv = _launch(
        '{"name": "p", "provider": "llama-cpp-python", "model": {"default": "base"}, "port": 1,'
        ' "adapters": ["sql"]}',
        adapters,
    )
    assert "--lora_path /a/sql.gguf" in " ".join(argv)


def test_each_engine_is_sent_the_adapter_in_its_own_words() -> None:
    body = b'{"model": "sql", "messages": [], "max_tokens": 3}'

    def sent(api: str, index: int = -1) -> dict[str, object]:
        hold = AdapterHold("s", "sql", api, index, 0.5)
        out: dict[str, object] = json.loads(adapter_body(body, hold, "base"))
        assert out["max_tokens"] == 3
        return out

    assert sent("vllm")["model"] == "sql"
    assert sent("sglang")["model"] == "base:sql"
    cpp = sent("llamacpp", 1)
    assert cpp["model"] == "base" and cpp["lora"] == [{"id": 1, "scale": 0.5}]
    assert sent("llama-cpp-python")["model"] == "base"


def test_a_url_adapter_needs_its_digest_as_a_url_model_does() -> None:
    url = ADAPTER.replace('"/a/sql"', '"https://host/sql.gguf"')
    report = load(stack(SLOT + url))
    assert any(p.code == "adapter.invalid_value" and "sha256" in p.message for p in report.errors)
    assert load(stack(SLOT + url + 'sha256 = "' + "B" * 64 + '"\n')).ok


def test_a_request_goes_where_its_adapter_is_unless_that_slot_is_saturated() -> None:
    from controller.scheduling.adapters import AdapterSeat, rank_adapter_slots

    def seat(name: str, holds: bool, ready: bool = True, full: bool = False) -> AdapterSeat:
        return AdapterSeat(name, holds, ready, full)

    assert rank_adapter_slots([seat("a", False), seat("b", True)]) == ["b", "a"]
    assert rank_adapter_slots([seat("a", False), seat("b", True, full=True)]) == ["a", "b"]
    cold = seat("c", False, ready=False)
    assert rank_adapter_slots([cold, seat("b", True, full=True)]) == ["b", "c"]
    assert rank_adapter_slots([cold, seat("a", False, full=True)]) == ["a", "c"]


def test_a_docker_server_sees_the_files_of_the_adapters_it_may_load() -> None:
    from controller.runtime.base import RuntimeKind

    adapters = {
        "sql": AdapterSpec(id="sql", base="base", source="/a/sql"),
        "poem": AdapterSpec(id="poem", base="base", source="hf://org/poem"),
        "elsewhere": AdapterSpec(id="elsewhere", base="other", source="/a/x"),
    }
    spec = SlotSpec.model_validate(
        {"name": "v", "provider": "vllm", "model": {"default": "base"}, "port": 1, "max_loras": 2}
    )
    ctx = BuildContext(runtime=RuntimeKind.DOCKER, models_dir=Path("/models"), adapters=adapters)
    launch = build_launch(spec, state(stack("")).models["base"], ctx)
    mounted = {m.source for m in launch.mounts}
    assert {"/a/sql", "/models/org/poem"} <= mounted and "/a/x" not in mounted
    process = build_launch(spec, state(stack("")).models["base"], BuildContext(adapters=adapters))
    assert not process.mounts  # the process runtime's server reads them where they are
