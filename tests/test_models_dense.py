"""Windowed Mistral, Gemma 2, Gemma 3 and Phi-3 against transformers on the same random
weights (float32 on CPU), prompts longer than the window (8 or 12 tokens), batched with
chunked prefill (16-token steps) in a cache small enough to preempt.

Gemma 2 covers soft-capped scores and logits and alternating local/global layers; Gemma 3
q/k norms, a local rope base beside a linearly scaled global one, and a 2:1 pattern;
Phi-3 its fused qkv/gate_up checkpoint, a window and longrope's short factors.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.config import ModelArchConfig  # noqa: E402
from kvflow.errors import InvalidParameterError, ModelLoadError  # noqa: E402
from kvflow.models.registry import PRESETS, resolve_model  # noqa: E402

from test_models_hf import save_hf_model  # noqa: E402

PROMPT_LENS = (5, 23, 37)
MAX_TOKENS = 10


def reference(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].float().log_softmax(-1)  # [L, V]


def check(hf, prompts, outs) -> None:
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.outputs[0].token_ids
        ref = reference(hf, seq)
        got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        want = [ref[i, seq[i + 1]].item() for i in range(len(prompt) - 1)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-4, rtol=0)
        for j, tok in enumerate(out.outputs[0].token_ids):
            pos = len(prompt) - 1 + j
            assert abs(out.outputs[0].logprobs[j][tok].logprob - ref[pos, tok].item()) < 2e-4
            top2 = ref[pos].topk(2).values
            if top2[0] - top2[1] > 1e-3:
                assert tok == int(ref[pos].argmax())


@pytest.mark.parametrize("name", ["tiny-mistral-window", "tiny-gemma2", "tiny-gemma3",
                                  "tiny-phi3"])
def test_matches_transformers_past_the_window(tmp_path, name):
    hf = save_hf_model(name, tmp_path, shard=name == "tiny-phi3")
    hf.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS * 2]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    # All 6 in 16 blocks of 4 (one max_model_len): they preempt each other even where
    # blocks behind the window are freed.
    llm = LLM(str(tmp_path), max_model_len=64, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory="16MiB", num_gpu_blocks_override=16, device="cpu")
    check(hf, prompts, llm.generate(prompts, params, use_tqdm=False))
    sched = llm.engine.core.scheduler
    assert sched.num_preemptions > 0
    # Every layer windowed (Mistral, Phi-3): blocks behind the window are given back.
    assert (sched.kv.num_window_freed > 0) == (name in ("tiny-mistral-window", "tiny-phi3"))


def test_the_window_changes_the_result(tmp_path):
    """The parity above could not pass with the window ignored: past it, transformers'
    logits with and without the window differ."""
    hf = save_hf_model("tiny-mistral-window", tmp_path, shard=False)
    seq = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    windowed = reference(hf, seq)
    hf.config.sliding_window = None
    full = reference(hf, seq)
    assert torch.allclose(windowed[:8], full[:8], atol=1e-5)
    assert (windowed[8:] - full[8:]).abs().max() > 1e-2


def test_config_reading():
    gemma3 = ModelArchConfig.from_hf_config(PRESETS["tiny-gemma3"])
    assert gemma3.layer_windows == (8, 8, None) and gemma3.qk_norm
    assert gemma3.rope_local_base_freq == 10000.0
    assert ModelArchConfig.from_hf_config(PRESETS["tiny-gemma2"]).layer_windows == (8, None)
    # Qwen2 configs carry a window they do not use unless use_sliding_window is set
    qwen = dict(PRESETS["tiny-qwen2"], sliding_window=4, max_window_layers=1)
    assert ModelArchConfig.from_hf_config(qwen).sliding_window is None
    on = ModelArchConfig.from_hf_config(dict(qwen, use_sliding_window=True))
    assert on.layer_windows == (None, 4)
    assert resolve_model("tiny-gemma3", "dummy").arch.architecture == "Gemma3ForCausalLM"


@pytest.mark.parametrize("change,field", [
    (dict(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "rope_scaling.rope_type"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(hidden_act="relu"), "hidden_act"),
])
def test_fields_kvflow_cannot_honour_are_refused(change, field):
    cfg = dict(PRESETS["tiny-mistral-window"], **change)
    with pytest.raises(InvalidParameterError, match=field.replace(".", r"\.")):
        ModelArchConfig.from_hf_config(cfg)


def test_unknown_architecture_is_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(
        dict(PRESETS["tiny-llama"], architectures=["FalconForCausalLM"])))
    with pytest.raises(ModelLoadError, match="FalconForCausalLM is not supported"):
        resolve_model(str(tmp_path))
