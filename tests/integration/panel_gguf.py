"""Generated llama GGUFs of chosen sizes, the footprint panel (issue 36).

:func:`write_llama` writes a model of the given width, depth and weight type (f32, f16 or
q8_0) with the byte-level vocabulary of :mod:`tests.integration.tiny_gguf`; the weights
are small random values (a fixed seed), cheap to write: the bytes, not the words, are
what the footprint tests and ``bench/footprint_estimate.py`` measure. :data:`PANEL`
names the shapes both use, smallest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tests.integration.tiny_gguf import BOS_ID, EOS_ID, UNK_ID, _vocab

__all__ = ["PANEL", "Shape", "write_llama"]


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int = 4096
    dtype: str = "f32"  # f32 | f16 | q8_0

    @property
    def label(self) -> str:
        return f"{self.name} ({self.n_layer}x{self.n_embd}, {self.dtype})"


# Smallest first: the suite runs the first; the bench runs them all.
PANEL: tuple[Shape, ...] = (
    Shape("s", 256, 4, 768, 4, 4),
    Shape("m", 1024, 8, 2816, 8, 2, dtype="f16"),
    Shape("l", 768, 12, 2048, 12, 12, n_ctx_train=8192),
    Shape("q", 1536, 8, 4096, 12, 4, dtype="q8_0"),
)


def write_llama(path: Path, shape: Shape, seed: int = 7) -> Path:
    """Write a llama model of ``shape`` to ``path`` and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    head_dim = shape.n_embd // shape.n_head
    n_kv = head_dim * shape.n_head_kv

    def weight(rows: int, cols: int) -> np.ndarray:
        data = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        if shape.dtype == "f16":
            return data.astype(np.float16)
        return data

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"slotctl-panel-{shape.name}")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    def add(name: str, data: np.ndarray) -> None:
        if shape.dtype == "q8_0" and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", weight(n_vocab, shape.n_embd))
    for i in range(shape.n_layer):
        blk = f"blk.{i}."
        add(blk + "attn_norm.weight", ones(shape.n_embd))
        add(blk + "attn_q.weight", weight(shape.n_embd, shape.n_embd))
        add(blk + "attn_k.weight", weight(n_kv, shape.n_embd))
        add(blk + "attn_v.weight", weight(n_kv, shape.n_embd))
        add(blk + "attn_output.weight", weight(shape.n_embd, shape.n_embd))
        add(blk + "ffn_norm.weight", ones(shape.n_embd))
        add(blk + "ffn_gate.weight", weight(shape.n_ff, shape.n_embd))
        add(blk + "ffn_up.weight", weight(shape.n_ff, shape.n_embd))
        add(blk + "ffn_down.weight", weight(shape.n_embd, shape.n_ff))
    add("output_norm.weight", ones(shape.n_embd))
    add("output.weight", weight(n_vocab, shape.n_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
