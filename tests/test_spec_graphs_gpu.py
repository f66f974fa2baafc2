"""On the GPU: speculative verification steps replayed through CUDA graphs give plain
greedy decoding's tokens, with graphs on and off (--enforce-eager), overlapped steps on.
A small random-weight model in float32 (no bf16 near-ties between the 1-row decode and the
k + 1-row verification forward); the draft is the target itself, so every draft is kept
and every step verifies a full chain."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KW = dict(load_format="dummy", dtype="float32", max_model_len=256, max_num_seqs=16,
          kv_cache_memory="256MiB")


def _run(prompts, params, **kw):
    llm = LLM("tiny-llama", **KW, **kw)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.core.executor.runner
    stats = llm.engine.core.scheduler.spec_stats
    verify_graphs = len(getattr(runner.graphs, "verify_graphs", {}) or {})
    llm.shutdown()
    return out, stats, verify_graphs


@pytest.mark.parametrize("k", [1, 4])
def test_spec_graphs_equal_plain_greedy(k):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 19, 33)]
    params = [SamplingParams(temperature=0, max_tokens=24 + 5 * i, ignore_eos=True)
              for i in range(len(prompts))]
    want, _, _ = _run(prompts, params)
    spec = {"method": "draft_model", "num_speculative_tokens": k, "draft_num_layers": 2,
            "disable_by_batch_size": None}
    for eager in (False, True):
        got, stats, graphs = _run(prompts, params, speculative_config=spec,
                                  enforce_eager=eager)
        assert got == want, f"enforce_eager={eager}"
        assert stats.num_draft_tokens > 0
        # (the draft's 1-row steps and the target's k + 1-row verification differ in
        # the last float32 bits: allow a rare near-tie to reject a draft)
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
        assert (graphs > 0) == (not eager)


def test_tree_graphs_equal_plain_greedy():
    """Candidate trees through the tree verification graphs: the bench-only oracle puts
    the plain run's continuation on a random branch of the tree each step, wrong tokens
    elsewhere, so the kept path's K/V moves from any branch."""
    from kvflow.bench.spec_oracle import install_oracle
    from kvflow.spec_decode.tree import DraftTree

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 21)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM("tiny-llama", **KW)
    ref = plain.generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in ref]
    plain.shutdown()
    llm = LLM("tiny-llama", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}, **KW)
    tree = DraftTree.from_choices([[0], [1], [0, 0], [1, 0], [1, 1], [0, 0, 0], [1, 1, 0]])
    refs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in ref]
    install_oracle(llm, refs, 3, tree, place="random")
    graphs = llm.engine.core.executor.runner.graphs
    graphs.capture_trees(tree.num_nodes)
    assert any(key[2] for key in graphs.verify_graphs)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == want
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0
    llm.shutdown()


def test_prefill_graphs_equal_eager(monkeypatch):
    """One-request prefills through the (1, q) prefill graphs (KVFLOW_PREFILL_GRAPHS=on):
    prompts of several lengths one at a time, one behind a cached prefix; greedy tokens
    equal the eager engine's, and the graphs were captured."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 19, 100, 200)]
    prompts.append(prompts[2] + [11, 12, 13])  # a cached prefix, then a short prefill
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = {**KW, "max_num_seqs": 1}
    eager = LLM("tiny-llama", enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.shutdown()
    monkeypatch.setenv("KVFLOW_PREFILL_GRAPHS", "on")
    llm = LLM("tiny-llama", **kw)
    graphs = llm.engine.core.executor.runner.graphs
    assert (1, 128, False) in graphs.verify_graphs and graphs.prefill_lens[-1] == 256
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert got == want
