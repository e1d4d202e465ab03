"""CRD generation: ``models.slotctl.io``, ``slots.slotctl.io`` and ``aliases.slotctl.io``
from the spec schema.

Pure. The CRDs are derived from the same pydantic models that read TOML
(:class:`~controller.spec.schema.ModelSpec`, :class:`~controller.spec.schema.SlotSpec`):
one schema, two syntaxes, so the keys of a ``Slot``'s ``spec`` are the keys of a
``[[slot]]`` table (``model.default``, ``server.extra_args``, ``idle_timeout_s``...).
pydantic's JSON Schema becomes a Kubernetes *structural* schema here: ``$ref`` inlined,
every node typed, ``anyOf [T, null]`` folded to ``nullable: true``, numeric
``exclusiveMinimum`` in the OpenAPI v3.0 boolean form, no ``default`` (defaults stay the
loader's, so an unset key means the same in a CR and in TOML) and no
``additionalProperties: false`` (the API server refuses it; unknown fields are pruned, or
rejected under ``kubectl``'s strict field validation, and the operator's loader refuses
whatever an older server lets through). The per-slot rules the loader enforces beyond the
types (hardware/placement flags and model-owned flags in ``server.extra_args``, device
visibility variables in ``server.env``, source schemes) become CEL
``x-kubernetes-validations``; the cross-object rules (unique ports, model references)
stay with the operator, which reports them as ``Degraded`` with the loader's code.

``slotctl crd generate`` writes :func:`crd_documents` to ``crds/`` (and the chart's
``crds/``); a test fails when the committed files differ.
"""

from __future__ import annotations

import re
from typing import Any, Final

import yaml
from pydantic import BaseModel

from controller.model.names import SLOT_NAME_PATTERN
from controller.spec.schema import (
    HARDWARE_ENV_VARS,
    HARDWARE_FLAGS,
    MODEL_OWNED_FLAGS,
    SAMPLING_KEYS,
    AdapterSpec,
    AliasSpec,
    ModelSpec,
    SlotSpec,
)

__all__ = [
    "GROUP",
    "VERSION",
    "adapter_crd",
    "alias_crd",
    "crd_documents",
    "crd_files",
    "model_crd",
    "render_yaml",
    "slot_crd",
    "structural",
]

GROUP: Final = "slotctl.io"
VERSION: Final = "v1alpha1"
CONDITION_TYPES: Final = ("Ready", "Progressing", "Degraded")
_MAX_ITEMS: Final = 256
_MAX_STRING: Final = 4096
# server.extra_args: its CEL rule runs a long regex on every item, and the API server
# refuses a rule whose estimated cost (items x item length x regex length) exceeds its
# budget: 256 x 4096 was 4.2 times over (kube-apiserver 1.37), 64 x 2048 is half of it.
_MAX_ARGS: Final = 64
_MAX_ARG: Final = 2048

