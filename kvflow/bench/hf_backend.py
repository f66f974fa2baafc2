"""The peer: Hugging Face transformers ``generate`` on the same model and requests, in
padded static batches — the way people run a model without a serving engine."""

from __future__ import annotations

import os
import time

import torch

from kvflow.bench.datasets import BenchRequest
from kvflow.errors import InvalidParameterError
from kvflow.models.registry import PRESETS, resolve_model

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                "Phi3ForCausalLM": "phi3",
                "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                "Qwen3MoeForCausalLM": "qwen3_moe"}


def load_hf_model(model: str, load_format: str, dtype: torch.dtype, device: str, seed: int = 0):
    """The same model in transformers: a HF directory, the GGUF file (transformers'
    own dequantizing loader), or a preset's shape with random weights."""
    try:
        import transformers
    except ImportError:
        raise InvalidParameterError("--backend hf needs transformers: pip install "
                                    "transformers accelerate") from None
    resolved = resolve_model(model, load_format)
    if resolved.load_format == "dummy":
        if model not in PRESETS:
            raise InvalidParameterError(f"dummy weights need a preset name, got {model!r}")
        cfg = dict(PRESETS[model])
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        config = transformers.AutoConfig.for_model(
            _MODEL_TYPES[cfg["architectures"][0]], **cfg)
        torch.manual_seed(seed)
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif resolved.load_format == "gguf":
        folder, name = os.path.split(resolved.path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                               dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(resolved.path, dtype=dtype)
    return hf.to(device).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def hf_generate_batch(hf, batch: list[list[int]], max_new_tokens: int, device: str,
                      temperature: float = 0.0, cache_implementation: str | None = None
                      ) -> list[list[int]]:
    """Left-padded batch, exactly ``max_new_tokens`` new tokens for every row."""
    from transformers import GenerationConfig

    pad = 0
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                           do_sample=temperature > 0, temperature=temperature or None,
                           top_p=None, top_k=None, pad_token_id=pad, eos_token_id=None,
                           cache_implementation=cache_implementation)
    out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                      generation_config=gen)
    return out[:, width:].tolist()


def run_hf_throughput(hf, requests: list[BenchRequest], batch_size: int, device: str,
                      temperature: float = 0.0) -> float:
    """Seconds to serve every request in static batches of ``batch_size`` (in order)."""
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        chunk = requests[i: i + batch_size]
        hf_generate_batch(hf, [r.prompt_token_ids for r in chunk],
                          max(r.output_len for r in chunk), device, temperature)
    _sync(device)
    return time.perf_counter() - start
