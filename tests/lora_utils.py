"""Tiny random base models and PEFT adapters for the LoRA tests (tests/test_lora*.py)."""

from __future__ import annotations

import copy

import torch


def save_base(name: str, folder) -> torch.nn.Module:
    """A random float32 transformers model of a tiny preset, saved to ``folder`` (the
    parity tests' builder, unsharded)."""
    from test_models_hf import save_hf_model

    return save_hf_model(name, folder, shard=False)


def save_adapter(base: torch.nn.Module, folder, *, r: int, alpha: float,
                 targets: list[str], seed: int, rslora: bool = False,
                 std: float = 0.15) -> None:
    """A PEFT LoRA adapter of ``base`` with random A and nonzero random B (PEFT starts B
    at zero, which would make every adapter the base model)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                     lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(folder)


def merged(base: torch.nn.Module, folder) -> torch.nn.Module:
    """transformers' model with the adapter merged into its weights (the reference)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).merge_and_unload() \
        .eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens (through its own KV cache)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for i in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        if i + 1 < n:
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens



ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters of different targets, ranks, alpha and scaling (rsLoRA).
THREE_ADAPTERS = {"a": dict(r=8, alpha=16, targets=ALL_TARGETS, seed=1),
                  "b": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=2,
                            rslora=True),
                  "c": dict(r=2, alpha=4, targets=["k_proj", "o_proj", "up_proj"], seed=3)}


def make_adapters(base: torch.nn.Module, folder, specs: dict[str, dict]):
    """Save one PEFT adapter of ``base`` per spec under ``folder``; returns the
    LoRARequests by name (ids from 1) and the merged transformers reference of each
    (``None``: the base itself)."""
    from kvflow import LoRARequest

    loras, refs = {}, {None: base}
    for i, (name, spec) in enumerate(specs.items(), start=1):
        save_adapter(base, folder / name, **spec)
        loras[name] = LoRARequest(name, i, str(folder / name))
        refs[name] = merged(base, folder / name)
    return loras, refs