# `kubectl explain` text for the keys (the TOML reference is docs/stack-files.md).
_DOCS: Final[dict[str, str]] = {
    "provider": "Server kind: llamacpp, vllm, openai-compatible, demo, or a self-managed "
    "speech server (kokoro, qwen3tts, moonshine, vibevoice).",
    "model": "The bound model: model.default names a Model's id. Non-empty activates the slot.",
    "default": "Id of the bound model (a Model's spec.id, or its metadata.name).",
    "device": (
        "Where the server runs: gpu (any GPU, placed by the controller), npu or cpu "
        "(default gpu); gpu:N or gpu:GPU-UUID pins GPUs on the process and docker runtimes."
    ),
    "gpus": "GPUs the slot spans (tensor parallel; default 1): nvidia.com/gpu on its pod.",
    "type": "What the slot serves: llm, embedding, tts, stt or image (default llm).",
    "port": "Port the server listens on, unique on the host (1..65535). Unset: the "
    "controller chooses a free one and keeps it across restarts.",
    "autoload": "Keep it loaded: loaded at controller start and after faults "
    "(default: true when a model is bound).",
    "priority": "Eviction order, lowest first (0..100, default 50).",
    "pinned": "Never evicted; unload and delete need force (default false).",
    "idle_timeout_s": "Seconds without requests before ready -> idle (default 300).",
    "ttl_s": "When > 0, unload after this many idle seconds (default 0: never).",
    "warmup_timeout_s": "Seconds a load may take to become ready (default 600).",
    "drain_timeout_s": "Seconds an unload waits for requests in flight (default 30).",
    "liveness_interval_s": "Seconds between liveness probes once ready (default 15).",
    "liveness_failures": "Missed liveness probes in a row before error (default 3).",
    "liveness_timeout_s": "Seconds a liveness probe waits for the server's first byte (default 5).",
    "upstream_idle_s": "Seconds the router waits for a byte from the server before it ends "
    "the request with slot.upstream_timeout (default 120).",
    "max_consecutive_failures": "Crash-loop breaker threshold (default 5).",
    "max_queue": "Requests waiting for the slot before the router answers 429 (default 64).",
    "memory_gb": "Device memory admission counts, in GiB (0: not counted); absent: "
    "estimated from the model file, then learnt from what ran.",
    "sha256": "The file's sha256 (64 hex digits): required for an http(s):// source, checked "
    "besides the hub's own for an hf:// file, verified once for a path.",
    "revision": "hf:// only: the branch, tag or commit to pull (default the hub's main).",
    "include": "hf://org/repo only: globs of the snapshot's files to pull (* crosses /).",
    "exclude": "hf://org/repo only: globs of the snapshot's files to leave out.",
    "sleep": "May an eviction put the server to sleep instead of unloading it (a GPU slot "
    "whose provider can sleep: vllm by default, demo when true)? Default: the provider's.",
    "sleep_level": "1: weights kept in host memory (counted there), fastest wake; 2: "
    "weights dropped, reloaded at the wake (default 1).",
    "wake_timeout_s": "Seconds a sleep or a wake (with the readiness probe after it) may "
    "take; a wake past it restarts the server, once (default 60).",
    "rollout": "How a changed server is replaced: surge (the new one started beside the old, "
    "switched to once ready, when memory allows; else recreate) or recreate (stop, then "
    "start). Default surge.",
    "server": "How the runtime starts the server.",
    "image": "Container image (docker runtime).",
    "binary": "Executable (process runtime).",
    "cmd": "The whole argv template (openai-compatible provider).",
    "extra_args": "Extra server arguments; hardware, placement and model-owned flags are refused.",
    "env": "Extra environment; device visibility variables are refused.",
    "volume": "PersistentVolumeClaim with the model files, mounted read-only at the models "
    "dir (kubernetes runtime).",
    "node": "Node the slot runs on (kubernetes runtime: its nodeSelector); unset: the "
    "scheduler places it.",
    "unit": "Co-loaded unit: the slots of one unit load, evict, sleep and restore "
    "together (a stack's [[unit]] or a slot's `with` sets it).",
    "id": "Model id (defaults to metadata.name); may contain . : / @ + = -.",
    "source": "Path, file://, hf://org/repo[/file], http(s):// (with sha256) or demo://name.",
    "kind": "What the model is: llm, embedding, tts, stt or image (default llm).",
    "exclusive_group": "At most one member of the group is loaded at a time.",
    "context_length": "Context window (model-owned: a Slot cannot override it).",
    "chat_template": "Chat template (model-owned).",
    "mmproj": "Multimodal projector file (model-owned).",
    **dict.fromkeys(SAMPLING_KEYS, "Sampling default (model-owned)."),
}


def _flag_regex() -> str:
    """One RE2 pattern for every refused flag, ``--flag`` and ``--flag=value`` forms.

    Long options compare with ``_`` folded to ``-`` (as the guard does), so each ``-``
    after the leading ``--`` matches either character.
    """
    alternatives = []
    for flag in sorted({*HARDWARE_FLAGS, *MODEL_OWNED_FLAGS}):
        if flag.startswith("--"):
            alternatives.append("--" + re.escape(flag[2:]).replace("\\-", "[-_]"))
        else:
            alternatives.append(re.escape(flag))
    return "^(" + "|".join(alternatives) + ")(=.*)?$"


