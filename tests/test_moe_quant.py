"""Weight-only quantized experts (int8, int4, fp8) of a tiny Qwen3-MoE through ``LLM``
against the float model on the same saved weights, the expert methods against the
per-expert reference on their own dequantized weights, and the refusals.

Model-level numbers: teacher-forced over six prompts (182 positions), the quantized
model's prompt logprobs against the float model's (mean and max |difference|, nats) and
how often its top-1 token equals the float model's. Two settings: only the experts
quantized (``method_for`` patched to leave the other layers dense: the experts' own
error), and plain ``--quantization METHOD`` (attention and the dense MLPs quantized
too; fp8 there is W8A8, most of its error). The bounds are about 3x the values measured
on CPU (experts only: int8 0.005 / 0.02 / 98.9%, fp8 0.021 / 0.10 / 97.3%, int4 0.062 /
0.26 / 88.5%; whole model: int8 0.037 / 96%, fp8 0.17 / 72%, int4 0.39 / 57%): random
weights of std 0.2 make the tiny model's logits sensitive, so a whole-model int4 run
agrees on barely half of its greedy tokens, while a wrong scale or nibble order agrees
on almost none.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.errors import ModelLoadError  # noqa: E402
from kvflow.kernels.fused_moe import fused_moe_ref  # noqa: E402
from kvflow.layers.quantization.config import QuantizationConfig  # noqa: E402

from test_models_moe import prompts, save_hf_model  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)

# method -> (mean |dlogprob|, max |dlogprob|, top-1 agreement): experts only, whole model
EXPERTS_ONLY = {"int8": (0.02, 0.1, 0.95), "fp8": (0.06, 0.3, 0.9),
                "int4": (0.15, 0.8, 0.75)}
WHOLE_MODEL = {"int8": (0.1, 1.5, 0.85), "fp8": (0.35, 2.0, 0.55),
               "int4": (0.6, 3.0, 0.4)}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    save_hf_model("tiny-qwen3-moe", folder)
    ps = prompts()
    g = torch.Generator().manual_seed(5)
    ps += [torch.randint(3, 500, (n,), generator=g).tolist() for n in (30, 41, 52)]
    return folder, ps, _scores(folder, ps, "none")


def _scores(folder, ps, method: str, device: str = "cpu"
            ) -> tuple[torch.Tensor, list[int]]:
    """(logprob of each prompt token, the top-1 token at each position), teacher-forced."""
    llm = LLM(str(folder), device=device, kv_cache_memory="64MiB", max_model_len=512,
              block_size=4, quantization=method,
              **({} if method in ("none", "auto") else {"lm_head_quantization": "none"}))
    lps, top = [], []
    for p, out in zip(ps, llm.generate(ps, PARAMS, use_tqdm=False)):
        for i, pos in enumerate(out.prompt_logprobs[1:]):
            lps.append(pos[p[i + 1]].logprob)
            top.append(min(pos, key=lambda t: pos[t].rank))
    del llm
    return torch.tensor(lps), top


def _check(got, want, bounds, what):
    diff = (got[0] - want[0]).abs()
    agree = sum(a == b for a, b in zip(got[1], want[1])) / len(want[1])
    mean_b, max_b, agree_b = bounds
    assert diff.mean() < mean_b and diff.max() < max_b and agree >= agree_b, (
        what, diff.mean().item(), diff.max().item(), agree)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_experts_close_to_float(qwen3_moe, monkeypatch, method):
    folder, ps, dense = qwen3_moe
    _check(_scores(folder, ps, method), dense, WHOLE_MODEL[method], f"{method} whole model")
    keep = QuantizationConfig.method_for
    monkeypatch.setattr(QuantizationConfig, "method_for",
                        lambda self, p: keep(self, p) if p.endswith(".experts") else "none")
    _check(_scores(folder, ps, method), dense, EXPERTS_ONLY[method], f"{method} experts")


def _layer(method: str, device, dtype=torch.float32, e=8, k=2, h=64, inter=32,
           group=32, symmetric=False):
    """A FusedMoE of random experts with ``method`` applied, and its float weights."""
    from kvflow.layers.moe import FusedMoE

    cfg = None if method == "none" else QuantizationConfig(
        method, group_size=group, symmetric=symmetric)
    torch.manual_seed(0)
    with torch.device(device):
        layer = FusedMoE(e, k, h, inter, dtype, quant_config=cfg, prefix="m.experts")
        w13 = torch.randn(e, 2 * inter, h, dtype=dtype) / h ** 0.5
        w2 = torch.randn(e, h, inter, dtype=dtype) / inter ** 0.5
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, w13, w2


def _dequantized(layer, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's experts as the float weights its method multiplies."""
    from kvflow.kernels.fused_moe import dequantize_int4_experts

    out = []
    for p in ("w13", "w2"):
        q = getattr(layer, f"{p}_q")
        if method in ("int8", "fp8"):
            out.append(q.float() * getattr(layer, f"{p}_scale").float()[..., None])
        else:  # int4 in the kernel's layout (CUDA; the CPU's aten pack is opaque)
            out.append(dequantize_int4_experts(q, getattr(layer, f"{p}_scale"),
                                               getattr(layer, f"{p}_offset", None),
                                               layer.quant_method.group_size))
    return out[0], out[1]


