"""INT8 W8A8 (``--quantization w8a8-int8``, SmoothQuant checkpoints of ``kvflow quantize``)
and LLM.int8 (``--quantization llm-int8``): the int8 GEMM and the outlier decomposition
against pure-torch references, calibration and smoothing on a tiny random model (the
smoothing alone leaves the model's function unchanged), the checkpoint round trip
through ``LLM(...)``, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow.bench.quality import _Scorer
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError, ModelLoadError
from kvflow.layers.quantization import resolve_quantization
from kvflow.layers.quantization.int8_gemm import (int8_mm, int8_mm_ref, prepare_weight,
                                                  quantize_int8_rows)
from kvflow.layers.quantization.llm_int8 import llm_int8_mm, llm_int8_ref, outlier_summary
from kvflow.quantize.smoothquant import (collect_input_absmax, smooth_model,
                                         write_smoothquant)
from test_fp8_w8a8 import H, INTER, KV, _dense_tensors, _save

IDS = torch.randint(3, 500, (48,), generator=torch.Generator().manual_seed(7)).tolist()


def _scorer(path: str, **kw) -> _Scorer:
    return _Scorer(EngineArgs(model=path, device="cpu", skip_tokenizer_init=True,
                              max_model_len=128, **kw), 64)


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((ref.exp() * (ref - got)).sum(-1).mean())


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    t = _dense_tensors(11)
    # Outlier activation channels, as real models have: a few hidden channels of the
    # norms 30x larger, so the smoothing has something to move.
    for layer in range(2):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{layer}.{norm}.weight"][[3, 17]] *= 30.0
    return _save(tmp_path_factory.mktemp("dense"), t, None)


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (7, 128, 96), (33, 576, 192), (5, 60, 20)])
def test_int8_gemm_matches_reference(m, k, n):
    g = torch.Generator().manual_seed(m * k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    x[0, 3] = 40.0  # an outlier channel: only token 0's scale grows
    xq, sx = quantize_int8_rows(x)
    wq, sw = quantize_int8_rows(w)
    assert xq.dtype == torch.int8 and sx.shape == (m,) and int(xq.abs().max()) == 127
    ref = int8_mm_ref(xq, sx, wq, sw, torch.float32)
    got = int8_mm(xq, sx, prepare_weight(wq, sw, "t"), torch.float32)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # int32 sums are exact
    dense = x @ w.t()
    assert float((ref - dense).norm() / dense.norm()) < 0.04  # token 0: coarse steps


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1, 4096, 1024), (16, 576, 1536), (100, 60, 20)])
def test_int_mm_cuda_padding_matches_reference(m, k, n):
    dev = torch.device("cuda")
    x, w = torch.randn(m, k, device=dev), torch.randn(n, k, device=dev) * 0.02
    xq, sx = quantize_int8_rows(x)
    wq, sw = quantize_int8_rows(w)
    got = int8_mm(xq, sx, prepare_weight(wq, sw, "t"), torch.float32)
    ref = int8_mm_ref(xq.cpu(), sx.cpu(), wq.cpu(), sw.cpu(), torch.float32)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("outliers", [(), (2,), (0, 5, 63)])
def test_llm_int8_decomposition_matches_reference(outliers):
    g = torch.Generator().manual_seed(len(outliers))
    x, w = torch.randn(9, 64, generator=g), torch.randn(48, 64, generator=g) * 0.05
    for c in outliers:
        x[4, c] = 25.0
    wq, sw = quantize_int8_rows(w)
    outlier_summary(reset=True)
    got = llm_int8_mm(x, w, prepare_weight(wq, sw, "t"), 6.0, "test_proj")
    torch.testing.assert_close(got, llm_int8_ref(x, w, 6.0), rtol=1e-5, atol=1e-5)
    s = outlier_summary(reset=True)["test_proj"]
    assert (s["calls"], s["max_outlier_columns"], s["in_features"]) == (1, len(outliers), 64)
    # The outliers go through float: the result is closer to the dense product than
    # plain per-token int8, whose token-4 scale the outliers inflate.
    dense = x @ w.t()
    plain = int8_mm_ref(*quantize_int8_rows(x), wq, sw, torch.float32)
    if outliers:
        assert float((got - dense).norm()) < 0.5 * float((plain - dense).norm())


def test_smoothing_is_a_no_op_before_quantization(dense_dir):
    """smooth_model moves the scales between norms/linears and their inputs: the float
    model computes the same logits (fold all), or the same with the explicit input_smooth
    multiplied in (fold norms); the activation range the int8 quantizer sees shrinks."""
    for fold in ("all", "norms"):
        sc = _scorer(dense_dir, quantization="none")
        ref = sc.logprobs(IDS)
        stats = collect_input_absmax(sc.model, lambda: sc.logprobs(IDS))
        assert len(stats) == 8 and stats["model.layers.0.self_attn.qkv_proj"].shape == (H,)
        explicit, summary = smooth_model(sc.model, stats, 0.5, fold)
        hooks = [lin.register_forward_pre_hook(lambda _m, a, _s=explicit[p]: (a[0] * _s,))
                 for p, lin in ((p, m) for m in sc.model.modules()
                                for p in [getattr(m, "prefix", None)] if p in explicit)]
        assert len(hooks) == (0 if fold == "all" else 4)
        torch.testing.assert_close(sc.logprobs(IDS), ref, atol=2e-4, rtol=1e-4)
        after = collect_input_absmax(sc.model, lambda: sc.logprobs(IDS))
        qkv = "model.layers.0.self_attn.qkv_proj"
        assert float(after[qkv].max()) < 0.5 * float(stats[qkv].max())
        assert summary["qkv_proj"]["act_absmax_after"] < summary["qkv_proj"]["act_absmax_before"]
        for h in hooks:
            h.remove()


def _write(dense_dir, out, alpha=0.5, fold="all") -> str:
    sc = _scorer(dense_dir, quantization="none")
    write_smoothquant(sc, [IDS, IDS[::-1]], alpha, fold, str(out))
    return str(out)


@pytest.mark.parametrize("fold", ["all", "norms"])
def test_checkpoint_round_trip_through_llm(dense_dir, tmp_path, fold):
    """kvflow writes a SmoothQuant checkpoint, LLM(...) loads it with auto, and it beats
    unsmoothed W8A8 on a model with outlier channels; greedy decoding through the engine
    follows the checkpoint model's own logits."""
    from kvflow import LLM, SamplingParams

    path = _write(dense_dir, tmp_path / "sq", fold=fold)
    qc = json.loads((tmp_path / "sq" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "smoothquant" and qc["calibration"]["tokens"] == 96
    assert qc["smooth_inputs"] == ([] if fold == "all" else ["o_proj", "down_proj"])
    ref = _scorer(dense_dir, quantization="none").logprobs(IDS)
    ck = _scorer(path)
    cfg = ck.model.quant_config
    assert (cfg.method, cfg.prequantized) == ("w8a8-int8", True)
    qkv = ck.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (H + 2 * KV,)
    down = ck.model.model.layers[1].mlp.down_proj
    assert hasattr(down, "input_smooth") == (fold == "norms")
    got = ck.logprobs(IDS)
    plain = _scorer(dense_dir, quantization="w8a8-int8").logprobs(IDS)
    kl_sq, kl_plain = _kl(ref, got), _kl(ref, plain)
    assert kl_sq < 0.5 * kl_plain, (kl_sq, kl_plain)
    with LLM(path, device="cpu", skip_tokenizer_init=True, max_model_len=128,
             kv_cache_memory="16MiB") as llm:
        out = llm.generate({"prompt_token_ids": IDS[:20]},
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    toks = list(out[0].outputs[0].token_ids)
    ids = IDS[:20]
    for t in toks:  # greedy by full prefills of the checkpoint model
        assert int(ck.logprobs(ids)[-1].argmax()) == t
        ids = ids + [t]


def test_w8a8_int8_and_llm_int8_at_load(dense_dir):
    """Both methods quantize a float checkpoint at load; llm-int8 with a low threshold
    sends columns through float and counts them per layer type."""
    ref = _scorer(dense_dir, quantization="none").logprobs(IDS)
    w8 = _scorer(dense_dir, quantization="w8a8-int8")
    assert w8.model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    assert w8.model.lm_head.weight.dtype == torch.float32
    kl_w8 = _kl(ref, w8.logprobs(IDS))
    outlier_summary(reset=True)
    li = _scorer(dense_dir, quantization="llm-int8", llm_int8_threshold=1.0)
    kl_li = _kl(ref, li.logprobs(IDS))
    s = outlier_summary(reset=True)
    assert set(s) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert s["qkv_proj"]["max_outlier_columns"] >= 2  # the planted channels 3 and 17
    # KL >= 0; a float32 estimate of a near-zero KL can land a few 1e-8 below it (seen on
    # an AVX2 machine, where the outlier split leaves almost nothing to round).
    assert -1e-6 < kl_li < kl_w8, (kl_li, kl_w8)


def test_bad_smoothquant_checkpoints_are_refused(dense_dir, tmp_path):
    path = _write(dense_dir, tmp_path / "sq")
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{path}/model.safetensors")
    good = dict(tensors)
    tensors["model.layers.0.self_attn.k_proj.weight_scale"] = torch.ones(3)
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ModelLoadError, match=r"weight_scale \(k\) has shape \(3,\)"):
        _scorer(path)
    tensors = dict(good)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(INTER, H)
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ModelLoadError, match="dtype torch.float32"):
        _scorer(path)
    cfg_path = tmp_path / "sq" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qc = cfg["quantization_config"]
    with pytest.raises(ModelLoadError, match="already int8 W8A8"):
        resolve_quantization("int4", "hf", qc, "cpu", False)
    bad = {**qc, "activations": {"type": "int", "num_bits": 8, "strategy": "tensor"}}
    with pytest.raises(ModelLoadError, match="not supported"):
        resolve_quantization("auto", "hf", bad, "cpu", False)


def test_unknown_method_and_bad_options_are_clear_errors():
    with pytest.raises(InvalidParameterError, match="quantization must be one of"):
        resolve_quantization("w8a8-int4", "hf", None, "cpu", False)
    with pytest.raises(InvalidParameterError, match="llm_int8_threshold"):
        EngineArgs(model="tiny-llama", load_format="dummy", quantization="llm-int8",
                   llm_int8_threshold=0.0).create_engine_config()
    with pytest.raises(ModelLoadError, match="needs one per output channel"):
        prepare_weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1), "x")


