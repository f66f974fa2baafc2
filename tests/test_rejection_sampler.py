"""Rejection sampling: exact greedy verification, and a statistical check (histograms of
many draws over a small vocabulary) that temperature > 0 verification reproduces the
target distribution, with and without draft probabilities."""

from __future__ import annotations

import pytest
import torch

from kvflow.layers.rejection_sampler import INVALID_TOKEN, RejectionSampler, expand_metadata
from kvflow.layers.sampler import SamplingMetadata, apply_top_k_top_p_min_p


def meta_for(b: int, temperature: float = 0.0, **kw) -> SamplingMetadata:
    kw = {"top_k": None, "top_p": None, "min_p": None, **kw}
    return SamplingMetadata(temperature=torch.full((b,), temperature),
                            all_greedy=temperature == 0, all_random=temperature > 0,
                            generators={}, **kw)


def rows(num_draft: list[int], v: int) -> int:
    return sum(n + 1 for n in num_draft)


def test_greedy_accepts_while_argmax_agrees():
    v = 6
    num_draft = [3, 0, 2]
    # Argmax per target row: request 0 rows -> 1, 2, 5, 4; request 1 -> 3; request 2 -> 0, 0, 1.
    best = [1, 2, 5, 4, 3, 0, 0, 1]
    logits = torch.full((rows(num_draft, v), v), -1.0)
    logits[torch.arange(len(best)), torch.tensor(best)] = 3.0
    drafts = torch.tensor([1, 2, 0, 0, 0])  # request 0: 1, 2 agree, 0 != 5; request 2: all agree
    out = RejectionSampler()(logits, drafts, num_draft, meta_for(3))
    assert out.num_accepted.tolist() == [2, 0, 2]
    assert out.token_ids.tolist() == [[1, 2, 5, INVALID_TOKEN],
                                      [3, INVALID_TOKEN, INVALID_TOKEN, INVALID_TOKEN],
                                      [0, 0, 1, INVALID_TOKEN]]
    assert out.row_token_ids.tolist() == [1, 2, 5, INVALID_TOKEN, 3, 0, 0, 1]


def test_greedy_applies_bans_and_penalties_per_position():
    v = 5
    num_draft = [2]
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0, 0.0]] * 3)
    # Draft 1 twice: row 1 sees one earlier 1 as output, so a frequency penalty of 2 makes
    # 2 the argmax there; row 0 (no output yet) still picks 1.
    meta = meta_for(1, presence_penalty=torch.tensor([0.0]),
                    frequency_penalty=torch.tensor([2.0]),
                    output_counts=torch.zeros(1, v, dtype=torch.int32))
    out = RejectionSampler()(logits, torch.tensor([1, 1]), num_draft, meta)
    assert out.token_ids.tolist() == [[1, 2, INVALID_TOKEN]]
    # min_tokens: the stop token 1 is banned only on the first row (one more token owed).
    meta = meta_for(1, banned=(torch.tensor([0]), torch.tensor([1])))
    out = RejectionSampler()(logits, torch.tensor([2, 1]), num_draft, meta,
                             min_tokens_left=[1])
    assert out.token_ids.tolist() == [[2, 1, 1]]


def l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b) ** 2).sum().sqrt())


def emitted_histogram(target: torch.Tensor, draft: torch.Tensor | None, k: int, trials: int,
                      seed: int, fixed_drafts: list[int] | None = None, **meta_kw):
    """Histogram of every token emitted over ``trials`` requests that each verify k drafts
    against the same target logits at every position."""
    v = target.shape[0]
    torch.manual_seed(seed)
    num_draft = [k] * trials
    logits = target.log()[None, :].expand(trials * (k + 1), v).contiguous()
    if fixed_drafts is not None:
        drafts = torch.tensor(fixed_drafts * trials)
        draft_probs = None
    else:
        drafts = torch.multinomial(draft, trials * k, replacement=True)
        draft_probs = draft[None, :].expand(trials * k, v).contiguous()
    meta = meta_for(trials, 1.0, **meta_kw)
    out = RejectionSampler()(logits, drafts, num_draft, meta, draft_probs=draft_probs)
    toks = out.token_ids[out.token_ids != INVALID_TOKEN]
    assert (out.num_accepted <= k).all()
    return torch.bincount(toks, minlength=v).float() / toks.numel()


