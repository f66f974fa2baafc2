"""Multi-LoRA on the GPU path, run on the CPU: the Triton shrink/expand kernels (under
the interpreter) replace the grouped matmuls, with the Triton attention, the device block
table and (second case) the CUDA-graph runner's static buffers, graph capture replaced by
eager calls on the same buffers, so decode steps with adapter rows replay the graphs.
Greedy tokens of every adapter and of the base, in one mixed batch, must equal
transformers with that adapter merged (what the torch path is held to in test_lora.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the LoRA helpers

from lora_utils import hf_greedy, merged, save_adapter, save_base  # noqa: E402
from test_gpu_plumbing import EagerGraph, EagerVerifyGraph, gpu_like  # noqa: E402

from kvflow import LLM, LoRARequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the real GPU runs these paths in the lora bench")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_TOKENS = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-gpu")
    base = save_base("tiny-llama", d / "base")
    # ranks 8 and 4 in slots of rank 8; qkv/gate_up merged slices with and without B
    specs = {"a": dict(r=8, alpha=16, targets=ALL, seed=1),
             "b": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "up_proj", "down_proj"],
                       seed=2, rslora=True)}
    loras, refs = {}, {None: base}
    for i, (name, spec) in enumerate(specs.items(), start=1):
        save_adapter(base, d / name, **spec)
        loras[name] = LoRARequest(name, i, str(d / name))
        refs[name] = merged(base, d / name)
    return d, loras, refs


@pytest.mark.parametrize("graphs", [False])
def test_lora_kernels_match_merged_reference(setup, graphs, monkeypatch):
    import kvflow.kernels.lora as kernels

    launches = []
    shrink = kernels.lora_shrink
    monkeypatch.setattr(kernels, "lora_shrink",
                        lambda x, *a, **k: launches.append(x.shape[0]) or shrink(x, *a, **k))
    d, loras, refs = setup
    llm = LLM(str(d / "base"), enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks_override=40, max_model_len=96, block_size=8,
              max_num_batched_tokens=24, max_num_seqs=8, async_scheduling=graphs)
    gpu_like(llm, graphs)
    runner = llm.engine.core.executor.runner
    runner.lora.kernels = True
    assert runner.lora.graph_tokens == (8 if graphs else 0)
    g = torch.Generator().manual_seed(4)
    names = ["a", None, "b", "a", "b"]
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 20, 3, 12)]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    EagerGraph.replays = EagerVerifyGraph.replays = 0
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[None if n is None else loras[n] for n in names])
    for p, n, o in zip(prompts, names, outs):
        assert o.outputs[0].token_ids == hf_greedy(refs[n], p, N_TOKENS), n
    # the kernels, not the grouped matmuls, on prefill and on decode steps (5 rows, or
    # the 8 of the graph that holds them)
    assert max(launches) == 24 and min(launches) <= 8
    if graphs:  # decode steps of mixed adapters went through the graphs
        assert EagerGraph.replays >= N_TOKENS - 1
    llm.shutdown()
