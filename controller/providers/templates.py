"""Provider templates: how each server kind is started and probed.

One small class per provider; each builds argv/image/env for a slot and its model and
says which sentinel request proves readiness. The controller owns placement flags
(``--host``, ``--port``, GPU layers, device visibility); the guard refuses them in
``server.extra_args`` so they can only come from here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import controller
from controller.model.devices import GpuRef
from controller.model.errors import SlotConfigError
from controller.probes.readiness import ProbeSpec
from controller.providers.base import (
    LIVENESS_PATH,
    READY_LOG,
    BuildContext,
    adapter_path,
    default_probe,
    device_env,
    model_path,
    require_model,
    sleep_mode,
)
from controller.providers.sampling import sampling_args
from controller.runtime.base import LaunchSpec, ModelPull, Mount, RuntimeKind
from controller.spec.adapters import serves_adapter
from controller.spec.schema import ModelSpec, SlotSpec

__all__ = [
    "DemoProvider",
    "GenericProvider",
    "LlamaCppProvider",
    "LlamaCppPythonProvider",
    "VllmProvider",
]

# The package root (parent of ``controller/``), mounted into demo containers.
PACKAGE_ROOT = str(Path(controller.__file__).resolve().parent.parent)


def _launch(
    slot: SlotSpec,
    model: ModelSpec | None,
    ctx: BuildContext,
    argv: list[str],
    *,
    image: str | None = None,
    path: str | None = None,
    mounts: tuple[Mount, ...] = (),
    probe: ProbeSpec | None = None,
    env: dict[str, str] | None = None,
    command: tuple[str, ...] = (),
) -> LaunchSpec:
    model_id = model.id if model else slot.model_id
    sleep = sleep_mode(slot)
    merged_env = {**device_env(slot), **(env or {}), **slot.server.env}
    if sleep is not None:  # the controller's, after the slot's own (VLLM_SERVER_DEV_MODE)
        argv = [*argv, *sleep.argv]
        merged_env.update(sleep.env)
    if (
        ctx.runtime is RuntimeKind.KUBERNETES and slot.device_ref.pinned
    ):  # the load refused it first
        raise SlotConfigError(
            f"slot {slot.name!r}: device = {slot.device!r} pins GPUs, which the kubernetes "
            "runtime cannot do (the device plugin picks a node's GPUs): use device = "
            '"gpu" with gpus = K, and `node` to choose the node',
            keys=["device"],
            slot=slot.name,
        )
    if path and ctx.runtime is RuntimeKind.DOCKER:
        mounts = (*mounts, Mount(path, path, read_only=True))
    if ctx.runtime is RuntimeKind.DOCKER:  # its adapters' files, where its server reads them
        mounts = (*mounts, *(Mount(p, p, read_only=True) for p in _adapter_files(slot, ctx)))
    pull = None
    if ctx.runtime is RuntimeKind.KUBERNETES:
        # The model file is in the pod (the slot's volume at the models dir, or the image):
        # the controller cannot look for it, and host paths mean nothing on another node.
        # A source that can be pulled is pulled there, by the pod's init container, into
        # the node's model cache; a slot that names its own volume brings its files.
        path, mounts = None, ()
        if slot.server.volume:
            mounts = (Mount(slot.server.volume, str(ctx.models_dir), read_only=True),)
        else:
            pull = model_pull(model, ctx)
    probe = probe or default_probe(slot, model_id)
    if probe.ready_log is None and slot.provider in READY_LOG:
        probe = replace(probe, ready_log=READY_LOG[slot.provider])
    if probe.liveness_path is None and slot.provider in LIVENESS_PATH:
        probe = replace(probe, liveness_path=LIVENESS_PATH[slot.provider])
    if slot.port is None:  # build_launch refuses it first
        raise SlotConfigError(f"slot {slot.name!r}: no port chosen yet", keys=["port"])
    return LaunchSpec(
        slot=slot.name,
        stack=ctx.stack,
        provider=slot.provider,
        port=slot.port,
        device=slot.device,
        gpus=slot.gpu_count,
        model_id=model_id,
        argv=tuple(argv),
        image=image,
        command=command,
        env=merged_env,
        host=ctx.host,
        model_source=model.source if model else None,
        model_path=path,
        mounts=mounts,
        probe=probe,
        node=slot.node if ctx.runtime is RuntimeKind.KUBERNETES else None,
        sleep=sleep,
        pull=pull,
    )


def model_pull(model: ModelSpec | None, ctx: BuildContext) -> ModelPull | None:
    """What a pod pulls before its server starts: ``model``'s files when its source can be
    pulled (``hf://``, ``http(s)://``) — local paths and ``demo://`` are not."""
    source = model.source if model is not None else None
    if model is None or not source or not source.startswith(("hf://", "http://", "https://")):
        return None
    return ModelPull(
        model=model.id,
        source=source,
        models_dir=str(ctx.models_dir),
        sha256=model.sha256,
        revision=model.revision,
        include=tuple(model.include or ()),
        exclude=tuple(model.exclude or ()),
    )


def _docker_image(slot: SlotSpec, ctx: BuildContext, default: str | None) -> str | None:
    if ctx.runtime not in (RuntimeKind.DOCKER, RuntimeKind.KUBERNETES):
        return None
    image = slot.server.image or default
    if not image:
        raise SlotConfigError(
            f"slot {slot.name!r}: the {ctx.runtime} runtime needs server.image",
            keys=["server.image"],
        )
    return image


# vLLM attaches its runtime adapter routes only with this set (docs/adapters.md).
RUNTIME_LORA_ENV: Final = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def _adapter_files(slot: SlotSpec, ctx: BuildContext) -> list[str]:
    """The files of every adapter ``slot`` may load (its start-time ones, or all of its
    base's for a runtime API), in id order: what a container must see."""
    ids = sorted(a.id for a in ctx.adapters.values() if serves_adapter(slot, a))
    return list(dict.fromkeys(adapter_path(ctx.adapters[a], ctx) for a in ids))


def _start_adapters(slot: SlotSpec, ctx: BuildContext) -> list[str]:
    """The files of the adapters ``slot`` is started with, in its order (a start-time
    engine's ``lora`` ids are these positions); one not declared is skipped (the
    validation refused it first)."""
    return [adapter_path(ctx.adapters[a], ctx) for a in slot.adapters if a in ctx.adapters]


@dataclass(frozen=True, slots=True)
class DemoProvider:
    """slotctl's own OpenAI-compatible demo server (``python -m controller.demo``)."""

    name: str = "demo"

    def build(self, slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> LaunchSpec:
        model_id = model.id if model else slot.model_id
        args = ["--host", ctx.host, "--port", str(slot.port)]
        if model_id:
            args += ["--model", model_id]
        lora_env: dict[str, str] = {}
        if slot.max_loras and slot.lora_api in ("vllm", "sglang"):  # vLLM's and SGLang's doubles
            args += ["--max-loras", str(slot.max_loras)]
            if slot.lora_api == "vllm":
                lora_env[RUNTIME_LORA_ENV] = "True"
        args += sampling_args(self.name, model)
        args += slot.server.extra_args
        python = slot.server.binary or sys.executable
        argv = [python, "-m", "controller.demo", *args]
        mounts: tuple[Mount, ...] = ()
        command: tuple[str, ...] = ()
        # On the kubernetes runtime a demo slot runs slotctl's own image by default (the
        # operator's: it carries the demo server), so a stack of demo slots needs no image.
        image = _docker_image(slot, ctx, ctx.image)
        env: dict[str, str] = dict(lora_env)
        if image and ctx.runtime is RuntimeKind.KUBERNETES:
            # the image's interpreter as the container's command: slotctl's image has the
            # entrypoint `slotctl`, which would take the args as a subcommand
            command, argv = (slot.server.binary or "python3",), argv[1:]
        elif image:
            # The container runs the host's interpreter and this package, read-only.
            roots = sorted({sys.prefix, sys.base_prefix, PACKAGE_ROOT})
            mounts = tuple(Mount(r, r) for r in roots)
            env["PYTHONPATH"] = PACKAGE_ROOT
        probe = default_probe(slot, model_id)
        return _launch(
            slot,
            model,
            ctx,
            argv,
            image=image,
            mounts=mounts,
            probe=probe,
            env=env,
            command=command,
        )


# llama-server's memory fitting (tools/server/README.md): "-fit, --fit [on|off] whether to
# adjust unset arguments to fit in device memory (default: 'on')"; "-fitt, --fit-target
# MiB0,MiB1,... target margin per device for --fit, comma-separated list of values, single
# value is broadcast across all devices, default: 1024".
FIT_FLAGS: Final = frozenset({"-fit", "--fit", "-fitt", "--fit-target", "-fitc", "--fit-ctx"})
# Their environment forms ("(env: LLAMA_ARG_FIT)", "(env: LLAMA_ARG_FIT_TARGET)"): set in
# the slot's server.env, they rule too — and a llama-server older than --fit ignores them,
# where it would refuse the flag.
FIT_ENV: Final = frozenset({"LLAMA_ARG_FIT", "LLAMA_ARG_FIT_TARGET", "LLAMA_ARG_FIT_CTX"})


@dataclass(frozen=True, slots=True)
class LlamaCppProvider:
    """llama.cpp's ``llama-server`` (binary for the process runtime, image for docker).

    Told its budget (``placement_args``): its ``--fit`` (on by default) fits what it
    leaves unset (the context, when the model declares none) to the free memory of each
    GPU less ``--fit-target``; slotctl sets that margin to the GPU's free memory at start
    less the admitted share, so llama-server fits into what admission counted.
    """

    name: str = "llamacpp"
    image: str = "ghcr.io/ggml-org/llama.cpp:server"

    def placement_args(
        self, slot: SlotSpec, gpus: tuple[GpuRef, ...], share_bytes: int
    ) -> tuple[str, ...]:
        """``--fit-target`` per GPU (MiB): its free memory now less the admitted share;
        nothing when the share is not counted, a free figure is not known, or the slot
        sets a fit flag itself (``extra_args``, or its ``LLAMA_ARG_FIT*`` variable in
        ``server.env``: theirs rule)."""
        if not gpus or share_bytes <= 0 or any(g.free_bytes is None for g in gpus):
            return ()
        if any(arg.split("=", 1)[0] in FIT_FLAGS for arg in slot.server.extra_args):
            return ()
        if FIT_ENV & set(slot.server.env):  # e.g. LLAMA_ARG_FIT=off: an older binary
            return ()
        margins = [max(0, (g.free_bytes or 0) - share_bytes) // 1024**2 for g in gpus]
        return ("--fit-target", ",".join(str(m) for m in margins))

    def build(self, slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> LaunchSpec:
        model = require_model(slot, model)
        path = model_path(model, ctx)
        args = ["--model", str(path), "--host", ctx.host, "--port", str(slot.port)]
        args += ["--alias", model.id]
        if model.context_length:
            args += ["--ctx-size", str(model.context_length)]
        args += ["--n-gpu-layers", "0" if slot.device_kind == "cpu" else "999"]
        if slot.device_kind == "gpu":  # across the GPUs it is given (it sees only those)
            args += ["--split-mode", "layer" if slot.gpu_count > 1 else "none"]
        if model.mmproj:
            args += ["--mmproj", model.mmproj]
        if model.chat_template:
            args += ["--chat-template", model.chat_template]
        if slot.type == "embedding":
            args += ["--embeddings"]
        loras = _start_adapters(slot, ctx)
        for lora in loras:  # loaded at scale 0: a request's `lora` field picks its own
            args += ["--lora", lora]
        if loras:
            args += ["--lora-init-without-apply"]
        args += sampling_args(self.name, model)  # the model's defaults; a request's win
        args += slot.server.extra_args
        image = _docker_image(slot, ctx, self.image)
        argv = args if image else [slot.server.binary or "llama-server", *args]
        probe = default_probe(slot, model.id)
        return _launch(slot, model, ctx, argv, image=image, path=path, probe=probe)


@dataclass(frozen=True, slots=True)
class LlamaCppPythonProvider:
    """llama-cpp-python's OpenAI server (``python -m llama_cpp.server``)."""

    name: str = "llama-cpp-python"

    def build(self, slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> LaunchSpec:
        model = require_model(slot, model)
        path = model_path(model, ctx)
        args = ["-m", "llama_cpp.server", "--model", str(path)]
        args += ["--host", ctx.host, "--port", str(slot.port), "--model_alias", model.id]
        if model.context_length:
            args += ["--n_ctx", str(model.context_length)]
        args += ["--n_gpu_layers", "0" if slot.device_kind == "cpu" else "-1"]
        if slot.device_kind == "gpu":  # llama_cpp's LLAMA_SPLIT_MODE_LAYER (1) or _NONE (0)
            args += ["--split_mode", "1" if slot.gpu_count > 1 else "0"]
        if slot.type == "embedding":
            args += ["--embedding", "true"]
        if model.chat_template and not any(c in model.chat_template for c in "{%"):
            # llama_cpp.server takes a chat *format name* (chatml, llama-2...), not Jinja.
            args += ["--chat_format", model.chat_template]
        for lora in _start_adapters(slot, ctx)[:1]:  # its server takes one, always applied
            args += ["--lora_path", lora]
        args += slot.server.extra_args
        image = _docker_image(slot, ctx, None)
        python = slot.server.binary or ("python3" if image else sys.executable)
        probe = default_probe(slot, model.id)
        return _launch(slot, model, ctx, [python, *args], image=image, path=path, probe=probe)


@dataclass(frozen=True, slots=True)
class VllmProvider:
    """vLLM's OpenAI server (``vllm serve`` or the vllm-openai image).

    vLLM preallocates ``--gpu-memory-utilization`` (default 0.9) of *each* GPU it is given,
    whatever the slot's estimate says: two slots placed on one GPU would each claim 90 %
    of it. So it is told its admitted share (``placement_args``).
    """

    name: str = "vllm"
    image: str = "vllm/vllm-openai:latest"

    def placement_args(
        self, slot: SlotSpec, gpus: tuple[GpuRef, ...], share_bytes: int
    ) -> tuple[str, ...]:
        """``--gpu-memory-utilization`` = the admitted share of the smallest of its GPUs
        (0.05..0.95); nothing when the share is not counted (``memory_gb = 0``) or a GPU's
        size is not known."""
        totals = [g.total_bytes for g in gpus]
        if not gpus or share_bytes <= 0 or any(not t for t in totals):
            return ()
        fraction = min(0.95, max(0.05, share_bytes / min(t for t in totals if t)))
        return ("--gpu-memory-utilization", f"{fraction:.3f}")

    def build(self, slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> LaunchSpec:
        model = require_model(slot, model)
        path = model_path(model, ctx)
        args = ["--host", ctx.host, "--port", str(slot.port), "--served-model-name", model.id]
        if model.context_length:
            args += ["--max-model-len", str(model.context_length)]
        if slot.type == "embedding":
            args += ["--task", "embed"]
        if slot.gpu_count > 1:  # tensor parallel over the GPUs it is given
            args += ["--tensor-parallel-size", str(slot.gpu_count)]
        env: dict[str, str] = {}
        if slot.max_loras:  # adapters loaded at run time (controller/slots/adapters.py)
            args += ["--enable-lora", "--max-loras", str(slot.max_loras)]
            args += ["--max-lora-rank", str(slot.max_lora_rank)]
            env[RUNTIME_LORA_ENV] = "True"
        args += sampling_args(self.name, model)  # over generation_config.json's
        args += slot.server.extra_args
        image = _docker_image(slot, ctx, self.image)
        argv = (
            ["--model", str(path), *args]
            if image
            else [slot.server.binary or "vllm", "serve", str(path), *args]
        )
        probe = default_probe(slot, model.id)
        return _launch(slot, model, ctx, argv, image=image, path=path, probe=probe, env=env)


@dataclass(frozen=True, slots=True)
class GenericProvider:
    """Any OpenAI-compatible server from a command template (also the self-managed ones).

    ``server.cmd`` is the argv template; ``{host}``, ``{port}``, ``{model_id}`` and
    ``{model_path}`` are substituted. Self-managed providers (kokoro, qwen3tts,
    moonshine, vibevoice) serve a baked-in model and are probed by their models list.
    """

    name: str
    self_managed: bool = False

    def build(self, slot: SlotSpec, model: ModelSpec | None, ctx: BuildContext) -> LaunchSpec:
        if not self.self_managed:
            model = require_model(slot, model)
        path = model_path(model, ctx)
        image = _docker_image(slot, ctx, None)
        template = list(slot.server.cmd or [])
        if not template and not image:
            raise SlotConfigError(
                f"slot {slot.name!r} (provider {self.name}) needs server.cmd "
                "(the server's argv, with {host}, {port}, {model_id}, {model_path})",
                keys=["server.cmd"],
            )
        values = {
            "host": ctx.host,
            "port": str(slot.port),
            "model_id": model.id if model else slot.model_id,
            "model_path": path or "",
        }
        argv = [_substitute(arg, values) for arg in template] + list(slot.server.extra_args)
        probe = (
            ProbeSpec()
            if self.self_managed or slot.type not in ("llm", "embedding")
            else default_probe(slot, values["model_id"])
        )
        return _launch(slot, model, ctx, argv, image=image, path=path, probe=probe)


def _substitute(arg: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg
