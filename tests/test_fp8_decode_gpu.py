"""FP8 decode rows through the engine on a GPU: the tiny model with every decode row on the
W8A8 GEMVs (``KVFLOW_FP8_DECODE=w8a8``: norm-quantized qkv, the MLP chain, o after a
quantize launch) gives the same greedy tokens with CUDA graphs and eagerly, and its
first decoded token's log-probability stays near the weight-dequant path's."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 (compute capability 8.9+)")]


def test_w8a8_decode_rows_in_graphs_match_eager_and_dequant(monkeypatch):
    from kvflow import LLM, SamplingParams
    from kvflow.kernels import gemv_fp8

    calls = []
    fn = gemv_fp8.gemv_fp8
    monkeypatch.setattr(gemv_fp8, "gemv_fp8", lambda *a, **k: calls.append(
        bool(k.get("fp8_out"))) or fn(*a, **k))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 17, 64)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    results = {}
    for name, mode, eager in (("graphs", "w8a8", False), ("eager", "w8a8", True),
                              ("dequant", "dequant", False)):
        monkeypatch.setenv("KVFLOW_FP8_DECODE", mode)
        calls.clear()
        llm = LLM("tiny-llama", load_format="dummy", device="cuda", dtype="bfloat16",
                  quantization="fp8", kv_cache_memory="256MiB", max_model_len=256,
                  enforce_eager=eager)
        results[name] = llm.generate(prompts, params, use_tqdm=False)
        if mode == "w8a8":  # the chain's gate/up (FP8 out) and the plain GEMVs ran
            assert True in calls and False in calls
        else:
            assert not calls
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(results["graphs"], results["eager"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-3
    for a, b in zip(results["graphs"], results["dequant"]):
        t = a.outputs[0].token_ids[0]
        lp_a = a.outputs[0].logprobs[0][t].logprob
        lp_b = b.outputs[0].logprobs[0].get(t)
        if lp_b is not None:  # the same first token: its probability barely moves
            assert abs(lp_a - lp_b.logprob) < 0.1
