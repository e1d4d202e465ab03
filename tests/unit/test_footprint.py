"""Footprints (issue 36): headers read, the estimate's arithmetic, the choice admission
makes, what is learnt, the engine told its budget, the probe's reason in a refusal."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import pytest

from controller.model.devices import GpuRef
from controller.model.errors import InsufficientMemory
from controller.model.sizes import GIB, MIB
from controller.model.weights import GGML_TYPES, tensor_bytes
from controller.modelfiles.headers import HeaderError, read_gguf, read_model, read_safetensors
from controller.probes.memory import AmdSysfsProbe, NvmlProbe, SystemMemoryProbe
from controller.probes.usage import ProcessUsage
from controller.providers.launch import placement_args
from controller.scheduling.breaker import Breaker
from controller.scheduling.footprint import (
    CACHE_RAM_DEFAULT_MIB,
    choose,
    estimate_gguf,
    estimate_safetensors,
    launch_facts,
)
from controller.slots.records import FootprintView, SlotRecord
from controller.spec.schema import ModelSpec, SlotSpec
from tests.integration.panel_gguf import PANEL, Shape, write_llama
from tests.unit.manager_fixtures import Harness, desired, slot_spec

SMALL = PANEL[0]


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("panel") / "s.gguf", SMALL)


def test_the_ggml_type_table_is_ggufs() -> None:
    theirs = {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}
    for type_id, (_name, block, size) in GGML_TYPES.items():
        assert theirs[type_id] == (block, size), type_id


def test_the_header_is_read_as_gguf_reads_it(small_gguf: Path) -> None:
    model = read_gguf(small_gguf)
    reader = gguf.GGUFReader(small_gguf)
    assert model.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert (model.n_layer, model.n_embd, model.n_head) == (SMALL.n_layer, SMALL.n_embd, 4)
    assert model.n_head_kv == (SMALL.n_head_kv,) * SMALL.n_layer
    assert model.n_ctx_train == SMALL.n_ctx_train and model.n_vocab == 260
    assert len(model.layer_bytes) == SMALL.n_layer and model.input_bytes > 0
    assert dict(model.by_type)["f32"] == model.weight_bytes
    assert read_model(small_gguf) == model  # by path; remembered


def test_what_is_not_a_model_is_said(tmp_path: Path) -> None:
    assert read_model(tmp_path / "absent.gguf") is None
    (tmp_path / "notes.txt").write_text("hello")
    assert read_model(tmp_path / "notes.txt") is None
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x01")
    with pytest.raises(HeaderError, match="truncated"):
        read_model(broken)


def test_kv_scales_with_context_and_cache_type(small_gguf: Path) -> None:
    model = read_gguf(small_gguf)
    at = {
        ctx: estimate_gguf(model, launch_facts("llamacpp", "gpu", ["-c", str(ctx)]))
        for ctx in (1024, 4096)
    }
    head_dim = SMALL.n_embd // SMALL.n_head
    per_token = SMALL.n_layer * SMALL.n_head_kv * head_dim * 2 * 2  # k+v, f16
    assert at[1024].kv == 1024 * per_token and at[4096].kv == 4 * at[1024].kv
    q8 = estimate_gguf(model, launch_facts("llamacpp", "gpu", ["-c", "4096", "-ctk", "q8_0"]))
    # K at q8_0's 34 bytes per 32 elements, V at f16's 2 bytes each
    assert q8.kv == int(4096 * per_token / 2 * (1 + 34 / 32 / 2))
    # -c is the whole pool the -np sequences share (llama-server's README)
    shared = estimate_gguf(model, launch_facts("llamacpp", "gpu", ["-c", "4096", "-np", "4"]))
    assert shared.kv == at[4096].kv and shared.parallel == 4
    per_slot = launch_facts("llamacpp", "gpu", ["-np", "4", "--kv-unified-per-slot", "512"])
    assert estimate_gguf(model, per_slot).context == 2048
    default = estimate_gguf(model, launch_facts("llamacpp", "gpu", []))
    assert default.context == SMALL.n_ctx_train and any("context" in n for n in default.notes)


def test_the_device_and_the_host_are_told_apart(small_gguf: Path) -> None:
    model = read_gguf(small_gguf)
    full = estimate_gguf(model, launch_facts("llamacpp", "gpu", ["-c", "1024", "-ngl", "999"]))
    assert full.layers_on_device == SMALL.n_layer
    assert full.weights_host == model.input_bytes  # the input embeddings stay on the CPU
    assert full.kv_host == 0 and full.prompt_cache == CACHE_RAM_DEFAULT_MIB * MIB
    assert full.device == full.weights_device + full.kv_device + full.buffers_device
    half = estimate_gguf(model, launch_facts("llamacpp", "gpu", ["-c", "1024", "-ngl", "2"]))
    assert half.layers_on_device == 2 and half.kv_device * 2 == half.kv
    assert half.weights_host > full.weights_host
    no_cache = launch_facts("llamacpp", "gpu", ["-c", "1024", "--cache-ram", "0"])
    assert estimate_gguf(model, no_cache).prompt_cache == 0
    cpu = estimate_gguf(model, launch_facts("llamacpp", "cpu", ["-c", "1024", "-ngl", "0"]))
    assert cpu.layers_on_device == 0 and cpu.device == cpu.host  # a CPU slot: all of it
    assert cpu.host >= cpu.weights + cpu.kv + cpu.buffers + cpu.prompt_cache


def test_flash_attention_drops_the_score_buffer(small_gguf: Path) -> None:
    model = read_gguf(small_gguf)
    off = estimate_gguf(model, launch_facts("llamacpp", "gpu", ["-c", "4096", "-fa", "off"]))
    on = estimate_gguf(model, launch_facts("llamacpp", "gpu", ["-c", "4096"]))
    # the scores (f32) in the graph, and their f16 copy in the matmul's work buffer
    assert off.buffers - on.buffers == (4 + 2) * 512 * SMALL.n_head * 4096
    # llama-cpp-python: flash attention off unless asked
    lcp = launch_facts("llama-cpp-python", "cpu", ["--n_ctx", "4096", "--n_gpu_layers", "0"])
    assert not lcp.flash_attn and lcp.context == 4096 and lcp.cache_ram_mib == 0


def test_a_safetensors_repository_is_sized(tmp_path: Path) -> None:
    header = {
        "a.weight": {"dtype": "BF16", "shape": [1024, 1024], "data_offsets": [0, 2 * 1024**2]},
        "b.weight": {
            "dtype": "F32",
            "shape": [1024],
            "data_offsets": [2 * 1024**2, 2 * 1024**2 + 4096],
        },
        "__metadata__": {"format": "pt"},
    }
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    config = {
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "hidden_size": 2048,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = read_safetensors(tmp_path)
    assert model.weight_bytes == 2 * 1024**2 + 4096 and model.head_dim == 128
    assert read_model(tmp_path) == model
    est = estimate_safetensors(model, launch_facts("vllm", "gpu", ["--max-model-len", "8192"]))
    assert est.kv == 8192 * 2 * 24 * 4 * 128 * 2 and est.context == 8192
    assert any("gpu-memory-utilization" in n for n in est.notes)


def test_admission_counts_declared_else_the_larger_of_estimate_and_seen() -> None:
    assert choose(None, None, None).basis == "none"
    assert choose(None, 5 * GIB, None).basis == "estimated"
    seen = choose(None, 5 * GIB, 6 * GIB)
    assert (seen.bytes, seen.basis) == (6 * GIB, "observed")
    assert choose(None, 5 * GIB, 4 * GIB).bytes == 5 * GIB
    declared = choose(4 * GIB, 5 * GIB, 6 * GIB)
    assert declared.bytes == 4 * GIB and declared.basis == "declared"
    assert declared.warning is not None and "4.00 GiB" in declared.warning
    assert "6.00 GiB" in declared.warning
    assert choose(0, None, 6 * GIB).warning is None  # 0: not counted, on purpose
    # vLLM sizes itself to its share: what it was seen holding is no need of its own
    assert choose(None, 5 * GIB, 9 * GIB, learns=False).bytes == 5 * GIB


def test_memory_gb_is_optional() -> None:
    model = ModelSpec(id="m", source="demo://m")
    assert model.memory_gb is None and model.memory_bytes == 0
    assert ModelSpec(id="m", source="demo://m", memory_gb=0).memory_gb == 0


async def test_a_slot_without_memory_gb_is_admitted_by_its_estimate(
    tmp_path: Path, small_gguf: Path
) -> None:
    h = Harness(tmp_path, gpu_gb=24.0)
    spec = slot_spec("chat", "tiny", provider="llamacpp")
    model = ModelSpec(id="tiny", source=str(small_gguf), context_length=2048)
    await h.manager.set_desired(desired([spec], [model]))
    plan = await h.manager.explain("chat")
    fp = plan.footprint
    assert fp is not None and fp.basis == "estimated" and fp.source == "gguf"
    assert fp.context == 2048 and fp.estimated_bytes == fp.admitted_bytes > 0
    assert plan.target is not None and plan.target.needed_bytes == fp.estimated_bytes
    await h.manager.load("chat", resident=False)
    assert h.manager.view("chat").memory_bytes == fp.estimated_bytes
    [shown] = await h.manager.footprints("tiny")
    assert shown.basis == "estimated" and shown.weights_bytes == read_gguf(small_gguf).weight_bytes


async def test_what_was_seen_is_kept_per_config_and_persisted(
    tmp_path: Path, small_gguf: Path
) -> None:
    h = Harness(tmp_path)
    spec = slot_spec("chat", "tiny", provider="llamacpp")
    model = ModelSpec(id="tiny", source=str(small_gguf), context_length=1024)
    await h.manager.set_desired(desired([spec], [model]))
    await h.manager.load("chat", resident=False)
    slot = h.manager.core.table.get("chat")
    assert slot.sizing is not None and slot.sizing.config_hash is not None
    estimate = slot.memory_bytes
    table = h.manager.core.table
    table.observed(slot, slot.sizing.config_hash, estimate + GIB, 3 * GIB, "fake")
    table.observed(slot, slot.sizing.config_hash, estimate, 2 * GIB, "fake")  # a peak kept
    assert slot.memory_bytes == estimate + GIB and slot.footprint.basis == "observed"
    view = FootprintView.of(slot)
    assert view.observed_bytes == estimate + GIB and view.observed_host_bytes == 3 * GIB
    table.observed(slot, "another-config", GIB, GIB, "fake")  # another launch: anew
    assert slot.seen is not None and slot.seen.device_bytes == GIB
    table.observed(slot, slot.sizing.config_hash, estimate + GIB, 3 * GIB, "fake")
    await h.manager.unload("chat")  # a transition: state.json takes it
    saved = h.manager.store.read("chat")
    assert saved is not None and saved.extra.seen is not None
    assert saved.extra.seen.device_bytes == estimate + GIB


def test_a_warning_is_said_once(tmp_path: Path) -> None:
    slot = SlotRecord(spec=slot_spec("chat", "tiny"), stack="t", model=None, breaker=Breaker())
    table = Harness(tmp_path).manager.core.table
    assert table.warned(slot, "k") is False and table.warned(slot, "k") is True
    assert table.warned(slot, "other") is False


class NvmlWithProcesses:
    """A fake pynvml whose GPU 0 runs ``pids`` at ``used`` bytes each."""

    def __init__(self, pids: set[int], used: int) -> None:
        self.pids, self.used = pids, used

    def nvmlInit(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(total=80 * GIB, free=40 * GIB, used=40 * GIB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        others = [SimpleNamespace(pid=1, usedGpuMemory=GIB)]  # not ours: not counted
        mine = [SimpleNamespace(pid=p, usedGpuMemory=self.used) for p in self.pids]
        return others + mine


def test_nvml_per_process_figures_of_a_process_tree() -> None:
    me = os.getpid()
    usage = ProcessUsage(NvmlProbe(NvmlWithProcesses({me}, 3 * GIB)))
    measured = usage.measure(me, "gpu", (0,))
    assert measured is not None and measured.source == "nvml"
    assert measured.device_bytes == 3 * GIB and measured.host_bytes > 0
    cpu = ProcessUsage().measure(me, "cpu")
    assert cpu is not None and cpu.device_bytes == cpu.host_bytes > 0 and cpu.source == "rss"
    assert ProcessUsage().measure(me, "gpu") is None  # no NVML: no GPU figure


class NoBinding(NvmlProbe):
    """The probe as a host without nvidia-ml-py has it."""

    def __init__(self) -> None:
        super().__init__(module=SimpleNamespace())
        self._nvml, self.error = None, "nvidia-ml-py is not installed"


async def test_a_gpu_refusal_without_a_probe_says_why_and_what_to_do(tmp_path: Path) -> None:
    probe = SystemMemoryProbe(nvml=NoBinding(), amd=AmdSysfsProbe(tmp_path / "no-drm"))
    h = Harness(tmp_path)
    h.manager.core.memory = h.manager.admission.memory = probe
    model = ModelSpec(id="m", source="demo://m", memory_gb=1.0)
    await h.manager.set_desired(desired([slot_spec("chat", "m")], [model]))
    error = h.manager.decide("chat").error
    assert isinstance(error, InsufficientMemory)
    assert "no memory probe answers for gpu" in error.message
    assert "nvidia-ml-py is not installed" in error.message
    assert "pip install nvidia-ml-py" in error.message
    assert error.details["probe"].startswith("nvidia-ml-py is not installed")


def test_llama_server_is_told_its_budget() -> None:
    spec = SlotSpec.model_validate(
        {"name": "chat", "provider": "llamacpp", "model": {"default": "m"}, "port": 9000}
    )
    gpus = (GpuRef(0, total_bytes=24 * GIB, free_bytes=20 * GIB),)
    assert placement_args(spec, gpus, 8 * GIB) == ("--fit-target", str(12 * 1024))
    two = (gpus[0], GpuRef(1, total_bytes=24 * GIB, free_bytes=10 * GIB))
    assert placement_args(spec, two, 4 * GIB) == ("--fit-target", f"{16 * 1024},{6 * 1024}")
    assert placement_args(spec, (GpuRef(0, total_bytes=24 * GIB),), 8 * GIB) == ()
    assert placement_args(spec, gpus, 0) == ()  # not counted: nothing to fit to
    own = spec.model_copy(
        update={"server": spec.server.model_copy(update={"extra_args": ["-fitt", "512"]})}
    )
    assert placement_args(own, gpus, 8 * GIB) == ()  # the slot's own fit flags rule
    old = spec.server.model_copy(update={"env": {"LLAMA_ARG_FIT": "off"}})  # an old binary
    assert placement_args(spec.model_copy(update={"server": old}), gpus, 8 * GIB) == ()


@pytest.mark.parametrize("shape", PANEL[:1])
def test_the_panel_writes_what_it_names(tmp_path: Path, shape: Shape) -> None:
    path = write_llama(tmp_path / "x.gguf", shape)
    model = read_gguf(path)
    assert model.n_layer == shape.n_layer and model.n_ff == shape.n_ff
    assert tensor_bytes(8, 64) == 68
