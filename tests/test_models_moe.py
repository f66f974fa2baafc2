"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers on the same random weights.

Each tiny preset is built in transformers (per-expert checkpoint tensors, one folder
sharded), loaded by kvflow from the saved folder, and run batched with chunked prefill
(a 16-token budget splits the longer prompts): prompt logprobs and the logprobs of the
greedy tokens must equal transformers' log-softmax over the same sequence. The quantized
experts (int8 / int4 round to nearest) are checked against the dense model's tokens.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.bench.hf_backend import _MODEL_TYPES  # noqa: E402
from kvflow.config import ModelArchConfig  # noqa: E402
from kvflow.errors import InvalidParameterError  # noqa: E402
from kvflow.models.registry import PRESETS  # noqa: E402


def save_hf_model(name: str, folder, shard: bool = False, **extra) -> torch.nn.Module:
    cfg = {**PRESETS[name], **extra}
    config = transformers.AutoConfig.for_model(_MODEL_TYPES[cfg["architectures"][0]], **cfg)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF's init is too flat for greedy tokens (and routing) to matter
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.2 if p.dim() >= 2 else 0.1)
    hf.save_pretrained(folder, max_shard_size="100KB" if shard else "10GB")
    return hf


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 23, 37)]


PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0,
                        prompt_logprobs=0)


YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 16}}


@pytest.mark.parametrize("name,shard,extra", [
    ("tiny-mixtral", False, {}), ("tiny-qwen2-moe", True, {}), ("tiny-qwen3-moe", False, {}),
    ("tiny-qwen3-moe", False, YARN)], ids=["mixtral", "qwen2-moe", "qwen3-moe", "qwen3-moe-yarn"])
def test_moe_logprobs_match_transformers(tmp_path, name, shard, extra):
    """(The YaRN case: the MoE models take the config's rope scaling too.)"""
    hf = save_hf_model(name, tmp_path, shard, **extra)
    llm = LLM(str(tmp_path), kv_cache_memory="64MiB", max_model_len=512, block_size=4,
              max_num_batched_tokens=16)
    ps = prompts()
    outs = llm.generate(ps, PARAMS, use_tqdm=False)
    for prompt, out in zip(ps, outs):
        seq = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float().log_softmax(-1)  # [L, V]
        got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        want = [ref[i, seq[i + 1]].item() for i in range(len(prompt) - 1)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-4, rtol=0)
        for j, tok in enumerate(out.outputs[0].token_ids):
            pos = len(prompt) - 1 + j
            assert abs(out.outputs[0].logprobs[j][tok].logprob - ref[pos, tok].item()) < 2e-4
            top2 = ref[pos].topk(2).values
            if top2[0] - top2[1] > 1e-3:
                assert tok == int(ref[pos].argmax())
    if name == "tiny-qwen3-moe" and not extra:  # quantized experts on the same folder
        dense = [o.outputs[0].token_ids for o in outs]
        del llm
        for method, min_agree in (("int8", 0.9), ("int4", 0.5)):
            q = LLM(str(tmp_path), kv_cache_memory="64MiB", max_model_len=512,
                    block_size=4, quantization=method, lm_head_quantization="none")
            toks = [o.outputs[0].token_ids for o in q.generate(ps, PARAMS, use_tqdm=False)]
            first = sum(a[0] == b[0] for a, b in zip(toks, dense))
            assert first >= len(ps) * min_agree, (method, toks, dense)
            del q


def test_moe_config_fields():
    arch = ModelArchConfig.from_hf_config(PRESETS["tiny-qwen2-moe"])
    assert arch.num_experts == 8 and arch.num_experts_per_tok == 3
    assert arch.shared_expert_intermediate_size == 48 and not arch.norm_topk_prob
    assert [arch.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert arch.attention_bias  # Qwen2-MoE's qkv_bias
    q3 = ModelArchConfig.from_hf_config(PRESETS["tiny-qwen3-moe"])
    assert [q3.is_moe_layer(i) for i in range(3)] == [False, True, False]
    assert q3.qk_norm and q3.norm_topk_prob
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
    saved = {k: v for k, v in PRESETS["tiny-qwen3-moe"].items() if k != "num_experts"}
    assert ModelArchConfig.from_hf_config({**saved, "num_local_experts": 8}).num_experts == 8
    big = ModelArchConfig.from_hf_config(PRESETS["qwen3-30b-a3b"])
    assert 30.0e9 < big.num_params < 31.0e9 and 3.0e9 < big.num_active_params < 3.5e9
    mix = ModelArchConfig.from_hf_config(PRESETS["mixtral-8x7b"])
    assert 46.0e9 < mix.num_params < 47.5e9 and 12.5e9 < mix.num_active_params < 13.2e9


@pytest.mark.parametrize("field,value", [("scoring_func", "sparsemax"), ("n_group", 8),
                                         ("topk_method", "noaux_tc"),
                                         ("num_experts_per_tok", 9)])
def test_unknown_router_options_refused(field, value):
    cfg = dict(PRESETS["tiny-qwen3-moe"], **{field: value})
    with pytest.raises(InvalidParameterError, match=field):
        ModelArchConfig.from_hf_config(cfg)


def test_plan_counts_active_experts():
    from kvflow.plan.model import ShardedModel

    arch = ModelArchConfig.from_hf_config(PRESETS["qwen3-30b-a3b"])
    one = ShardedModel(arch, 1, "bfloat16", "bfloat16")
    assert one.num_params == arch.num_params
    # batch 1 reads the active parameters (all but the input embedding table)
    emb = arch.vocab_size * arch.hidden_size
    assert one.weight_read_bytes(1) == pytest.approx(2 * (arch.num_active_params - emb),
                                                     rel=1e-6)
    reads = [one.weight_read_bytes(b) for b in (1, 8, 64, 4096)]
    assert reads == sorted(reads) and reads[-1] == pytest.approx(one.weight_read_bytes(0))
    two = ShardedModel(arch, 2, "bfloat16", "bfloat16")
    experts = 48 * 128 * 3 * arch.hidden_size * arch.moe_intermediate_size
    assert one.num_params - two.num_params > experts // 2  # experts split over the GPUs
