"""Reading GGUF files: architecture from metadata, weights dequantized to Hugging Face
names and layouts (llama.cpp permutes q/k rows for its interleaved rotary; we undo it)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import torch

from kvflow.config import ModelArchConfig
from kvflow.errors import ModelLoadError

_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


@lru_cache(maxsize=4)
def open_gguf(path: str):
    """A GGUFReader over the file (memory-mapped); corrupt files raise ModelLoadError."""
    try:
        import gguf
    except ImportError:
        raise ModelLoadError("reading GGUF files needs the 'gguf' package: pip install gguf")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises many types on damaged files
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from None


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as e:
        raise ModelLoadError(f"GGUF metadata field {key} is unreadable: {e}") from None


def read_gguf_arch(path: str) -> tuple[ModelArchConfig, dict]:
    """Architecture hyperparameters and sampling defaults from GGUF metadata."""
    r = open_gguf(path)
    a = gguf_field(r, "general.architecture")
    if a not in _ARCHS:
        raise ModelLoadError(f"{path}: GGUF architecture {a!r} is not supported "
                             f"(supported: {', '.join(_ARCHS)})")
    names = {t.name for t in r.tensors}

    def need(key: str):
        value = gguf_field(r, f"{a}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {a}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    tokens = gguf_field(r, "tokenizer.ggml.tokens") or []
    cfg = dict(
        architectures=[_ARCHS[a]],
        vocab_size=int(gguf_field(r, f"{a}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(gguf_field(r, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(gguf_field(r, f"{a}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf_field(r, f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(gguf_field(r, f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=gguf_field(r, "tokenizer.ggml.bos_token_id"),
    )
    eos = [gguf_field(r, k) for k in ("tokenizer.ggml.eos_token_id",
                                      "tokenizer.ggml.eot_token_id")]
    cfg["eos_token_id"] = [int(e) for e in dict.fromkeys(eos) if e is not None]
    scaling = gguf_field(r, f"{a}.rope.scaling.type")
    if "rope_freqs.weight" in names:
        t = next(t for t in r.tensors if t.name == "rope_freqs.weight")
        cfg["rope_scaling"] = {"rope_type": "freq_factors",
                               "factors": tuple(float(x) for x in np.asarray(t.data))}
    elif scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(need("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported")
    return ModelArchConfig.from_hf_config(cfg), {}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half layout)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def iter_gguf_weights(path: str, arch: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for every weight in the file."""
    import gguf

    r = open_gguf(path)
    permute = gguf_field(r, "general.architecture") in ("llama", "mistral")
    for t in r.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m:
            layer, part, kind = m.groups()
            if part not in _LAYER_NAMES:
                continue
            name = f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        else:
            base, _, kind = t.name.rpartition(".")
            if base not in _GLOBAL_NAMES:
                continue  # e.g. rope_freqs, read with the architecture
            name = f"{_GLOBAL_NAMES[base]}.{kind}"
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: tensor {t.name} cannot be dequantized "
                                 f"({type(e).__name__}: {e})") from None
        # A copy: unquantized tensors come back as read-only views of the memory map.
        data = np.array(data, dtype=np.float32).reshape(tuple(reversed(
            [int(x) for x in t.shape])))
        if permute and m and part in ("attn_q", "attn_k"):
            heads = arch.num_attention_heads if part == "attn_q" else arch.num_key_value_heads
            data = _unpermute(data, heads)
        yield name, torch.from_numpy(data)
