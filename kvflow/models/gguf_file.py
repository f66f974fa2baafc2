"""Reading GGUF files: architecture from metadata, weights dequantized to Hugging Face
names and layouts (llama.cpp permutes q/k rows for its interleaved rotary; we undo it).
Mixtures of experts: ``gguf_moe.py``."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from kvflow.config import ModelArchConfig
from kvflow.errors import ModelLoadError
from kvflow.models import gguf_moe
from kvflow.models.gguf_header import GGUFTensor, cached_gguf_header

_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
          "phi3": "Phi3ForCausalLM", **gguf_moe.MOE_ARCHS}
# Where an architecture's layer tensors differ from _LAYER_NAMES: Gemma's four norms,
# Phi-3's fused qkv and gate_up (split by models/phi3.py).
_ARCH_LAYER_NAMES = {
    "gemma": {"post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}

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


def _file_bytes(path: str) -> np.memmap:
    """The whole file as read-only bytes, mapped once for all its tensors."""
    return np.memmap(path, dtype=np.uint8, mode="r")


def gguf_weight_bytes(path: str) -> tuple[int, int]:
    """(bytes, elements) of a GGUF file's tensors as stored: its real weight size, which
    a 4-bit file has at about a quarter of bf16's (``kvflow plan`` plans with it)."""
    import gguf

    h = cached_gguf_header(path)
    nbytes = elements = 0
    for t in h.tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        nbytes += t.num_elements // block * type_size
        elements += t.num_elements
    return nbytes, elements


