"""What a model file says of its size: ggml's tensor types, a GGUF model's and a
safetensors repository's shape (the vocabulary between :mod:`controller.modelfiles.headers`,
which reads them, and :mod:`controller.scheduling.footprint`, which sizes a server by them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

__all__ = ["GGML_TYPES", "GgufModel", "SafetensorsModel", "element_bytes", "tensor_bytes"]

# ggml's tensor types: id -> (name, elements per block, bytes per block); ggml.h / gguf's
# GGML_QUANT_SIZES (tests/unit/test_footprint.py checks the two agree).
GGML_TYPES: Final[dict[int, tuple[str, int, int]]] = {
    0: ("f32", 1, 4),
    1: ("f16", 1, 2),
    2: ("q4_0", 32, 18),
    3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24),
    8: ("q8_0", 32, 34),
    9: ("q8_1", 32, 40),
    10: ("q2_k", 256, 84),
    11: ("q3_k", 256, 110),
    12: ("q4_k", 256, 144),
    13: ("q5_k", 256, 176),
    14: ("q6_k", 256, 210),
    15: ("q8_k", 256, 292),
    16: ("iq2_xxs", 256, 66),
    17: ("iq2_xs", 256, 74),
    18: ("iq3_xxs", 256, 98),
    19: ("iq1_s", 256, 50),
    20: ("iq4_nl", 32, 18),
    21: ("iq3_s", 256, 110),
    22: ("iq2_s", 256, 82),
    23: ("iq4_xs", 256, 136),
    24: ("i8", 1, 1),
    25: ("i16", 1, 2),
    26: ("i32", 1, 4),
    27: ("i64", 1, 8),
    28: ("f64", 1, 8),
    29: ("iq1_m", 256, 56),
    30: ("bf16", 1, 2),
    34: ("tq1_0", 256, 54),
    35: ("tq2_0", 256, 66),
    39: ("mxfp4", 32, 17),
}
_BY_NAME: Final = {name: (block, size) for name, block, size in GGML_TYPES.values()}


def tensor_bytes(type_id: int, elements: int) -> int:
    """Bytes of a tensor of ``elements`` of ggml type ``type_id`` (ValueError: unknown)."""
    if type_id not in GGML_TYPES:
        raise ValueError(f"unknown ggml tensor type {type_id}")
    _name, block, size = GGML_TYPES[type_id]
    return -(-elements // block) * size


def element_bytes(cache_type: str) -> float:
    """Bytes per element of a KV cache type (``f16``, ``q8_0``...; unknown: f16's)."""
    block, size = _BY_NAME.get(cache_type.lower(), (1, 2))
    return size / block


@dataclass(frozen=True, slots=True)
class GgufModel:
    """What a GGUF header says of a model's size (:mod:`controller.modelfiles.headers`)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer (one value broadcast)
    key_length: int
    value_length: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    layer_bytes: tuple[int, ...]  # the weights of blk.N, per layer
    input_bytes: int  # token_embd (llama.cpp keeps the input layer on the CPU)
    output_bytes: int  # everything else (output, output_norm...): with the last layer
    by_type: tuple[tuple[str, int], ...]  # weight bytes per tensor type, largest first

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.input_bytes + self.output_bytes

    def kv_per_token(self, cache_k: str, cache_v: str, layers: Iterable[int]) -> float:
        """KV bytes per token of context over ``layers``."""
        k, v = element_bytes(cache_k), element_bytes(cache_v)
        total = 0.0
        for i in layers:
            heads = self.n_head_kv[i] if i < len(self.n_head_kv) else self.n_head_kv[-1]
            total += heads * (self.key_length * k + self.value_length * v)
        return total


@dataclass(frozen=True, slots=True)
class SafetensorsModel:
    """A safetensors repository: its tensors' bytes (headers) and ``config.json``'s shape."""

    weight_bytes: int
    by_type: tuple[tuple[str, int], ...]
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    max_position: int | None
    dtype_bytes: int  # the KV cache's element size (the model's dtype)
