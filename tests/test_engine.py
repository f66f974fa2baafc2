"""End-to-end engine behaviour through the public API (LLM, LLMEngine)."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, OutputKind, SamplingParams
from kvflow.engine.args import EngineArgs
from kvflow.engine.llm_engine import LLMEngine


def tiny(**kw) -> LLM:
    args = dict(load_format="dummy", max_model_len=256, num_gpu_blocks_override=64,
                block_size=4, max_num_batched_tokens=32, device="cpu")
    args.update(kw)
    return LLM("tiny-llama", **args)


def rand_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def test_async_scheduling_gives_the_same_tokens():
    """Overlapped steps (step N+1 launched before N's tokens are read) change nothing:
    seeded sampling, penalties, min_tokens, logprobs and preemption included."""
    prompts = rand_prompts((5, 40, 100, 7))
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=30 + i, ignore_eos=True,
                             logprobs=2, repetition_penalty=1.2, presence_penalty=0.5,
                             frequency_penalty=0.3, min_tokens=3) for i in range(4)]
    results = {}
    for overlap in (False, True):
        llm = tiny(async_scheduling=overlap, num_gpu_blocks_override=40, max_model_len=160)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.core.scheduler.num_preemptions > 0
        results[overlap] = [(o.outputs[0].token_ids,
                             [sorted(d) for d in o.outputs[0].logprobs]) for o in outs]
    assert results[False] == results[True]


def test_seed_is_independent_of_batch():
    llm = tiny()
    target = rand_prompts((20,), seed=1)[0]
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], p, use_tqdm=False)[0].outputs[0].token_ids
    others = rand_prompts((3, 50, 9, 31), seed=2)
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 2
                         + [p] + [SamplingParams(temperature=0.5, max_tokens=10)] * 2,
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    unseeded = llm.generate([target] * 2, SamplingParams(temperature=1.0, max_tokens=24,
                                                         ignore_eos=True), use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_samples_share_prompt_blocks_and_match_independent_seeds():
    llm = tiny(max_num_batched_tokens=128)
    prompt = rand_prompts((37,), seed=3)[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=10, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=10 + i,
                                                     max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    # Siblings reused the first sample's full prompt blocks (37 tokens: 9 full blocks).
    assert out.num_cached_tokens == 36


def test_greedy_n_and_stop_token_ids():
    llm = tiny()
    prompt = rand_prompts((10,), seed=4)[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = base[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                stop_token_ids=[stop_tok]), use_tqdm=False)
    c = out[0].outputs[0]
    first = base.index(stop_tok)
    assert c.token_ids == base[: first + 1] and c.finish_reason == "stop"
    assert c.stop_reason == stop_tok


def test_prompt_logprobs_shape_and_consistency():
    llm = tiny(max_num_batched_tokens=8)  # chunked: prompt logprobs arrive in pieces
    prompt = rand_prompts((21,), seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, logprobs=3,
                                                prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for tok, d in zip(prompt[1:], out.prompt_logprobs[1:]):
        assert tok in d and 2 <= len(d) <= 3
        ranks = sorted(lp.rank for t, lp in d.items() if t != tok)
        assert ranks == list(range(1, len(ranks) + 1))
    for tok, d in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert d[tok].rank == 1  # greedy: the chosen token is the most likely
        assert 3 <= len(d) <= 4


def test_delta_streaming_reassembles(smollm2):
    engine = smollm2.engine
    params = SamplingParams(temperature=0, max_tokens=40, output_kind=OutputKind.DELTA)
    engine.add_request("stream", "Tell me about the moon.", params)
    text, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text.append(out.outputs[0].text)
            tokens.extend(out.outputs[0].token_ids)
    full = smollm2.generate("Tell me about the moon.", SamplingParams(temperature=0,
                                                                      max_tokens=40),
                            use_tqdm=False)[0].outputs[0]
    assert "".join(text) == full.text and tokens == full.token_ids


def test_stop_strings(smollm2):
    p = "Count from 1 to 10, separated by commas."
    messages = [{"role": "user", "content": p}]
    base = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=40),
                        use_tqdm=False)[0].outputs[0]
    assert "5" in base.text
    out = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=40, stop=["5"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[: base.text.index("5")]
    assert out.finish_reason == "stop" and out.stop_reason == "5"
    out = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=40, stop=["5"],
                                                include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[: base.text.index("5") + 1]


def test_chat_and_generate_inputs(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    tok = smollm2.get_tokenizer()
    ids = tok.encode("Hello there")
    outs = smollm2.generate(["Hello there", ids, {"prompt_token_ids": ids}],
                            SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert outs[0].prompt_token_ids == ids == outs[1].prompt_token_ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == \
        outs[2].outputs[0].token_ids
    assert outs[0].prompt == "Hello there" and outs[1].prompt is None


def test_abort_frees_everything():
    llm = tiny()
    engine = llm.engine
    for i, p in enumerate(rand_prompts((30, 60, 5))):
        engine.add_request(str(i), p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(["0", "1", "2"])
    while engine.core.has_unfinished_requests():
        engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.core.scheduler.kv.num_free_blocks == engine.core.num_blocks


def test_engine_args_cli_round_trip():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["tiny-llama", "--load-format", "dummy", "--max-model-len", "128",
                            "--no-enable-chunked-prefill", "--kv-cache-memory", "64MiB",
                            "--async-scheduling"])
    args = EngineArgs.from_cli_args(ns)
    assert args.model == "tiny-llama" and args.max_model_len == 128
    assert args.enable_chunked_prefill is False and args.async_scheduling is True
    cfg = args.create_engine_config()
    assert cfg.cache.kv_cache_memory == 64 << 20
    assert cfg.scheduler.max_num_batched_tokens >= 128


@pytest.mark.parametrize("kw", [{"block_size": 3}, {"gpu_memory_utilization": 1.5},
                                {"max_num_seqs": 0}])
def test_bad_engine_args(kw):
    from kvflow.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError):
        LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", load_format="dummy", **kw))


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_round_trip_matches_no_preemption(mode):
    """Requests swapped out to host memory and back give exactly the tokens of a run with
    room for everyone."""
    prompts = rand_prompts((30, 45, 12, 60), seed=7)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(4)]
    roomy = tiny(num_gpu_blocks_override=256, max_model_len=128)
    ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = tiny(num_gpu_blocks_override=34, max_model_len=128, preemption_mode=mode,
                 swap_space="1MiB", enable_prefix_caching=False)
    out = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    sched = tight.engine.core.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swaps == sched.num_preemptions
    assert out == ref
    assert sched.host_pool.num_free_blocks == sched.host_pool.num_blocks


def test_cpu_kv_cache_is_zero_over_recycled_nan_memory():
    """Attention reads whole blocks and masks the unwritten slots; a NaN there would still
    poison the output. The cache must start zeroed even where the heap held NaNs."""
    from kvflow.worker.kv_cache import allocate_kv_cache

    cfg = EngineArgs("tiny-llama", load_format="dummy", max_model_len=96,
                     device="cpu").create_engine_config()
    probe = allocate_kv_cache(cfg, 40, torch.device("cpu"))
    shape, numel = probe.shape, probe.numel()
    del probe
    for _ in range(8):  # leave freed NaN-filled chunks of the cache's size behind
        junk = [torch.full((numel,), float("nan")) for _ in range(4)]
        del junk
        cache = allocate_kv_cache(cfg, 40, torch.device("cpu"))
        assert cache.shape == shape and bool((cache == 0).all())
        cache.add_(1)  # writable
        del cache


def test_cpu_kv_budget_against_available_memory(monkeypatch):
    """A budget the machine cannot hold is refused at start, with the numbers; the default
    shrinks to half of what is available on a small machine."""
    from kvflow.errors import OutOfMemoryError
    from kvflow.cpu import memory

    GiB = 1 << 30
    monkeypatch.setattr(memory, "available_host_memory", lambda: 3 * GiB)
    assert memory.cpu_kv_budget(None) == 3 * GiB // 2
    assert memory.cpu_kv_budget(2 * GiB) == 2 * GiB
    with pytest.raises(OutOfMemoryError, match=r"asks for 8.00 GiB but only 3.00 GiB"):
        LLM("tiny-llama", load_format="dummy", max_model_len=64, kv_cache_memory="8GiB")
    monkeypatch.setattr(memory, "available_host_memory", lambda: None)  # not Linux
    assert memory.cpu_kv_budget(None) == memory.CPU_DEFAULT_KV_BYTES
    assert memory.cpu_kv_budget(64 * GiB) == 64 * GiB


def test_min_tokens_bans_every_eos_id_the_scheduler_stops_on():
    """The request's EOS ids (the model's plus the tokenizer's) are what the worker keeps
    from being sampled under min_tokens, not the model's alone."""
    llm = tiny()
    prompt = rand_prompts((9,), seed=5)[0]
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    # As if the tokenizer named `first` its EOS token while the model config says 2.
    assert first not in llm.engine.config.model.arch.eos_token_ids
    llm.engine.processor.eos_token_ids = sorted({first, 2})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=4),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:4]
