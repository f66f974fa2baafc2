"""The GPU engine's input plumbing, run on the CPU: Triton attention backend (under the
interpreter), the device-side block table, and the CUDA-graph runner's static buffers and
padding (graph capture replaced by eager calls on the same buffers). Tokens must equal
the pure-torch path's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.attention import get_attention_backend
from kvflow.layers.custom_op import use_kernels
from kvflow.worker import cuda_graphs
from kvflow.worker.block_table import DeviceBlockTable

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the real GPU runs these paths in test_gpu_parity")


class EagerGraph:
    """Stands in for a captured CUDA graph: replays the forward on the static buffers."""

    replays = 0

    def __init__(self, runner: cuda_graphs.CudaGraphRunner, bs: int) -> None:
        self.runner, self.bs = runner, bs

    def replay(self) -> None:
        EagerGraph.replays += 1
        self.runner.hidden[self.bs].copy_(self.runner._forward(self.bs))


class EagerVerifyGraph:
    """Stands in for a captured verification graph (batch size bs, q tokens a request,
    candidate trees or chains)."""

    replays = 0

    def __init__(self, runner: cuda_graphs.CudaGraphRunner, key: tuple) -> None:
        self.runner, self.key = runner, key

    def replay(self) -> None:
        EagerVerifyGraph.replays += 1
        self.runner.verify_hidden[self.key].copy_(self.runner._verify_forward(*self.key))


def gpu_like(llm: LLM, graphs: bool, verify_sizes=(), verify_lens=(),
             tree_nodes: int = 0, prefill_lens=()) -> None:
    """Switch a CPU engine to the GPU path: Triton kernels and their metadata builder,
    device block table, graphs (verification graphs of ``verify_sizes`` x
    ``verify_lens`` too, for trees of up to ``tree_nodes`` nodes, and one-request
    prefill graphs of ``prefill_lens``)."""
    r = llm.engine.core.executor.runner
    backend = get_attention_backend("triton")
    for m in r.model.modules():
        if hasattr(m, "backend"):
            m.backend = backend
    use_kernels(r.model, True)
    r.use_kernels = True
    sb = r.step_builder
    # 4 SMs: small decode batches split their KV (the flash-decoding path runs too).
    sb.attn_builder = backend.metadata_builder(dataclasses.replace(r.attn_spec, num_sms=4))
    sb.device_block_table = DeviceBlockTable(r.config.scheduler.max_num_seqs,
                                             sb.batch.block_table.shape[1], r.device)
    sb.batch.record_ops = True
    if graphs:
        g = cuda_graphs.CudaGraphRunner(r.model, sb.attn_builder,
                                        r.config.scheduler.max_num_seqs,
                                        r.config.model.max_model_len,
                                        sb.device_block_table.table.shape[1], r.device,
                                        list(verify_sizes), list(verify_lens),
                                        list(prefill_lens), lora=r.lora)
        g.sizes = g.sizes[:4]  # 1, 2, 4, 8: the tests run at most 6 requests at once
        for bs in g.sizes:
            g.hidden[bs] = g._forward(bs)
            g.graphs[bs] = EagerGraph(g, bs)
        g._capture = lambda forward: (None, forward())  # graphs come next
        g._capture_verify(g.prefill_lens, False, sizes=[1])
        g._capture_verify(g.verify_lens, False)
        if tree_nodes:
            g.tree_lens = cuda_graphs.verify_query_lens(tree_nodes)
            g._capture_verify(g.tree_lens, True)
        g.verify_graphs = {key: EagerVerifyGraph(g, key) for key in g.verify_hidden}
        r.graphs = g


@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_path_matches_torch_path(graphs):
    kw = dict(load_format="dummy", max_model_len=96, num_gpu_blocks_override=40,
              block_size=8, max_num_batched_tokens=24, max_num_seqs=16, device="cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 30, 3, 17, 9)]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=8 + i, ignore_eos=True)
              for i in range(len(prompts))]
    ref = LLM("tiny-llama", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny-llama", async_scheduling=True, **kw)
    gpu_like(llm, graphs)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    if graphs:
        assert EagerGraph.replays > 5  # decode steps went through the graph runner


def test_gpu_path_verifies_drafts_like_torch_path():
    """Speculative decoding on the GPU path: a drafting request's query spans several
    tokens, so the Triton paged-attention call treats it like a prefill chunk over its
    cached context; greedy tokens must equal the pure-torch plain decode's."""
    kw = dict(load_format="dummy", max_model_len=96, num_gpu_blocks_override=40,
              block_size=8, max_num_batched_tokens=24, max_num_seqs=16, device="cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() * 3 for n in (4, 7)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = LLM("tiny-llama", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny-llama", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **kw)
    gpu_like(llm, graphs=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0


def test_gpu_path_verifies_medusa_trees_like_torch_path(tmp_path):
    """Candidate trees on the GPU path: the Triton kernel's tree masks (interpreter), the
    device block table and the K/V move of the kept path; the oracle puts the right
    continuation on random branches, so greedy tokens equal plain decoding's only if all
    of them work."""
    from kvflow.bench.spec_oracle import install_oracle
    from kvflow.spec_decode.tree import DraftTree
    from tests.test_spec_medusa import write_heads

    kw = dict(load_format="dummy", max_model_len=96, num_gpu_blocks_override=40,
              block_size=8, max_num_batched_tokens=24, max_num_seqs=16, device="cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 11)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ref = LLM("tiny-llama", **kw).generate(prompts, params, use_tqdm=False)
    write_heads(tmp_path)
    llm = LLM("tiny-llama", speculative_config={
        "method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 3,
        "disable_by_batch_size": None}, **kw)
    tree = DraftTree.from_choices([[0], [1], [0, 0], [1, 0], [1, 1], [0, 0, 0], [1, 1, 0]])
    # Tree verification graphs (2 requests replay in the 2-request graphs of 8 tokens).
    gpu_like(llm, graphs=True, verify_sizes=[1, 2], tree_nodes=tree.num_nodes)
    refs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in ref]
    install_oracle(llm, refs, 3, tree, place="random")
    EagerVerifyGraph.replays = 0
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.core.scheduler.spec_stats.mean_accepted_length > 2.0
    assert EagerVerifyGraph.replays > 3


def test_gpu_path_verification_graphs_match_torch_path():
    """Verification steps replayed through the (batch size, query length) graphs: the
    step's tokens first, a padding request after them (fewer requests or drafts than the
    graph's), overlapped steps on. Greedy tokens must equal the pure-torch plain decode's,
    and verification steps must have gone through the graphs."""
    kw = dict(load_format="dummy", max_model_len=96, num_gpu_blocks_override=40,
              block_size=8, max_num_batched_tokens=24, max_num_seqs=16, device="cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() * 3 for n in (4, 7, 5)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    ref = LLM("tiny-llama", **kw).generate(prompts, params, use_tqdm=False)
    # The target as its own draft: every draft kept; 3 requests replay in the 4-request
    # graphs (a padding request after them), max_tokens cuts the last steps' drafts.
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 2,
            "disable_by_batch_size": None}
    llm = LLM("tiny-llama", speculative_config=spec, async_scheduling=True, **kw)
    gpu_like(llm, graphs=True, verify_sizes=[1, 2, 4],
             verify_lens=cuda_graphs.verify_query_lens(3))
    EagerVerifyGraph.replays = 0
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    assert EagerVerifyGraph.replays > 3


def test_gpu_path_prefill_graphs_match_torch_path():
    """One-request prefills replayed through the (1, q) prefill graphs (KVFLOW_PREFILL_GRAPHS):
    the prompt's tokens first, the rest of the rung a padding request; a prompt longer
    than the budget arrives in chunks over its cached context, and one prompt repeats
    another's start so its prefill runs behind a cached prefix. Tokens must equal the
    pure-torch path's, and the prefills must have gone through the graphs."""
    kw = dict(load_format="dummy", max_model_len=96, num_gpu_blocks_override=40,
              block_size=8, max_num_batched_tokens=32, max_num_seqs=1, device="cpu")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 30, 2, 17, 45)]
    prompts.append(prompts[1] + [7, 8, 9])  # 24 cached tokens (3 blocks), then 9 new
    params = [SamplingParams(temperature=0.7 if i % 2 else 0, seed=i, max_tokens=6 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    ref = LLM("tiny-llama", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny-llama", async_scheduling=True, **kw)
    lens = cuda_graphs.prefill_query_lens(32, 96) + [24]  # 16, 32; 24 for the chunks
    gpu_like(llm, graphs=True, prefill_lens=sorted(lens))
    EagerVerifyGraph.replays = 0
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    # every prefill step but the 1-token remainder of none: 5, 30, 2, 17, 32 + 13, 9
    assert EagerVerifyGraph.replays >= 6
    graphs = llm.engine.core.executor.runner.graphs
    assert set(graphs.verify_graphs) == {(1, 16, False), (1, 24, False), (1, 32, False)}


def test_prefill_graph_pick():
    """Which steps replay a prefill graph: one request, 2..max rung new tokens, no tree;
    the next rung up; verification graphs first where both exist."""
    from types import SimpleNamespace as NS

    assert cuda_graphs.prefill_query_lens(8192, 4096) == list(cuda_graphs.PREFILL_LENS)
    assert cuda_graphs.prefill_query_lens(100, 4096) == [16, 32, 64]
    g = cuda_graphs.CudaGraphRunner(None, None, 4, 128, 8, torch.device("cpu"),
                                    prefill_lens=[16, 64])
    pick = lambda r, q, tree=None: g._pick(NS(num_reqs=r, max_query_len=q, tree=tree))  # noqa
    assert pick(1, 5) == (1, 16, False) and pick(1, 16) == (1, 16, False)
    assert pick(1, 17) == (1, 64, False) and pick(1, 64) == (1, 64, False)
    assert pick(1, 65) is None and pick(2, 5) is None and pick(1, 1) is None
    assert pick(1, 5, tree=object()) is None
    v = cuda_graphs.CudaGraphRunner(None, None, 4, 128, 8, torch.device("cpu"),
                                    verify_sizes=[1, 2], verify_lens=[2, 4],
                                    prefill_lens=[16])
    assert v._pick(NS(num_reqs=1, max_query_len=3, tree=None)) == (1, 4, False)
    assert v._pick(NS(num_reqs=1, max_query_len=9, tree=None)) == (1, 16, False)
    assert v.input_ids.shape[0] >= 16  # room for the longest prefill rung


def test_prefill_graphs_switch(monkeypatch):
    from kvflow.errors import InvalidParameterError

    cpu = torch.device("cpu")
    monkeypatch.setenv("KVFLOW_PREFILL_GRAPHS", "on")
    assert cuda_graphs.prefill_graphs_on(cpu)
    monkeypatch.setenv("KVFLOW_PREFILL_GRAPHS", "auto")
    assert not cuda_graphs.prefill_graphs_on(cpu)  # unmeasured: the eager prefill
    monkeypatch.setenv("KVFLOW_PREFILL_GRAPHS", "maybe")
    with pytest.raises(InvalidParameterError, match="KVFLOW_PREFILL_GRAPHS"):
        cuda_graphs.prefill_graphs_on(cpu)


def test_gpu_path_deterministic_matches_torch_path(monkeypatch):
    """--deterministic's GPU plumbing on the CPU: batch-invariant linears, decode
    attention split in fixed key ranges (64 keys here: the 60-token prompt's context
    grows into the second),
    one-token prompt chunks (a prefix-cache hit on the repeated 17-token prompt) counted
    as prefills, graphs; tokens as the torch path's."""
    from kvflow.layers import linear
    from kvflow.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend, "DET_MIN_SPLIT_TOKENS", 64)
    kw = dict(load_format="dummy", max_model_len=96, num_gpu_blocks_override=40,
              block_size=8, max_num_batched_tokens=24, max_num_seqs=16, device="cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 60, 3, 17, 9)]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=6 + i, ignore_eos=True)
              for i in range(len(prompts))]
    ref = LLM("tiny-llama", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny-llama", async_scheduling=True, **kw)
    gpu_like(llm, False)
    r = llm.engine.core.executor.runner
    sb = r.step_builder
    sb.attn_builder = get_attention_backend("triton").metadata_builder(dataclasses.replace(
        r.attn_spec, num_sms=4, deterministic=True, max_model_len=96))
    sb.deterministic = True
    switched, others = linear.use_batch_invariant(r.model)
    assert switched == 2 * 4 + 1 and not others  # qkv, o, gate_up, down per layer; lm_head
    builds = []
    build = sb.build

    def spy(so):
        inputs = build(so)
        builds.append(inputs.meta)
        return inputs

    monkeypatch.setattr(sb, "build", spy)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    again = llm.generate([prompts[3]], params[3], use_tqdm=False)  # cached up to 1 token
    assert again[0].outputs[0].token_ids == ref[3].outputs[0].token_ids
    assert {m.backend.split_tokens for m in builds} == {64}
    assert all(m.backend.num_kv_splits == 2 for m in builds)
    assert max(m.max_seq_len for m in builds) > 64  # a context that spans both ranges
    # some step had a one-token prompt chunk among the prefills
    assert any(1 in [b - a for a, b in zip(m.query_start_loc_cpu[m.num_decodes:],
                                           m.query_start_loc_cpu[m.num_decodes + 1:])]
               for m in builds)
