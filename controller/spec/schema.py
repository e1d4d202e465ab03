"""Desired-state schema: the pydantic models for stacks, catalogue models and slots.

Pure (no I/O). The loader (``spec.loader``) turns TOML into these models and the guard
(``spec.guard``) is the only code that writes them to the config dir. Models are strict:
TOML and JSON carry real types, so ``port = "8081"`` is an error, not a silent cast.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from controller.model.devices import (
    DEVICE_KINDS,
    DEVICE_MAX_LENGTH,
    DEVICE_PATTERN,
    VISIBILITY_ENV_VARS,
    DeviceRef,
    parse_device,
)
from controller.model.names import (
    MODEL_ID_PATTERN,
    SLOT_NAME_PATTERN,
    ModelId,
    SlotName,
    is_valid_slot_name,
)

__all__ = [
    "ADAPTER_APIS",
    "ALIAS_PREFERS",
    "AUTO_PORT",
    "DEVICES",
    "HARDWARE_ENV_VARS",
    "HARDWARE_FLAGS",
    "KINDS",
    "MAX_REPLICAS",
    "MODEL_OWNED_KEYS",
    "PROVIDERS",
    "REPLICA_PLACEMENTS",
    "ROUTINGS",
    "SELF_MANAGED_PROVIDERS",
    "SLOT_NAME_PATTERN",
    "AdapterSpec",
    "AliasSpec",
    "ControllerSettings",
    "ModelId",
    "ModelSpec",
    "PriorityClass",
    "ServerSpec",
    "SlotModelRef",
    "SlotName",
    "SlotSpec",
    "StackMeta",
    "check_source",
    "hub_parts",
    "is_hub_snapshot",
    "is_url_source",
    "is_valid_slot_name",
    "provider_requires_model",
]

_ENV_NAME_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Provider = Literal[
    "llamacpp",
    "llama-cpp-python",
    "vllm",
    "openai-compatible",
    "demo",
    "kokoro",
    "qwen3tts",
    "moonshine",
    "vibevoice",
]
PROVIDERS: Final[tuple[str, ...]] = get_args(Provider)
# These serve a baked-in model: no model.default is needed to dispatch to them.
AUTO_PORT: Final = "auto"  # ``port = "auto"``: as the key absent, the controller chooses

# How LoRA adapters reach a server (docs/adapters.md): vllm's and sglang's load them at
# run time through their HTTP APIs; llamacpp's llama-server is given them at start and
# picks them per request; llama-cpp-python's server takes one at start, always applied.
AdapterApi = Literal["vllm", "sglang", "llamacpp", "llama-cpp-python"]
ADAPTER_APIS: Final[tuple[str, ...]] = get_args(AdapterApi)
_PROVIDER_ADAPTER_API: Final[dict[str, str]] = {
    "vllm": "vllm",
    "demo": "vllm",
    "llamacpp": "llamacpp",
    "llama-cpp-python": "llama-cpp-python",
}

SELF_MANAGED_PROVIDERS: Final[frozenset[str]] = frozenset(
    {"kokoro", "qwen3tts", "moonshine", "vibevoice"}
)

# The device kinds; a slot's ``device`` is a kind or pinned GPUs (controller.model.devices).
DEVICES: Final[tuple[str, ...]] = DEVICE_KINDS
_BUDGET_KEY_RE: Final = re.compile(r"^(?:gpu|npu|cpu|gpu:[0-9]{1,3})$")
Kind = Literal["llm", "embedding", "tts", "stt", "image"]
# How a changed slot's server is replaced (docs/workflow.md#rollouts): surge starts the new
# one beside the old and switches when it is ready (when memory allows); recreate stops
# the old one first.
Rollout = Literal["surge", "recreate"]
# How a request picks one of a slot's replicas (controller/router/replicas.py): prefix
# (consistent hashing of the prompt's prefix with bounded load), least-loaded, round-robin.
Routing = Literal["prefix", "least-loaded", "round-robin"]
ROUTINGS: Final[tuple[str, ...]] = get_args(Routing)
# Where a slot's replicas go: spread (each on a GPU no sibling holds, while one is left),
# share (a sibling's GPU is as good as any other).
ReplicaPlacement = Literal["spread", "share"]
REPLICA_PLACEMENTS: Final[tuple[str, ...]] = get_args(ReplicaPlacement)
MAX_REPLICAS: Final = 16
KINDS: Final[tuple[str, ...]] = get_args(Kind)

# Keys a model owns: a slot write that sets them is refused (the guard says which model
# owns them). Sampling defaults are model-owned too.
SAMPLING_KEYS: Final[frozenset[str]] = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        "max_tokens",
        "seed",
        "stop",
        "system_prompt",
    }
)
MODEL_OWNED_KEYS: Final[frozenset[str]] = frozenset(
    {"context_length", "chat_template", "mmproj", *SAMPLING_KEYS}
)

# Hardware/placement flags owned by the slot's `device` field and the controller. Long
# options are compared with "_" folded to "-", so `--n_gpu_layers` is caught too.
HARDWARE_FLAGS: Final[frozenset[str]] = frozenset(
    {
        "--device",
        "-dev",
        "--n-gpu-layers",
        "--gpu-layers",
        "-ngl",
        "--main-gpu",
        "-mg",
        "--tensor-split",
        "-ts",
        "--split-mode",
        "-sm",
        "--gpu-memory-utilization",
        "--tensor-parallel-size",
        "-tp",
        "--port",
        "--host",
    }
)
HARDWARE_ENV_VARS: Final[frozenset[str]] = VISIBILITY_ENV_VARS
# Server flags that set what a model owns: refused in extra_args, naming the model key.
MODEL_OWNED_FLAGS: Final[dict[str, str]] = {
    "--ctx-size": "context_length",
    "-c": "context_length",  # llama-server's short form of --ctx-size
    "--n-ctx": "context_length",
    "--max-model-len": "context_length",
    "--chat-template": "chat_template",
    "--mmproj": "mmproj",
    # llama-server sampling defaults: model-owned like the keys they set
    "--temp": "temperature",
    "--top-k": "top_k",
    "--top-p": "top_p",
    "--min-p": "min_p",
    "--repeat-penalty": "repeat_penalty",
    "--presence-penalty": "presence_penalty",
    "--frequency-penalty": "frequency_penalty",
}

_SOURCE_SCHEMES: Final = frozenset({"file", "hf", "demo", "http", "https"})
# A model's pinned digest, a hub revision (branch, tag or commit) and a snapshot's
# include/exclude glob (controller/modelfiles/: what is pulled and how it is verified).
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
HubRevision = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/+-]*$", min_length=1, max_length=200)
]
GlobPattern = Annotated[str, Field(min_length=1, max_length=200)]


def hub_parts(source: str) -> list[str]:
    """``hf://org/repo[/path/in/repo]`` as its non-empty segments."""
    return [part for part in source.removeprefix("hf://").split("/") if part]