def _routing(t, e, k, device, drop=False):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 64, generator=g)
    logits = torch.randn(t, e, generator=g)
    from kvflow.layers.moe.router import route

    w, ids = route(logits, k, "softmax", True)
    if drop:
        ids[torch.rand(t, k, generator=g) < 0.3] = -1
    return x.to(device), w.to(device), ids.to(device)


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_cpu_expert_methods_equal_reference(method):
    """The CPU routed path multiplies exactly the dequantized weights (fp8: float32
    products; int8: aten's bf16 op, so a bf16-sized tolerance)."""
    layer, _, _ = _layer(method, "cpu")
    x, w, ids = _routing(7, 8, 2, "cpu", drop=True)
    d13, d2 = _dequantized(layer, method)
    got = layer.quant_method.apply(layer, x, w, ids)
    tol = 1e-5 if method == "fp8" else 3e-2
    torch.testing.assert_close(got, fused_moe_ref(x, d13, d2, w, ids), atol=tol, rtol=tol)


def test_fp8_experts_stored_as_float8():
    layer, w13, _ = _layer("fp8", "cpu")
    assert layer.w13_q.dtype == torch.float8_e4m3fn and layer.w13_q.shape == w13.shape
    assert layer.w13_scale.shape == w13.shape[:2] and not hasattr(layer, "w13_weight")
    assert "fp8" in repr(layer)


@pytest.mark.parametrize("method,message", [
    ("fp8-block", "fp8-block.*MoE experts.*--quantization fp8"),
    ("w8a8-int8", "'w8a8-int8' is not supported for MoE experts"),
])
def test_unsupported_expert_methods_refused(qwen3_moe, method, message):
    folder, _, _ = qwen3_moe
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(folder), kv_cache_memory="64MiB", max_model_len=512, quantization=method)


def _fp8_copy(folder, dst, quant: dict | None) -> None:
    """``dst``: ``folder``'s checkpoint with every expert projection as float8 (even
    experts one scale per tensor, odd ones per output channel, as [N] for gate/up and
    [N, 1] for down; a per-tensor ``input_scale`` each, which weight-only experts
    ignore) with ``quantization_config`` ``quant``; None: the float checkpoint whose
    experts are those float8 values dequantized (the reference)."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, moe_layers = {}, set()
    for name, w in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$", name)
        if not m:
            out[name] = w
            continue
        moe_layers.add(int(m.group(1)))
        per_tensor = int(m.group(2)) % 2 == 0
        amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
        scale = (amax / 448.0).float()
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        if quant is None:
            out[name] = q.float() * scale
            continue
        out[name] = q
        stem = name[:-len("weight")]
        out[stem + "weight_scale"] = (scale.reshape(()) if per_tensor else
                                      scale if m.group(3) == "down" else scale.reshape(-1))
        out[stem + "input_scale"] = torch.tensor(0.02)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if quant is not None:
        layers = cfg["num_hidden_layers"]
        # attention and the dense MLPs stay float: only the experts are pre-quantized
        quant["ignored_layers"] = [f"model.layers.{i}.self_attn" for i in range(layers)] + [
            f"model.layers.{i}.mlp" for i in range(layers) if i not in moe_layers]
        cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    assert moe_layers


def test_prequantized_fp8_moe_checkpoint_loads(qwen3_moe, tmp_path):
    """An fp8 checkpoint's experts load as stored (no re-quantization; per-tensor scales
    broadcast to channels; input_scale ignored): the model's prompt logprobs equal, to
    1e-4 nats (both runs multiply the same float32 weights, so only summation order
    may differ), those of the float model whose experts are the dequantized float8
    values, which themselves differ visibly from the original float model's."""
    folder, ps, dense = qwen3_moe
    _fp8_copy(folder, tmp_path / "fp8", {"quant_method": "fp8",
                                          "activation_scheme": "static"})
    _fp8_copy(folder, tmp_path / "ref", None)
    got, want = _scores(tmp_path / "fp8", ps, "auto"), _scores(tmp_path / "ref", ps, "none")
    assert (got[0] - want[0]).abs().max() < 1e-4, (got[0] - want[0]).abs().max()
    assert got[1] == want[1]
    assert (want[0] - dense[0]).abs().max() > 1e-3  # the fp8 rounding is in the numbers


