"""GPUs in the desired state and at the runtimes' edge: the ``device`` field, ``gpus``, the
guard's refusals with their hints, the validate warning for pinned autoload slots, and
what each provider and runtime is given for a placement (flags, visibility, device
requests, a pod's GPU count)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from controller.model.devices import GpuRef, key_index, key_kind, parse_device, share
from controller.model.errors import SlotConfigError
from controller.providers.base import BuildContext
from controller.providers.launch import build_launch
from controller.providers.quadlet import render_quadlet
from controller.runtime.base import visibility_env
from controller.runtime.docker.spec import device_options
from controller.runtime.kubernetes.spec import deployment_body
from controller.spec.guard import guard_slot_write_payload
from controller.spec.loader import DesiredSlot, load_stack_texts
from controller.spec.schema import ControllerSettings, ModelSpec, SlotSpec

UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def _slot(**kw: Any) -> SlotSpec:
    data: dict[str, Any] = {
        "name": "chat",
        "provider": "vllm",
        "port": 8081,
        "model": {"default": "qwen"},
    }
    data.update(kw)
    return SlotSpec.model_validate(data)


MODEL = ModelSpec(id="qwen", source="/models/qwen", memory_gb=16)

# ----------------------------------------------------------------- the device field


@pytest.mark.parametrize(
    ("value", "kind", "pins"),
    [
        ("gpu", "gpu", ()),
        ("cpu", "cpu", ()),
        ("npu", "npu", ()),
        ("gpu:1", "gpu", ("1",)),
        (f"gpu:{UUID0}", "gpu", (UUID0,)),
        ("gpu:2,3", "gpu", ("2", "3")),
    ],
)
def test_device_values(value: str, kind: str, pins: tuple[str, ...]) -> None:
    ref = parse_device(value)
    assert (ref.kind, ref.pins) == (kind, pins)
    spec = _slot(device=value)
    assert spec.device_kind == kind and spec.device_ref.pins == pins
    assert spec.gpu_count == (len(pins) or 1 if kind == "gpu" else 0)


@pytest.mark.parametrize(
    "value",
    [
        "GPU",
        "gpu:",
        "gpu:x",
        "gpu:1,1",
        "cpu:0",
        "gpu:1,",
        "gpu:01234",
        "tpu",
        "gpu: 1",
        "gpu:MIG-1",
    ],
)
def test_bad_devices_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="device"):
        parse_device(value)
    with pytest.raises(ValidationError) as info:
        _slot(device=value)
    assert info.value.errors()[0]["loc"] == ("device",)


def test_gpus_spans_and_its_checks() -> None:
    assert _slot(gpus=4).gpu_count == 4
    assert _slot(device="gpu:0,1", gpus=2).gpu_count == 2
    assert _slot(device="cpu").gpu_count == 0
    for bad in ({"device": "cpu", "gpus": 2}, {"device": "gpu:0", "gpus": 2}, {"gpus": 0}):
        with pytest.raises(ValidationError) as info:
            _slot(**bad)
        assert info.value.errors()[0]["loc"] == ("gpus",), bad


def test_keys_and_shares() -> None:
    assert (
        key_kind("gpu:3") == "gpu" and key_kind("node-a/gpu") == "gpu" and key_kind("cpu") == "cpu"
    )
    assert key_index("gpu:3") == 3 and key_index("gpu") is None and key_index("cpu") is None
    assert share(10, 3) == 4 and share(10, 1) == 10 and share(10, 0) == 10  # rounded up


def test_budgets_per_gpu() -> None:
    ControllerSettings(memory_budget_gb={"gpu": 22, "gpu:1": 10, "cpu": 32})
    with pytest.raises(ValidationError, match="per GPU index"):
        ControllerSettings(memory_budget_gb={"gpu:x": 10})


# ----------------------------------------------------------------- the guard


@pytest.mark.parametrize(
    ("server", "key"),
    [
        ({"env": {"CUDA_VISIBLE_DEVICES": "1"}}, "server.env.CUDA_VISIBLE_DEVICES"),
        ({"env": {"ROCR_VISIBLE_DEVICES": "0"}}, "server.env.ROCR_VISIBLE_DEVICES"),
        ({"extra_args": ["--tensor-parallel-size", "2"]}, "server.extra_args[0]"),
        ({"extra_args": ["--split-mode=row"]}, "server.extra_args[0]"),
        ({"extra_args": ["--main-gpu", "1"]}, "server.extra_args[0]"),
    ],
)
def test_the_guard_refuses_placement_flags_and_names_device_and_gpus(
    server: dict[str, Any], key: str
) -> None:
    payload = {"name": "chat", "provider": "vllm", "port": 8081, "server": server}
    with pytest.raises(SlotConfigError) as info:
        guard_slot_write_payload(payload, others=[], catalogue=None)
    (problem,) = [p for p in info.value.problems if p["key"] == key]
    assert problem["code"] == "slot.hardware_flag"
    assert "`device`" in problem["hint"] and "`gpus`" in problem["hint"], problem["hint"]


def test_the_guard_accepts_pins_and_spans() -> None:
    payload = {"name": "chat", "provider": "vllm", "port": 8081, "device": "gpu:1,2"}
    assert guard_slot_write_payload(payload, others=[], catalogue=None).gpu_count == 2


# ----------------------------------------------------------------- stack validate


STACK = """
[stack]
name = "t"
[[model]]
id = "a"
memory_gb = 10
[[model]]
id = "b"
memory_gb = 10
[[slot]]
name = "one"
provider = "demo"
port = 9001
model.default = "a"
priority = 90
device = "gpu:1"
[[slot]]
name = "two"
provider = "demo"
port = 9002
model.default = "b"
priority = 10
device = "DEVICE"
"""


def _warnings(device: str, budgets: dict[str, float]) -> list[Any]:
    settings = ControllerSettings(memory_budget_gb=budgets, safety_margin_gb=0.5)
    report = load_stack_texts([("t.toml", STACK.replace("DEVICE", device))], settings)
    assert report.ok, report.errors
    return [w for w in report.warnings if w.code == "slot.autoload_over_budget"]


def test_validate_warns_when_autoload_slots_pinned_to_one_gpu_cannot_all_fit_it() -> None:
    (warning,) = _warnings("gpu:1", {"gpu": 16})
    assert warning.slot == "two" and "gpu:1" in warning.message
    assert "wait for memory" in warning.message
    assert _warnings("gpu:0", {"gpu": 16}) == []  # each pinned to its own GPU
    assert _warnings("gpu:1", {"gpu": 16, "gpu:1": 24}) == []  # GPU 1's own budget
    # unpinned on a host whose budgets name two GPUs: judged against both together
    assert _warnings("gpu", {"gpu:0": 12, "gpu:1": 12}) == []
    assert len(_warnings("gpu", {"gpu:0": 8, "gpu:1": 12})) == 1


# ----------------------------------------------------------------- providers


def _argv(slot: SlotSpec, runtime: str = "process") -> list[str]:
    model = ModelSpec(id="qwen", source="/models/qwen.gguf", memory_gb=16)
    return list(build_launch(slot, model, BuildContext(runtime=runtime)).argv)


def test_provider_flags_follow_the_span() -> None:
    assert "--tensor-parallel-size" not in _argv(_slot())
    tp = _argv(_slot(gpus=2))
    assert tp[tp.index("--tensor-parallel-size") + 1] == "2"
    one = _argv(_slot(provider="llamacpp"))
    assert one[one.index("--split-mode") + 1] == "none"
    two = _argv(_slot(provider="llamacpp", device="gpu:0,1"))
    assert two[two.index("--split-mode") + 1] == "layer"
    assert "--split-mode" not in _argv(_slot(provider="llamacpp", device="cpu"))
    py = _argv(_slot(provider="llama-cpp-python", gpus=2))
    assert py[py.index("--split_mode") + 1] == "1"


def test_the_span_is_part_of_the_config_hash_and_the_placement_is_not() -> None:
    model = ModelSpec(id="qwen", source="demo://qwen", memory_gb=16)
    demo = _slot(provider="demo")
    base = build_launch(demo, model, BuildContext())
    assert build_launch(_slot(provider="demo", gpus=2), model, BuildContext()).config_hash() != (
        base.config_hash()
    )
    placed = base.placed_on((GpuRef(1, UUID1, "nvidia"),))
    assert placed.config_hash() == base.config_hash() and placed.visible != base.visible
    pinned = build_launch(_slot(provider="demo", device="gpu:1"), model, BuildContext())
    assert pinned.config_hash() != base.config_hash()  # a new pin is a new config


def test_kubernetes_refuses_pins_and_asks_for_the_span() -> None:
    with pytest.raises(SlotConfigError, match="device plugin") as info:
        build_launch(
            _slot(device="gpu:1", server={"image": "x"}), MODEL, BuildContext("kubernetes")
        )
    assert info.value.keys == ["device"]
    launch = build_launch(_slot(gpus=2, server={"image": "x"}), MODEL, BuildContext("kubernetes"))
    body = deployment_body(launch, "default")
    resources = body["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {"limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "2"}}
    one = deployment_body(
        build_launch(_slot(server={"image": "x"}), MODEL, BuildContext("kubernetes")), "default"
    )
    assert one["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "1"
    }


# ----------------------------------------------------------------- runtimes


def test_visibility_env() -> None:
    nvidia = (GpuRef(1, UUID1, "nvidia"), GpuRef(0, UUID0, "nvidia"))
    assert visibility_env(nvidia) == {"CUDA_VISIBLE_DEVICES": f"{UUID1},{UUID0}"}
    by_index = (GpuRef(2, None, "nvidia"),)
    assert visibility_env(by_index) == {
        "CUDA_VISIBLE_DEVICES": "2",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert visibility_env(by_index, in_container=True) == {}  # the device request chose it
    amd = (GpuRef(1, None, "amd"), GpuRef(3, None, "amd"))
    assert visibility_env(amd) == {"ROCR_VISIBLE_DEVICES": "1,3", "HIP_VISIBLE_DEVICES": "0,1"}
    unknown = visibility_env((GpuRef(1),))  # a budget-only GPU: both vendors' variables
    assert unknown["CUDA_VISIBLE_DEVICES"] == "1" and unknown["ROCR_VISIBLE_DEVICES"] == "1"
    assert visibility_env(()) == {}


def test_docker_requests_exactly_the_placed_gpus() -> None:
    placed = (GpuRef(1, UUID1, "nvidia"), GpuRef(2, None, "nvidia"))
    (request,) = device_options("gpu:1,2", ["runc", "nvidia"], gpus=placed)["device_requests"]
    assert request["DeviceIDs"] == [UUID1, "2"] and request["Capabilities"] == [["gpu"]]
    assert request["Count"] == 0
    (every,) = device_options("gpu", ["nvidia"])["device_requests"]
    assert every["Count"] == -1  # no placement given: every GPU, as before


def test_quadlet_adds_the_pinned_gpus() -> None:
    models = {"qwen": ModelSpec(id="qwen", source="demo://qwen", memory_gb=1)}

    def unit(**kw: Any) -> list[str]:
        spec = _slot(provider="demo", server={"image": "demo:latest"}, **kw)
        return render_quadlet(DesiredSlot(spec=spec, stack="t"), models).splitlines()

    pinned = unit(device="gpu:1,2")
    assert "AddDevice=nvidia.com/gpu=1" in pinned and "AddDevice=nvidia.com/gpu=2" in pinned
    assert "AddDevice=nvidia.com/gpu=all" in unit()


def test_vllm_is_told_its_share_of_the_gpu_and_the_others_are_not() -> None:
    from controller.providers.launch import placement_args

    gpus = (GpuRef(0, UUID0, "nvidia", total_bytes=24 * 1024**3),)
    assert placement_args(_slot(), gpus, 8 * 1024**3) == ("--gpu-memory-utilization", "0.333")
    tp = (gpus[0], GpuRef(1, UUID1, "nvidia", total_bytes=16 * 1024**3))
    assert placement_args(_slot(gpus=2), tp, 8 * 1024**3) == ("--gpu-memory-utilization", "0.500")
    assert placement_args(_slot(), gpus, 40 * 1024**3)[1] == "0.950"  # capped
    assert placement_args(_slot(), gpus, 0) == ()  # not counted: vLLM's own default
    assert placement_args(_slot(), (GpuRef(0),), 8 * 1024**3) == ()  # size unknown
    assert placement_args(_slot(provider="llamacpp"), gpus, 8 * 1024**3) == ()
