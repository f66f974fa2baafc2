"""Quantized KV cache (--kv-cache-dtype int8|fp8) through the torch backend and the
engine: attention over the quantized cache equals the reference attention over the same
values dequantized; prefix caching, copy-on-write (n > 1) and swap preemption keep
their guarantees; capacity and the planner agree; bad values get clear errors."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError
from kvflow.layers.attention import AttentionMetadata, AttentionSpec
from kvflow.layers.attention.kv_quant import (KVQuant, dequantize_cache, keep_cache_values,
                                             storage_dtype, write_kv_quant)
from kvflow.layers.attention.torch_backend import (PaddedDecodePlan, TorchAttentionBackend,
                                                   paged_attention_ref)
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary_ref
from kvflow.utils import cdiv

KINDS = ["int8", "fp8"]


def _meta(q_lens, seq_lens, num_decodes, tables, bs):
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (n, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(s - n, s):
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
    return AttentionMetadata(
        num_actual_tokens=qsl[-1], num_reqs=len(q_lens), num_decodes=num_decodes,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("padded", [False, True], ids=["planned", "padded-decode"])
def test_torch_backend_matches_reference_over_dequantized_cache(kind, padded):
    """Two steps: a prefill (fresh prompt, then a chunk after a cached prefix) fills the
    cache; then a decode step. Each is compared with paged_attention_ref over the
    cache's dequantized values, so the fresh prefill must attend to the quantized
    values too."""
    torch.manual_seed(0)
    h, kvh, d, bs = 6, 2, 32, 4
    rotary = RotaryEmbedding(d, 128, 10000.0, None)
    spec = AttentionSpec(block_size=bs, num_kv_heads=kvh, dtype=torch.float32,
                         device=torch.device("cpu"), rotary=rotary)
    backend = TorchAttentionBackend()
    builder = backend.metadata_builder(spec)
    nb = 24
    cache = torch.zeros(2, nb, bs, kvh, d, dtype=storage_dtype(kind))
    quant = KVQuant(kind, torch.zeros(2, nb, bs, kvh) if kind == "int8" else None,
                    k_scale=0.1, v_scale=0.05)
    tables = torch.randperm(nb)[:15].to(torch.int32).view(3, 5)

    def step(q_lens, seq_lens, num_decodes, use_padded=False):
        meta = _meta(q_lens, seq_lens, num_decodes, tables, bs)
        t = meta.num_actual_tokens
        positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens)])
        q = torch.randn(t, h, d)
        k, v = torch.randn(t, kvh, d) * 2, torch.randn(t, kvh, d)
        if use_padded:
            meta.backend = PaddedDecodePlan.build(spec, meta, positions)
        else:
            builder.build(meta, positions)
        out = backend.forward(positions, q, k, v, cache, rotary, d ** -0.5, meta,
                              kv_quant=quant)
        cos, sin = rotary.cos_sin(positions)
        ref = paged_attention_ref(apply_rotary_ref(q, cos, sin),
                                  dequantize_cache(cache, quant, torch.float32), tables,
                                  meta.query_start_loc_cpu, seq_lens, d ** -0.5)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)

    step([10, 7], [10, 7], 0)  # two fresh prompts
    step([6], [13], 0)  # a chunk after the second one's cached prefix (request order kept)
    step([1, 1, 1], [11, 14, 9], 3, use_padded=padded)  # a third request joins as decode
    assert quant.kind != "int8" or bool((quant.scales[:, tables[0, :3].long()] > 0).any())


@pytest.mark.parametrize("kind", KINDS)
def test_keep_cache_values_reads_back_instead_of_storing(kind):
    """Inside keep_cache_values() a quantized write leaves the cache (and int8 scales)
    as they were and returns what they hold at its slots, dequantized; outside it,
    the same call stores the new values."""
    torch.manual_seed(0)
    nb, bs, kvh, d = 4, 4, 2, 8
    cache = torch.zeros(2, nb, bs, kvh, d, dtype=storage_dtype(kind))
    quant = KVQuant(kind, torch.zeros(2, nb, bs, kvh) if kind == "int8" else None,
                    k_scale=0.05, v_scale=0.1)
    slots = torch.tensor([1, 6, 13])
    k, v = torch.randn(3, kvh, d), torch.randn(3, kvh, d)
    kd, vd = write_kv_quant(k, v, cache, quant, slots, torch.float32)
    stored = [cache.clone()] + ([quant.scales.clone()] if kind == "int8" else [])
    with keep_cache_values():
        kk, vk = write_kv_quant(k * 3, -v, cache, quant, slots, torch.float32)
    assert torch.equal(cache.view(torch.uint8), stored[0].view(torch.uint8))
    if kind == "int8":
        assert torch.equal(quant.scales, stored[1])
    assert torch.equal(kk, kd) and torch.equal(vk, vd)
    k3, _ = write_kv_quant(k * 3, -v, cache, quant, slots, torch.float32)
    assert not torch.equal(k3, kd)  # stored again outside the context


def tiny(**kw) -> LLM:
    args = dict(load_format="dummy", max_model_len=128, num_gpu_blocks_override=64,
                block_size=4, max_num_batched_tokens=32, device="cpu")
    args.update(kw)
    return LLM("tiny-llama", **args)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
def test_swap_preemption_and_n_samples_with_quantized_cache(kind):
    """Swapped-out blocks come back with their scales: a tight cache that preempts by
    swapping gives the tokens of a roomy one. n=3 siblings share the prompt's blocks
    (copy-on-write of the partial last one) and match three independent requests."""
    prompts = _prompts((30, 45, 12, 60), seed=7)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(4)]
    roomy = tiny(kv_cache_dtype=kind, num_gpu_blocks_override=256)
    ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]

    prompt = _prompts((37,), seed=3)[0]
    out = roomy.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=10, max_tokens=10,
                                                  ignore_eos=True), use_tqdm=False)[0]
    singles = [roomy.generate([prompt], SamplingParams(temperature=1.0, seed=10 + i,
                                                       max_tokens=10, ignore_eos=True),
                              use_tqdm=False)[0] for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    assert out.num_cached_tokens == 36 and singles[1].num_cached_tokens == 36
    del roomy

    tight = tiny(kv_cache_dtype=kind, num_gpu_blocks_override=34, preemption_mode="swap",
                 swap_space="1MiB", enable_prefix_caching=False)
    runner = tight.engine.core.executor.runner
    assert runner.kv_caches.dtype == storage_dtype(kind)
    assert (runner.host_scales is not None) == (kind == "int8")
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    sched = tight.engine.core.scheduler
    assert sched.num_preemptions > 0 and sched.num_swaps == sched.num_preemptions
    assert got == ref


def test_quantized_cache_capacity_and_planner():
    """int8 and fp8 blocks are a quarter of fp32 ones (int8: plus its scales); the
    engine's block count for a budget is what `kvflow plan --kv-dtype` predicts."""
    from kvflow.plan.model import ShardedModel
    from kvflow.worker.kv_cache import block_bytes, kv_bytes_per_token

    base = EngineArgs("smollm2-135m", device="cpu", max_model_len=256,
                      kv_cache_memory="64MiB")
    cfgs = {k: EngineArgs(**{**base.__dict__, "kv_cache_dtype": k}).create_engine_config()
            for k in ("auto", "int8", "fp8")}
    arch = cfgs["auto"].model.arch
    fp32 = kv_bytes_per_token(cfgs["auto"])
    assert fp32 == arch.kv_bytes_per_token("float32")
    assert kv_bytes_per_token(cfgs["fp8"]) * 4 == fp32
    assert kv_bytes_per_token(cfgs["int8"]) == fp32 // 4 + 2 * 30 * 3 * 4
    for kind in ("int8", "fp8"):
        planned = ShardedModel(arch, 1, "float32", kind).kv_bytes_per_token
        assert planned == kv_bytes_per_token(cfgs[kind])
        llm = LLM("smollm2-135m", device="cpu", max_model_len=256, kv_cache_memory="64MiB",
                  kv_cache_dtype=kind)
        measured = llm.engine.core.scheduler.kv.num_blocks
        assert measured == (64 << 20) // (16 * planned) == (64 << 20) // block_bytes(
            cfgs[kind])
        assert measured > 3.5 * ((64 << 20) // block_bytes(cfgs["auto"]))
        del llm


def test_bad_kv_cache_dtype_values(monkeypatch):
    with pytest.raises(InvalidParameterError, match="cache_dtype"):
        EngineArgs("tiny-llama", load_format="dummy", kv_cache_dtype="int4",
                   device="cpu").create_engine_config()
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(InvalidParameterError, match="float8_e4m3fn.*use int8"):
        tiny(kv_cache_dtype="fp8")


def test_cli_flag_reaches_the_engine():
    import argparse

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["tiny-llama", "--load-format", "dummy", "--kv-cache-dtype", "int8"])
    assert EngineArgs.from_cli_args(ns).create_engine_config().cache.cache_dtype == "int8"
    with pytest.raises(SystemExit):
        p.parse_args(["tiny-llama", "--kv-cache-dtype", "fp4"])


