"""Tensor parallelism on GPUs (NCCL): TP 2 gives TP 1's greedy tokens with CUDA graphs
(NCCL all-reduces captured inside them) and overlapped steps. Needs two CUDA GPUs."""

from __future__ import annotations

import pytest

from kvflow import LLM
from kvflow.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _two_gpus() -> bool:
    import torch

    return torch.cuda.device_count() >= 2


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_tp2_equals_tp1_on_gpus(model):
    prompts = [[1, 5, 7, 9, 11, 13], [3, 4, 5], list(range(20, 300))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(load_format="dummy", device="cuda", max_model_len=1024, dtype="float32",
              num_gpu_blocks_override=256, skip_tokenizer_init=True)
    with LLM(model, **kw) as one:
        ref = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(model, tensor_parallel_size=2, **kw) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert two.engine.core.executor.runner.graphs is not None  # graphs were captured
    assert got == ref


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs")
def test_pp2_batches_in_flight_equal_tp1_on_gpus():
    """Two pipeline stages on two GPUs with two batches in flight (NCCL point-to-point
    between the stages, sampled ids and logprobs from the last stage): TP 1's tokens."""
    prompts = [[1, 5, 7, 9, 11, 13], [3, 4, 5], list(range(20, 300)), [8, 9], [40, 41]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    kw = dict(load_format="dummy", device="cuda", max_model_len=1024, dtype="float32",
              num_gpu_blocks_override=256, skip_tokenizer_init=True)
    with LLM("tiny-qwen3", **kw) as one:
        ref = [o.outputs[0] for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM("tiny-qwen3", pipeline_parallel_size=2, **kw) as two:
        assert two.engine.core._depth == 2
        got = [o.outputs[0] for o in two.generate(prompts, params, use_tqdm=False)]
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    for r, g in zip(ref, got):
        for lr, lg, tok in zip(r.logprobs, g.logprobs, r.token_ids):
            assert lg[tok].logprob == pytest.approx(lr[tok].logprob, abs=1e-3)
