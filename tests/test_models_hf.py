"""Every architecture against Hugging Face transformers on the same random weights.

Each tiny preset is built in transformers, saved as a Hugging Face directory
(safetensors, sharded for one of them) and loaded by kvflow from that directory.
kvflow's prompt logprobs (prefill) and the logprobs of its greedy tokens (decode through
the paged cache) must equal transformers' log-softmax over the same sequence.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.bench.hf_backend import _MODEL_TYPES  # noqa: E402
from kvflow.models.registry import PRESETS  # noqa: E402


def save_hf_model(name: str, folder, shard: bool) -> torch.nn.Module:
    cfg = dict(PRESETS[name])
    config = transformers.AutoConfig.for_model(_MODEL_TYPES[cfg["architectures"][0]], **cfg)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF's init is too flat for greedy tokens to be meaningful
        for n, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif "bias" in n:
                p.normal_(0, 0.1)
    hf.save_pretrained(folder, max_shard_size="100KB" if shard else "10GB")
    return hf


@pytest.mark.parametrize("name,shard", [("tiny-llama", False), ("tiny-qwen2", True),
                                        ("tiny-qwen3", False)])
def test_logprobs_match_transformers(tmp_path, name, shard):
    hf = save_hf_model(name, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), kv_cache_memory="64MiB", max_model_len=512, block_size=4,
              max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 23, 37)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float().log_softmax(-1)  # [L, V]
        # Prefill: logprob of each prompt token given its prefix.
        got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        want = [ref[i, seq[i + 1]].item() for i in range(len(prompt) - 1)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-4, rtol=0)
        # Decode: each greedy token is transformers' argmax and has the same logprob.
        for j, tok in enumerate(out.outputs[0].token_ids):
            pos = len(prompt) - 1 + j
            lp = out.outputs[0].logprobs[j][tok].logprob
            assert abs(lp - ref[pos, tok].item()) < 2e-4
            top2 = ref[pos].topk(2).values
            if top2[0] - top2[1] > 1e-3:
                assert tok == int(ref[pos].argmax())
