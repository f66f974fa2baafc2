"""What the tests of the head proposers (Medusa, eagle_mlp) share: the tiny engine they
load heads onto, and the check that a proposer's greedy output equals plain greedy under
batching, n > 1, logprobs, preemption and chunked prompts."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams

# The engine variants the equality check runs under (pass to the test as ``overrides``).
ENGINE_VARIANTS = pytest.mark.parametrize("overrides", [
    {},
    dict(num_gpu_blocks_override=24, max_model_len=96),  # preemption
    dict(enable_prefix_caching=False, max_num_batched_tokens=16),  # chunked prompts
], ids=["plain", "preempt", "chunked"])


def tiny(**kw) -> LLM:
    args = dict(load_format="dummy", max_model_len=256, num_gpu_blocks_override=64,
                block_size=4, max_num_batched_tokens=64, device="cpu")
    args.update(kw)
    return LLM("tiny-llama", **args)


def assert_spec_equals_plain(speculative_config: dict, overrides: dict) -> None:
    """Greedy output with ``speculative_config`` equals plain greedy token for token, drafts
    were proposed, and sampling requests (verified with the one-hot rule) reproduce their
    seeded output."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 17, 30)]
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True,
                             n=2 if i == 1 else 1, logprobs=1) for i in range(len(prompts))]
    want = tiny(**overrides).generate(prompts, params, use_tqdm=False)
    llm = tiny(speculative_config=speculative_config, **overrides)
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    sp = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=5)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == first
