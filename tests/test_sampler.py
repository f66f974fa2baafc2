"""The sampler's filters and penalties on small hand-computed cases, and the sharded
branch of the linear layers' weight loader."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.errors import ModelLoadError
from kvflow.layers.linear import MergedLinear, QKVLinear
from kvflow.layers import sampler as sampler_mod
from kvflow.layers.sampler import (Sampler, SamplingMetadata, apply_penalties,
                                   apply_top_k_top_p_min_p, gather_logprobs, random_sample)

NEG = float("-inf")


def meta(rows: int, **kw) -> SamplingMetadata:
    base = dict(temperature=torch.ones(rows), all_greedy=False, all_random=True, top_k=None,
                top_p=None, min_p=None, generators={})
    base.update(kw)
    return SamplingMetadata(**base)


def kept(logits: torch.Tensor) -> list[list[bool]]:
    return (logits > NEG).tolist()


def test_top_k_keeps_the_k_largest_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.5, 0.1, 0.3, 0.2]])
    out = apply_top_k_top_p_min_p(logits, meta(2, top_k=torch.tensor([2, 4])))
    assert kept(out) == [[False, True, True, False], [True, True, True, True]]
    assert out[0, 1] == 4.0 and out[0, 2] == 3.0  # kept values are unchanged


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probs 0.5, 0.25, 0.125, 0.125 (as logits: log of them).
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    # 0.5 alone < 0.6, 0.5 + 0.25 >= 0.6: two tokens kept.
    assert kept(apply_top_k_top_p_min_p(logits, meta(1, top_p=torch.tensor([0.6])))) == \
        [[True, True, False, False]]
    # p = 0.5 exactly: the first token already has it.
    assert kept(apply_top_k_top_p_min_p(logits, meta(1, top_p=torch.tensor([0.5])))) == \
        [[True, False, False, False]]
    # A tiny p still keeps the most likely token.
    assert kept(apply_top_k_top_p_min_p(logits, meta(1, top_p=torch.tensor([1e-6])))) == \
        [[True, False, False, False]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    # Threshold 0.3 * 0.5 = 0.15: the two 0.125 tokens go.
    out = apply_top_k_top_p_min_p(logits, meta(1, min_p=torch.tensor([0.3])))
    assert kept(out) == [[True, True, False, False]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0]])
    m = meta(1, repetition_penalty=torch.tensor([2.0]),
             prompt_mask=torch.tensor([[True, False, False, False]]),
             output_counts=torch.tensor([[0, 1, 0, 0]], dtype=torch.int32))
    assert apply_penalties(logits, m).tolist() == [[1.0, -2.0, 3.0, -2.0]]


def test_frequency_and_presence_penalties_use_output_counts_only():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    m = meta(1, frequency_penalty=torch.tensor([0.5]), presence_penalty=torch.tensor([0.25]),
             output_counts=torch.tensor([[0, 1, 3]], dtype=torch.int32))
    # token 1: 1 - 0.5 * 1 - 0.25 = 0.25; token 2: 1 - 0.5 * 3 - 0.25 = -0.75.
    assert apply_penalties(logits, m).tolist() == [[1.0, 0.25, -0.75]]


def test_sampler_bans_min_tokens_ids_and_returns_ranked_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 1.0, 0.0]])
    m = meta(2, temperature=torch.zeros(2), all_greedy=True, all_random=False,
             banned=(torch.tensor([0]), torch.tensor([1])), max_num_logprobs=1)
    out = Sampler()(logits, m)
    assert out.sampled.tolist() == [2, 0]  # row 0's best token (1) is banned
    # Logprobs come from the raw logits: token 2 of row 0 ranks second there.
    assert out.sampled_ranks.tolist() == [2, 1]
    assert out.logprob_token_ids.tolist() == [[2, 1], [0, 0]]
    expected = 1.0 - math.log(math.exp(0) + math.exp(5) + math.exp(1))
    assert out.logprobs[0, 0].item() == pytest.approx(expected, abs=1e-5)


def test_gather_logprobs_without_top_n():
    lp = torch.tensor([[-0.1, -2.0, -3.0]])
    ids, lps, ranks = gather_logprobs(lp, torch.tensor([1]), 0)
    assert ids.tolist() == [[1]] and lps.tolist() == [[-2.0]] and ranks.tolist() == [2]


def _sorted_filter(logits: torch.Tensor, m: SamplingMetadata, monkeypatch) -> torch.Tensor:
    """The sort path's result (the CPU's partial path switched off)."""
    with monkeypatch.context() as mp:
        mp.setattr(sampler_mod, "_top_k_top_p_partial", lambda *a: None)
        return apply_top_k_top_p_min_p(logits, m)


@pytest.mark.parametrize("case", ["top_p", "top_k", "both", "mixed", "min_p", "flat",
                                  "large_k", "tie"])
def test_cpu_partial_filter_equals_the_sort(case, monkeypatch):
    """The CPU's topk-based top-k/top-p keeps exactly the tokens the full sort keeps, on
    a 49k vocabulary, peaked and flat rows; where the kept set may pass its candidates
    it falls back to the sort (and says so by returning None)."""
    g = torch.Generator().manual_seed(0)
    rows, v = 6, 49152
    logits = torch.randn(rows, v, generator=g) * torch.tensor([4.0, 3, 5, 3.5, 6, 4])[:, None]
    full_k, full_p = torch.full((rows,), v), torch.ones(rows)
    kw = {"top_p": dict(top_p=torch.tensor([0.9, 0.5, 0.95, 0.8, 0.99, 0.7])),
          "top_k": dict(top_k=torch.tensor([1, 5, 40, 100, 127, 50])),
          "both": dict(top_k=torch.tensor([20, 50, 100, 40, 10, 80]),
                       top_p=torch.tensor([0.9, 0.5, 0.95, 0.8, 0.99, 0.7])),
          "mixed": dict(top_k=torch.where(torch.arange(rows) % 2 == 0, full_k, 30),
                        top_p=torch.where(torch.arange(rows) % 3 == 0, full_p, 0.9)),
          "min_p": dict(min_p=torch.full((rows,), 0.05), top_p=torch.full((rows,), 0.9)),
          "flat": dict(top_p=torch.full((rows,), 0.9)),
          "large_k": dict(top_k=torch.full((rows,), 1000)),
          "tie": dict(top_k=torch.full((rows,), 3))}[case]
    if case == "flat":
        logits = logits / 100  # nearly uniform: 128 candidates hold far less than 0.9
    if case == "tie":
        logits[:, :200] = 50.0  # the 3rd best ties with 197 more: past the candidates
    m = meta(rows, **kw)
    want = _sorted_filter(logits, m, monkeypatch)
    got = apply_top_k_top_p_min_p(logits, m)
    # Rows with neither filter keep every token (the sort's float32 running sum may reach
    # 1.0 a little early and drop a tail of ~1e-7 there).
    none = (m.top_k if m.top_k is not None else full_k) >= v
    none &= (m.top_p if m.top_p is not None else full_p) >= 1.0
    if m.min_p is None:
        assert torch.equal(got[none], logits[none])
    assert torch.equal(got[~none] > NEG, want[~none] > NEG)
    assert torch.equal(got[got > NEG], logits[got > NEG])
    filtered = logits if case != "min_p" else apply_top_k_top_p_min_p(
        logits, meta(rows, min_p=m.min_p))
    partial = [sampler_mod._top_k_top_p_partial(filtered, m, k) is not None
               for k in sampler_mod.PARTIAL_CANDIDATES]
    want_partial = {"flat": [False] * 3, "tie": [False, True, True]}  # 200 ties fit 1024
    assert partial == want_partial.get(case, partial) and any(partial) == (case != "flat"), \
        (case, partial)


def test_cpu_draw_follows_the_distribution_and_ignores_zero_weights():
    """random_sample on the CPU (one uniform through the cumulative weights): frequencies
    converge to the weights, unnormalized rows included, zero-weight tokens never come."""
    torch.manual_seed(0)
    w = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25], [3.0, 0.0, 1.0, 0.0, 0.0]])
    draws = torch.stack([random_sample(w, {}) for _ in range(20000)])  # [N, 2]
    for r in range(2):
        freq = torch.bincount(draws[:, r], minlength=5).float() / len(draws)
        assert float((freq - w[r] / w[r].sum()).abs().max()) < 0.015
        assert freq[w[r] == 0].sum() == 0


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def draw(rows):
        gen = torch.Generator().manual_seed(7)
        return Sampler()(logits[rows], meta(len(rows), generators={0: gen})).sampled[0]

    assert draw([1]) == draw([1, 0, 2])


def test_merged_weight_loader_places_each_shard():
    qkv = QKVLinear(hidden_size=2, head_dim=1, num_heads=2, num_kv_heads=1, bias=True,
                    dtype=torch.float32)
    for shard, rows, fill in (("q", 2, 1.0), ("k", 1, 2.0), ("v", 1, 3.0)):
        qkv.weight.weight_loader(qkv.weight, torch.full((rows, 2), fill), shard)
        qkv.bias.weight_loader(qkv.bias, torch.full((rows,), fill), shard)
    assert qkv.weight[:, 0].tolist() == [1.0, 1.0, 2.0, 3.0]
    assert qkv.bias.tolist() == [1.0, 1.0, 2.0, 3.0]
    gate_up = MergedLinear(2, [3, 1], False, torch.float32)
    gate_up.weight.weight_loader(gate_up.weight, torch.full((1, 2), 9.0), 1)
    assert gate_up.weight[3].tolist() == [9.0, 9.0]
    with pytest.raises(ModelLoadError, match="unknown shard"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(1, 2), "o")
    with pytest.raises(ModelLoadError, match="does not match"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(2, 2), "k")  # k has one row


def test_logit_bias_is_added_before_greedy_and_random_sampling():
    from kvflow.layers.sampler import process_logits

    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.0]])
    bias = (torch.tensor([0, 0, 1]), torch.tensor([1, 2, 0]), torch.tensor([-100.0, 4.0, 0.5]))
    out = process_logits(logits, meta(2, logit_bias=bias))
    assert out.tolist() == [[0.0, -95.0, 5.0], [2.5, 0.0, 1.0]]
    assert logits[0, 1] == 5.0  # the caller's logits are not changed
    greedy = Sampler()(logits, meta(2, temperature=torch.zeros(2), all_greedy=True,
                                    all_random=False, logit_bias=bias, max_num_logprobs=0))
    assert greedy.sampled.tolist() == [2, 0]
    # Returned logprobs stay the model's own (OpenAI and vLLM report them before bias).
    assert greedy.logprobs[0, 0].item() == pytest.approx(torch.log_softmax(logits[0], 0)[2].item())
    # +100 on token 0 wins every random draw in row 1, -100 never draws token 1 in row 0.
    push = (torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([-100.0, 100.0]))
    for _ in range(20):
        s = Sampler()(logits, meta(2, logit_bias=push)).sampled.tolist()
        assert s[0] != 1 and s[1] == 0


def test_logit_bias_through_llm_and_its_validation():
    from kvflow import LLM, SamplingParams
    from kvflow.errors import InvalidParameterError

    llm = LLM("tiny-llama", load_format="dummy", max_model_len=128, device="cpu",
              num_gpu_blocks_override=32, block_size=4)
    prompt = [[5, 6, 7, 8, 9]]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 logit_bias={321: 100.0}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [321] * 6
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 logit_bias={t: -100.0 for t in plain}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert not set(banned) & set(plain)
    vocab = llm.engine.config.model.arch.vocab_size
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        llm.generate(prompt, SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    for bad in ({1: 101.0}, {-1: 1.0}, {1: float("nan")}, {"1": 1.0}, [1, 2]):
        with pytest.raises(InvalidParameterError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