def is_url_source(source: str | None) -> bool:
    return bool(source) and urlsplit(source or "").scheme in ("http", "https")


def is_hub_snapshot(source: str | None) -> bool:
    """``hf://org/repo``: a whole repository (what vLLM serves), not one file of it."""
    return bool(source) and (source or "").startswith("hf://") and len(hub_parts(source or "")) == 2


NonNegFloat = Annotated[float, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
# An admission estimate in GiB: bounded (1 PiB), so its bytes are an integer (1e308 GiB
# would be an infinity of bytes).
MemoryGb = Annotated[float, Field(ge=0, le=1024**2)]


def check_source(value: str | None) -> str | None:
    """A model's or an adapter's ``source``, judged (ValueError: why not)."""
    if value is None:
        return None
    if not value.strip() or "\x00" in value:
        raise ValueError("source must be a non-empty path or URL")
    if "://" in value:
        parts = urlsplit(value)
        if parts.scheme not in _SOURCE_SCHEMES:
            raise ValueError(
                f"unsupported source scheme {parts.scheme!r}: use a path, file://, "
                "hf://org/repo[/file], https://host/path or demo://name"
            )
        if parts.scheme == "hf" and len(hub_parts(value)) < 2:
            raise ValueError("hf:// sources name org/repo (a repository) or org/repo/file")
        if parts.scheme == "hf" and any(p in (".", "..") for p in hub_parts(value)):
            raise ValueError("hf:// sources must not contain '.' or '..' segments")
        if parts.scheme in ("http", "https"):
            if not parts.hostname or not parts.path.strip("/") or parts.path.endswith("/"):
                raise ValueError(f"{parts.scheme}:// sources name a file: scheme://host/path")
            if parts.username is not None or parts.password is not None:
                raise ValueError(
                    "a source URL must not carry credentials (user:password@): a stack "
                    "file is no place for a secret"
                )
            if ".." in parts.path.split("/"):
                raise ValueError("a source URL's path must not contain '..'")
    return value


def provider_requires_model(provider: str) -> bool:
    """Self-managed providers serve a baked-in model; every other provider needs one."""
    return provider not in SELF_MANAGED_PROVIDERS


class _Strict(BaseModel):
    # inf/nan are valid TOML floats but no valid timeout, estimate or penalty (and JSON
    # cannot carry them back out), so they are refused.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class StackMeta(_Strict):
    """``[stack]``: who owns the slots a file declares (prune only touches its own)."""

    name: Annotated[str, Field(pattern=SLOT_NAME_PATTERN)]
    description: str | None = None


class ModelSpec(_Strict):
    """One ``[[model]]`` catalogue entry."""

    id: Annotated[str, Field(pattern=MODEL_ID_PATTERN)]
    source: str | None = None  # path, file://, hf://org/repo[/file], https://, demo://name
    # The file's sha256 (hex): required for an http(s):// source (nothing else vouches for
    # its bytes), checked besides the hub's own for an hf:// file, verified once (and
    # remembered by the file's identity) for a path.
    sha256: Sha256 | None = Field(default=None, validate_default=True)
    # hf:// only: the branch, tag or commit to pull (default: the repository's main).
    revision: HubRevision | None = None
    # hf://org/repo (a whole snapshot) only: glob patterns of the files to pull, and of
    # those to leave out (huggingface_hub's allow/ignore patterns: `*` crosses `/`).
    include: Annotated[list[GlobPattern], Field(min_length=1, max_length=64)] | None = None
    exclude: Annotated[list[GlobPattern], Field(min_length=1, max_length=64)] | None = None
    kind: Kind = "llm"
    # The device memory admission counts (GiB); None (absent): estimated from the model
    # file and the slot's launch, then learnt from what ran
    # (docs/design/0022-footprints.md); 0: not counted.
    memory_gb: MemoryGb | None = None
    exclusive_group: Annotated[str, Field(min_length=1, max_length=63)] | None = None
    context_length: Annotated[int, Field(gt=0)] | None = None
    chat_template: str | None = None
    mmproj: str | None = None
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: NonNegFloat | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    seed: int | None = None
    stop: list[str] | None = None
    system_prompt: str | None = None

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str | None) -> str | None:
        return check_source(value)

    @field_validator("sha256")
    @classmethod
    def _check_sha256(cls, value: str | None, info: ValidationInfo) -> str | None:
        if "source" not in info.data:
            return value  # the source itself was refused
        source = info.data["source"]
        if value is None:
            if is_url_source(source):
                raise ValueError(
                    'an http(s):// source needs sha256 = "<64 hex digits>": nothing else '
                    "vouches for its bytes"
                )
            return None
        if not source or source.startswith("demo://"):
            raise ValueError("sha256 needs a file source (a path, file://, hf:// or https://)")
        if is_hub_snapshot(source):
            raise ValueError(
                "sha256 names one file; hf://org/repo is a whole repository (each of its "
                "files is verified against the hub's own digest)"
            )
        return value.lower()

    @field_validator("revision")
    @classmethod
    def _check_revision(cls, value: str | None, info: ValidationInfo) -> str | None:
        source = info.data.get("source")
        if value is not None and "source" in info.data and not (source or "").startswith("hf://"):
            raise ValueError("revision is for hf:// sources only")
        if value is not None and ".." in value.split("/"):
            raise ValueError("revision must not contain '..'")
        return value

    @field_validator("include", "exclude")
    @classmethod
    def _check_patterns(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is None or "source" not in info.data:
            return value
        if not is_hub_snapshot(info.data.get("source")):
            raise ValueError(
                f"{info.field_name} is for hf://org/repo sources only (a whole repository)"
            )
        if any("\x00" in pattern for pattern in value):
            raise ValueError("patterns must not contain NUL bytes")
        return value

    @property
    def memory_bytes(self) -> int:
        return int((self.memory_gb or 0.0) * 1024**3)


class SlotModelRef(_Strict):
    """``model.default``: the bound model. Non-empty means the slot is activated."""

    default: str = ""


# A Kubernetes object name (DNS-1123 subdomain): a node's or a PersistentVolumeClaim's.
NODE_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class ServerSpec(_Strict):
    """``[slot.server]``: how the runtime starts the server."""

    image: Annotated[str, Field(min_length=1)] | None = None  # docker runtime
    binary: Annotated[str, Field(min_length=1)] | None = None  # process runtime executable
    cmd: list[str] | None = None  # openai-compatible: the whole argv template
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    # kubernetes runtime: a PersistentVolumeClaim with the model files, mounted read-only
    # at the models dir
    volume: Annotated[str, Field(pattern=NODE_NAME_PATTERN, max_length=253)] | None = None

    @field_validator("extra_args", "cmd")
    @classmethod
    def _no_nul(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any("\x00" in arg for arg in value):
            raise ValueError("arguments must not contain NUL bytes")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not _ENV_NAME_RE.fullmatch(key):
                raise ValueError(f"invalid environment variable name {key!r}")
            if "\x00" in val:
                raise ValueError(f"environment variable {key} contains a NUL byte")
        return value


class SlotSpec(_Strict):
    """One ``[[slot]]``: a serving position on the host."""

    name: Annotated[str, Field(pattern=SLOT_NAME_PATTERN)]
    provider: Provider
    model: SlotModelRef = Field(default_factory=SlotModelRef)
    # gpu (any GPU: placed by the controller), gpu:N / gpu:GPU-UUID / gpu:N,M (pinned), npu,
    # cpu; see controller.model.devices
    device: Annotated[str, Field(pattern=DEVICE_PATTERN, max_length=DEVICE_MAX_LENGTH)] = "gpu"
    # GPUs the slot spans (tensor parallel); None: one, or as many as `device` pins
    gpus: Annotated[int, Field(ge=1, le=16)] | None = None
    type: Kind = "llm"
    # None (the key absent, or "auto"): a free port the controller chooses and records in
    # the state dir, the same across restarts (controller.slots.core.Core.auto_port).
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    autoload: bool | None = None  # None only before migration (see loader)
    priority: Annotated[int, Field(ge=0, le=100)] = 50
    pinned: bool | None = None  # None: pinned when named in settings.default_pinned
    idle_timeout_s: NonNegFloat = 300.0
    ttl_s: NonNegFloat = 0.0
    warmup_timeout_s: PosFloat = 600.0
    drain_timeout_s: NonNegFloat = 30.0
    liveness_interval_s: PosFloat = 15.0
    liveness_failures: Annotated[int, Field(ge=1)] = 3
    liveness_timeout_s: PosFloat = 5.0  # a liveness probe with no byte by then is a miss
    # The router ends a request after this long without a byte from the server (the head
    # included: it allows a slow first token) and answers slot.upstream_timeout.
    upstream_idle_s: PosFloat = 120.0
    max_consecutive_failures: Annotated[int, Field(ge=1)] = 5
    max_queue: Annotated[int, Field(ge=0)] = 64
    # Requests in flight at once (None: no limit); beyond it they wait, served by their
    # keys' priority classes (controller/scheduling/fairqueue.py)
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    memory_gb: MemoryGb | None = None  # admission estimate override (self-managed)
    # The residency tier (docs/lifecycle.md): may an eviction put the server to sleep
    # (its provider permitting) instead of unloading it? None: the provider's default
    # (vllm: yes; demo: no, it is the test double: opt in). A GPU slot's only.
    sleep: bool | None = None
    # 1: weights to host memory (counted there), fastest wake; 2: weights dropped (nothing
    # held on the host), a wake reloads them in place.
    sleep_level: Annotated[int, Field(ge=1, le=2)] = 1
    # A wake (its calls and the readiness probe after it) longer than this falls back to
    # a restart of the server, once.
    wake_timeout_s: PosFloat = 60.0
    # surge: the new server beside the old one, switched to once ready, when it fits (else
    # recreate, said in the plan); recreate: stop, then start (controller/scheduling/rollout.py).
    rollout: Rollout = "surge"
    server: ServerSpec = Field(default_factory=ServerSpec)
    # kubernetes runtime: pin the slot to this node (its nodeSelector); unset: the
    # scheduler places it and admission counts it on the node it lands on
    node: Annotated[str, Field(pattern=NODE_NAME_PATTERN, max_length=253)] | None = None
    # The co-loaded unit the slot belongs to (controller/spec/units.py: a stack's
    # [[unit]] or a member's `with` set it): its members load, evict, sleep and restore
    # together. A scheduling key: changing it restarts no server.
    unit: Annotated[str, Field(pattern=SLOT_NAME_PATTERN)] | None = None
    # LoRA adapters of the slot's model ([[adapter]], docs/adapters.md): how many its
    # server holds at once (0: the slot serves none), the largest rank it is started for,
    # and how they reach it (None: the provider's own: vllm and demo load at run time,
    # llamacpp and llama-cpp-python are given theirs at start; openai-compatible names it).
    max_loras: Annotated[int, Field(ge=0, le=256)] = 0
    max_lora_rank: Annotated[int, Field(ge=1, le=1024)] = 16
    adapter_api: AdapterApi | None = None
    # The adapters a start-time engine is started with (llamacpp: all of them, chosen per
    # request; llama-cpp-python: exactly one, always applied: that slot serves only it).
    adapters: Annotated[
        list[Annotated[str, Field(pattern=MODEL_ID_PATTERN)]], Field(max_length=64)
    ] = Field(default_factory=list)

    @field_validator("adapters")
    @classmethod
    def _distinct_adapters(cls, value: list[str]) -> list[str]:
        twice = sorted({a for a in value if value.count(a) > 1})
        if twice:
            raise ValueError(f"adapters named twice: {twice}")
        return value

    @property
    def lora_api(self) -> str | None:
        """How adapters reach this slot's server (:data:`ADAPTER_APIS`); None: it serves
        none (``max_loras = 0`` and no start-time ``adapters``)."""
        if not self.max_loras and not self.adapters:
            return None
        return self.adapter_api or _PROVIDER_ADAPTER_API.get(self.provider)

    # Replicas (docs/replicas.md): the same model served by several servers of this slot,
    # each a slot of its own named `<name>-r<i>` (the first keeps `<name>`). `replicas = N`
    # is min_replicas = max_replicas = N; above min_replicas they are added and removed
    # by demand (controller/scheduling/scaling.py).
    replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] | None = None
    min_replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] | None = None
    max_replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] | None = None
    routing: Routing = "prefix"
    # prefix routing: a replica above load_factor x the mean in-flight is skipped
    load_factor: Annotated[float, Field(ge=1.0, le=10.0)] = 1.25
    replica_placement: ReplicaPlacement = "spread"
    # demand scaling: a replica is added once every running sibling has been saturated
    # this long, and one is removed once the group has been idle this long
    scale_up_after_s: PosFloat = 10.0
    scale_down_after_s: PosFloat = 120.0
    # Set by the desired state's expansion (controller/spec/replicas.py), never by a
    # source: the slot a replica is one of, and its index (0: the slot itself).
    # Excluded from every dump: no stack file, render or hash carries them.
    replica_of: Annotated[str | None, Field(pattern=SLOT_NAME_PATTERN, exclude=True)] = None
    replica_index: Annotated[int, Field(ge=0, lt=MAX_REPLICAS, exclude=True)] = 0

    @model_validator(mode="after")
    def _check_replicas(self) -> SlotSpec:
        if self.replicas is not None and (
            self.min_replicas is not None or self.max_replicas is not None
        ):
            raise ValueError("replicas = N sets both bounds: give it or min/max_replicas, not both")
        low, high = self.min_count, self.max_count
        if low > high:
            raise ValueError(f"min_replicas = {low} is above max_replicas = {high}")
        if low < high and self.max_concurrency is None:
            raise ValueError(
                f"replicas between {low} and {high} scale by demand, measured against "
                "max_concurrency: set it (the requests one replica serves at once)"
            )
        if high > 1:
            longest = len(self.name) + len(f"-r{high - 1}")
            if longest > 63:
                raise ValueError(
                    f"slot name {self.name!r} is too long for {high} replicas: its last "
                    f"replica's name would be {longest} characters (63 at most)"
                )
            if self.device_kind == "npu":
                raise ValueError("an npu slot has one server: replicas need gpu or cpu")
            pins = self.device_ref.pins if self.device_kind == "gpu" else ()
            if pins and self.replica_placement == "spread":
                raise ValueError(
                    f"device {self.device!r} pins every replica to the same GPU(s): set "
                    'replica_placement = "share" to ask for that, or device = "gpu"'
                )
            if self.unit is not None:
                raise ValueError("a co-loaded unit's member has one server: no replicas")
        return self

    @property
    def min_count(self) -> int:
        """Replicas always wanted (1 without replicas)."""
        return self.replicas or self.min_replicas or 1

    @property
    def max_count(self) -> int:
        """Replicas at most (1 without replicas)."""
        return self.replicas or self.max_replicas or self.min_replicas or 1

    @property
    def replica_group(self) -> str:
        """The slot whose replicas this one is one of ("" when it has none)."""
        if self.replica_of is not None:
            return self.replica_of
        return self.name if self.max_count > 1 else ""

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        parse_device(value)  # each pinned GPU an index or a UUID, none twice
        return value

    @field_validator("gpus")
    @classmethod
    def _check_span(cls, value: int | None, info: ValidationInfo) -> int | None:
        device = info.data.get("device")
        if value is None or not isinstance(device, str):
            return value
        ref = parse_device(device)
        if ref.kind != "gpu" and value != 1:
            raise ValueError(f"gpus = {value} needs a GPU slot (device is {device!r})")
        if ref.pins and value != len(ref.pins):
            raise ValueError(
                f"gpus = {value} but device {device!r} pins {len(ref.pins)} GPU(s): leave "
                "gpus out or name as many GPUs"
            )
        return value

    @property
    def device_ref(self) -> DeviceRef:
        return parse_device(self.device)

    @property
    def device_kind(self) -> str:
        """``gpu``, ``npu`` or ``cpu`` (``gpu:1`` is a ``gpu`` slot)."""
        return self.device.split(":", 1)[0]

    @property
    def gpu_count(self) -> int:
        """GPUs the slot spans: as many as it pins, else ``gpus`` (default 1); 0 off GPU."""
        if self.device_kind != "gpu":
            return 0
        pins = self.device_ref.pins
        return len(pins) if pins else (self.gpus or 1)

    @field_validator("port", mode="before")
    @classmethod
    def _auto_port(cls, value: object) -> object:
        return None if value == AUTO_PORT else value

    @property
    def model_id(self) -> str:
        return self.model.default

    @property
    def activated(self) -> bool:
        """A non-empty model.default (or a self-managed provider) activates a slot."""
        return bool(self.model.default) or not provider_requires_model(self.provider)