def test_real_model_greedy_int8_and_fp8_kv_stay_close_to_fp32(smollm2):
    """The embedded model, greedy: int8/fp8 KV against the float32 cache on the same
    (dense float32) weights. Agreement is counted up to each pair's first divergence."""
    prompts = ["The capital of France is", "Here is a list of three fruits:",
               "def fibonacci(n):", "Water boils at a temperature of"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = {"auto": [o.outputs[0].token_ids for o in smollm2.generate(prompts, params,
                                                                      use_tqdm=False)]}
    for kind in ("int8", "fp8"):
        llm = LLM("smollm2-135m", device="cpu", max_model_len=256, kv_cache_memory="32MiB",
                  quantization="none", kv_cache_dtype=kind)
        outs[kind] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
        del llm

    def prefix_agreement(a, b):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        return n / len(a)

    agree = {k: sum(prefix_agreement(r, o) for r, o in zip(outs["auto"], outs[k]))
             / len(prompts) for k in ("int8", "fp8")}
    print("greedy prefix agreement vs fp32 KV:", agree)
    assert agree["int8"] >= 0.75, agree
    assert agree["fp8"] >= 0.5, agree


def test_bench_quality_kv_methods_score_the_quantized_cache():
    """`kvflow bench quality --methods kv-int8,kv-fp8`: dense weights, quantized cache;
    the figures differ from the dense run's (the cache really rounds) but stay close."""
    from kvflow.bench.quality import _Scorer, method_args

    base = EngineArgs("tiny-llama", load_format="dummy", device="cpu", max_model_len=128,
                      skip_tokenizer_init=True)
    ids = torch.randint(3, 500, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _Scorer(method_args(base, "none"), 64).logprobs(ids)
    for kind, bound in (("int8", 1e-3), ("fp8", 2e-2)):
        scorer = _Scorer(method_args(base, f"kv-{kind}"), 64)
        assert scorer.config.cache.cache_dtype == kind
        layer = next(m for m in scorer.model.modules() if hasattr(m, "kv_quant"))
        assert layer.kv_cache.dtype == storage_dtype(kind)
        got = scorer.logprobs(ids)
        kl = float((ref.exp() * (ref - got)).sum(-1).mean())
        assert 0 < kl < bound, (kind, kl)
