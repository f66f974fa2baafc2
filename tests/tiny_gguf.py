"""A tiny GGUF Llama written with gguf-py (2 layers, hidden 64): Q4_0, Q4_1, Q8_0 and F32
tensors, mixed types inside merged layers as Q4_K_M files have them. Shared by
tests/test_quantization.py and tests/kernels/test_woq_seam.py."""

from __future__ import annotations

import numpy as np

H, I, L, HEADS, KV, V = 64, 128, 2, 4, 2, 512


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of the loader's unpermute)."""
    r = w.shape[0]
    return w.reshape(n_head, 2, r // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_shape(w, cfg: dict, num_layers: int | None = None) -> None:
    """The attention/MLP shape keys llama.cpp writes for a transformers ``config.json``
    (``cfg``) on GGUFWriter ``w``; ``num_layers`` overrides the block count."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(num_layers or cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])


def write_tiny_gguf(path: str, special_ids: dict[str, int] | None = None) -> str:
    """``special_ids``: extra ``tokenizer.ggml.<name>`` fields, e.g. {"eos_token_id": 2}."""
    import gguf

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_block_count(L)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(V)
    for name, value in (special_ids or {}).items():
        w.add_uint32(f"tokenizer.ggml.{name}", value)

    def mat(name, rows, cols, qtype, permute_heads=0):
        x = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
        if permute_heads:
            x = _permute(x, permute_heads)
        if qtype == Q.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    mat("token_embd.weight", V, H, Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    mat("output.weight", V, H, Q.Q4_0)
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", rng.uniform(0.8, 1.2, H).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", rng.uniform(0.8, 1.2, H).astype(np.float32))
        mat(p + "attn_q.weight", H, H, Q.Q4_1, HEADS)
        mat(p + "attn_k.weight", KV * H // HEADS, H, Q.Q4_1, KV)
        # Mixed types inside merged layers, as Q4_K_M files have them.
        mat(p + "attn_v.weight", KV * H // HEADS, H, Q.Q8_0)
        mat(p + "attn_output.weight", H, H, Q.Q4_0)
        mat(p + "ffn_gate.weight", I, H, Q.Q4_1)
        mat(p + "ffn_up.weight", I, H, Q.F32 if i else Q.Q4_1)
        mat(p + "ffn_down.weight", H, I, Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