class AdapterSpec(_Strict):
    """One ``[[adapter]]``: a LoRA adapter of catalogue model ``base``, asked for by its id
    (or ``base:id``) and loaded into a slot serving ``base`` (controller/slots/adapters.py;
    checks across the state are :mod:`controller.spec.adapters`')."""

    id: Annotated[str, Field(pattern=MODEL_ID_PATTERN)]
    base: Annotated[str, Field(pattern=MODEL_ID_PATTERN)]
    source: str  # path, file://, hf://org/repo[/file], https:// (as a model's)
    # As a model's: required for an http(s):// source; pulled and verified alike.
    sha256: Sha256 | None = Field(default=None, validate_default=True)
    rank: Annotated[int, Field(ge=1, le=1024)] | None = None  # None: not declared
    scale: Annotated[float, Field(ge=0, le=100)] = 1.0  # llama.cpp's per-request scale
    priority: Annotated[int, Field(ge=0, le=100)] = 50  # eviction: lowest goes first
    pinned: bool = False  # never evicted from a slot that holds it
    memory_gb: MemoryGb = 0.0  # device memory it adds to a slot holding it

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        checked = check_source(value)
        if checked is None or checked.startswith("demo://"):
            raise ValueError("an adapter's source is a path, file://, hf:// or https:// URL")
        return checked

    @field_validator("sha256")
    @classmethod
    def _check_sha256(cls, value: str | None, info: ValidationInfo) -> str | None:
        source = info.data.get("source")
        if value is None and is_url_source(source):
            raise ValueError(
                'an http(s):// source needs sha256 = "<64 hex digits>": nothing else '
                "vouches for its bytes"
            )
        if value is not None and is_hub_snapshot(source):
            raise ValueError("sha256 names one file; hf://org/repo is a whole repository")
        return value.lower() if value is not None else None

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1024**3)

    def as_model(self) -> ModelSpec:
        """Its files as the model-files engine knows files (pulled, verified, kept from
        GC, at the destination its server reads)."""
        return ModelSpec(id=self.id, source=self.source, sha256=self.sha256)