def test_quantize_cli_rejects_bad_input(tmp_path, capsys):
    from kvflow.cli import main

    assert main(["quantize", "--output", str(tmp_path / "o"), "--alpha", "1.5"]) == 2
    assert "--alpha must be in [0, 1]" in capsys.readouterr().err
    assert main(["quantize", "--output", str(tmp_path / "o"), "--calib",
                 str(tmp_path / "missing.txt")]) == 2
    assert "cannot read --calib" in capsys.readouterr().err


def test_bench_method_names(tmp_path):
    from kvflow.bench.quality import method_args

    base = EngineArgs(model="tiny-llama", load_format="dummy")
    assert method_args(base, "w8a8-int8").quantization == "w8a8-int8"
    assert method_args(base, "llm-int8").quantization == "llm-int8"
    ck = method_args(base, str(tmp_path))  # a checkpoint directory: loaded as it is
    assert (ck.model, ck.quantization) == (str(tmp_path), "auto")
    with pytest.raises(InvalidParameterError, match="unknown option"):
        method_args(base, "int4-x9")


def test_quantize_cli_end_to_end_with_a_tokenizer(dense_dir, tmp_path):
    """`kvflow quantize` on a tiny model with a word-level tokenizer: the calibration text
    is tokenized, the checkpoint carries the tokenizer, and LLM(...) serves text from it."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvflow import LLM, SamplingParams
    from kvflow.cli import main

    src = tmp_path / "src"
    shutil.copytree(dense_dir, src)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(400)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{(i * 37) % 400}" for i in range(300)))
    out = tmp_path / "sq"
    assert main(["quantize", "--model", str(src), "--calib", str(calib), "--output",
                 str(out), "--context", "64", "--max-windows", "3", "--alpha", "0.6"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["alpha"], qc["calibration"]["windows"], qc["calibration"]["tokens"]) == (
        0.6, 3, 192)
    with LLM(str(out), device="cpu", max_model_len=128, kv_cache_memory="16MiB") as llm:
        assert llm.get_tokenizer().encode("w5 w6", add_special_tokens=False) == [8, 9]
        got = llm.generate("w1 w2 w3", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 3
    assert main(["quantize", "--model", str(src), "--output", str(out)]) == 2  # not empty
