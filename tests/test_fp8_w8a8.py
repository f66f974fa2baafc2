"""FP8 W8A8 (``--quantization fp8`` and pre-quantized FP8 checkpoints): the product
against its reference, checkpoints made here in the compressed-tensors
``float-quantized`` and ``fp8`` layouts, KV cache scales from a checkpoint, errors."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow.bench.quality import _Scorer
from kvflow.engine.args import EngineArgs
from kvflow.errors import ModelLoadError
from kvflow.layers.quantization.fp8 import (FP8_MAX, fp8_mm, fp8_mm_ref, has_fp8_matmul,
                                            quantize_fp8_rows)
from kvflow.models.registry import PRESETS

CFG = PRESETS["tiny-llama"]
H, INTER, KV = CFG["hidden_size"], CFG["intermediate_size"], 32  # 2 KV heads x 16
SHAPES = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (KV, H),
          "self_attn.v_proj": (KV, H), "self_attn.o_proj": (H, H),
          "mlp.gate_proj": (INTER, H), "mlp.up_proj": (INTER, H),
          "mlp.down_proj": (H, INTER)}


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (7, 128, 96), (33, 576, 192)])
def test_fp8_product_matches_reference_and_dense(m, k, n):
    g = torch.Generator().manual_seed(m + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    x[0, 3] = 40.0  # an outlier channel: per-token scales absorb it
    xq, sx = quantize_fp8_rows(x)
    wq, sw = quantize_fp8_rows(w)
    assert xq.dtype == wq.dtype == torch.float8_e4m3fn and sx.shape == (m,)
    assert float(xq.float().abs().max()) == FP8_MAX  # every row's max maps to 448
    ref = fp8_mm_ref(xq, sx, wq, sw, torch.float32)
    torch.testing.assert_close(fp8_mm(xq, sx, wq, sw, torch.float32), ref)  # CPU: emulated
    dense = x @ w.t()
    rel = float((ref - dense).norm() / dense.norm())
    assert rel < 0.06, rel  # E4M3 has 3 mantissa bits: about 3% per operand


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 100])
def test_scaled_mm_matches_the_emulation(m):
    dev = torch.device("cuda")
    if not has_fp8_matmul(dev):
        pytest.skip("needs a GPU with FP8 (compute capability 8.9+)")
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device=dev) * 0.02
    xq, sx = quantize_fp8_rows(x)
    wq, sw = quantize_fp8_rows(w)
    got = fp8_mm(xq, sx, wq, sw, torch.bfloat16)
    ref = fp8_mm_ref(xq, sx, wq, sw, torch.float32)
    torch.testing.assert_close(got.float(), ref, atol=2e-2 * float(ref.abs().max()), rtol=1e-2)


def _dense_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(CFG["vocab_size"], H, generator=g) * 0.1,
         "lm_head.weight": torch.randn(CFG["vocab_size"], H, generator=g) * 0.1,
         "model.norm.weight": torch.ones(H)}
    for layer in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = torch.rand(H, generator=g) * 0.4 + 0.8
        t[p + "post_attention_layernorm.weight"] = torch.rand(H, generator=g) * 0.4 + 0.8
        for name, shape in SHAPES.items():
            t[p + name + ".weight"] = torch.randn(shape, generator=g) * 0.1
    return t


def _save(folder, tensors: dict, quant_config: dict | None) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    cfg = dict(CFG)
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _fp8_checkpoint(dense: dict, per_tensor: bool, kv_scales: dict | None = None) -> dict:
    """The dense checkpoint with every decoder linear stored as FP8 plus its scale(s)."""
    out = {}
    for name, w in dense.items():
        if not name.endswith("proj.weight"):
            out[name] = w
            continue
        if per_tensor:
            s = w.abs().max() / FP8_MAX
            out[name] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[name + "_scale"] = s.reshape(())  # weight_scale, one number
        else:
            q, s = quantize_fp8_rows(w)
            out[name], out[name + "_scale"] = q, s[:, None]  # [N, 1], as compressed-tensors
        # A static activation scale (used where the config says activations are static).
        out[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
    out.update(kv_scales or {})
    return out


def _scorer(path: str, **kw) -> _Scorer:
    return _Scorer(EngineArgs(model=path, device="cpu", skip_tokenizer_init=True,
                              max_model_len=128, **kw), 64)


CT_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized",
             "ignore": ["lm_head"], "config_groups": {"group_0": {
                 "targets": ["Linear"],
                 "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                             "symmetric": True, "dynamic": False},
                 "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                       "dynamic": True}}}}


def test_compressed_tensors_fp8_checkpoint_equals_quantize_at_load(tmp_path):
    """A float-quantized checkpoint holding exactly what --quantization fp8 makes of the
    dense one gives the same logits; both stay close to the dense model; lm_head dense."""
    dense = _dense_tensors(0)
    dense_path = _save(tmp_path / "dense", dense, None)
    ct_path = _save(tmp_path / "ct", _fp8_checkpoint(dense, per_tensor=False), CT_CONFIG)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _scorer(dense_path, quantization="none").logprobs(ids)
    at_load = _scorer(dense_path, quantization="fp8")
    ckpt = _scorer(ct_path)
    assert ckpt.model.quant_config.prequantized and not at_load.model.quant_config.prequantized
    qkv = ckpt.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (H + 2 * KV,)
    assert ckpt.model.lm_head.weight.dtype == torch.float32
    a, b = at_load.logprobs(ids), ckpt.logprobs(ids)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    kl = float((ref.exp() * (ref - b)).sum(-1).mean())
    assert 0 < kl < 5e-3, kl


def test_fp8_layout_per_tensor_scales_and_kv_scales(tmp_path):
    """quant_method fp8 with one weight_scale per tensor: merged q/k/v get each shard's
    own scale; k_scale/v_scale tensors reach the attention layers (fp8 KV cache)."""
    dense = _dense_tensors(2)
    kv = {f"model.layers.{i}.self_attn.{n}": torch.tensor(v)
          for i in range(2) for n, v in (("k_scale", 0.02 + i), ("v_scale", 0.5))}
    path = _save(tmp_path / "fp8", _fp8_checkpoint(dense, per_tensor=True, kv_scales=kv),
                 {"quant_method": "fp8", "activation_scheme": "static"})
    scorer = _scorer(path, kv_cache_dtype="fp8")
    qkv = scorer.model.model.layers[0].self_attn.qkv_proj
    q_scale = float(dense["model.layers.0.self_attn.q_proj.weight"].abs().max() / FP8_MAX)
    k_scale = float(dense["model.layers.0.self_attn.k_proj.weight"].abs().max() / FP8_MAX)
    assert torch.allclose(qkv.weight_scale[:H], torch.tensor(q_scale))
    assert torch.allclose(qkv.weight_scale[H:H + KV], torch.tensor(k_scale))
    attn = scorer.model.model.layers[1].self_attn.attn
    assert (attn.k_scale, attn.v_scale) == (pytest.approx(1.02), 0.5)
    assert attn.kv_quant.k_scale == pytest.approx(1.02)
    ids = list(range(5, 45))
    ref = _scorer(_save(tmp_path / "dense", dense, None), quantization="none").logprobs(ids)
    got = scorer.logprobs(ids)
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert kl < 2e-2, kl


@pytest.mark.parametrize("qc,tensor_fix,match", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None,
     "lacks .*weight_scale_inv"),  # block-wise: scales per block (tests/test_fp8_block.py)
    ({"quant_method": "fp8"}, ("model.layers.0.self_attn.q_proj.weight_scale",
                               torch.ones(3)), "weight_scale has 3 values"),
    ({"quant_method": "fp8"}, ("model.layers.0.mlp.up_proj.weight",
                               torch.zeros(INTER, H)), "dtype torch.float32"),
    ({"quant_method": "fp8"}, ("model.layers.0.self_attn.k_scale",
                               torch.ones(2)), "must be one number"),
])
def test_bad_fp8_checkpoints_are_refused(tmp_path, qc, tensor_fix, match):
    tensors = _fp8_checkpoint(_dense_tensors(3), per_tensor=True)
    if tensor_fix is not None:
        tensors[tensor_fix[0]] = tensor_fix[1]
    path = _save(tmp_path / "bad", tensors, qc)
    with pytest.raises(ModelLoadError, match=match):
        _scorer(path)


def test_another_method_on_an_fp8_checkpoint_is_refused():
    from kvflow.layers.quantization import resolve_quantization

    with pytest.raises(ModelLoadError, match="already fp8-quantized"):
        resolve_quantization("int8", "hf", CT_CONFIG, "cpu", False)


def _calibrated_input_scales(dense_path: str, ids: list[int]) -> dict[str, float]:
    """Per-tensor static activation scales (max |input| / 448) of every decoder linear of
    the dense model on ``ids``, by checkpoint name (q/k/v and gate/up share an input)."""
    scorer = _scorer(dense_path, quantization="none")
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in scorer.model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            def hook(m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    scorer.logprobs(ids)
    for h in hooks:
        h.remove()
    split = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj",
                                                                          "up_proj")}
    out = {}
    for name, a in amax.items():
        parent, leaf = name.rsplit(".", 1)
        for ckpt in split.get(leaf, (leaf,)):
            out[f"{parent}.{ckpt}.input_scale"] = a / FP8_MAX
    return out


CT_STATIC = json.loads(json.dumps(CT_CONFIG))
CT_STATIC["config_groups"]["group_0"]["input_activations"] = {
    "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_static_input_scales_from_a_checkpoint(tmp_path, fmt):
    """Static per-tensor activation scales (the fp8 layout's activation_scheme static,
    compressed-tensors dynamic: false) are loaded and used: a merged layer keeps the
    largest of its shards' scales, a layer's product is the reference with x quantized
    by that scale, the logits differ from per-token quantization of the same weights and
    stay close to the dense model's."""
    dense = _dense_tensors(4)
    dense_path = _save(tmp_path / "dense", dense, None)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    scales = _calibrated_input_scales(dense_path, ids)
    scales["model.layers.0.self_attn.k_proj.input_scale"] *= 1.5  # the merged max wins
    tensors = _fp8_checkpoint(dense, per_tensor=fmt == "fp8")
    tensors.update({k: torch.tensor(v) for k, v in scales.items()})
    static_qc = {"quant_method": "fp8", "activation_scheme": "static"} if fmt == "fp8" \
        else CT_STATIC
    dynamic_qc = {"quant_method": "fp8", "activation_scheme": "dynamic"} if fmt == "fp8" \
        else CT_CONFIG
    static = _scorer(_save(tmp_path / "static", tensors, static_qc))
    dynamic = _scorer(_save(tmp_path / "dynamic", tensors, dynamic_qc))
    assert static.model.quant_config.static_input_scale
    assert not dynamic.model.quant_config.static_input_scale
    assert "static scales" in static.model.quant_config.describe()
    qkv = static.model.model.layers[0].self_attn.qkv_proj
    assert float(qkv.input_scale) == pytest.approx(
        scales["model.layers.0.self_attn.k_proj.input_scale"])
    assert not hasattr(dynamic.model.model.layers[0].self_attn.qkv_proj, "input_scale")
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    s = qkv.input_scale
    xq = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    ref = fp8_mm_ref(xq, s.expand(5), qkv.weight, qkv.weight_scale, torch.float32)
    torch.testing.assert_close(qkv(x), ref)
    ref_lp = _scorer(dense_path, quantization="none").logprobs(ids)
    got, per_token = static.logprobs(ids), dynamic.logprobs(ids)
    assert not torch.allclose(got, per_token)
    kl = float((ref_lp.exp() * (ref_lp - got)).sum(-1).mean())
    assert 0 < kl < 2e-2, kl