def test_prequantized_fp8_moe_experts_stored_as_loaded(qwen3_moe, tmp_path):
    """The experts keep the checkpoint's float8 bytes and scales (per-tensor broadcast)."""
    from safetensors.torch import load_file

    folder, _, _ = qwen3_moe
    _fp8_copy(folder, tmp_path / "fp8", {"quant_method": "fp8",
                                          "activation_scheme": "dynamic"})
    llm = LLM(str(tmp_path / "fp8"), device="cpu", kv_cache_memory="64MiB",
              max_model_len=512)
    model = llm.engine.core.executor.runner.model
    ck = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    layer = model.get_submodule("model.layers.1.mlp.experts")
    assert type(layer.quant_method).__name__ == "Fp8CheckpointMoEMethod"
    for e in (0, 1):
        stem = f"model.layers.1.mlp.experts.{e}."
        gate, up = ck[stem + "gate_proj.weight"], ck[stem + "up_proj.weight"]
        i = gate.shape[0]
        assert torch.equal(layer.w13_q[e].view(torch.uint8),
                           torch.cat([gate, up]).view(torch.uint8))
        assert torch.equal(layer.w2_q[e].view(torch.uint8),
                           ck[stem + "down_proj.weight"].view(torch.uint8))
        s = ck[stem + "gate_proj.weight_scale"].reshape(-1).expand(i)
        assert torch.equal(layer.w13_scale[e, :i], s)
        s2 = ck[stem + "down_proj.weight_scale"].reshape(-1)
        assert torch.equal(layer.w2_scale[e], s2.expand(layer.w2_scale.shape[1]))


def test_block_quantized_fp8_moe_checkpoint_refused(qwen3_moe, tmp_path):
    """Block-wise scales (weight_block_size) have no expert layout: refused, saying so."""
    folder, _, _ = qwen3_moe
    _fp8_copy(folder, tmp_path / "m", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]})
    with pytest.raises(ModelLoadError, match="block-wise scales.*weight_block_size.*MoE "
                                             "experts"):
        LLM(str(tmp_path / "m"), device="cpu", kv_cache_memory="64MiB", max_model_len=512)


# --- the real kernels -----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("method,group,symmetric", [
    ("int4", 32, False), ("int4", 128, True), ("fp8", 0, False), ("int8", 0, False)])
@pytest.mark.parametrize("t", [1, 5, 64])
def test_gpu_expert_methods_equal_reference(method, group, symmetric, t):
    """On CUDA the methods run the fused kernel (int4 from its packed tiles, fp8 from
    float8 tiles) on bf16 activations: equal to the per-expert reference on the
    dequantized weights at bf16 tolerance, at a Qwen3-30B-A3B-like width (E 32, top-8,
    H 512, I 256: K spans several groups and tiles)."""
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 experts need compute capability 8.9+")
    e, k, h, inter = 32, 8, 512, 256
    layer, _, _ = _layer(method, "cuda", torch.bfloat16, e, k, h, inter, group or 32,
                         symmetric)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to("cuda", torch.bfloat16)
    w, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
    w, ids = w.cuda(), ids.cuda()
    d13, d2 = _dequantized(layer, method)
    got = layer.quant_method.apply(layer, x, w, ids).float()
    want = fused_moe_ref(x.float(), d13, d2, w, ids)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_gpu_quantized_experts_close_to_float(qwen3_moe, monkeypatch, method):
    """The tiny model on the GPU (CUDA graphs, the fused kernel), experts only quantized,
    against the CPU float model (bf16 on the GPU: looser than on CPU)."""
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 experts need compute capability 8.9+")
    folder, ps, dense = qwen3_moe
    keep = QuantizationConfig.method_for
    monkeypatch.setattr(QuantizationConfig, "method_for",
                        lambda self, p: keep(self, p) if p.endswith(".experts") else "none")
    mean_b, max_b, agree_b = EXPERTS_ONLY[method]
    _check(_scores(folder, ps, method, "cuda"), dense, (2 * mean_b + 0.05, 2 * max_b + 0.2,
                                                         agree_b - 0.15), f"{method} cuda")
