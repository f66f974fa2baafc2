"""Acceptance: greedy output equals Hugging Face transformers token for token on the real
SmolLM2-135M-Instruct (float32 dequantized: --quantization none; CPU), 8 chat prompts x 64 tokens — each prompt alone, and
all together with chunked prefill and a KV cache small enough to force preemption."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.models.registry import embedded_model_path  # noqa: E402
from kvflow.cpu.step import CppDecodeStep, find_compiler  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain what a hash table is to a beginner.",
    "List three benefits of regular exercise.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the ocean salty?",
    "Give me a recipe idea that uses eggs and spinach.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    tok = smollm2.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                       add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids):
    path = embedded_model_path("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                             dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, top_p=None,
                              top_k=None, temperature=None)
            gen = out[0, len(ids):].tolist()
            outs.append(gen)
    return outs


def _trim(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def test_each_prompt_alone(smollm2, prompt_ids, hf_greedy):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    eos = set(smollm2.engine.processor.eos_token_ids)
    for ids, ref in zip(prompt_ids, hf_greedy):
        out = smollm2.generate([ids], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == _trim(ref, eos)


def test_all_together_chunked_with_preemption(prompt_ids, hf_greedy):
    # 24 blocks of 16 tokens hold 384 tokens; the 8 requests need ~870 at their longest.
    llm = LLM("smollm2-135m", device="cpu", max_model_len=256, num_gpu_blocks_override=24,
              max_num_batched_tokens=48, max_num_seqs=8, quantization="none")
    if find_compiler() is not None:  # decodes and short chunks run in the C++ step
        assert isinstance(llm.engine.core.executor.runner.graphs, CppDecodeStep)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out, ref in zip(outs, hf_greedy):
        assert out.outputs[0].token_ids[: len(ref)] == ref
    text = llm.get_tokenizer().decode(outs[0].outputs[0].token_ids)
    assert "Paris" in text


def _compiled_llm(monkeypatch, **kw) -> LLM:
    """The real model with the compiled CPU decode step on (the suite turns it off)."""
    monkeypatch.setenv("KVFLOW_CPU_COMPILE", "1")
    # Dense fp32, as HF runs it: the GGUF-quantized default computes in bf16.
    llm = LLM("smollm2-135m", device="cpu", quantization="none", **kw)
    assert llm.engine.core.executor.runner.graphs is not None
    return llm


def test_compiled_step_matches_hf_short(monkeypatch, prompt_ids, hf_greedy):
    """CI's short version: three prompts batched, 16 tokens each."""
    llm = _compiled_llm(monkeypatch, max_model_len=256, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompt_ids[:3], params, use_tqdm=False)
    for out, ref in zip(outs, hf_greedy):
        assert out.outputs[0].token_ids[: len(ref[:16])] == ref[:16]


@pytest.mark.slow
def test_compiled_step_all_together_chunked_with_preemption(monkeypatch, prompt_ids,
                                                            hf_greedy):
    llm = _compiled_llm(monkeypatch, max_model_len=256, num_gpu_blocks_override=24,
                        max_num_batched_tokens=48, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out, ref in zip(outs, hf_greedy):
        assert out.outputs[0].token_ids[: len(ref)] == ref
