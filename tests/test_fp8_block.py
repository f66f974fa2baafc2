"""Block-wise FP8 W8A8 (``--quantization fp8-block``, DeepSeek-style checkpoints): the
layer against the dense model, checkpoints made here in the ``fp8`` layout
(``weight_block_size`` + ``weight_scale_inv``) and compressed-tensors ``block`` strategy,
and bad scale shapes refused."""

from __future__ import annotations

import pytest
import torch

from kvflow.errors import ModelLoadError
from kvflow.layers.quantization import resolve_quantization
from kvflow.layers.quantization.fp8_block import quantize_fp8_blocks
from test_fp8_w8a8 import CFG, H, INTER, KV, _dense_tensors, _save, _scorer


def _block_checkpoint(dense: dict, block: tuple[int, int], scale_name: str) -> dict:
    """Every decoder linear as FP8 with one scale per block (made with the same function
    ``--quantization fp8-block`` uses, so both must give the same model)."""
    out = {}
    for name, w in dense.items():
        if not name.endswith("proj.weight"):
            out[name] = w
            continue
        q, s = quantize_fp8_blocks(w, block)
        out[name], out[name.replace(".weight", "." + scale_name)] = q, s
    return out


def _fp8_config(block) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": list(block)}


def _ct_config(block) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                            "block_structure": list(block), "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                      "group_size": block[1], "dynamic": True}}}}


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref.exp() * (ref - got)).sum(-1).mean())


IDS = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def test_block_quantization_round_trips():
    w = torch.randn(200, 300) * 0.1
    w[7, 5] = 30.0  # one outlier sets its own block's scale only
    q, s = quantize_fp8_blocks(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    scale = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    err = (q.float() * scale - w).abs()
    # half a step: of 3 mantissa bits, or of the subnormals' 2^-9 (scaled)
    assert bool((err <= w.abs() * 2 ** -4 + scale * 2 ** -10 + 1e-9).all())
    assert float(s[0, 0]) == pytest.approx(30.0 / 448)


def test_fp8_block_at_load_is_close_to_dense(tmp_path):
    dense = _dense_tensors(4)
    path = _save(tmp_path / "dense", dense, None)
    ref = _scorer(path, quantization="none").logprobs(IDS)
    blk = _scorer(path, quantization="fp8-block")
    assert blk.model.quant_config.weight_block == (128, 128)
    qkv = blk.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    assert qkv.weight_scale_inv.shape == (1, 1)  # [H + 2 KV = 128, K = 64]: one block
    assert blk.model.lm_head.weight.dtype == torch.float32
    kl = _kl(ref, blk.logprobs(IDS))
    assert 0 < kl < 5e-3, kl


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_block_checkpoints_load(tmp_path, fmt, block):
    """(32, 32): q, k and v (64, 32, 32 rows) fall on block boundaries and their scales
    stack; (128, 128): they do not, and each row carries its block's scale."""
    dense = _dense_tensors(5)
    scale_name = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
    qc = _fp8_config(block) if fmt == "fp8" else _ct_config(block)
    path = _save(tmp_path / fmt, _block_checkpoint(dense, block, scale_name), qc)
    got = _scorer(path)
    layer = got.model.model.layers[1].self_attn.qkv_proj
    rows = block[0] if block[0] == 32 else 1
    assert got.model.quant_config.prequantized
    assert layer.quant_method.block == (rows, block[1])
    assert layer.weight_scale_inv.shape == (-(-(H + 2 * KV) // rows), -(-H // block[1]))
    # The checkpoint's k_proj block scale is where the merged layer reads it for row H.
    k_scale = quantize_fp8_blocks(dense["model.layers.1.self_attn.k_proj.weight"], block)[1]
    assert float(layer.weight_scale_inv[H // rows, 0]) == float(k_scale[0, 0])
    ref = _scorer(_save(tmp_path / "dense", dense, None), quantization="none").logprobs(IDS)
    lp = got.logprobs(IDS)
    kl = _kl(ref, lp)
    assert 0 < kl < 5e-3, kl
    if block == (128, 128):  # the same blocks quantized at load: the same numbers
        at_load = _scorer(_save(tmp_path / "d2", dense, None), quantization="fp8-block")
        # (at load the merged [128, 64] qkv is one block; per shard here: not identical)
        assert _kl(at_load.logprobs(IDS), lp) < 5e-3


@pytest.mark.parametrize("fix,match", [
    (("model.layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(3, 1)),
     r"weight_scale_inv has shape \(3, 1\).*needs \(2, 2\)"),
    (("model.layers.0.mlp.down_proj.weight_scale_inv", torch.ones(2)),
     r"weight_scale_inv has shape \(2,\)"),
    (("model.layers.1.mlp.up_proj.weight_scale_inv", -torch.ones(4, 2)),
     "must be positive and finite"),
])
def test_bad_block_scales_are_refused(tmp_path, fix, match):
    tensors = _block_checkpoint(_dense_tensors(6), (32, 32), "weight_scale_inv")
    tensors[fix[0]] = fix[1]
    path = _save(tmp_path / "bad", tensors, _fp8_config((32, 32)))
    with pytest.raises(ModelLoadError, match=match):
        _scorer(path)


@pytest.mark.parametrize("block,match", [([128], "two positive integers"),
                                         ([128, 100], "is not supported")])
def test_bad_block_sizes_are_refused(tmp_path, block, match):
    tensors = _block_checkpoint(_dense_tensors(7), (32, 32), "weight_scale_inv")
    path = _save(tmp_path / "bad", tensors, _fp8_config(block))
    with pytest.raises(ModelLoadError, match=match):
        _scorer(path)


def test_block_config_resolution():
    qc = resolve_quantization("auto", "hf", _ct_config((128, 128)), "cpu", False)
    assert qc.weight_block == (128, 128) and qc.scale_name == "weight_scale"
    assert "block-wise" in qc.describe()
    qc = resolve_quantization("fp8-block", "hf", None, "cpu", False)
    assert qc.weight_block == (128, 128) and not qc.prequantized
    assert CFG["intermediate_size"] == INTER  # the shapes the tests above assume