@pytest.mark.parametrize("qc,fix,match", [
    ({"quant_method": "fp8", "activation_scheme": "static"},
     ("model.layers.1.mlp.down_proj.input_scale", torch.ones(4)), "input_scale has shape"),
    ({"quant_method": "fp8", "activation_scheme": "static"},
     ("model.layers.0.self_attn.v_proj.input_scale", torch.tensor(0.0)),
     "input_scale must be positive"),
    ({"quant_method": "fp8", "activation_scheme": "static"},
     ("model.layers.0.mlp.up_proj.input_scale", None), "lacks 1 weights"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, None,
     "activation_scheme 'sometimes'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [16, 16]},
     None, "static activation scales with block-wise"),
])
def test_bad_static_input_scales_are_refused(tmp_path, qc, fix, match):
    tensors = _fp8_checkpoint(_dense_tensors(5), per_tensor=True)
    if fix is not None:
        if fix[1] is None:
            del tensors[fix[0]]
        else:
            tensors[fix[0]] = fix[1]
    with pytest.raises(ModelLoadError, match=match):
        _scorer(_save(tmp_path / "bad", tensors, qc))


def test_static_per_token_activations_are_refused():
    from kvflow.layers.quantization import resolve_quantization

    qc = json.loads(json.dumps(CT_STATIC))
    qc["config_groups"]["group_0"]["input_activations"]["strategy"] = "token"
    with pytest.raises(ModelLoadError, match="static activations"):
        resolve_quantization("auto", "hf", qc, "cpu", False)
