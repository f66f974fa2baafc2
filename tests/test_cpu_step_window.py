"""The C++ CPU step on windowed, soft-capped and own-rotary attention (Mistral with a
window, Phi-3, Gemma 2, Gemma 3): the same greedy tokens as transformers (float32) and
as the eager path, prompts past the window, batched, prefills chunked by a 16-token
budget; every step runs in C++ (no silent eager fallback), and no step reads a block
the KV cache manager gave back behind the window (they are filled with NaN first)."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.cpu import step as cpu_step  # noqa: E402

from test_models_hf import save_hf_model  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_step.find_compiler() is None,
                                reason="no C++ compiler to build the step with")

PROMPT_LENS = (5, 23, 37, 30)  # windows are 8 (Mistral, Gemma) and 12 (Phi-3)
MAX_TOKENS = 10


def _engine(path, **kw) -> LLM:
    args = dict(max_model_len=64, block_size=4, max_num_batched_tokens=16,
                num_gpu_blocks_override=64, enable_prefix_caching=False, device="cpu")
    return LLM(str(path), **(args | kw))


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _poison_free_blocks(llm: LLM, step: cpu_step.CppDecodeStep) -> dict[str, int]:
    """Before every C++ step, NaN into every block the pool holds free (those given back
    behind the window among them): a step that read one would turn its tokens to NaN.
    Counts the C++ steps, and those with a prefill chunk."""
    calls = {"cpp": 0, "mixed": 0}
    pool = llm.engine.core.scheduler.kv.pool
    caches = llm.engine.core.executor.runner.kv_caches  # [L, 2, NB, BS, KVH, D]
    run = step.run

    def poisoned(inputs):
        free = torch.tensor([b.block_id for b in pool.free_queue], dtype=torch.int64)
        caches[:, :, free] = float("nan")
        calls["cpp"] += 1
        calls["mixed"] += inputs.meta.num_decodes != inputs.meta.num_reqs
        return run(inputs)
    step.run = poisoned
    return calls


def _check_transformers(hf, prompts, outs) -> None:
    """Each greedy token is transformers' argmax (unless its top two nearly tie)."""
    for prompt, out in zip(prompts, outs):
        seq = prompt + out
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0].float()  # [L, V]
        for j, tok in enumerate(out):
            row = logits[len(prompt) - 1 + j]
            top2 = row.topk(2).values
            if top2[0] - top2[1] > 1e-3:
                assert tok == int(row.argmax()), (j, tok, int(row.argmax()))


@pytest.mark.parametrize("name", ["tiny-mistral-window", "tiny-phi3", "tiny-gemma2",
                                  "tiny-gemma3"])
def test_windowed_models_run_in_cpp(tmp_path, name, caplog):
    hf = save_hf_model(name, tmp_path, shard=False)
    hf.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
    eager = _greedy(_engine(tmp_path, enforce_eager=True), prompts)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _engine(tmp_path)
    step = llm.engine.core.executor.runner.graphs
    assert isinstance(step, cpu_step.CppDecodeStep), caplog.text
    assert "C++ CPU decode step:" in caplog.text
    calls = _poison_free_blocks(llm, step)
    got = _greedy(llm, prompts)
    assert got == eager
    _check_transformers(hf, prompts, got)
    # Every step ran in C++: the prefill chunks (16-token budget) and every decode.
    assert calls["mixed"] > 0 and calls["cpp"] >= MAX_TOKENS + sum(PROMPT_LENS) // 16
    freed = llm.engine.core.scheduler.kv.num_window_freed
    assert (freed > 0) == (name in ("tiny-mistral-window", "tiny-phi3"))


def test_the_step_needs_the_window(tmp_path, monkeypatch):
    """The test above could not pass with the C++ step ignoring the window: built with
    windows of 0 (none), it runs (its self-check's contexts then fit in the window) and
    its tokens part from eager's past the window."""
    save_hf_model("tiny-mistral-window", tmp_path, shard=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
    eager = _greedy(_engine(tmp_path, enforce_eager=True), prompts)
    real = cpu_step.stack_args

    def unwindowed(model):
        args = real(model)
        args.windows = [0] * len(args.windows)
        return args
    monkeypatch.setattr(cpu_step, "stack_args", unwindowed)
    llm = _engine(tmp_path)
    assert isinstance(llm.engine.core.executor.runner.graphs, cpu_step.CppDecodeStep)
    assert _greedy(llm, prompts) != eager


def test_a_request_longer_than_the_cache_runs_in_its_window(tmp_path):
    """Window-aware admission through the public entry: a 37-token prompt plus 10 tokens
    needs 12 blocks of 4, the cache has 6; every layer's window is 8 and steps take 8
    tokens, so it holds at most 5 blocks at a time. It is admitted and its tokens equal
    those of an engine whose cache holds it whole."""
    hf = save_hf_model("tiny-mistral-window", tmp_path, shard=False)
    prompt = [list(range(3, 40))]
    want = _greedy(_engine(tmp_path, max_num_batched_tokens=8), prompt)
    small = _engine(tmp_path, max_num_batched_tokens=8, num_gpu_blocks_override=6)
    assert _greedy(small, prompt) == want
    del hf
