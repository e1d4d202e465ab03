"""A model's sampling defaults as its server's start flags, engine by engine.

Part of :mod:`controller.providers`, used by the templates (:mod:`.templates`) and by
``slotctl stack validate`` (which warns about a default a slot's server would not take).
A model's sampling keys (``temperature``, ``top_p``, … ``max_tokens``, ``seed``, ``stop``,
``system_prompt``: :data:`controller.spec.schema.SAMPLING_KEYS`) are *defaults*: a
request's own value wins. Each engine is told them the way its documents say, and a key
an engine has no start-time form for is named, never dropped silently:

* **llama-server** (``tools/server/README.md``, "Sampling params"): ``--temp``,
  ``--top-k``, ``--top-p``, ``--min-p``, ``--repeat-penalty``, ``--presence-penalty``,
  ``--frequency-penalty``, ``-s, --seed``; the server's start parameters are each
  request's defaults.
* **vLLM** (``--override-generation-config``, a JSON object over the model's
  ``generation_config.json``): the keys ``ModelConfig.get_diff_sampling_param`` reads —
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` (slotctl's
  ``repeat_penalty``).

``max_tokens`` is told to neither: llama-server's ``--n-predict`` also caps a request's own
``n_predict`` ("exceeds server configuration, setting to …"), and vLLM's
``max_new_tokens`` override becomes ``override_max_tokens``, the ``min`` of
``get_max_tokens``: a default a request could not raise is not a default.
* **the demo server** (``--sampling``, a JSON object): every key; it applies
  ``max_tokens`` and reports them all at ``GET /props`` as llama-server does.
* **llama-cpp-python** (``python -m llama_cpp.server``): its settings have no sampling
  defaults; none is passed.

``stop`` and ``system_prompt`` have a start-time form only on the demo server.
"""

from __future__ import annotations

import json
from typing import Final

from controller.spec.schema import SAMPLING_KEYS, ModelSpec

__all__ = ["SAMPLING_FORMS", "sampling_args", "sampling_defaults", "unpassed"]

# llama-server's flag for each key it takes at start
_LLAMA_SERVER_FLAGS: Final[dict[str, str]] = {
    "temperature": "--temp",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "seed": "--seed",
}
# vLLM's generation-config name for each key its override reads
_VLLM_KEYS: Final[dict[str, str]] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
}
# The keys each provider passes to its server (a provider not named passes none: its
# command is the user's own, ``server.cmd``).
SAMPLING_FORMS: Final[dict[str, frozenset[str]]] = {
    "llamacpp": frozenset(_LLAMA_SERVER_FLAGS),
    "vllm": frozenset(_VLLM_KEYS),
    "demo": SAMPLING_KEYS,
    "llama-cpp-python": frozenset(),
}


def sampling_defaults(model: ModelSpec | None) -> dict[str, object]:
    """The sampling keys ``model`` sets, in :data:`SAMPLING_KEYS`' sorted order."""
    if model is None:
        return {}
    values = {key: getattr(model, key) for key in sorted(SAMPLING_KEYS)}
    return {key: value for key, value in values.items() if value is not None}


def unpassed(provider: str, model: ModelSpec | None) -> list[str]:
    """The sampling keys ``model`` sets that ``provider``'s server is not told (sorted)."""
    passed = SAMPLING_FORMS.get(provider, frozenset())
    return [key for key in sampling_defaults(model) if key not in passed]


def sampling_args(provider: str, model: ModelSpec | None) -> list[str]:
    """The start flags that tell ``provider``'s server ``model``'s sampling defaults."""
    values = sampling_defaults(model)
    if not values:
        return []
    if provider == "llamacpp":
        args: list[str] = []
        for key, value in values.items():
            flag = _LLAMA_SERVER_FLAGS.get(key)
            if flag is not None:
                args += [flag, str(value)]
        return args
    if provider == "vllm":
        config = {_VLLM_KEYS[k]: v for k, v in values.items() if k in _VLLM_KEYS}
        return ["--override-generation-config", _json(config)] if config else []
    if provider == "demo":
        return ["--sampling", _json(values)]
    return []


def _json(values: dict[str, object]) -> str:
    return json.dumps(values, separators=(",", ":"), ensure_ascii=False)