@pytest.mark.parametrize("mode", ["draft_probs", "one_hot"])
def test_distribution_converges_to_target(mode):
    """The emitted tokens follow the target distribution: the distance to it shrinks as
    samples grow and ends far below the distance to random reference distributions."""
    v, k = 8, 3
    gen = torch.Generator().manual_seed(0)
    target = torch.rand(v, generator=gen).softmax(0) ** 2
    target /= target.sum()
    draft = torch.rand(v, generator=gen).softmax(0)
    fixed = [int(target.argmin()), 0, int(target.argmax())] if mode == "one_hot" else None
    refs = [torch.rand(v, generator=gen) for _ in range(20)]
    refs = [r / r.sum() for r in refs]
    dists = []
    for trials in (200, 20000):
        hist = emitted_histogram(target, draft, k, trials, seed=1, fixed_drafts=fixed)
        dists.append(l2(hist, target))
    assert dists[1] < dists[0]
    assert dists[1] < 0.02
    assert all(dists[1] < l2(hist, r) / 5 for r in refs)


def test_distribution_is_the_filtered_target():
    """Top-k / top-p run before verification: the emitted tokens follow the filtered,
    temperature-scaled distribution and never a filtered-out token."""
    v, k, trials = 8, 2, 20000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(v, generator=gen) * 2
    draft = torch.full((v,), 1.0 / v)
    temp = 0.7
    meta_kw = dict(top_k=torch.full((trials,), 4), top_p=torch.full((trials,), 0.9))
    ref_meta = SamplingMetadata(temperature=torch.tensor([temp]), all_greedy=False,
                                all_random=True, top_k=torch.tensor([4]),
                                top_p=torch.tensor([0.9]), min_p=None, generators={})
    want = apply_top_k_top_p_min_p((logits / temp)[None], ref_meta).softmax(-1)[0]
    # emitted_histogram feeds log(target) as logits at temperature 1: pass the scaled ones.
    target = (logits / temp).softmax(0)
    hist = emitted_histogram(target, draft, k, trials, seed=4, **meta_kw)
    assert hist[want == 0].sum() == 0
    assert l2(hist, want) < 0.02


def test_seeded_requests_do_not_depend_on_the_batch():
    v, k = 50, 4
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3 * (k + 1), v, generator=gen)
    drafts = torch.randint(0, v, (3 * k,), generator=gen)
    probs = torch.rand(3 * k, v, generator=gen).softmax(-1)

    def run(req_rows: list[int]) -> list[list[int]]:
        lg = torch.cat([logits[r * (k + 1):(r + 1) * (k + 1)] for r in req_rows])
        dr = torch.cat([drafts[r * k:(r + 1) * k] for r in req_rows])
        pr = torch.cat([probs[r * k:(r + 1) * k] for r in req_rows])
        meta = meta_for(len(req_rows), 0.9)
        gens = {i: torch.Generator().manual_seed(100 + r) for i, r in enumerate(req_rows)}
        out = RejectionSampler()(lg, dr, [k] * len(req_rows), meta, draft_probs=pr,
                                 generators=gens)
        return out.token_ids.tolist()

    alone = run([1])[0]
    torch.manual_seed(123)  # unseeded neighbours draw from the global generator
    assert run([0, 1, 2])[1] == alone
    assert run([2, 1])[1] == alone


def test_expand_counts_earlier_drafts_as_output():
    meta = meta_for(2, presence_penalty=torch.zeros(2), frequency_penalty=torch.ones(2),
                    output_counts=torch.zeros(2, 4, dtype=torch.int32))
    ex = expand_metadata(meta, [2, 1], torch.tensor([3, 1, 2]))
    assert ex.output_counts.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 1],
                                         [0, 0, 0, 0], [0, 0, 1, 0]]
    assert ex.temperature.shape == (5,)


def test_expand_repeats_logit_bias_on_every_row_of_its_request():
    bias = (torch.tensor([0, 1, 1]), torch.tensor([3, 0, 2]), torch.tensor([1.0, -2.0, 5.0]))
    ex = expand_metadata(meta_for(2, logit_bias=bias), [2, 1], torch.tensor([3, 1, 2]))
    got = sorted(zip(*(t.tolist() for t in ex.logit_bias)))
    assert got == [(0, 3, 1.0), (1, 3, 1.0), (2, 3, 1.0),
                   (3, 0, -2.0), (3, 2, 5.0), (4, 0, -2.0), (4, 2, 5.0)]
