"""Speculative decoding end to end through LLM(...): greedy output equals plain greedy
output token for token (penalties, min_tokens, logprobs, preemption, n > 1 and prefix
caching included), seeded sampling is reproducible, and the counters move."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}


def tiny(**kw) -> LLM:
    args = dict(load_format="dummy", max_model_len=256, num_gpu_blocks_override=64,
                block_size=4, max_num_batched_tokens=64, device="cpu")
    args.update(kw)
    return LLM("tiny-llama", **args)


def repetitive_prompts(seed=0):
    """Prompts that repeat a pattern, so prompt lookup finds drafts from the start."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, reps in ((5, 4), (9, 3), (3, 6), (20, 2)):
        pattern = torch.randint(3, 500, (n,), generator=g).tolist()
        out.append(pattern * reps)
    return out


def run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, [sorted(d.items()) for d in c.logprobs or []]) for c in o.outputs]
            for o in outs]


def close_logprobs(a, b):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        for da, db in zip(la, lb):
            assert [t for t, _ in da] == [t for t, _ in db]
            for (_, x), (_, y) in zip(da, db):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.mark.parametrize("overrides", [
    {},
    dict(num_gpu_blocks_override=24, max_model_len=96),  # preemption
    dict(enable_prefix_caching=False, max_num_batched_tokens=16),  # chunked prompts
])
def test_greedy_speculation_equals_plain_greedy(overrides):
    prompts = repetitive_prompts()
    params = [SamplingParams(temperature=0, max_tokens=24 + 3 * i, ignore_eos=True,
                             logprobs=2, presence_penalty=0.2 * (i % 2), min_tokens=i,
                             n=2 if i == 1 else 1,
                             # a ban and a push on request 2 (applied on every verify row)
                             logit_bias={prompts[2][0]: 3.0, prompts[2][1]: -100.0}
                             if i == 2 else None)
              for i in range(len(prompts))]
    plain = tiny(**overrides)
    want = run(plain, prompts, params)
    spec = tiny(speculative_config=NGRAM, **overrides)
    got = run(spec, prompts, params)
    for a, b in zip(want, got):
        close_logprobs(a, b)
    stats = spec.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if "num_gpu_blocks_override" in overrides:
        assert spec.engine.core.scheduler.num_preemptions > 0
    # Nothing leaks: every block is back in the pool.
    assert spec.engine.core.scheduler.kv.num_free_blocks == spec.engine.core.num_blocks


def test_seeded_sampling_is_reproducible_with_speculation():
    prompts = repetitive_prompts(1)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=7 + i, max_tokens=20,
                             ignore_eos=True) for i in range(len(prompts))]
    llm = tiny(speculative_config=NGRAM)
    first = run(llm, prompts, params)
    assert run(llm, prompts, params) == first
    # Alone or beside others: a seeded request draws from its own generator.
    assert run(llm, prompts[2:3], params[2:3])[0] == first[2]


def test_stop_inside_an_accepted_run():
    prompt = repetitive_prompts()[0]
    llm = tiny(speculative_config=NGRAM)
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                 ignore_eos=True), use_tqdm=False)
    toks = full[0].outputs[0].token_ids
    stop = toks[10]
    first = toks.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop_token_ids=[stop]), use_tqdm=False)
    assert out[0].outputs[0].token_ids == toks[: first + 1]
    for max_tokens in (1, 2, 7):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == toks[:max_tokens]


def test_large_batch_turns_speculation_off():
    prompts = repetitive_prompts() * 3  # 12 requests
    llm = tiny(speculative_config={**NGRAM, "disable_by_batch_size": 2})
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens == 0
