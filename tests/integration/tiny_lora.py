"""A tiny LoRA adapter GGUF for the tiny llama of :mod:`tests.integration.tiny_gguf`, as
llama.cpp reads adapters: ``general.type = adapter``, ``adapter.type = lora``,
``adapter.lora.alpha``, and for each adapted base tensor ``W`` (numpy shape
``(n_out, n_in)``) the pair ``<W>.lora_a`` ``(rank, n_in)`` and ``<W>.lora_b``
``(n_out, rank)``, so that ``W' = W + scale * alpha / rank * B @ A``.

It adapts the output projection strongly (a fixed seed): at scale 1 the greedy tokens
differ from the base model's, which is what tests and the bench tell apart.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.integration.tiny_gguf import EMBEDDING_LENGTH, VOCAB_SIZE

__all__ = ["write_tiny_lora"]


def write_tiny_lora(path: Path, *, seed: int = 7, rank: int = 4, alpha: float = 4.0) -> Path:
    """Write an adapter (``seed`` makes each one recognisable) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    n_in, n_out = EMBEDDING_LENGTH, VOCAB_SIZE
    a = (rng.standard_normal((rank, n_in)) * 2.0).astype(np.float32)
    b = (rng.standard_normal((n_out, rank)) * 2.0).astype(np.float32)
    writer.add_tensor("output.weight.lora_a", a)
    writer.add_tensor("output.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
