"""The draft_model proposer end to end through LLM(...): greedy output equals plain greedy
output token for token whatever the draft's quality (a full copy of the target accepts
everything, a one-layer cut nearly nothing), with preemption, chunked prompts, prefix
caching, n > 1 and aborts; the draft's own KV cache is given back; draft probabilities
reach the rejection sampler; bad drafts fail at startup naming the option."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError, ModelNotFoundError
from kvflow.cpu import step as cpu_step

# Dummy weights with the target's own seed: the full copy IS the target.
COPY = {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 2,
        "disable_by_batch_size": None}
CUT = {**COPY, "draft_num_layers": 1, "num_speculative_tokens": 4}
OTHER = {"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny-llama",
         "draft_load_format": "dummy", "disable_by_batch_size": None}


def tiny(**kw) -> LLM:
    args = dict(load_format="dummy", max_model_len=256, num_gpu_blocks_override=64,
                block_size=4, max_num_batched_tokens=64, device="cpu")
    args.update(kw)
    return LLM("tiny-llama", **args)


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 17, 30)]


def tokens(llm, ps, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(ps, params, use_tqdm=False)]


def proposer(llm):
    return llm.engine.core.executor.runner.spec.proposer


def assert_all_given_back(llm):
    llm.engine.step()  # the last finished ids reach the worker with the next step
    core = llm.engine.core
    assert core.scheduler.kv.num_free_blocks == core.num_blocks
    blocks = proposer(llm).blocks
    assert blocks.num_free == blocks.num_blocks and not blocks.tables


@pytest.mark.parametrize("spec", [COPY, CUT, OTHER], ids=["copy", "cut", "other"])
@pytest.mark.parametrize("overrides", [
    {},
    dict(num_gpu_blocks_override=24, max_model_len=96),  # preemption
    dict(enable_prefix_caching=False, max_num_batched_tokens=16),  # chunked prompts
], ids=["plain", "preempt", "chunked"])
def test_greedy_draft_model_equals_plain_greedy(spec, overrides):
    ps = prompts()
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True,
                             n=2 if i == 1 else 1, min_tokens=i) for i in range(len(ps))]
    want = tokens(tiny(**overrides), ps, params)
    llm = tiny(speculative_config=spec, **overrides)
    assert tokens(llm, ps, params) == want
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if spec is COPY:  # the draft is the target: every draft is kept
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if "num_gpu_blocks_override" in overrides:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert_all_given_back(llm)


def test_sampled_drafts_carry_their_probabilities():
    """A draft identical to the target proposes from q == p, so the rejection sampler
    keeps (nearly) every draft at temperature > 0; one-hot verification of the same
    drafts would keep each only with probability p(x)."""
    llm = tiny(speculative_config=COPY)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=24,
                            ignore_eos=True, seed=3)
    first = tokens(llm, prompts(1), params)
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 40
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    assert tokens(llm, prompts(1), params) == first  # seeded: reproducible
    assert_all_given_back(llm)


def test_abort_mid_generation_frees_the_draft_cache():
    llm = tiny(speculative_config=CUT)
    engine = llm.engine
    for i, p in enumerate(prompts(2)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50,
                                                      ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert proposer(llm).blocks.tables  # the draft holds blocks for the running requests
    engine.abort_request(["r0", "r2"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_given_back(llm)


def test_draft_memory_comes_out_of_the_kv_budget():
    base = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                      max_model_len=256, kv_cache_memory="1MiB")
    spec = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                      max_model_len=256, kv_cache_memory="1MiB", speculative_config=COPY)
    from kvflow.worker.kv_cache import block_bytes, num_blocks_for_budget

    plain_cfg, spec_cfg = base.create_engine_config(), spec.create_engine_config()
    assert block_bytes(spec_cfg) == 2 * block_bytes(plain_cfg)  # the draft is a full copy
    assert num_blocks_for_budget(spec_cfg, 2**20) == num_blocks_for_budget(plain_cfg, 2**20) // 2


def test_target_kv_log_line_counts_only_the_targets_cache(caplog):
    """The target's line and the draft's line add up to the budget: the target's does not
    also count the draft's blocks."""
    import logging
    import re

    from kvflow.worker.kv_cache import kv_bytes_per_token, log_kv_cache

    cfg = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                     max_model_len=256, speculative_config=COPY).create_engine_config()
    blocks = 2**30 // (cfg.cache.block_size * kv_bytes_per_token(cfg))  # 1 GiB of target KV
    with caplog.at_level(logging.INFO, logger="kvflow"):
        log_kv_cache(cfg, blocks)
    assert float(re.search(r"([0-9.]+) GiB", caplog.text).group(1)) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("spec, error, match", [
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "smollm2-135m",
      "draft_load_format": "dummy"}, InvalidParameterError,
     r"speculative_config.model .*vocabulary of 49152 tokens but the target .* has 512"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/draft"},
     ModelNotFoundError, r"speculative_config.model: model '/no/such/draft' was not found"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, InvalidParameterError,
     "speculative_config.model is needed for method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 3},
     InvalidParameterError, "draft_num_layers is 3 but the draft 'tiny-llama' has only 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "tiny-llama"},
     InvalidParameterError, "speculative_config.model is an option of method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 1,
      "draft_quantization": "fp3"}, InvalidParameterError, "draft_quantization must be"),
])
def test_bad_draft_fails_at_startup_naming_the_option(spec, error, match):
    args = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                      max_model_len=64, speculative_config=spec)
    with pytest.raises(error, match=match):
        args.create_engine_config()


@pytest.mark.skipif(cpu_step.find_compiler() is None, reason="needs a C++ compiler")
def test_draft_runs_its_own_cpp_step(monkeypatch):
    """On CPU the draft gets the C++ step the target runs: its forwards (catch-up chunks
    and one-token steps) go through it, the output stays plain greedy's; with the
    target eager (--enforce-eager) the draft is eager too."""
    ps = prompts(1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = tokens(tiny(), ps, params)
    llm = tiny(speculative_config=COPY)
    step = proposer(llm).cpp_step
    assert isinstance(step, cpu_step.CppDecodeStep)
    assert step.model is proposer(llm).model and step.model is not \
        llm.engine.core.executor.runner.model
    runs = []
    real_run = step.run
    monkeypatch.setattr(step, "run", lambda inputs: runs.append(
        inputs.meta.num_actual_tokens) or real_run(inputs))
    assert tokens(llm, ps, params) == want
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # the copy is the target
    assert len(runs) >= 3 * stats.num_drafts / len(ps)  # k forwards per proposing step
    assert max(runs) > len(ps)  # prompt catch-up chunks too
    assert proposer(tiny(speculative_config=COPY, enforce_eager=True)).cpp_step is None


def test_real_model_with_its_quantized_copy_as_draft(smollm2):
    """SmolLM2 dense (HF-exact weights) verifying drafts of its own 4-bit GGUF copy: the
    greedy output is plain greedy's, and the copy agrees with the target most of the
    time."""
    chat = [{"role": "user", "content": "Write a short poem about the sea."}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = smollm2.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("smollm2-135m", device="cpu", max_model_len=512, kv_cache_memory="64MiB",
              quantization="none", speculative_config={
                  "method": "draft_model", "model": "smollm2-135m",
                  "draft_quantization": "gguf", "num_speculative_tokens": 3})
    got = llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    if cpu_step.find_compiler() is not None:  # the 4-bit draft decodes in C++ with its GEMV
        assert proposer(llm).cpp_step is not None and proposer(llm).cpp_step.num_int4 == 120
