"""A tiny random-weight llama GGUF (~120 KB) for tests against real llama.cpp servers.

One layer, 32 wide, a byte-level SentencePiece-style vocabulary (``<unk>``, ``<s>``,
``</s>``, ``▁`` and the 256 byte tokens), f32 weights from a fixed seed. It generates
gibberish, but it loads in milliseconds and speaks every OpenAI endpoint a real server
has: completions, chat completions (with the server's default chat format) and, with
mean pooling written into the file, embeddings of length 32.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

__all__ = ["EMBEDDING_LENGTH", "VOCAB_SIZE", "write_tiny_llama"]

EMBEDDING_LENGTH = 32
FEED_FORWARD_LENGTH = 64
HEAD_COUNT = 2
CONTEXT_LENGTH = 256
SEED = 20240601

_SPECIAL = ["<unk>", "<s>", "</s>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = [*_SPECIAL, "\u2581"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types.append(gguf.TokenType.NORMAL)
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    scores[3] = -1.0  # "▁": the only merge-able piece; bytes are the fallback
    return tokens, scores, [int(t) for t in types]


VOCAB_SIZE = len(_vocab()[0])


def write_tiny_llama(path: Path, *, embeddings_pooling: bool = True) -> Path:
    """Write the tiny model to ``path`` and return it (deterministic bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    n_embd, n_ff = EMBEDDING_LENGTH, FEED_FORWARD_LENGTH
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)

    def weight(*shape: int) -> np.ndarray:
        # numpy shape is GGUF's dims reversed: (rows = output features, cols = input).
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("slotctl-tiny-llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(HEAD_COUNT)
    writer.add_head_count_kv(HEAD_COUNT)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(n_embd // HEAD_COUNT)
    writer.add_vocab_size(n_vocab)
    if embeddings_pooling:
        writer.add_pooling_type(gguf.PoolingType.MEAN)

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

    tensors: list[tuple[str, np.ndarray]] = [
        ("token_embd.weight", weight(n_vocab, n_embd)),
        ("blk.0.attn_norm.weight", ones(n_embd)),
        ("blk.0.attn_q.weight", weight(n_embd, n_embd)),
        ("blk.0.attn_k.weight", weight(n_embd, n_embd)),
        ("blk.0.attn_v.weight", weight(n_embd, n_embd)),
        ("blk.0.attn_output.weight", weight(n_embd, n_embd)),
        ("blk.0.ffn_norm.weight", ones(n_embd)),
        ("blk.0.ffn_gate.weight", weight(n_ff, n_embd)),
        ("blk.0.ffn_up.weight", weight(n_ff, n_embd)),
        ("blk.0.ffn_down.weight", weight(n_embd, n_ff)),
        ("output_norm.weight", ones(n_embd)),
        ("output.weight", weight(n_vocab, n_embd)),
    ]
    for name, data in tensors:
        writer.add_tensor(name, data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
