"""Multi-LoRA against transformers + peft: every adapter's greedy output equals the base
model with that adapter merged (``merge_and_unload``), for batches that mix adapters and
the base model, through chunked prefill, preemption and slot swaps; and the adapter
checks refuse what they must."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from lora_utils import THREE_ADAPTERS, hf_greedy, make_adapters, save_base  # noqa: E402

from kvflow import LLM, InvalidParameterError, SamplingParams  # noqa: E402
from kvflow.lora.adapter import load_adapter  # noqa: E402
from kvflow.lora.config import LoRAConfig  # noqa: E402
from kvflow.lora.memory import lora_slot_bytes  # noqa: E402
from kvflow.models.registry import resolve_model  # noqa: E402

N_TOKENS = 8


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])  # qwen2: QKV bias
def setup(request, tmp_path_factory):
    """A base model, three adapters (different targets, ranks, alpha, rsLoRA) and the
    merged transformers reference of each."""
    d = tmp_path_factory.mktemp(request.param)
    base = save_base(request.param, d / "base")
    loras, refs = make_adapters(base, d, THREE_ADAPTERS)
    return d, loras, refs


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _check(llm, loras, refs, names, lengths):
    prompts = _prompts(lengths)
    reqs = [None if n is None else loras[n] for n in names]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=reqs)
    for p, n, o in zip(prompts, names, outs):
        assert o.outputs[0].token_ids == hf_greedy(refs[n], p, N_TOKENS), n


def test_mixed_batch_chunked_prefill_and_prefix_cache(setup):
    """Base and adapter rows in one step; prompts longer than the token budget are
    prefilled in chunks; the same prompt under different adapters never shares cached
    blocks (a shared prompt would otherwise hit the prefix cache)."""
    d, loras, refs = setup
    llm = LLM(str(d / "base"), enable_lora=True, max_loras=3, max_lora_rank=8,
              kv_cache_memory="32MiB", max_model_len=256, block_size=4,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    _check(llm, loras, refs, [None, "a", "b", "c", "a"], [5, 23, 37, 11, 9])
    # one prompt, four models: cached blocks of one must not serve another
    prompt = _prompts([21], seed=7)[0]
    names = [None, "a", "b", "a"]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    for n in names:
        out = llm.generate([prompt], params, use_tqdm=False,
                           lora_request=None if n is None else loras[n])[0]
        assert out.outputs[0].token_ids == hf_greedy(refs[n], prompt, N_TOKENS), n
    llm.shutdown()


def test_slot_swaps_and_preemption(setup):
    """Two slots for three adapters (the scheduler holds back a fourth adapter's request,
    slots swap by least-recent use), a host cache of two, and a KV cache small enough to
    preempt."""
    d, loras, refs = setup
    llm = LLM(str(d / "base"), enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=8, num_gpu_blocks_override=16, max_model_len=64,
              block_size=4, max_num_batched_tokens=32)
    _check(llm, loras, refs, ["a", "b", None, "c", "b", "a", "c"],
           [19, 17, 15, 21, 18, 16, 20])
    runner = llm.engine.core.executor.runner
    assert runner.lora.slots.num_swaps >= 3  # c had to move in over a or b, and back
    assert llm.engine.core.scheduler.num_preemptions > 0
    # kvflow plan's count of the slots' memory is what the engine allocates
    arch = llm.engine.config.model.arch
    assert runner.lora.slots.num_bytes == lora_slot_bytes(arch, 1, 2, 8, 4)
    llm.shutdown()


def _write(d, cfg: dict | None = None, tensors: dict | None = None):
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return str(d)


def test_bad_adapters_are_refused(tmp_path):
    arch = resolve_model("tiny-llama", "dummy").arch  # hidden 64, q 64, kv 32, mlp 128
    lora = LoRAConfig(max_lora_rank=8)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    ok = {f"{key}.lora_A.weight": torch.randn(4, 64), f"{key}.lora_B.weight": torch.randn(64, 4)}
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    good = load_adapter(_write(tmp_path / "ok", cfg, ok), "ok", 1, arch, lora)
    torch.testing.assert_close(good.weights[(0, "q_proj")][1], ok[f"{key}.lora_B.weight"] * 2)
    cases = {
        "no such directory": (str(tmp_path / "missing"),),
        "missing adapter_model.safetensors": (_write(tmp_path / "nofile", cfg),),
        "peft_type IA3": (_write(tmp_path / "ia3", {**cfg, "peft_type": "IA3"}, ok),),
        "DoRA": (_write(tmp_path / "dora", {**cfg, "use_dora": True}, ok),),
        "target modules ['embed_tokens']": (_write(
            tmp_path / "emb", {**cfg, "target_modules": ["q_proj", "embed_tokens"]}, ok),),
        "rank 16": (_write(tmp_path / "big", cfg, {
            f"{key}.lora_A.weight": torch.randn(16, 64),
            f"{key}.lora_B.weight": torch.randn(64, 16)}),),
        "do not fit the base layer": (_write(tmp_path / "shape", cfg, {
            f"{key}.lora_A.weight": torch.randn(4, 96),
            f"{key}.lora_B.weight": torch.randn(64, 4)}),),
        "layer 5": (_write(tmp_path / "deep", cfg, {
            k.replace("layers.0", "layers.5"): v for k, v in ok.items()}),),
        "lora_B missing": (_write(tmp_path / "half", cfg,
                                  {f"{key}.lora_A.weight": torch.randn(4, 64)}),),
    }
    for want, (path,) in cases.items():
        with pytest.raises(InvalidParameterError, match=want.replace("[", r"\[")
                           .replace("]", r"\]")):
            load_adapter(path, "x", 1, arch, lora)


def test_lora_requests_need_enable_lora(setup):
    d, loras, _ = setup
    llm = LLM(str(d / "base"), kv_cache_memory="16MiB", max_model_len=64)
    with pytest.raises(InvalidParameterError, match="--enable-lora"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=loras["a"])
    llm.shutdown()
