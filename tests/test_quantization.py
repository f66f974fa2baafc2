"""Low-bit weights: each fast path against its dequantize-then-matmul reference, GGML
block parsing against gguf-py's own dequantization, and whole models (a tiny GGUF file
written here, and the embedded SmolLM2) against their dense selves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.bench.quality import _Scorer  # noqa: E402
from kvflow.engine.args import EngineArgs  # noqa: E402
from kvflow.errors import InvalidParameterError, ModelLoadError  # noqa: E402
from kvflow.layers.quantization import QuantizationConfig, resolve_quantization  # noqa: E402
from kvflow.layers.quantization import ggml_blocks as gb  # noqa: E402
from kvflow.layers.quantization.packed import (Int4Groups, PackedInt4, int4_mm,  # noqa: E402
                                               int8_mm, quantize_int4, quantize_int8)

Q = gguf.GGMLQuantizationType


def _bf16_tol(ref: torch.Tensor) -> dict:
    # Activations and outputs are rounded to bfloat16 (8 significant bits) on this path.
    return {"atol": 2e-2 * float(ref.abs().max()) + 1e-3, "rtol": 2e-2}


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("n,k,m", [(64, 128, 1), (192, 256, 5), (96, 384, 17)])
def test_int4_matches_reference(group, symmetric, n, k, m):
    g = torch.Generator().manual_seed(n + k + group)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    q = quantize_int4(w, group, symmetric)
    deq = q.dequantize()
    # Round to nearest: every weight within half a step of its group's grid.
    step = q.scale.repeat_interleave(group, dim=1)
    assert bool(((deq - w).abs() <= 0.5 * step + 1e-5).all())
    packed = PackedInt4(q)
    y = int4_mm(x, packed.packed, packed.scale_zero, group, False)
    ref = x @ deq.t()
    torch.testing.assert_close(y, ref, **_bf16_tol(ref))


@pytest.mark.parametrize("n,k,m", [(64, 64, 1), (160, 256, 7)])
def test_int8_matches_reference(n, k, m):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q, scale = quantize_int8(w)
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6
    y = int8_mm(x, q, scale.bfloat16())
    ref = x @ (q.float() * scale.bfloat16().float()[:, None]).t()
    torch.testing.assert_close(y, ref, **_bf16_tol(ref))


def test_8bit_as_two_nibbles_is_exact():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (32, 128), generator=g, dtype=torch.int8)
    d = (torch.rand(32, 4, generator=g) + 0.1).half().float()  # GGUF scales are fp16
    w = Int4Groups.from_int8_blocks(q, d)
    exact = q.float() * d.repeat_interleave(32, dim=1)
    assert torch.equal(w.dequantize(), exact)
    x = torch.randn(3, 128, generator=g)
    p = PackedInt4(w)
    ref = x @ exact.t()
    torch.testing.assert_close(int4_mm(x, p.packed, p.scale_zero, 32, True), ref,
                               **_bf16_tol(ref))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_exact_against_gguf_py(qtype):
    w = np.random.default_rng(int(qtype)).standard_normal((48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)  # [48, row_bytes]
    groups, exact = gb.to_int4_groups(raw, 256, int(qtype))
    ref = gguf.quants.dequantize(raw, qtype)
    assert exact
    np.testing.assert_array_equal(groups.dequantize().numpy(), ref)


def _random_k_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant super-blocks with sane float16 scales (bytes otherwise random)."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, (rows, cols // elems, 2)).astype(np.float16)
    if qtype == Q.Q4_K:
        b[..., 0:4] = scales.view(np.uint8)
    else:  # Q6_K: d is the last two bytes
        b[..., -2:] = scales[..., :1].view(np.uint8)
    return b.reshape(rows, -1)


def test_q4_k_exact_and_q6_k_close():
    raw = _random_k_blocks(Q.Q4_K, 16, 512, 0)
    groups, exact = gb.to_int4_groups(raw, 512, int(Q.Q4_K))
    assert exact
    np.testing.assert_allclose(groups.dequantize().numpy(),
                               gguf.quants.dequantize(raw, Q.Q4_K), rtol=1e-6, atol=1e-6)
    raw6 = _random_k_blocks(Q.Q6_K, 16, 512, 1)
    groups6, exact6 = gb.to_int4_groups(raw6, 512, int(Q.Q6_K))
    ref = gguf.quants.dequantize(raw6, Q.Q6_K)
    assert not exact6  # requantized to 8 bits per 32: within half an 8-bit step
    step = np.abs(ref).reshape(16, -1, 32).max(-1, keepdims=True) / 127
    err = np.abs(groups6.dequantize().numpy() - ref).reshape(16, -1, 32)
    assert (err <= step / 2 * (1 + 1e-4)).all()


def test_corrupt_block_tensor_is_refused():
    raw = gguf.quants.quantize(np.ones((4, 64), np.float32), Q.Q4_1)
    with pytest.raises(ModelLoadError, match="bytes per row"):
        gb.to_int4_groups(raw[:, :-3], 64, int(Q.Q4_1))
    with pytest.raises(ModelLoadError, match="unknown GGML tensor type"):
        gb.block_size(999)


def test_config_resolution_and_prefixes():
    assert resolve_quantization("auto", "gguf", None, "cpu", False).method == "gguf"
    assert resolve_quantization("auto", "gguf", None, "cpu", True) is None  # --dtype given
    assert resolve_quantization("auto", "gguf", None, "cuda", False) is None
    assert resolve_quantization("auto", "hf", None, "cpu", False) is None
    assert resolve_quantization("none", "gguf", None, "cpu", False) is None
    gptq = resolve_quantization("auto", "hf", {"quant_method": "gptq", "bits": 8}, "cpu", False)
    assert (gptq.method, gptq.bits, gptq.zero_offset) == ("gptq", 8, 1)
    assert gptq.method_for("lm_head") == "none"
    fp8 = resolve_quantization("auto", "hf", {"quant_method": "fp8"}, "cpu", False)
    assert (fp8.method, fp8.prequantized, fp8.method_for("lm_head")) == ("fp8", True, "none")
    with pytest.raises(ModelLoadError, match="pre-quantized with 'hqq'"):
        resolve_quantization("auto", "hf", {"quant_method": "hqq"}, "cpu", False)
    assert resolve_quantization("auto", "hf", {"quant_method": "awq"}, "cuda", False).method == (
        "awq")  # the GPU runs them on the Triton kernels
    with pytest.raises(ModelLoadError, match="cpu and cuda"):
        resolve_quantization("auto", "hf", {"quant_method": "awq"}, "mps", False)
    with pytest.raises(ModelLoadError, match="needs a GGUF file"):
        resolve_quantization("gguf", "hf", None, "cpu", False)
    with pytest.raises(InvalidParameterError, match="group_size"):
        QuantizationConfig("int4", group_size=48)
    c = QuantizationConfig("int4", skip_modules=("model.layers.1",))
    assert c.method_for("model.layers.0.mlp.down_proj") == "int4"
    assert c.method_for("model.layers.1.mlp.down_proj") == "none"
    assert c.method_for("model.layers.10.mlp.down_proj") == "int4"
    assert c.method_for("model.embed_tokens") == "none"
    assert c.method_for("lm_head") == "int8"
    with pytest.raises(InvalidParameterError, match="quantization"):
        EngineArgs(model="tiny-llama", load_format="dummy",
                   quantization="fp3").create_engine_config()


def test_lm_head_quantization_option():
    """--lm-head-quantization: auto keeps each method's choice; none / int8 override it
    for weights quantized at load; a dense model, GGUF blocks and pre-quantized
    checkpoints refuse int8 by name."""
    res = resolve_quantization
    assert res("int4", "hf", None, "cpu", False).method_for("lm_head") == "int8"
    assert res("fp8", "hf", None, "cpu", False).method_for("lm_head") == "none"
    assert res("fp8", "hf", None, "cpu", False, lm_head="int8").method_for("lm_head") == "int8"
    assert res("int4", "hf", None, "cpu", False, lm_head="none").method_for("lm_head") == "none"
    w8 = res("w8a8-int8", "hf", None, "cpu", False, lm_head="int8")
    assert (w8.method_for("lm_head"), w8.method_for("model.layers.0.mlp.down_proj")) == (
        "int8", "w8a8-int8")
    assert "lm_head int8" in w8.describe()
    assert res("none", "hf", None, "cpu", False, lm_head="none") is None
    with pytest.raises(ModelLoadError, match="--lm-head-quantization int8 applies to"):
        res("none", "hf", None, "cpu", False, lm_head="int8")
    with pytest.raises(ModelLoadError, match="GGUF weights keep"):
        res("auto", "gguf", None, "cpu", False, lm_head="int8")
    with pytest.raises(ModelLoadError, match="pre-quantized checkpoint keeps"):
        res("auto", "hf", {"quant_method": "fp8"}, "cpu", False, lm_head="int8")
    with pytest.raises(InvalidParameterError, match="lm_head_quantization"):
        EngineArgs(model="tiny-llama", load_format="dummy", quantization="fp8",
                   lm_head_quantization="fp4").create_engine_config()


# --- a tiny GGUF model written here, loaded dense and kept quantized -------------------

from tiny_gguf import V, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def _scorer(path: str, quantization: str, **kw) -> _Scorer:
    return _Scorer(EngineArgs(model=path, quantization=quantization, device="cpu",
                              skip_tokenizer_init=True, **kw), 64)


@pytest.mark.parametrize("method", ["gguf", "int8", "int4"])
def test_tiny_gguf_quantized_close_to_dense(tiny_gguf, method):
    ids = list(np.random.default_rng(3).integers(0, V, 40))
    dense = _scorer(tiny_gguf, "none")
    quant = _scorer(tiny_gguf, method)
    ref, got = dense.logprobs(ids), quant.logprobs(ids)
    assert quant.weight_bytes < dense.weight_bytes / 2
    kl = (ref.exp() * (ref - got)).sum(-1)
    # gguf only rounds activations to bf16; int8/int4 re-quantize the weights too.
    assert float(kl.mean()) < {"gguf": 2e-4, "int8": 2e-3, "int4": 5e-2}[method]
    layer = quant.model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(layer, "weight") and hasattr(layer, "qweight")


def test_fp8_model_with_int8_lm_head(tiny_gguf):
    """An FP8 W8A8 model with its lm_head asked for in int8 (weight-only, per output
    channel): the head is quantized, the logits stay close to the bf16-head FP8 model's."""
    ids = list(np.random.default_rng(5).integers(0, V, 40))
    fp8 = _scorer(tiny_gguf, "fp8")
    head8 = _scorer(tiny_gguf, "fp8", lm_head_quantization="int8")
    ref, got = fp8.logprobs(ids), head8.logprobs(ids)
    assert head8.weight_bytes < fp8.weight_bytes
    assert hasattr(head8.model.lm_head, "qweight") and hasattr(fp8.model.lm_head, "weight")
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert 0 < float(kl.mean()) < 2e-3


