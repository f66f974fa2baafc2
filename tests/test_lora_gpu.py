"""Multi-LoRA on a real GPU (marked ``gpu``; CI has none): the Triton shrink/expand
kernels, CUDA-graph decode steps holding adapter rows, and chunked prefill, in float32
(the kernels' IEEE dot), against transformers with each adapter merged. The CPU suite
runs the same paths under the interpreter (tests/gpu_paths/test_lora_gpu_paths.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from lora_utils import THREE_ADAPTERS, hf_greedy, make_adapters, save_base  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

N_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-cuda")
    base = save_base("tiny-llama", d / "base")
    loras, refs = make_adapters(base, d, THREE_ADAPTERS)
    return d, loras, refs


@pytest.mark.parametrize("graphs", [True, False])
def test_mixed_adapters_on_cuda_match_merged(setup, graphs):
    d, loras, refs = setup
    llm = LLM(str(d / "base"), device="cuda", dtype="float32", enable_lora=True,
              max_loras=2, max_cpu_loras=3, max_lora_rank=8, num_gpu_blocks_override=256,
              max_model_len=256, block_size=16, max_num_batched_tokens=32,
              max_num_seqs=8, enforce_eager=not graphs)
    runner = llm.engine.core.executor.runner
    assert (runner.graphs is not None) == graphs
    g = torch.Generator().manual_seed(1)
    names = [None, "a", "b", "c", "a", None, "b"]
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist()
               for n in (5, 41, 17, 29, 9, 60, 3)]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[None if n is None else loras[n] for n in names])
    for p, n, o in zip(prompts, names, outs):
        assert o.outputs[0].token_ids == hf_greedy(refs[n], p, N_TOKENS), n
    assert runner.lora.slots.num_swaps >= 1  # three adapters through two slots
    llm.shutdown()