def _cel_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
            return _resolve(merged, defs)
        return {k: _resolve(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def structural(node: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """One resolved pydantic JSON Schema node -> a Kubernetes structural schema node."""
    nullable = False
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(node["anyOf"])
        if len(options) != 1:
            raise ValueError(f"{name}: cannot express anyOf {node['anyOf']} structurally")
        node = {**{k: v for k, v in node.items() if k != "anyOf"}, **options[0]}
    out: dict[str, Any] = {}
    kind = node.get("type")
    if kind is None and "enum" in node:
        kind = "string"
    if kind is None and "const" in node:
        kind, node = "string", {**node, "enum": [node["const"]]}
    if kind is None:
        raise ValueError(f"{name}: untyped schema node {node}")
    out["type"] = kind
    if name in _DOCS:
        out["description"] = _DOCS[name]
    for key in ("enum", "pattern", "minLength", "maxLength", "minimum", "maximum"):
        if key in node:
            out[key] = node[key]
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if kind == "object":
        props = node.get("properties", {})
        if props:
            out["properties"] = {k: structural(v, k) for k, v in props.items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = structural(extra, None)
    if kind == "array":
        out["items"] = structural(node.get("items", {"type": "string"}), None)
    if nullable:
        out["nullable"] = True
    return out


def _spec_schema(model: type[BaseModel], drop: tuple[str, ...]) -> dict[str, Any]:
    raw = model.model_json_schema()
    resolved = _resolve(raw, raw.get("$defs", {}))
    for key in drop:
        resolved["properties"].pop(key, None)
        if key in resolved.get("required", []):
            resolved["required"].remove(key)
    return structural(resolved)


def _slot_spec_schema() -> dict[str, Any]:
    # (replica_of, replica_index: set by the desired state's expansion, never by a source)
    schema = _spec_schema(SlotSpec, drop=("name", "replica_of", "replica_index"))
    server = schema["properties"]["server"]["properties"]
    # Bounds let the API server estimate the CEL rules' cost (it refuses unbounded ones).
    server["cmd"]["maxItems"] = _MAX_ITEMS
    server["cmd"]["items"]["maxLength"] = _MAX_STRING
    server["extra_args"]["maxItems"] = _MAX_ARGS
    server["extra_args"]["items"]["maxLength"] = _MAX_ARG
    server["env"]["maxProperties"] = _MAX_ITEMS
    server["extra_args"]["x-kubernetes-validations"] = [
        {
            "rule": f"self.all(a, !a.matches({_cel_string(_flag_regex())}))",
            "message": "server.extra_args sets a flag the slot's device, the controller or "
            "the model owns (slot.hardware_flag / slot.model_owned_key): set device/port on "
            "the Slot and context_length, chat_template, sampling on the Model",
            "reason": "FieldValueForbidden",
        }
    ]
    names = ", ".join(_cel_string(v) for v in sorted(HARDWARE_ENV_VARS))
    server["env"]["x-kubernetes-validations"] = [
        {
            "rule": f"self.all(k, !(k in [{names}]))",
            "message": "server.env sets device visibility, which the slot's device field "
            "and the controller own (slot.hardware_flag)",
            "reason": "FieldValueForbidden",
        }
    ]
    schema["properties"]["model"]["properties"]["default"]["maxLength"] = 200
    schema["x-kubernetes-validations"] = _replica_rules()
    return schema


def _set(field: str, on: str = "self") -> str:
    """CEL: ``field`` is given. (A field set to null counts as given and then fails the
    rule's arithmetic: the API server refuses ``replicas: null``, which the loader would
    read as absent; leave such a field out.)"""
    return f"has({on}.{field})"


def _max_count(on: str = "self") -> str:
    """CEL: the slot's replicas at most (``SlotSpec.max_count``)."""
    return (
        f"({_set('replicas', on)} ? {on}.replicas : ({_set('max_replicas', on)} ? "
        f"{on}.max_replicas : ({_set('min_replicas', on)} ? {on}.min_replicas : 1)))"
    )


def _replica_rules() -> list[dict[str, str]]:
    """The loader's replica cross-field checks (``SlotSpec._check_replicas``) as CEL on
    the Slot's spec, so the API server refuses what the operator would (the name-length
    check needs ``metadata.name``: it is a root rule, :func:`_replica_name_rule`)."""
    low = f"({_set('min_replicas')} ? self.min_replicas : 1)"
    many = f"{_max_count()} > 1"
    return [
        {
            "rule": f"!({_set('replicas')} && ({_set('min_replicas')} || {_set('max_replicas')}))",
            "message": "replicas = N sets both bounds: give it or min_replicas/max_replicas, "
            "not both (slot.invalid_value)",
        },
        {
            "rule": f"!({_set('min_replicas')} && {_set('max_replicas')}) || "
            "self.min_replicas <= self.max_replicas",
            "message": "min_replicas is above max_replicas (slot.invalid_value)",
        },
        {
            "rule": f"!(!{_set('replicas')} && {_set('max_replicas')} && "
            f"{low} < self.max_replicas) || {_set('max_concurrency')}",
            "message": "replicas between min_replicas and max_replicas scale by demand, "
            "measured against max_concurrency: set it (slot.invalid_value)",
        },
        {
            "rule": f"!({many} && has(self.device) && self.device == 'npu')",
            "message": "an npu slot has one server: replicas need gpu or cpu (slot.invalid_value)",
        },
        {
            "rule": f"!({many} && has(self.device) && self.device.startsWith('gpu:')) || "
            "(has(self.replica_placement) && self.replica_placement == 'share')",
            "message": "a device that pins GPUs pins every replica to the same GPU(s): set "
            "replica_placement = share to ask for that, or device = gpu (slot.invalid_value)",
        },
        {
            "rule": f"!({many} && {_set('unit')})",
            "message": "a co-loaded unit's member has one server: no replicas (slot.invalid_value)",
        },
    ]


def _replica_name_rule() -> dict[str, str]:
    """CEL on the Slot: its last replica's name (``<name>-r<i>``) is a slot name too."""
    high = _max_count("self.spec")
    return {
        "rule": f"{high} <= 1 || size(self.metadata.name) + 2 + size(string({high} - 1)) <= 63",
        "message": "the Slot's name is too long for its replicas: its last replica's name "
        "<name>-r<i> would be over 63 characters (slot.invalid_value)",
    }


def _model_spec_schema() -> dict[str, Any]:
    schema = _spec_schema(ModelSpec, drop=())
    required = [r for r in schema.pop("required", []) if r != "id"]
    if required:
        schema["required"] = required
    schema["properties"]["source"]["maxLength"] = _MAX_STRING
    schema["properties"]["source"]["x-kubernetes-validations"] = [
        {
            "rule": "self.matches('[^\\\\s]') && (!self.contains('://') || "
            "self.matches('^(file|demo|https?)://') || self.matches('^hf:///*[^/]+/+[^/]+'))",
            "message": "source is a path, file://, hf://org/repo[/file], http(s):// or "
            "demo://name (model.invalid_value)",
        }
    ]
    return schema


def _conditions_schema() -> dict[str, Any]:
    return {
        "type": "array",
        "description": "Ready, Progressing and Degraded (Kubernetes API conventions).",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["type", "status", "lastTransitionTime", "reason", "message"],
            "properties": {
                "type": {"type": "string", "maxLength": 316},
                "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
                "lastTransitionTime": {"type": "string", "format": "date-time"},
                "reason": {
                    "type": "string",
                    "maxLength": 1024,
                    "minLength": 1,
                    "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                },
                "message": {"type": "string", "maxLength": 32768},
            },
        },
    }


def _error_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "The last error: the loader's or the controller's code and message.",
        "nullable": True,
        "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
    }


def _slot_status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "conditions": _conditions_schema(),
            "state": {"type": "string", "description": "Lifecycle state of the slot."},
            "reason": {
                "type": "string",
                "description": "Why the slot is not as it should be, in one word "
                "(WaitingForMemory, Unschedulable, CrashLoopBackOff, ...); empty when fine.",
            },
            "idleReason": {"type": "string", "nullable": True},
            "model": {"type": "string", "description": "The model the slot serves."},
            "endpoint": {"type": "string", "nullable": True},
            "node": {
                "type": "string",
                "nullable": True,
                "description": "The node the slot's server runs on (kubernetes runtime).",
            },
            "memory": {
                "type": "object",
                "properties": {
                    "device": {"type": "string"},
                    "gb": {"type": "number"},
                    "admitted": {"type": "boolean"},
                },
            },
            "lastError": _error_schema(),
            "rollout": {
                "type": "object",
                "description": "The slot's rollout: the one in flight, else the last one "
                "decided. strategy: surge (the new server beside the old, switched to once "
                "ready) or recreate (stopped, then started); reason: why that way (a "
                "recreate says why it could not surge: no room on a GPU, a declared port, "
                "rollout = recreate); phase: starting, switched, failed, stopping, or done.",
                "properties": {
                    "strategy": {"type": "string"},
                    "phase": {"type": "string"},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "since": {"type": "string"},
                },
            },
            "replicas": {
                "type": "object",
                "description": "A slot with replicas: how many are wanted (min, max), "
                "have a server (running), take requests (ready), and each one's state.",
                "properties": {
                    "min": {"type": "integer"},
                    "max": {"type": "integer"},
                    "running": {"type": "integer"},
                    "ready": {"type": "integer"},
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string"},
                                "index": {"type": "integer"},
                                "state": {"type": "string"},
                                "ready": {"type": "boolean"},
                                "endpoint": {"type": "string", "nullable": True},
                                "node": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    }


def _model_status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "conditions": _conditions_schema(),
            "id": {"type": "string"},
            "state": {"type": "string", "description": "Loaded on a slot, or not."},
            "slots": {"type": "array", "items": {"type": "string"}},
            "lastError": _error_schema(),
        },
    }


def _crd(
    *,
    kind: str,
    plural: str,
    short: list[str],
    spec: dict[str, Any],
    status: dict[str, Any],
    columns: list[dict[str, Any]],
    root_rules: list[dict[str, str]],
) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    if root_rules:
        schema["x-kubernetes-validations"] = root_rules
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "slotctl", "app.kubernetes.io/part-of": "slotctl"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
                "categories": ["slotctl"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def _ready_column() -> dict[str, Any]:
    return {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    }


def _age_column() -> dict[str, Any]:
    return {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def slot_crd() -> dict[str, Any]:
    return _crd(
        kind="Slot",
        plural="slots",
        short=["sl"],
        spec=_slot_spec_schema(),
        status=_slot_status_schema(),
        columns=[
            {"name": "State", "type": "string", "jsonPath": ".status.state"},
            {"name": "Reason", "type": "string", "jsonPath": ".status.reason"},
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.default"},
            {"name": "Port", "type": "integer", "jsonPath": ".spec.port"},
            {"name": "Node", "type": "string", "jsonPath": ".status.node"},
            _ready_column(),
            _age_column(),
            {
                "name": "Endpoint",
                "type": "string",
                "jsonPath": ".status.endpoint",
                "priority": 1,
            },
        ],
        root_rules=[
            {
                "rule": f"self.metadata.name.matches({_cel_string(SLOT_NAME_PATTERN)})",
                "message": "a Slot's name is its slot name: a DNS-1123 label of at most 63 "
                "characters (slot.invalid_value)",
            },
            _replica_name_rule(),
        ],
    )


def model_crd() -> dict[str, Any]:
    return _crd(
        kind="Model",
        plural="models",
        short=["mdl"],
        spec=_model_spec_schema(),
        status=_model_status_schema(),
        columns=[
            {"name": "Id", "type": "string", "jsonPath": ".status.id"},
            {"name": "Kind", "type": "string", "jsonPath": ".spec.kind"},
            {"name": "Memory", "type": "number", "jsonPath": ".spec.memory_gb"},
            {"name": "State", "type": "string", "jsonPath": ".status.state"},
            _ready_column(),
            _age_column(),
        ],
        root_rules=[],
    )


_ALIAS_DOCS = {
    "id": "Alias id, the model name clients send (defaults to metadata.name); no Model or "
    "Slot may have it.",
    "models": "The catalogue models it names, in order of preference (1..16, each once).",
    "prefer": "warm: the first member already loaded, else the first whose load evicts "
    "nothing of a higher priority; first: always the first member; spread: the least busy "
    "loaded slot of any member (default warm).",
}


def _alias_spec_schema() -> dict[str, Any]:
    schema = _spec_schema(AliasSpec, drop=())
    schema["required"] = [r for r in schema.get("required", []) if r != "id"]
    for key, text in _ALIAS_DOCS.items():
        schema["properties"][key]["description"] = text
    schema["properties"]["models"]["maxItems"] = 16
    schema["properties"]["models"]["items"]["maxLength"] = 200
    schema["properties"]["models"]["x-kubernetes-validations"] = [
        {
            "rule": "size(self) >= 1 && self.all(m, self.exists_one(n, n == m))",
            "message": "models names at least one model, each once (alias.invalid_value)",
        }
    ]
    return schema


def _alias_status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "conditions": _conditions_schema(),
            "id": {"type": "string"},
            "lastError": _error_schema(),
        },
    }


def alias_crd() -> dict[str, Any]:
    """The ``aliases.slotctl.io`` CRD (short name ``mal``): an ``[[alias]]`` as a resource;
    its ``id`` defaults to ``metadata.name``. Whether its members are catalogue models is
    the operator's to judge (``alias.unknown_member``, reported as ``Degraded``), as for a
    Slot's model reference."""
    return _crd(
        kind="Alias",
        plural="aliases",
        short=["mal"],
        spec=_alias_spec_schema(),
        status=_alias_status_schema(),
        columns=[
            {"name": "Id", "type": "string", "jsonPath": ".status.id"},
            {"name": "Prefer", "type": "string", "jsonPath": ".spec.prefer"},
            {"name": "Models", "type": "string", "jsonPath": ".spec.models"},
            _ready_column(),
            _age_column(),
        ],
        root_rules=[],
    )


_ADAPTER_DOCS = {
    "id": "Adapter id, the model name clients send (or base:id; defaults to metadata.name); "
    "no Model, Alias or Slot may have it.",
    "base": "The catalogue model the adapter was trained on: a slot of it serves the adapter.",
    "source": "The adapter's file or directory: a path, file://, hf://org/repo[/file] or "
    "https:// (as a Model's source).",
    "rank": "The LoRA rank: refused above every serving slot's max_lora_rank.",
    "scale": "The scale a start-time engine applies it at (llama.cpp's per-request scale).",
    "priority": "Eviction order inside a slot: the lowest goes first, then the least "
    "recently used.",
    "pinned": "Never evicted from a slot that holds it.",
    "memory_gb": "Device memory it adds to a slot holding it (counted in admission).",
}


def _adapter_spec_schema() -> dict[str, Any]:
    schema = _spec_schema(AdapterSpec, drop=())
    schema["required"] = [r for r in schema.get("required", []) if r != "id"]
    for key, text in _ADAPTER_DOCS.items():
        schema["properties"][key]["description"] = text
    return schema


def adapter_crd() -> dict[str, Any]:
    """The ``adapters.slotctl.io`` CRD (short name ``mla``): an ``[[adapter]]`` as a
    resource; its ``id`` defaults to ``metadata.name``. Whether its base is a catalogue
    model is the loader's rule (``adapter.unknown_base``)."""
    return _crd(
        kind="Adapter",
        plural="adapters",
        short=["mla"],
        spec=_adapter_spec_schema(),
        status=_alias_status_schema(),
        columns=[
            {"name": "Id", "type": "string", "jsonPath": ".status.id"},
            {"name": "Base", "type": "string", "jsonPath": ".spec.base"},
            {"name": "Rank", "type": "integer", "jsonPath": ".spec.rank"},
            _ready_column(),
            _age_column(),
        ],
        root_rules=[],
    )


def crd_documents() -> dict[str, dict[str, Any]]:
    """File name -> CRD object, in the order ``kubectl apply -f crds/`` applies them."""
    return {
        f"{GROUP}_adapters.yaml": adapter_crd(),
        f"{GROUP}_aliases.yaml": alias_crd(),
        f"{GROUP}_models.yaml": model_crd(),
        f"{GROUP}_slots.yaml": slot_crd(),
    }


_HEADER: Final = (
    "# Generated by `slotctl crd generate` from controller/spec/schema.py: do not edit.\n"
)


def render_yaml(document: dict[str, Any]) -> str:
    return _HEADER + yaml.safe_dump(document, sort_keys=False, width=100)


def crd_files() -> dict[str, str]:
    """File name -> YAML text, exactly what ``slotctl crd generate`` writes."""
    return {name: render_yaml(doc) for name, doc in crd_documents().items()}