def test_tiny_gguf_corrupt_file_is_refused(tiny_gguf, tmp_path):
    data = open(tiny_gguf, "rb").read()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 3000])
    with pytest.raises(ModelLoadError, match="truncated"):
        _scorer(str(bad), "gguf")


def test_embedded_model_runs_quantized_by_default():
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=20)
    prompts = ["What is the capital of France?", "Name three colours."]
    outs, dense_lp = {}, None
    for q in ("auto", "none", "int8"):
        llm = LLM("smollm2-135m", device="cpu", max_model_len=256, kv_cache_memory="64MiB",
                  quantization=q)
        tok = llm.get_tokenizer()
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) for p in prompts]
        res = llm.generate([{"prompt_token_ids": i} for i in ids], sp)
        outs[q] = [r.outputs[0].token_ids for r in res]
        if q == "none":
            dense_lp = [r.outputs[0].logprobs for r in res]
        if q == "auto":  # the GGUF blocks: about 140 MiB instead of 0.5 GiB dense
            assert llm.engine.core.executor.runner.weight_bytes < 200 * 2**20
        del llm
    for q in ("auto", "int8"):
        same = [sum(a == b for a, b in zip(x, y)) / len(y)
                for x, y in zip(outs[q], outs["none"])]
        # Greedy decoding keeps following the dense model's tokens for 4 tokens of each
        # prompt unless it parts at a near tie of the dense model (its token and the
        # quantized one within 0.15 in log-probability), and a quarter of all. (The C++
        # step's int8 activations leave "Name three colours." at its 5th token, where the
        # dense model's top two are 0.10 apart; on the prompt's rows too they would take
        # "L" for "The" as the France answer's first token, 0.08 apart.)
        for x, y, lps in zip(outs[q], outs["none"], dense_lp):
            i = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
            if i < 4:
                assert x[i] in lps[i], (q, i, x[i], lps[i])
                gap = lps[i][y[i]].logprob - lps[i][x[i]].logprob
                assert gap < 0.15, (q, i, gap, same)
        assert sum(same) / len(same) > 0.25, (q, same)


