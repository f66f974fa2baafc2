"""GPU: windowed, soft-capped and own-rotary layers through the Triton backend, with CUDA
graphs on and off, against transformers on the same random weights (float32).

Mistral v0.1 (every layer windowed: blocks behind the window are freed, so the kernels
must start at the window), Gemma 2 (soft cap, local/global layers), Gemma 3 (local layers
with their own rotary table) and Phi-3 (a window of 12, longrope), all with windows
smaller than the 16-token cache block and prompts well past them, batched with chunked
prefill (32-token steps). Before issue 31 these models ran attention in a per-request
Python loop with CUDA graphs off.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

transformers = pytest.importorskip("transformers")

from kvflow import LLM, SamplingParams  # noqa: E402

from test_models_hf import save_hf_model  # noqa: E402

PROMPT_LENS = (5, 23, 37, 70)
MAX_TOKENS = 24
TOL = 2e-3  # float32 end to end; the GPU's reductions differ in order from the CPU's


@pytest.mark.parametrize("name", ["tiny-mistral-window", "tiny-gemma2", "tiny-gemma3",
                                  "tiny-phi3"])
def test_windowed_models_graphs_match_eager_and_transformers(tmp_path, name):
    hf = save_hf_model(name, tmp_path, shard=False)
    hf.config._attn_implementation = "eager"
    hf = hf.cuda()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    results = {}
    for mode in ("graphs", "eager"):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=256,
                  block_size=16, max_num_batched_tokens=32, kv_cache_memory="64MiB",
                  enforce_eager=mode == "eager")
        runner = llm.engine.core.executor.runner
        assert (runner.graphs is not None) == (mode == "graphs"), mode
        assert runner.use_kernels  # the Triton attention backend
        results[mode] = llm.generate(prompts, params, use_tqdm=False)
        del llm
        torch.cuda.empty_cache()
    for prompt, a, b in zip(prompts, results["graphs"], results["eager"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        seq = prompt + a.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([seq], device="cuda")).logits[0].float().log_softmax(-1)
        ref = ref.cpu()
        for out in (a, b):
            got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
            want = [ref[i, seq[i + 1]].item() for i in range(len(prompt) - 1)]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOL,
                                       rtol=0)
            for j, tok in enumerate(out.outputs[0].token_ids):
                pos = len(prompt) - 1 + j
                assert abs(out.outputs[0].logprobs[j][tok].logprob - ref[pos, tok].item()) < TOL
                top2 = ref[pos].topk(2).values
                if top2[0] - top2[1] > 1e-2:
                    assert tok == int(ref[pos].argmax())
