"""Tiny pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) packed from known
integers with a packer of our own, beside the same model dequantized. Shared by
tests/test_quantization.py and tests/kernels/test_woq_seam.py."""

from __future__ import annotations

import numpy as np


def _pack_words(v: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Our own packer: ``32 // bits`` values per int32 along ``axis``; with ``order``,
    nibble i of a word holds element order[i] of its run (AWQ)."""
    pf = 32 // bits
    v = np.moveaxis(v.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // pf, pf)
    if order is not None:
        v = v[..., list(order)]
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(pf):
        words |= v[..., i] << np.uint32(bits * i)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def _write_prequantized(path, fmt: str, bits: int, group: int, desc_act: bool,
                        v1: bool = True, sym: bool = False) -> None:
    """A tiny-llama checkpoint whose linears are GPTQ/AWQ packed, plus the same model
    dequantized in ``path``/dense (the reference)."""
    import json
    import os

    from safetensors.numpy import save_file

    from kvflow.models.registry import PRESETS

    rng = np.random.default_rng(bits + group)
    cfg = dict(PRESETS["tiny-llama"])
    h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], 32
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, h),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    packed: dict[str, np.ndarray] = {}
    dense: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], h)) * 0.1,
        "lm_head.weight": rng.standard_normal((cfg["vocab_size"], h)) * 0.1,
        "model.norm.weight": np.ones(h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        dense[p + "input_layernorm.weight"] = rng.uniform(0.8, 1.2, h)
        dense[p + "post_attention_layernorm.weight"] = rng.uniform(0.8, 1.2, h)
        # q/k/v (and gate/up) share their input, so their desc_act order too.
        perms = {k: rng.permutation(k) for k in (h, inter)}
        for name, (n, k) in shapes.items():
            ng = k // group
            q = rng.integers(0, 1 << bits, (k, n))
            # v1 stores z - 1 in 4 bits, so it cannot hold z = 0.
            z = rng.integers(1 if fmt == "gptq" and v1 else 0, 1 << bits, (ng, n))
            if sym:  # compressed-tensors stores signed values + 2^(bits-1): zero at mid
                z[:] = 1 << (bits - 1)
            s = rng.uniform(0.002, 0.01, (ng, n)).astype(np.float16)
            g_idx = (np.argsort(perms[k]) // group if desc_act else np.arange(k) // group)
            w = (q - z[g_idx]) * s[g_idx].astype(np.float64)  # [K, N]
            dense[p + name + ".weight"] = w.T
            key = p + name + "."
            if fmt == "compressed-tensors":
                packed[key + "weight_packed"] = _pack_words(q.T, bits, 1)
                packed[key + "weight_scale"] = np.ascontiguousarray(s.T)
                packed[key + "weight_shape"] = np.array([n, k], np.int64)
                if not sym:
                    packed[key + "weight_zero_point"] = _pack_words(z.T, bits, 0)
                continue
            if fmt == "gptq":
                packed[key + "qweight"] = _pack_words(q, bits, 0)
                packed[key + "qzeros"] = _pack_words(z - 1 if v1 else z, bits, 1)
                packed[key + "g_idx"] = g_idx.astype(np.int32)
            else:
                order = (0, 2, 4, 6, 1, 3, 5, 7)
                packed[key + "qweight"] = _pack_words(q, bits, 1, order)
                packed[key + "qzeros"] = _pack_words(z, bits, 1, order)
            packed[key + "scales"] = s
    dense = {k: np.ascontiguousarray(v, np.float32) for k, v in dense.items()}
    qc = {"quant_method": fmt, "bits": bits, "group_size": group}
    if fmt == "compressed-tensors":
        qc = {"quant_method": fmt, "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group",
                  "group_size": group}}}}
    elif fmt == "gptq":
        qc.update(desc_act=desc_act, checkpoint_format="gptq" if v1 else "gptq_v2")
    else:
        qc.update(version="gemm", zero_point=True)
    os.makedirs(path / "dense")
    for folder, tensors, extra in ((path, {**packed, **{k: v for k, v in dense.items()
                                                       if not k.endswith("proj.weight")}},
                                    {"quantization_config": qc}),
                                   (path / "dense", dense, {})):
        save_file(tensors, str(folder / "model.safetensors"))
        with open(folder / "config.json", "w") as f:
            json.dump({**cfg, **extra}, f)
