"""Provider templates and the config hash."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from controller.model.errors import SlotConfigError
from controller.providers.base import BuildContext
from controller.providers.launch import PROVIDER_REGISTRY, build_launch
from controller.spec.schema import PROVIDERS, ModelSpec, SlotSpec


def _slot(**kw: object) -> SlotSpec:
    data: dict[str, object] = {
        "name": "chat",
        "provider": "llamacpp",
        "port": 8081,
        "model": {"default": "qwen"},
    }
    data.update(kw)
    return SlotSpec.model_validate(data)


MODEL = ModelSpec(id="qwen", source="/models/qwen.gguf", memory_gb=5, context_length=8192)


def test_every_provider_has_a_template() -> None:
    assert set(PROVIDER_REGISTRY) == set(PROVIDERS)


def test_llamacpp_process_argv() -> None:
    launch = build_launch(_slot(server={"extra_args": ["--parallel", "2"]}), MODEL, BuildContext())
    assert launch.argv[0] == "llama-server"
    argv = list(launch.argv)
    assert argv[argv.index("--model") + 1] == "/models/qwen.gguf"
    assert argv[argv.index("--port") + 1] == "8081"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--ctx-size") + 1] == "8192"
    assert argv[argv.index("--n-gpu-layers") + 1] == "999"
    assert argv[argv.index("--alias") + 1] == "qwen"
    assert argv[-2:] == ["--parallel", "2"]
    assert launch.image is None
    assert launch.probe.sentinel is not None and launch.probe.sentinel.path == "/v1/completions"


def test_llamacpp_cpu_and_embedding() -> None:
    slot = _slot(device="cpu", type="embedding")
    launch = build_launch(slot, MODEL, BuildContext())
    argv = list(launch.argv)
    assert argv[argv.index("--n-gpu-layers") + 1] == "0"
    assert "--embeddings" in argv
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ""
    assert launch.probe.sentinel is not None and launch.probe.sentinel.path == "/v1/embeddings"


def test_llamacpp_docker_uses_image_and_mounts_model_read_only() -> None:
    launch = build_launch(_slot(), MODEL, BuildContext(runtime="docker"))
    assert launch.image == "ghcr.io/ggml-org/llama.cpp:server"
    assert launch.argv[0] == "--model"
    assert any(m.source == "/models/qwen.gguf" and m.read_only for m in launch.mounts)


def test_llama_cpp_python_argv() -> None:
    slot = _slot(provider="llama-cpp-python")
    launch = build_launch(slot, MODEL, BuildContext())
    argv = list(launch.argv)
    assert argv[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert argv[argv.index("--n_ctx") + 1] == "8192"
    assert argv[argv.index("--model_alias") + 1] == "qwen"


def test_hf_source_resolves_into_models_dir(tmp_path: object) -> None:
    model = ModelSpec(id="q", source="hf://org/repo/file.gguf")
    from pathlib import Path

    launch = build_launch(_slot(model={"default": "q"}), model, BuildContext(models_dir=Path("/m")))
    assert launch.model_path == "/m/org/repo/file.gguf"
    # A whole repository (what vLLM serves) is accepted and resolves to its directory.
    repo = ModelSpec(id="r", source="hf://org/repo")
    vllm = _slot(provider="vllm", model={"default": "r"})
    launch = build_launch(vllm, repo, BuildContext(models_dir=Path("/m")))
    assert launch.model_path == "/m/org/repo" and "/m/org/repo" in launch.argv


def test_generic_needs_cmd_and_substitutes() -> None:
    with pytest.raises(SlotConfigError, match=r"server\.cmd"):
        build_launch(_slot(provider="openai-compatible"), MODEL, BuildContext())
    slot = _slot(
        provider="openai-compatible",
        server={"cmd": ["my-server", "--listen", "{host}:{port}", "--weights", "{model_path}"]},
    )
    launch = build_launch(slot, MODEL, BuildContext())
    assert launch.argv == (
        "my-server",
        "--listen",
        "127.0.0.1:8081",
        "--weights",
        "/models/qwen.gguf",
    )


def test_self_managed_needs_no_model() -> None:
    slot = _slot(provider="kokoro", type="tts", model={}, server={"cmd": ["kokoro", "{port}"]})
    launch = build_launch(slot, None, BuildContext())
    assert launch.argv == ("kokoro", "8081")
    assert launch.probe.sentinel is None


def test_model_required_for_real_providers() -> None:
    with pytest.raises(SlotConfigError, match="needs a model"):
        build_launch(_slot(), None, BuildContext())


def test_config_hash_ignores_scheduling_knobs_and_sees_runtime_config() -> None:
    base = build_launch(_slot(), MODEL, BuildContext())
    same = build_launch(
        _slot(priority=90, pinned=True, idle_timeout_s=5, ttl_s=60, warmup_timeout_s=9),
        MODEL,
        BuildContext(),
    )
    assert base.config_hash() == same.config_hash()
    assert len(base.config_hash()) == 12
    changes = [
        _slot(port=9000),
        _slot(device="cpu"),
        _slot(server={"extra_args": ["--parallel", "4"]}),
        _slot(server={"env": {"FOO": "1"}}),
    ]
    hashes = {build_launch(s, MODEL, BuildContext()).config_hash() for s in changes}
    assert base.config_hash() not in hashes and len(hashes) == len(changes)
    other_model = replace(base, model_source="/models/other.gguf")
    assert other_model.config_hash() != base.config_hash()
    assert base.labels()["slotctl.config-hash"] == base.config_hash()
    assert base.labels()["slotctl.managed"] == "true"


# ----------------------------------------------------------------- sleep mode (issue 22)


def test_vllm_sleeps_by_default_with_the_dev_mode_the_controller_sets() -> None:
    from controller.probes.sleep import VLLM_SLEEP

    slot = _slot(provider="vllm", server={"env": {"VLLM_SERVER_DEV_MODE": "0"}})
    launch = build_launch(slot, MODEL, BuildContext())
    assert launch.sleep is VLLM_SLEEP
    assert "--enable-sleep-mode" in launch.argv
    assert launch.env["VLLM_SERVER_DEV_MODE"] == "1"  # the controller's, not the slot's
    docker = build_launch(slot, MODEL, BuildContext(runtime="docker"))
    assert "--enable-sleep-mode" in docker.argv and docker.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert VLLM_SLEEP.sleep.path == "/sleep?level={level}&mode=wait"
    assert [c.path for c in VLLM_SLEEP.wake[1]] == ["/wake_up"]
    assert [c.path for c in VLLM_SLEEP.wake[2]] == [
        "/wake_up?tags=weights",
        "/collective_rpc",
        "/wake_up?tags=kv_cache",
    ]
    assert VLLM_SLEEP.ask.path == "/is_sleeping"


def test_a_slot_opts_out_and_providers_without_sleep_keep_full_unloads() -> None:
    optout = build_launch(_slot(provider="vllm", sleep=False), MODEL, BuildContext())
    assert optout.sleep is None and "--enable-sleep-mode" not in optout.argv
    assert "VLLM_SERVER_DEV_MODE" not in optout.env
    assert build_launch(_slot(), MODEL, BuildContext()).sleep is None  # llamacpp
    assert build_launch(_slot(sleep=True), MODEL, BuildContext()).sleep is None
    cpu = build_launch(_slot(provider="vllm", device="cpu"), MODEL, BuildContext())
    assert cpu.sleep is None  # sleeping releases device memory: a GPU slot's only


def test_the_demo_server_sleeps_when_the_slot_asks() -> None:
    demo = ModelSpec(id="qwen", source="demo://qwen")
    assert build_launch(_slot(provider="demo"), demo, BuildContext()).sleep is None
    launch = build_launch(_slot(provider="demo", sleep=True), demo, BuildContext())
    assert launch.sleep is not None and launch.argv[-1] == "--enable-sleep-mode"
    assert "VLLM_SERVER_DEV_MODE" not in launch.env
    level2 = build_launch(_slot(provider="demo", sleep=True, sleep_level=2), demo, BuildContext())
    assert level2.sleep is not None  # both levels offered


def test_sleep_changes_the_config_hash_its_level_does_not() -> None:
    base = build_launch(_slot(provider="vllm"), MODEL, BuildContext()).config_hash()
    off = build_launch(_slot(provider="vllm", sleep=False), MODEL, BuildContext()).config_hash()
    two = build_launch(_slot(provider="vllm", sleep_level=2), MODEL, BuildContext()).config_hash()
    assert base != off and base == two
