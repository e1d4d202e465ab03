"""Footprints: what a server will hold, estimated from its model file and its launch.

Pure (a function of numbers; the headers are read by :mod:`controller.modelfiles.headers`,
the observed use by :mod:`controller.probes.usage`). Three figures meet here
(docs/design/0022-footprints.md):

* **declared**: a ``memory_gb`` the stack sets (the slot's, else its model's);
* **estimated**: :func:`estimate_gguf` (llama.cpp servers) or :func:`estimate_safetensors`
  (vLLM), each part named — weights (by tensor type), the KV cache at the launch's context
  and cache types, compute buffers, what stays in host memory;
* **observed**: the most the server was seen to use (:class:`Observed`).

:func:`choose` says which one admission counts: the declared figure when there is one (a
user's word; a warning when it is below what was seen), else the larger of the estimate
and what was seen. Each is in bytes.

Sources of the arithmetic (docs/design/0022-footprints.md cites them): the GGUF layout
(ggml's ``docs/gguf.md``), llama-server's README (``-c`` is the whole KV pool shared by
``-np`` sequences, ``-ctk``/``-ctv`` default f16, ``-ub`` 512, ``-fa`` auto, ``-cram``
8192 MiB, ``-fit``/``-fitt``), and the compute buffer's size as llama.cpp's graph
allocator reports it (``sched_reserve: CPU compute buffer size``), fitted on the panel of
``tests/integration/panel_gguf.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from controller.model.sizes import MIB
from controller.model.weights import GGML_TYPES, GgufModel, SafetensorsModel

__all__ = [
    "CACHE_RAM_DEFAULT_MIB",
    "ENGINE_BASELINE",
    "Choice",
    "Estimate",
    "LaunchFacts",
    "Observed",
    "choose",
    "estimate_gguf",
    "estimate_safetensors",
    "launch_facts",
]


# llama-server's host prompt cache (`-cram, --cache-ram N`: "set the maximum cache size in
# MiB (default: 8192, -1 - no limit, 0 - disable)", tools/server/README.md).
CACHE_RAM_DEFAULT_MIB: Final = 8192
# llama-server: `-ub, --ubatch-size N` physical maximum batch size (default: 512).
UBATCH_DEFAULT: Final = 512

# What the engine's own process holds besides the model (interpreter, libraries, HTTP
# server), in host memory: measured here (bench/footprint_estimate.py prints it again),
# not read from a document. llama-cpp-python 0.3.36's server (Python, FastAPI, uvicorn,
# libllama) serving the panel's smallest model, less its weights and buffers; llama-server
# (C++) is taken at a fifth of that.
ENGINE_BASELINE: Final[dict[str, int]] = {
    "llama-cpp-python": 84 * MIB,
    "llamacpp": 16 * MIB,
}
# vLLM, besides weights and KV: activations of the profiling run, CUDA graphs, the CUDA
# context. Its docs size these from `--gpu-memory-utilization` (it takes its share and fills
# the rest with KV blocks), so the estimate counts one sequence at max_model_len and this.
VLLM_OVERHEAD: Final = 2 * 1024 * MIB

Engine = Literal["llamacpp", "llama-cpp-python", "vllm", "other"]


@dataclass(frozen=True, slots=True)
class LaunchFacts:
    """What a server's argv says of its memory (:func:`launch_facts`)."""

    engine: Engine
    device: str  # gpu | cpu | npu
    context: int | None = None  # None: the model's own (n_ctx_train, max_position)
    parallel: int = 1
    cache_k: str = "f16"
    cache_v: str = "f16"
    gpu_layers: int | None = None  # None: every layer (-ngl 999 / -1)
    kv_offload: bool = True
    ubatch: int = UBATCH_DEFAULT
    flash_attn: bool = True
    cache_ram_mib: int = 0  # llama-server's host prompt cache (its default: 8192)
    per_slot_ctx: int | None = None  # llama-server's --kv-unified-per-slot


