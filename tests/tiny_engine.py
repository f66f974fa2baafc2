"""Helpers shared by the CPU decode-step tests (test_cpu_step.py, test_cpu_compile.py):
a tiny random-weight engine, random prompts, greedy outputs, the engine's model runner."""

from __future__ import annotations

import torch

from kvflow import LLM, SamplingParams


def tiny(model: str = "tiny-llama", **kw) -> LLM:
    args = dict(load_format="dummy", max_model_len=256, num_gpu_blocks_override=64,
                block_size=4, max_num_batched_tokens=32, device="cpu")
    args.update(kw)
    return LLM(model, **args)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def runner(llm: LLM):
    return llm.engine.core.executor.runner


def greedy(llm: LLM, prompt_ids, max_tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]