# --- pre-quantized checkpoints, packed here from known integers ---------------------------

from prequant_checkpoints import _pack_words, _write_prequantized  # noqa: E402,F401


@pytest.mark.parametrize("fmt,bits,group,desc_act,v1,sym", [
    ("gptq", 4, 32, False, True, False), ("gptq", 4, 32, True, True, False),
    ("gptq", 8, 64, True, False, False), ("gptq", 4, 64, False, False, False),
    ("awq", 4, 32, False, True, False), ("awq", 4, 64, False, True, False),
    ("compressed-tensors", 4, 32, False, True, True),
    ("compressed-tensors", 4, 64, False, True, False),
    ("compressed-tensors", 8, 32, False, True, True)])
def test_prequantized_checkpoint_matches_dequantized(tmp_path, fmt, bits, group, desc_act,
                                                     v1, sym):
    _write_prequantized(tmp_path, fmt, bits, group, desc_act, v1, sym)
    ids = list(np.random.default_rng(5).integers(0, 512, 40))
    quant = _scorer(str(tmp_path), "auto")
    assert quant.model.quant_config.method == fmt
    ref = _scorer(str(tmp_path / "dense"), "none").logprobs(ids)
    got = quant.logprobs(ids)
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert float(kl.mean()) < 1e-3  # bf16 activations only: the weights are exact
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_prequantized_bad_input(tmp_path):
    import json

    from safetensors.numpy import load_file, save_file

    _write_prequantized(tmp_path, "gptq", 4, 32, False)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for change, match in (({"bits": 3}, "3-bit weights is not supported"),
                          ({"quant_method": "bitsandbytes"}, "'bitsandbytes'.*supported"),
                          ({"group_size": 48}, "groups of 48")):
        cfg_path.write_text(json.dumps({**cfg, "quantization_config": {
            **cfg["quantization_config"], **change}}))
        with pytest.raises(ModelLoadError, match=match):
            _scorer(str(tmp_path), "auto")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="already gptq-quantized"):
        _scorer(str(tmp_path), "int8")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = np.zeros_like(tensors[name])  # every input in group 0
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="g_idx"):
        _scorer(str(tmp_path), "auto")


def test_int4_group_that_does_not_divide_the_layer_is_refused():
    with pytest.raises(ModelLoadError, match="group size 128 does not divide the 64 inputs"):
        LLM("tiny-llama", load_format="dummy", device="cpu", quantization="int4",
            quantization_group_size=128)


def test_gguf_end_of_turn_and_end_of_message_ids_stop_generation(tmp_path):
    # Llama 3.1 GGUF files name <|eot_id|> and <|eom_id|> beside <|end_of_text|>: all three
    # end a reply, as in the model's generation_config.json.
    from kvflow.models.gguf_file import read_gguf_arch

    path = write_tiny_gguf(str(tmp_path / "t.gguf"), {"eos_token_id": 2, "eot_token_id": 5,
                                                       "eom_token_id": 6})
    arch, _ = read_gguf_arch(path)
    assert arch.eos_token_ids == (2, 5, 6)
    arch, _ = read_gguf_arch(write_tiny_gguf(str(tmp_path / "u.gguf"), {"eos_token_id": 2}))
    assert arch.eos_token_ids == (2,)