AliasPrefer = Literal["warm", "first", "spread"]
ALIAS_PREFERS: Final[tuple[str, ...]] = get_args(AliasPrefer)


class AliasSpec(_Strict):
    """One ``[[alias]]``: a model id that names catalogue models, the one to serve chosen
    per request by ``prefer`` (:mod:`controller.router.aliases`; checks across the state
    are :mod:`controller.spec.aliases`')."""

    id: Annotated[str, Field(pattern=MODEL_ID_PATTERN)]
    models: Annotated[
        list[Annotated[str, Field(pattern=MODEL_ID_PATTERN)]], Field(min_length=1, max_length=16)
    ]
    prefer: AliasPrefer = "warm"

    @field_validator("models")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        twice = sorted({m for m in value if value.count(m) > 1})
        if twice:
            raise ValueError(f"models named twice: {twice}")
        return value


class PriorityClass(_Strict):
    """A request priority class: keys carry one; waiters are served by its weight."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")]
    weight: Annotated[float, Field(gt=0, le=1000)]
    queue_limit: Annotated[int, Field(ge=0)] | None = None  # waiters per slot; beyond: 429


DEFAULT_PRIORITY_CLASSES: Final = (
    PriorityClass(name="interactive", weight=8.0),
    PriorityClass(name="batch", weight=1.0),
)


class ControllerSettings(_Strict):
    """Controller-wide settings (``<config_dir>/controller.toml``, all optional)."""

    default_pinned: list[str] = Field(default_factory=lambda: ["agent"])
    memory_budget_gb: dict[str, NonNegFloat] = Field(default_factory=dict)
    safety_margin_gb: NonNegFloat = 0.5
    # Hysteresis of background loads (an autoload slot coming back, the restore at start):
    # they may only evict slots of lower priority idle for at least this long.
    min_resident_s: NonNegFloat = 60.0
    # Kept free in host memory when the eviction plan puts a slot to sleep (a level-1
    # sleeper holds its weights in host RAM): a sleeper that would leave less is unloaded.
    host_margin_gb: NonNegFloat = 2.0
    # Allowlists of what a slot may run (None: anything; see docs/reliability.md, "Security
    # model"): the guard refuses a slot whose server.binary or server.cmd[0] is not in
    # allowed_binaries, or whose server.image is not in allowed_images.
    allowed_binaries: list[Annotated[str, Field(min_length=1)]] | None = None
    allowed_images: list[Annotated[str, Field(min_length=1)]] | None = None
    # Request priority classes (keys carry one; the API token and keys without one get
    # default_priority); where requests wait they are served by class weight.
    priority_classes: list[PriorityClass] = Field(
        default_factory=lambda: list(DEFAULT_PRIORITY_CLASSES)
    )
    default_priority: Annotated[str, Field(min_length=1)] = "interactive"
    # A waiter older than this goes first whatever its class (nothing starves); 0: plain
    # first come, first served (classes and keys ignored).
    queue_aging_s: Annotated[float, Field(ge=0, le=3600)] = 30.0

    @field_validator("priority_classes")
    @classmethod
    def _classes(cls, value: list[PriorityClass]) -> list[PriorityClass]:
        names = [c.name for c in value]
        if not names:
            raise ValueError("at least one priority class is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"priority classes are named twice: {sorted(names)}")
        return value

    @field_validator("default_priority")
    @classmethod
    def _default_class(cls, value: str, info: ValidationInfo) -> str:
        classes = info.data.get("priority_classes") or []
        if classes and value not in {c.name for c in classes}:
            raise ValueError(f"default_priority {value!r} is not one of the priority classes")
        return value

    def priority_class(self, name: str | None) -> PriorityClass:
        """The class named (a key's), else the default one."""
        classes = self.priority_classes  # a few: a scan beats a dict made every request
        for c in classes:
            if c.name == name:
                return c
        for c in classes:
            if c.name == self.default_priority:
                return c
        return classes[0]

    @field_validator("memory_budget_gb")
    @classmethod
    def _devices(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(key for key in value if not _BUDGET_KEY_RE.fullmatch(key))
        if unknown:
            raise ValueError(
                f"unknown device(s) {unknown}; budgets are per kind ({', '.join(DEVICES)}; "
                '`gpu` = each GPU) or per GPU index ("gpu:1")'
            )
        return value


def field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def jsonable(spec: BaseModel) -> dict[str, Any]:
    return spec.model_dump(mode="json")