def _flag_values(argv: Sequence[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` pairs of an argv, flags with "_" as "-"."""
    out: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            continue
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-") if name.startswith("--") else name
        if eq:
            out[name] = value
        elif i + 1 < len(argv):
            out[name] = argv[i + 1]
        else:
            out[name] = ""
    return out


def _int(values: dict[str, str], *names: str) -> int | None:
    for name in names:
        if name in values:
            try:
                return int(values[name])
            except ValueError:
                return None
    return None


def launch_facts(engine: str, device: str, argv: Sequence[str]) -> LaunchFacts:
    """The memory facts of a server's argv (llama-server's, llama-cpp-python's, vLLM's
    flags; a flag it does not know is ignored)."""
    v = _flag_values(argv)
    kind: Engine = engine if engine in ("llamacpp", "llama-cpp-python", "vllm") else "other"  # type: ignore[assignment]
    context = _int(v, "--ctx-size", "-c", "--n-ctx", "--max-model-len")
    layers = _int(v, "--n-gpu-layers", "-ngl", "--gpu-layers")
    if layers is not None and layers < 0:
        layers = None  # llama-cpp-python's -1: all
    if device != "gpu":
        layers = 0
    if kind == "llama-cpp-python":
        fa = v.get("--flash-attn", "false").lower() in ("true", "1", "on")
        ub = _int(v, "--n-ubatch") or UBATCH_DEFAULT
        return LaunchFacts(
            kind,
            device,
            context=context or None,
            cache_k=_cache_type(v.get("--type-k")),
            cache_v=_cache_type(v.get("--type-v")),
            gpu_layers=layers,
            kv_offload=v.get("--offload-kqv", "true").lower() not in ("false", "0"),
            ubatch=ub,
            flash_attn=fa,
        )
    parallel = _int(v, "--parallel", "-np") or 1
    cram = _int(v, "--cache-ram", "-cram")
    return LaunchFacts(
        kind,
        device,
        context=context or None,
        parallel=max(1, parallel),
        cache_k=(v.get("--cache-type-k") or v.get("-ctk") or "f16").lower(),
        cache_v=(v.get("--cache-type-v") or v.get("-ctv") or "f16").lower(),
        gpu_layers=layers,
        kv_offload=not any(a in ("--no-kv-offload", "-nkvo") for a in argv),
        ubatch=_int(v, "--ubatch-size", "-ub") or UBATCH_DEFAULT,
        flash_attn=(v.get("--flash-attn") or v.get("-fa") or "auto").lower() != "off",
        cache_ram_mib=(CACHE_RAM_DEFAULT_MIB if cram is None else cram)
        if kind == "llamacpp"
        else 0,
        per_slot_ctx=_int(v, "--kv-unified-per-slot"),
    )


def _cache_type(value: str | None) -> str:
    """llama-cpp-python's ``--type_k``/``--type_v``: a ggml type id (default f16)."""
    if value is None:
        return "f16"
    try:
        return GGML_TYPES[int(value)][0]
    except (ValueError, KeyError):
        return value.lower()


@dataclass(frozen=True, slots=True)
class Estimate:
    """A server's estimated memory, by part (bytes). ``device`` is what admission counts
    on the slot's device (the GPU, or system memory for a CPU slot); ``host`` what stays
    in host memory besides (a GPU slot's CPU layers, the prompt cache, the engine)."""

    source: str  # gguf | safetensors
    context: int  # the KV cache's tokens
    parallel: int
    cache_type: str  # k/v
    weights_device: int
    weights_host: int
    kv_device: int
    kv_host: int
    buffers_device: int
    buffers_host: int
    prompt_cache: int  # llama-server's --cache-ram ceiling (host)
    engine: int  # the engine's own process (host)
    by_type: tuple[tuple[str, int], ...]
    layers_on_device: int
    layers: int
    notes: tuple[str, ...] = ()
    on_gpu: bool = True

    @property
    def weights(self) -> int:
        return self.weights_device + self.weights_host

    @property
    def kv(self) -> int:
        return self.kv_device + self.kv_host

    @property
    def buffers(self) -> int:
        return self.buffers_device + self.buffers_host

    @property
    def host(self) -> int:
        """What stays in host memory (a CPU slot: everything)."""
        return (
            self.weights_host + self.kv_host + self.buffers_host + self.prompt_cache + self.engine
        )

    @property
    def device(self) -> int:
        """The bytes admission counts on the slot's device."""
        gpu = self.weights_device + self.kv_device + self.buffers_device
        return gpu if self.on_gpu else gpu + self.host


def estimate_gguf(model: GgufModel, launch: LaunchFacts) -> Estimate:
    """llama.cpp's memory for ``model`` under ``launch``: weights by layer (the first
    ``n_layer - gpu_layers`` stay on the CPU; the input embeddings always do; the output
    goes with the last layer), the KV cache (``-c`` tokens — the whole pool the ``-np``
    sequences share; the model's ``n_ctx_train`` when not set; ``--kv-unified-per-slot N``
    alone: ``N x -np``), the compute buffer (the graph allocator's peak: the logits, the
    FFN and, without flash attention, the attention scores of one ubatch), the prompt
    cache (llama-server's ``--cache-ram``, a ceiling) and the engine."""
    on_gpu = launch.device == "gpu"
    n_layer = model.n_layer
    offloaded = n_layer if launch.gpu_layers is None else max(0, min(n_layer, launch.gpu_layers))
    if not on_gpu:
        offloaded = 0
    first_gpu = n_layer - offloaded
    gpu_layers = range(first_gpu, n_layer)
    notes: list[str] = []
    context = launch.context
    if context is None:
        if launch.per_slot_ctx:
            context = launch.per_slot_ctx * launch.parallel
        else:
            context = model.n_ctx_train
            notes.append(f"context: the model's own ({context}); set context_length to size it")
    weights_device = sum(model.layer_bytes[i] for i in gpu_layers)
    output_on_gpu = on_gpu and offloaded == n_layer and n_layer > 0
    weights_device += model.output_bytes if output_on_gpu else 0
    weights_host = model.weight_bytes - weights_device
    kv_gpu_layers = gpu_layers if launch.kv_offload else range(0)
    kv_device = int(context * model.kv_per_token(launch.cache_k, launch.cache_v, kv_gpu_layers))
    kv_all = int(context * model.kv_per_token(launch.cache_k, launch.cache_v, range(n_layer)))
    kv_host = kv_all - kv_device
    # The compute buffer: per ubatch token, f32 logits over the vocabulary, two FFN-wide
    # activations, and (no flash attention) the KQ scores of every head plus the mask
    # over the whole context. Fitted on the panel: within 2 % of llama.cpp's own figure
    # (sched_reserve's "compute buffer size") for every shape of it.
    ub = launch.ubatch
    per_token = model.n_vocab + 2 * model.n_ff + context  # the mask
    if not launch.flash_attn:
        per_token += model.n_head * context
    compute = 4 * ub * per_token
    if not launch.flash_attn:
        # and the matmul's work buffer (outside the graph allocator's figure): the f32
        # attention weights converted to the f16 V cache's type, every head of a ubatch
        # over the whole context (measured: the panel's residue at long contexts).
        compute += 2 * ub * model.n_head * context
    buffers_device = compute if offloaded else 0
    # With layers on a GPU, llama.cpp keeps a host compute buffer too (the input
    # embeddings' lookup, CPU layers): the logits' share when everything is offloaded.
    buffers_host = compute if not offloaded else 4 * ub * (model.n_embd + model.n_vocab)
    if offloaded and offloaded < n_layer:
        buffers_host = compute
    prompt_cache = launch.cache_ram_mib * MIB if launch.cache_ram_mib > 0 else 0
    if launch.engine == "llamacpp" and launch.cache_ram_mib < 0:
        notes.append("--cache-ram -1: the host prompt cache has no limit (not counted)")
    if prompt_cache:
        notes.append(
            f"host prompt cache: up to {launch.cache_ram_mib} MiB (llama-server --cache-ram; "
            "set -cram in extra_args to change it)"
        )
    engine = ENGINE_BASELINE.get(launch.engine, 0)
    return Estimate(
        source="gguf",
        context=context,
        parallel=launch.parallel,
        cache_type=f"{launch.cache_k}/{launch.cache_v}",
        weights_device=weights_device,
        weights_host=weights_host,
        kv_device=kv_device,
        kv_host=kv_host,
        buffers_device=buffers_device,
        buffers_host=buffers_host,
        prompt_cache=prompt_cache,
        engine=engine,
        by_type=model.by_type,
        layers_on_device=offloaded,
        layers=n_layer,
        notes=tuple(notes),
        on_gpu=on_gpu,
    )


def estimate_safetensors(model: SafetensorsModel, launch: LaunchFacts) -> Estimate:
    """vLLM's memory for ``model``: the weights, the KV cache of one sequence at
    ``max_model_len`` (what vLLM needs to start; it fills the rest of its share with KV
    blocks) and its overhead. vLLM takes ``--gpu-memory-utilization`` of each GPU whatever
    the model needs: slotctl sets it from the admitted share, so the share *is* its use."""
    context = launch.context or model.max_position or 4096
    per_token = 2 * model.n_layer * model.n_head_kv * model.head_dim * model.dtype_bytes
    kv = context * per_token
    notes = [
        "vLLM fills --gpu-memory-utilization of its GPU(s) with KV blocks; slotctl sets it "
        "from the admitted share, so what it holds is what admission counts"
    ]
    if launch.context is None:
        notes.append(f"max_model_len: the model's own ({context}); set context_length to size it")
    on_gpu = launch.device == "gpu"
    return Estimate(
        source="safetensors",
        context=context,
        parallel=1,
        cache_type=f"{model.dtype_bytes * 8}-bit",
        weights_device=model.weight_bytes if on_gpu else 0,
        weights_host=0 if on_gpu else model.weight_bytes,
        kv_device=kv if on_gpu else 0,
        kv_host=0 if on_gpu else kv,
        buffers_device=VLLM_OVERHEAD if on_gpu else 0,
        buffers_host=0 if on_gpu else VLLM_OVERHEAD,
        prompt_cache=0,
        engine=0,
        by_type=model.by_type,
        layers_on_device=model.n_layer if on_gpu else 0,
        layers=model.n_layer,
        notes=tuple(notes),
        on_gpu=on_gpu,
    )


@dataclass(frozen=True, slots=True)
class Observed:
    """The most a server was seen to hold (bytes): on its device (NVML's per-process
    figures; a CPU slot's: its process tree's RSS) and in host memory (RSS)."""

    device_bytes: int
    host_bytes: int
    source: str  # nvml | rss | docker | fake
    samples: int = 1
    at: str = ""  # when the peak was seen (UTC)


Basis = Literal["declared", "estimated", "observed", "none"]


@dataclass(frozen=True, slots=True)
class Choice:
    """What admission counts for a slot and why."""

    bytes: int
    basis: Basis
    declared: int | None
    estimated: int | None
    observed: int | None
    warning: str | None = None  # a declared figure below what was seen
    notes: tuple[str, ...] = field(default=())


def choose(
    declared: int | None,
    estimated: int | None,
    observed: int | None,
    *,
    learns: bool = True,
) -> Choice:
    """The figure admission counts: a declared ``memory_gb`` as it is (a warning when
    what was seen is larger), else the larger of the estimate and what was seen (an
    engine that sizes itself to its share — ``learns`` False, vLLM — is admitted by its
    estimate: what it was seen to hold is the share it was given), else 0 (``none``)."""
    seen = observed if learns else None
    if declared is not None:
        warning = None
        if observed is not None and 0 < declared < observed:  # 0: not counted, on purpose
            warning = (
                f"memory_gb declares {declared / 1024**3:.2f} GiB but the server was seen "
                f"using {observed / 1024**3:.2f} GiB"
            )
        return Choice(declared, "declared", declared, estimated, observed, warning)
    if estimated is None and seen is None:
        return Choice(0, "none", None, None, observed)
    if seen is not None and (estimated is None or seen > estimated):
        return Choice(seen, "observed", None, estimated, observed)
    assert estimated is not None
    return Choice(estimated, "estimated", None, estimated, observed)
