"""Medusa candidate trees: construction, verification (greedy, exact sampling whose
output is the target's distribution, typical acceptance),
the accepted path's K/V moved into place, and greedy output equal to plain greedy
through LLM(...) with prefix caching, preemption, chunked prompts, n > 1 and logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import SamplingParams
from kvflow.bench.spec_oracle import install_oracle
from kvflow.engine.args import EngineArgs
from kvflow.errors import InvalidParameterError
from kvflow.layers.rejection_sampler import INVALID_TOKEN
from kvflow.layers.sampler import SamplingMetadata
from kvflow.spec_decode.tree import DraftTree, parse_tree_option, rank_accuracy_profile
from kvflow.spec_decode.tree_verify import TreeVerifier, move_kv
from spec_heads import tiny
from tests.test_spec_medusa import write_heads


def test_tree_is_breadth_first_with_ancestors():
    t = DraftTree.from_choices([[0, 1], [1], [0], [0, 0], [0, 0, 0]])
    assert t.choices == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert t.parents.tolist() == [-1, -1, 0, 0, 2]
    assert t.depth.tolist() == [1, 1, 2, 2, 3]
    assert t.ancestors[4] == (0, 2, 4)
    # Token 0 is the root; node 4 sees the root, nodes 0 and 2 and itself.
    assert np.nonzero(t.visible[5])[0].tolist() == [0, 1, 3, 5]
    assert np.nonzero(t.visible[2])[0].tolist() == [0, 2]
    # Any prefix of the nodes is a tree: every parent comes first.
    assert all(p < i for i, p in enumerate(t.parents.tolist()))


@pytest.mark.parametrize("choices, match", [
    ([[0, 1]], "lacks its parent"),
    ([[0], [0]], "repeated"),
    ([[0], [-1]], "top-k ranks"),
    ([], "at least one"),
])
def test_bad_trees_are_refused(choices, match):
    with pytest.raises(InvalidParameterError, match=match):
        DraftTree.from_choices(choices)


def test_best_tree_takes_the_likeliest_paths():
    acc = [[0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    t = DraftTree.best(4, acc)
    # 0.5, 0.2, 0.5*0.4 = 0.2, then 0.1 (rank 2 of head 0) vs 0.2*0.4=0.08, 0.5*0.1=0.05.
    assert set(t.choices) == {(0,), (1,), (0, 0), (2,)}
    assert DraftTree.best(3, rank_accuracy_profile(None, 3)).num_nodes == 3
    # Measured top-1/top-5 figures shape the profile.
    prof = rank_accuracy_profile({"heldout": [{"top1": 0.3, "top5": 0.5}]}, 1)
    assert prof[0][0] == 0.3 and abs(sum(prof[0][1:5]) - 0.2) < 1e-9


def test_tree_option():
    assert parse_tree_option("chain", 3, "cpu", None, 3) is None
    assert parse_tree_option(None, 3, "cpu", None, 3).num_nodes == 4
    assert parse_tree_option(None, 3, "cuda", None, 3).num_nodes == 32
    assert parse_tree_option(5, 3, "cpu", None, 2).max_depth <= 2
    with pytest.raises(InvalidParameterError, match="medusa_tree"):
        parse_tree_option([[0], [0, 0], [0, 0, 0]], 3, "cpu", None, 2)
    with pytest.raises(InvalidParameterError, match="medusa_tree"):
        parse_tree_option(64, 3, "cpu", None, 3)


def _meta(b: int, temperature: float = 0.0) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((b,), temperature), all_greedy=temperature == 0,
        all_random=temperature > 0, top_k=None, top_p=None, min_p=None, generators={})


TREE = DraftTree.from_choices([[0], [1], [0, 0], [1, 0], [1, 1], [1, 0, 0]])


def _tree_logits(argmax_rows: list[int], vocab: int = 16) -> torch.Tensor:
    logits = torch.zeros(len(argmax_rows), vocab)
    logits[torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 10.0
    return logits


def test_greedy_tree_keeps_the_deepest_right_path():
    # Request 0: all 6 nodes. Node tokens; the target's argmax at each row (root, nodes).
    drafts = [5, 7, 1, 2, 9, 4]  # nodes (0), (1), (0,0), (1,0), (1,1), (1,0,0)
    # Root's argmax 7 (node 1 right), node 1's row says 2 (node (1,0) right), node (1,0)'s
    # row says 4 (node (1,0,0) right), its row says 11 (the bonus).
    rows = [7, 0, 2, 0, 4, 0, 11]
    # Request 1: cut to 2 nodes; the root's argmax matches neither: emits 3.
    drafts1, rows1 = [5, 6], [3, 0, 0]
    v = TreeVerifier(TREE)
    out = v(_tree_logits(rows + rows1), torch.tensor(drafts + drafts1), [6, 2], _meta(2))
    tok = out.row_token_ids.tolist()
    assert tok[:7] == [7, 2, 4, 11, INVALID_TOKEN, INVALID_TOKEN, INVALID_TOKEN]
    assert tok[7:] == [3, INVALID_TOKEN, INVALID_TOKEN]
    assert out.num_accepted.tolist() == [3, 0]
    # Emitted token i was scored at the row of the path's depth-i node.
    assert out.perm[:4].tolist() == [0, 2, 4, 6]
    # K/V moves: depth d's node -> row d (root stays); request 1 moves nothing.
    pairs = list(zip(out.src_rows.tolist(), out.dst_rows.tolist()))
    assert pairs[:4] == [(0, 0), (2, 1), (4, 2), (6, 3)]
    assert all(s == d for s, d in pairs[4:])


def test_typical_acceptance_at_temperature_zero_is_greedy_and_keeps_likely_tokens():
    drafts = [5, 7, 1, 2, 9, 4]
    rows = [7, 0, 2, 0, 4, 0, 11]
    v = TreeVerifier(TREE, posterior_threshold=0.09, posterior_alpha=0.3,
                     acceptance="typical")
    greedy = v(_tree_logits(rows), torch.tensor(drafts), [6], _meta(1, 0.0))
    # A sharply peaked target at temperature 1: the same nodes are typical, nothing else.
    sampled = v(_tree_logits(rows), torch.tensor(drafts), [6], _meta(1, 1.0))
    assert sampled.num_accepted.tolist() == greedy.num_accepted.tolist() == [3]
    assert sampled.row_token_ids[:3].tolist() == greedy.row_token_ids[:3].tolist()
    # A target sure of other tokens keeps no node; a flat one finds every token typical
    # (the threshold falls with the entropy: alpha / V < 1 / V).
    other = v(_tree_logits([3] * 7), torch.tensor(drafts), [6], _meta(1, 1.0))
    assert other.num_accepted.tolist() == [0]
    flat = v(torch.zeros(7, 16), torch.tensor(drafts), [6], _meta(1, 1.0))
    assert flat.num_accepted.tolist() == [3]


def _stream(verifier: TreeVerifier, target: torch.Tensor, drafts: list[int], steps: int,
            seed: int) -> torch.Tensor:
    """The tokens one request emits over ``steps`` verification steps of ``drafts`` (the
    tree's node tokens, the same each step) when the target's distribution is ``target``
    at every position, whatever came before: then the emitted stream must be i.i.d.
    draws from ``target``. The steps run as a batch of requests, concatenated."""
    torch.manual_seed(seed)
    m = len(drafts)
    logits = target.log()[None, :].expand(steps * (m + 1), -1).contiguous()
    out = verifier(logits, torch.tensor(drafts * steps), [m] * steps, _meta(steps, 1.0))
    tok = out.row_token_ids
    return tok[tok != INVALID_TOKEN]


@pytest.mark.parametrize("drafts", [
    [0, 1, 0, 2, 0, 1],  # each node holds its head's rank-th likeliest token
    [0, 0, 1, 0, 1, 0],  # siblings (0,) and (1,) both hold token 0; so do (1,0) and (1,1)
])
def test_exact_tree_acceptance_emits_the_target_distribution(drafts):
    """Exact acceptance (the default) over a tree: the emitted stream's unigram and bigram
    frequencies converge to the target's (i.i.d. draws), far below their distance to
    random references; typical acceptance, which keeps every plausible candidate, fails
    the same check (so the check can tell)."""
    v = 6
    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([0.42, 0.25, 0.15, 0.1, 0.05, 0.03])
    order = target.argsort(descending=True)
    drafts = [int(order[d]) for d in drafts]
    refs = [torch.rand(v, generator=gen) for _ in range(20)]
    refs = [r / r.sum() for r in refs]
    want_pairs = (target[:, None] * target[None, :]).reshape(-1)

    def dists(verifier: TreeVerifier, steps: int) -> tuple[float, float, float]:
        s = _stream(verifier, target, drafts, steps, seed=1)
        uni = torch.bincount(s, minlength=v).float() / s.numel()
        pairs = torch.bincount(s[:-1] * v + s[1:], minlength=v * v).float() / (s.numel() - 1)
        return (float((uni - target).norm()), float((pairs - want_pairs).norm()),
                min(float((uni - r).norm()) for r in refs))

    exact = TreeVerifier(TREE)
    small, big = dists(exact, 500), dists(exact, 40000)
    assert big[0] < small[0] or big[0] < 0.005
    assert big[0] < 0.01 and big[1] < 0.01, big
    assert big[0] < big[2] / 10
    typical = dists(TreeVerifier(TREE, acceptance="typical"), 40000)
    assert typical[0] > 0.05, typical


def test_exact_tree_acceptance_keeps_drawn_paths_and_is_greedy_at_zero():
    """Rows whose draw matches a child descend into it (several levels deep when the
    target is sure), and at temperature 0 exact acceptance is greedy."""
    drafts = [5, 7, 1, 2, 9, 4]
    rows = [7, 0, 2, 0, 4, 0, 11]
    v = TreeVerifier(TREE)
    greedy = v(_tree_logits(rows), torch.tensor(drafts), [6], _meta(1, 0.0))
    sampled = v(_tree_logits(rows, vocab=16) * 3, torch.tensor(drafts), [6], _meta(1, 1.0))
    assert greedy.num_accepted.tolist() == sampled.num_accepted.tolist() == [3]
    assert sampled.row_token_ids[:4].tolist() == [7, 2, 4, 11]
    # A flat target: typical acceptance finds every node plausible, exact acceptance keeps
    # a node only when the draw hits it (about 1 in 16 here).
    flat = torch.zeros(7 * 400, 16)
    kept = v(flat, torch.tensor(drafts * 400), [6] * 400, _meta(400, 1.0)).num_accepted
    assert 0.01 < kept.float().mean() < 0.2


def test_move_kv_copies_every_layer_and_scales():
    kv = torch.randn(3, 2, 4, 4, 2, 8)  # [L, 2, NB, BS, KVH, D]
    scales = torch.randn(3, 2, 4, 4, 2)
    before, sbefore = kv.clone(), scales.clone()
    src, dst = torch.tensor([5, 9, 3]), torch.tensor([4, 5, 3])  # overlapping: 5 -> 4, 9 -> 5
    move_kv(kv, scales, src, dst)
    flat, bflat = kv.view(3, 2, 16, 2, 8), before.view(3, 2, 16, 2, 8)
    torch.testing.assert_close(flat[:, :, 4], bflat[:, :, 5])
    torch.testing.assert_close(flat[:, :, 5], bflat[:, :, 9])
    torch.testing.assert_close(flat[:, :, 9], bflat[:, :, 9])
    torch.testing.assert_close(scales.view(3, 2, 16, 2)[:, :, 5], sbefore.view(3, 2, 16, 2)[:, :, 9])


PROMPTS_SEED = 0


def _prompts():
    g = torch.Generator().manual_seed(PROMPTS_SEED)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 17, 30)]


@pytest.mark.parametrize("overrides", [
    {},
    dict(num_gpu_blocks_override=24, max_model_len=96),  # preemption
    dict(enable_prefix_caching=False, max_num_batched_tokens=16),  # chunked prompts
], ids=["plain", "preempt", "chunked"])
def test_tree_with_right_paths_anywhere_equals_plain_greedy(tmp_path, overrides):
    """An oracle puts the right continuation on a random branch of the tree each step:
    most steps accept several nodes away from the first slots, so the output is only
    plain greedy's if the kept path's K/V was moved into place."""
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True,
                             n=2 if i == 1 else 1, logprobs=1) for i in range(len(prompts))]
    plain = tiny(**overrides)
    want = plain.generate(prompts, params, use_tqdm=False)
    refs = [list(o.prompt_token_ids) + list(c.token_ids) for o in want for c in o.outputs]
    write_heads(tmp_path)
    llm = tiny(speculative_config={"method": "medusa", "model": str(tmp_path),
                                   "num_speculative_tokens": 3,
                                   "disable_by_batch_size": None}, **overrides)
    install_oracle(llm, refs, 3, DraftTree.from_choices(TREE.choices), place="random")
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):  # read at the kept path's rows
            la = [e[t].logprob for e, t in zip(ca.logprobs, ca.token_ids)]
            lb = [e[t].logprob for e, t in zip(cb.logprobs, cb.token_ids)]
            np.testing.assert_allclose(la, lb, atol=1e-4)
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.mean_accepted_length > 2.0, stats


@pytest.mark.parametrize("acceptance", ["exact", "typical"])
def test_medusa_tree_greedy_and_sampling(tmp_path, acceptance):
    """Random heads with the default CPU tree: greedy output is plain greedy's; sampled
    requests take the tree acceptance asked for, seeded ones reproducibly."""
    write_heads(tmp_path)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = tiny().generate(prompts, params, use_tqdm=False)
    llm = tiny(speculative_config={"method": "medusa", "model": str(tmp_path),
                                   "num_speculative_tokens": 3, "tree_acceptance": acceptance,
                                   "disable_by_batch_size": None})
    assert llm.engine.core.executor.runner.spec.tree.num_nodes == 4
    assert llm.engine.core.executor.runner.spec.tree_verifier.acceptance == acceptance
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    sp = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=5)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(t) == 16 for t in first)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == first


@pytest.mark.parametrize("tree, match", [
    ("oak", "medusa_tree"),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "medusa_tree: a choice is 4 deep"),
    ([[1, 1]], "lacks its parent"),
])
def test_bad_tree_fails_at_startup(tmp_path, tree, match):
    write_heads(tmp_path)
    args = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                      max_model_len=64, speculative_config={
                          "method": "medusa", "model": str(tmp_path),
                          "num_speculative_tokens": 3, "medusa_tree": tree})
    with pytest.raises(InvalidParameterError, match=match):
        args.create_engine_config()


def test_tree_acceptance_option(tmp_path):
    from kvflow.config import SpeculativeConfig

    write_heads(tmp_path)
    assert SpeculativeConfig("medusa", 3, model=str(tmp_path)).tree_acceptance == "exact"
    with pytest.raises(InvalidParameterError,
                       match="tree_acceptance must be exact or typical, got 'greedy'"):
        SpeculativeConfig("medusa", 3, model=str(tmp_path), tree_acceptance="greedy")


def test_chain_shaped_tree_verifies_like_the_rejection_sampler_with_penalties():
    """A tree that is a chain must give the chain verifier's result, with penalties
    counting each row's preceding drafts and min_tokens banning by depth."""
    from kvflow.layers.rejection_sampler import RejectionSampler

    g = torch.Generator().manual_seed(3)
    vocab, d = 12, 3
    logits = torch.randn(2 * (d + 1), vocab, generator=g)
    drafts = logits.argmax(dim=-1).view(2, d + 1)[:, :d].reshape(-1)  # mostly right
    # Request 0 repeats its first draft, and row 1 (after it) favours that token by a
    # margin the presence penalty (3.0) overturns once the draft is counted as output.
    drafts[1] = drafts[0]
    top2 = logits[1].topk(2).values
    logits[1, int(drafts[0])] = top2[0] + 1.0
    meta = _meta(2)
    meta.repetition_penalty = torch.tensor([1.0, 1.0])
    meta.presence_penalty = torch.tensor([3.0, 0.0])
    meta.frequency_penalty = torch.tensor([0.0, 0.0])
    meta.output_counts = torch.zeros(2, vocab, dtype=torch.int64)
    meta.prompt_mask = torch.zeros(2, vocab, dtype=torch.bool)
    meta.banned = (torch.tensor([1]), torch.tensor([int(drafts[d + 1])]))
    chain = DraftTree.chain(d)
    tree_out = TreeVerifier(chain)(logits, drafts, [d, d], meta, min_tokens_left=[0, 2])
    ref = RejectionSampler()(logits, drafts, [d, d], meta, min_tokens_left=[0, 2])
    assert tree_out.row_token_ids.tolist() == ref.row_token_ids.tolist()
    assert tree_out.num_accepted.tolist() == ref.num_accepted.tolist()
    assert ref.num_accepted.tolist()[0] == 1  # the penalty rejected the repeat
