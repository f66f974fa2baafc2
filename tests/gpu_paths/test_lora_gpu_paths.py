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

from lora_utils import ALL_TARGETS, hf_greedy, make_adapters, save_base  # noqa: E402
from test_gpu_plumbing import EagerGraph, EagerVerifyGraph, gpu_like  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the real GPU runs these paths in the lora bench")

N_TOKENS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-gpu")
    base = save_base("tiny-llama", d / "base")
    # ranks 8 and 4 in slots of rank 8; qkv/gate_up merged slices with and without B
    specs = {"a": dict(r=8, alpha=16, targets=ALL_TARGETS, seed=1),
             "b": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "up_proj", "down_proj"],
                       seed=2, rslora=True)}
    loras, refs = make_adapters(base, d, specs)
    return d, loras, refs


def test_lora_kernels_match_merged_reference(setup, monkeypatch):
    """Prefill chunks run eager with the kernels; decode steps replay the graphs (the
    interpreter's cost allows one run: the graphs-off eager decode is the same kernels
    as the prefill's, with fewer rows)."""
    import kvflow.kernels.lora as kernels

    launches = []
    shrink = kernels.lora_shrink
    monkeypatch.setattr(kernels, "lora_shrink",
                        lambda x, *a, **k: launches.append(x.shape[0]) or shrink(x, *a, **k))
    d, loras, refs = setup
    llm = LLM(str(d / "base"), enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks_override=40, max_model_len=96, block_size=8,
              max_num_batched_tokens=24, max_num_seqs=4, async_scheduling=True)
    gpu_like(llm, graphs=True)
    runner = llm.engine.core.executor.runner
    assert runner.lora.graph_tokens == 4  # the graphs hold the kernels
    g = torch.Generator().manual_seed(4)
    names = ["a", None, "b", "a"]
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 14, 3)]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    EagerGraph.replays = EagerVerifyGraph.replays = 0
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[None if n is None else loras[n] for n in names])
    for p, n, o in zip(prompts, names, outs):
        assert o.outputs[0].token_ids == hf_greedy(refs[n], p, N_TOKENS), n
    # the kernels, not the grouped matmuls, on prefill and on decode steps (4 rows)
    assert max(launches) == 24 and 4 in launches
    assert EagerGraph.replays >= N_TOKENS - 1  # mixed-adapter decode steps: graphs
    # base-only steps replay the same graphs: the last adapter step's tiles must be gone
    replays = EagerGraph.replays
    out = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(refs[None], prompts[0], N_TOKENS)
    assert EagerGraph.replays > replays
    llm.shutdown()
