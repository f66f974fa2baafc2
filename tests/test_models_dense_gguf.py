"""Gemma 2, Gemma 3 and Phi-3 from GGUF files, against transformers on the safetensors
the files were made from.

The files are written here the way llama.cpp's convert_hf_to_gguf.py writes them
(gguf-py's tensor name map, Gemma's norms stored as 1 + weight, Phi-3's fused
attn_qkv / ffn_up and longrope factors as rope_factors_{long,short} tensors); transformers'
own GGUF reader agrees on the norm shift (Gemma2TensorProcessor subtracts 1), checked
below on the same file.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.models.registry import PRESETS  # noqa: E402

from test_models_dense import check  # noqa: E402
from test_models_hf import save_hf_model  # noqa: E402
from tiny_gguf import add_shape  # noqa: E402

ARCH = {"Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
        "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3, "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3}


def write_gguf(hf, cfg: dict, path: str) -> None:
    arch = ARCH[cfg["architectures"][0]]
    name = gguf.MODEL_ARCH_NAMES[arch]
    gemma = arch != gguf.MODEL_ARCH.PHI3
    w = gguf.GGUFWriter(path, name)
    n = cfg["num_hidden_layers"]
    add_shape(w, cfg, n)
    w.add_sliding_window(cfg["sliding_window"])
    if arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_float32(f"{name}.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        w.add_float32(f"{name}.final_logit_softcapping", cfg["final_logit_softcapping"])
    if arch == gguf.MODEL_ARCH.GEMMA3:
        w.add_uint32(f"{name}.attention.sliding_window_pattern",
                     cfg["sliding_window_pattern"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg["rope_scaling"]["factor"])
    if arch == gguf.MODEL_ARCH.PHI3:
        rope = cfg["rope_scaling"]
        orig = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    names = gguf.get_tensor_name_map(arch, n)
    for hf_name, t in hf.state_dict().items():
        if hf_name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        base = names.get_name(hf_name.removesuffix(".weight"))
        assert base is not None, hf_name
        data = t.float().numpy().copy()
        if gemma and hf_name.endswith("norm.weight"):
            data += 1.0
        w.add_tensor(base + ".weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Gemma 2's query scale is not in GGUF (llama.cpp derives it): head_dim here.
CASES = {"tiny-gemma2": dict(query_pre_attn_scalar=16), "tiny-gemma3": {}, "tiny-phi3": {}}


@pytest.mark.parametrize("preset", sorted(CASES))
def test_gguf_matches_transformers(tmp_path, preset):
    cfg = dict(PRESETS[preset], **CASES[preset])
    PRESETS[f"{preset}-gguf-test"] = cfg
    try:
        hf = save_hf_model(f"{preset}-gguf-test", tmp_path / "hf", shard=False)
    finally:
        del PRESETS[f"{preset}-gguf-test"]
    hf.config._attn_implementation = "eager"
    path = str(tmp_path / "model.gguf")
    write_gguf(hf, cfg, path)
    if preset != "tiny-phi3":  # transformers reads the file back to the same weights
        back = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
        for k, v in hf.state_dict().items():
            torch.testing.assert_close(back.state_dict()[k], v, msg=k)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 29)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    llm = LLM(path, max_model_len=64, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory="16MiB", device="cpu", skip_tokenizer_init=True)
    assert llm.engine.config.model.arch.architecture == cfg["architectures"][0]
    check(hf, prompts, llm.generate(prompts, params, use_tqdm=False))