def _tensor_data(path: str, file: np.memmap, t: GGUFTensor, qtype) -> np.ndarray:
    """A tensor's bytes as gguf.quants.dequantize expects them (a view of ``file``)."""
    import gguf

    try:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except KeyError:
        raise ModelLoadError(f"{path}: tensor {t.name} has unknown GGML type "
                             f"{t.ggml_type}") from None
    nbytes = t.num_elements // block * type_size
    raw = file[t.offset:t.offset + nbytes]
    if raw.size != nbytes:
        raise ModelLoadError(f"the GGUF file {path} is truncated: tensor {t.name} needs "
                             f"{nbytes} bytes at offset {t.offset}")
    shape = t.numpy_shape
    if qtype == gguf.GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape)
    if qtype == gguf.GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape)
    # Block-quantized (and bf16) rows are bytes: [..., row_bytes].
    return raw.reshape(*shape[:-1], shape[-1] // block * type_size)


def read_gguf_arch(path: str) -> tuple[ModelArchConfig, dict]:
    """Architecture hyperparameters and sampling defaults from GGUF metadata."""
    h = cached_gguf_header(path)
    a = h.field("general.architecture")
    if a not in _ARCHS:
        raise ModelLoadError(f"{path}: GGUF architecture {a!r} is not supported "
                             f"(supported: {', '.join(_ARCHS)})")
    names = {t.name for t in h.tensors}

    def need(key: str):
        value = h.field(f"{a}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {a}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    tokens = h.field("tokenizer.ggml.tokens") or []
    moe = gguf_moe.is_moe(h, a)
    cfg = dict(
        architectures=[gguf_moe.moe_architecture(a) if moe else _ARCHS[a]],
        vocab_size=int(h.field(f"{a}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(h.field(f"{a}.attention.head_count_kv", heads)),
        head_dim=int(h.field(f"{a}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(h.field(f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(h.field(f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=h.field("tokenizer.ggml.bos_token_id"),
    )
    eos = [h.field(k) for k in ("tokenizer.ggml.eos_token_id",
                                "tokenizer.ggml.eot_token_id",
                                "tokenizer.ggml.eom_token_id")]
    cfg["eos_token_id"] = [int(e) for e in dict.fromkeys(eos) if e is not None]
    scaling = h.field(f"{a}.rope.scaling.type")
    if "rope_freqs.weight" in names:
        t = next(t for t in h.tensors if t.name == "rope_freqs.weight")
        factors = _dequantize(path, _file_bytes(path), t)
        cfg["rope_scaling"] = {"rope_type": "freq_factors",
                               "factors": tuple(float(x) for x in factors.reshape(-1))}
    elif scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(need("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported")
    cfg.update(_dense_fields(path, h, a, names, cfg))
    if moe:
        cfg.update(gguf_moe.moe_config(path, h, a, cfg))
    return ModelArchConfig.from_hf_config(cfg), gguf_sampling_defaults(h)


def _dense_fields(path: str, h, a: str, names: set[str], cfg: dict) -> dict:
    """Gemma's and Phi-3's config fields from llama.cpp's metadata. Where llama.cpp
    hard-codes a value instead of storing it (Gemma's query scale: hidden / heads on the
    27B models, else head_dim; Gemma 3's 5:1 pattern and local rope base 10000), so do we."""
    out: dict = {}
    window = h.field(f"{a}.attention.sliding_window")
    if window is not None:
        out["sliding_window"] = int(window)
    if a in ("gemma2", "gemma3"):
        layers = cfg["num_hidden_layers"]
        big = layers == (46 if a == "gemma2" else 62)  # llama.cpp's LLM_TYPE_27B
        out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=(
            cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]))
    if a == "gemma2":
        out["attn_logit_softcapping"] = h.field("gemma2.attn_logit_softcapping", 50.0)
        out["final_logit_softcapping"] = h.field("gemma2.final_logit_softcapping", 30.0)
    if a == "gemma3":
        pattern = h.field("gemma3.attention.sliding_window_pattern", 6)
        if not isinstance(pattern, int):
            raise ModelLoadError(f"{path}: gemma3.attention.sliding_window_pattern "
                                 f"{pattern!r} is not supported (an integer period)")
        out["sliding_window_pattern"] = pattern
        out["rope_local_base_freq"] = float(h.field("gemma3.rope.freq_base_swa", 10000.0))
    if a == "phi3" and "rope_factors_long.weight" in names:
        file = _file_bytes(path)
        factors = {n: tuple(float(x) for x in _dequantize(
            path, file, next(t for t in h.tensors if t.name == f"rope_factors_{n}.weight")
        ).reshape(-1)) for n in ("long", "short")}
        out["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": factors["long"],
            "short_factor": factors["short"],
            "original_max_position_embeddings": int(h.field(
                "phi3.rope.scaling.original_context_length", cfg["max_position_embeddings"]))}
        attn = h.field("phi3.rope.scaling.attn_factor")
        if attn is not None:
            out["rope_scaling"]["attention_factor"] = float(attn)
    return out


# llama.cpp's recommended-sampling keys (general.sampling.*) -> SamplingParams fields.
_GGUF_SAMPLING = {"temp": ("temperature", float), "top_p": ("top_p", float),
                  "top_k": ("top_k", int), "min_p": ("min_p", float),
                  "penalty_repeat": ("repetition_penalty", float)}


def gguf_sampling_defaults(h) -> dict:
    """The sampling settings a GGUF file recommends, where its metadata has them."""
    out = {}
    for key, (name, kind) in _GGUF_SAMPLING.items():
        value = h.field(f"general.sampling.{key}")
        if value is not None:
            out[name] = kind(value)
    return out


def _dequantize(path: str, file: np.memmap, t: GGUFTensor, expert: int | None = None
                ) -> np.ndarray:
    """A tensor as a writable float32 array in numpy (Hugging Face) shape; ``expert``:
    only that expert of a stacked [E, rows, cols] expert tensor (one at a time, so a big
    model's layer is never all float32 at once)."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(t.ggml_type)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {t.name} has unknown GGML type "
                             f"{t.ggml_type}") from None
    data, shape = _tensor_data(path, file, t, qtype), t.numpy_shape
    if expert is not None:
        data, shape = data[expert], shape[1:]
    try:
        data = gguf.quants.dequantize(data, qtype)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {t.name} cannot be dequantized "
                             f"({type(e).__name__}: {e})") from None
    # A copy: unquantized tensors come back as read-only views of the memory map.
    return np.array(data, dtype=np.float32).reshape(shape)


def _expert_weights(path: str, file: np.memmap, t: GGUFTensor, blocks: np.memmap | None
                    ) -> Iterator[tuple[str, torch.Tensor]] | None:
    """A llama.cpp expert tensor as per-expert Hugging Face tensors (``FusedMoE``'s loader
    stacks them): dequantized to float32 one expert at a time, or, with ``blocks`` (the
    file mapped copy-on-write: writable views, nothing copied), as each expert's
    ``qweight_type`` then ``qweight`` (its block rows, a view of the mapping) for the GGUF
    expert method, which reads only its rank's experts. None: ``t`` is not an expert
    tensor."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
    if m and m.group(2) in gguf_moe.STACKED_EXPERTS:  # [E, rows, cols]
        layer, proj = m.group(1), gguf_moe.STACKED_EXPERTS[m.group(2)]
        names = [(e, f"model.layers.{layer}.mlp.experts.{e}.{proj}.")
                 for e in range(t.numpy_shape[0])]
    elif m := gguf_moe.PER_EXPERT.fullmatch(t.name):  # older Mixtral files
        layer, proj, e = m.groups()
        names = [(None, f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.")]
    else:
        return None
    if blocks is None:
        return ((name + "weight", torch.from_numpy(_dequantize(path, file, t, e)))
                for e, name in names)
    return _expert_blocks(path, blocks, t, names)


def _expert_blocks(path: str, blocks: np.memmap, t: GGUFTensor,
                   names: list[tuple[int | None, str]]) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(t.ggml_type)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {t.name} has unknown GGML type "
                             f"{t.ggml_type}") from None
    data = _tensor_data(path, blocks, t, qtype)
    data = data.view(np.uint8).reshape(*data.shape[:-1], -1)  # F32/F16 rows as bytes too
    for e, name in names:
        yield name + "qweight_type", torch.tensor(int(t.ggml_type))
        yield name + "qweight", torch.from_numpy(data if e is None else data[e])


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half layout)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def iter_gguf_weights(path: str, arch: ModelArchConfig, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for every weight in the file.

    ``keep_quantized``: every matrix (linear layers, embedding, output) comes instead as
    ``<module>.qweight_type`` (0-d int64, its GGML type) then ``<module>.qweight`` (its
    raw block bytes, uint8 [rows, row_bytes], rows in Hugging Face order), for the GGUF
    quantization method to repack; so does each expert of a mixture of experts (per
    expert, ``experts.{e}.{gate,up,down}_proj.qweight*``, views of the mapped file);
    vectors (norms, biases) and routers stay float32."""
    import gguf

    h = cached_gguf_header(path)
    a = h.field("general.architecture")
    permute = a in ("llama", "mistral")
    gemma = a in ("gemma2", "gemma3")
    moe = gguf_moe.is_moe(h, a)
    layer_names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get("gemma" if gemma else a, {}),
                   **(gguf_moe.MOE_LAYER_NAMES if moe else {})}
    file = _file_bytes(path)
    blocks = np.memmap(path, dtype=np.uint8, mode="c") if moe and keep_quantized else None
    for t in h.tensors:
        if moe and (experts := _expert_weights(path, file, t, blocks)) is not None:
            yield from experts
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m:
            layer, part, kind = m.groups()
            if part not in layer_names:
                continue
            name = f"model.layers.{layer}.{layer_names[part]}.{kind}"
        else:
            base, _, kind = t.name.rpartition(".")
            if base not in _GLOBAL_NAMES:
                continue  # e.g. rope_freqs, read with the architecture
            name = f"{_GLOBAL_NAMES[base]}.{kind}"
        router = m is not None and part in gguf_moe.ROUTERS
        if keep_quantized and kind == "weight" and len(t.numpy_shape) == 2 and not router:
            try:
                qtype = gguf.GGMLQuantizationType(t.ggml_type)
            except ValueError:
                raise ModelLoadError(f"{path}: tensor {t.name} has unknown GGML type "
                                     f"{t.ggml_type}") from None
            data = np.array(_tensor_data(path, file, t, qtype)).view(np.uint8)
            data = data.reshape(t.numpy_shape[0], -1)  # [rows, row_bytes]
            name = name[:-len("weight")]
            if permute and m and part in ("attn_q", "attn_k"):
                heads = (arch.num_attention_heads if part == "attn_q"
                         else arch.num_key_value_heads)
                data = np.ascontiguousarray(_unpermute(data, heads))
            yield name + "qweight_type", torch.tensor(int(t.ggml_type))
            yield name + "qweight", torch.from_numpy(data)
            continue
        data = _dequantize(path, file, t)
        if gemma and t.name.endswith("norm.weight"):
            data -= 1.0  # llama.cpp stores Gemma's (1 + weight); kvflow's norm adds the 1
        if permute and m and part in ("attn_q", "attn_k"):
            heads = arch.num_attention_heads if part == "attn_q" else arch.num_key_value_heads
            data = _unpermute(data, heads)
        if router:
            data = data.reshape(-1, arch.hidden_size)  # the shared gate: [H] or [1, H]
        yield name, torch.from_numpy(data)
