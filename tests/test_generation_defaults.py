"""Generation defaults: the model's recommended sampling settings fill the fields a request
leaves out (explicit values win), from generation_config.json, GGUF metadata or the
registry entry of the embedded model; --generation-config and --max-tokens-default."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

from kvflow.engine.args import EngineArgs
from kvflow.engine.processor import InputProcessor
from kvflow.errors import InvalidParameterError, ModelLoadError, ModelNotFoundError
from kvflow.models.gguf_file import gguf_sampling_defaults
from kvflow.models.registry import PRESETS, resolve_model
from kvflow.sampling_params import SamplingParams


def hf_dir(tmp_path, generation: dict | None):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny-llama"]))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_unset_fields_take_defaults_and_explicit_values_win():
    p = SamplingParams(top_p=0.5, max_tokens=8)
    assert p.temperature == 1.0 and p.defaulted == {"temperature", "top_k", "min_p",
                                                    "repetition_penalty"}
    q = p.with_defaults({"temperature": 0.2, "top_p": 0.9, "top_k": 40})
    assert (q.temperature, q.top_p, q.top_k, q.max_tokens) == (0.2, 0.5, 40, 8)
    assert q.defaulted == {"min_p", "repetition_penalty"}
    assert p.with_defaults({}) is p
    # An explicit value equal to the neutral one is still explicit.
    assert SamplingParams(temperature=1.0).with_defaults({"temperature": 0.2}).temperature == 1.0
    # Greedy stays greedy: the default filters cannot come back behind it.
    g = SamplingParams(temperature=0).with_defaults({"top_p": 0.9, "top_k": 5})
    assert g.greedy and (g.top_p, g.top_k) == (1.0, 0)
    # Clones keep what was unset; copies across the IPC boundary keep their values.
    assert p.clone(n=2).defaulted == p.defaulted
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(q), type=SamplingParams)
    assert (back.temperature, back.top_p, back.top_k) == (0.2, 0.5, 40)


def test_embedded_model_uses_its_registry_entry():
    cfg = EngineArgs().create_engine_config().model
    assert dict(cfg.generation_defaults) == {"temperature": 0.2, "top_p": 0.9}
    assert "registry" in cfg.generation_source and "SmolLM2" in cfg.generation_source
    assert "temperature=0.2" in cfg.generation_defaults_line()
    none = EngineArgs(generation_config="none").create_engine_config().model
    assert none.generation_defaults == () and none.generation_source == "none"
    assert "none (temperature 1.0" in none.generation_defaults_line()


def test_hf_generation_config(tmp_path):
    path = hf_dir(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                             "max_new_tokens": 99, "do_sample": True, "eos_token_id": 2})
    r = resolve_model(path)
    assert r.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert r.generation_source.endswith("generation_config.json")
    cfg = EngineArgs(model=path, load_format="dummy").create_engine_config().model
    assert dict(cfg.generation_defaults)["temperature"] == 0.6


def test_hf_do_sample_false_is_greedy(tmp_path):
    r = resolve_model(hf_dir(tmp_path, {"do_sample": False, "temperature": 0.7}))
    assert r.generation_defaults["temperature"] == 0.0


def test_hf_dir_without_generation_config(tmp_path):
    r = resolve_model(hf_dir(tmp_path, None))
    assert r.generation_defaults == {} and r.generation_source == "none"


def test_generation_config_path_and_errors(tmp_path):
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    for choice in (str(gen), str(gen / "generation_config.json")):
        cfg = EngineArgs(generation_config=choice).create_engine_config().model
        assert dict(cfg.generation_defaults) == {"temperature": 0.3}
        assert cfg.generation_source == str(gen / "generation_config.json")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        EngineArgs(generation_config=str(tmp_path / "nope")).create_engine_config()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ModelLoadError, match="temperature must be a number"):
        EngineArgs(generation_config=str(gen)).create_engine_config()
    (gen / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(InvalidParameterError, match="top_p"):
        EngineArgs(generation_config=str(gen)).create_engine_config()


def test_gguf_sampling_metadata():
    class Header:
        fields = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40,
                  "general.sampling.penalty_repeat": 1.1}

        def field(self, key, default=None):
            return self.fields.get(key, default)

    assert gguf_sampling_defaults(Header()) == {"temperature": 0.7, "top_k": 40,
                                                "repetition_penalty": 1.1}
    Header.fields = {}
    assert gguf_sampling_defaults(Header()) == {}


def test_processor_applies_defaults_and_max_tokens_default():
    cfg = EngineArgs(max_tokens_default=50).create_engine_config()
    proc = InputProcessor(cfg, None, num_blocks=1000)
    out = proc.process("a", [1, 2, 3], SamplingParams(max_tokens=None, top_p=0.5))
    p = out.params
    assert (p.temperature, p.top_p, p.max_tokens) == (0.2, 0.5, 50)
    assert out.core_requests[0].sampling_params.temperature == 0.2
    explicit = proc.process("b", [1], SamplingParams(max_tokens=7, temperature=1.0)).params
    assert (explicit.temperature, explicit.max_tokens) == (1.0, 7)
    assert proc.default_sampling_params().temperature == 0.2
    with pytest.raises(InvalidParameterError, match="max_tokens_default"):
        EngineArgs(max_tokens_default=-1).create_engine_config()


def test_models_endpoint_says_which_defaults(server):
    card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert card["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    assert "registry" in card["generation_source"]
    assert card["max_tokens_default"] == 1024 and card["repetition_guard"] == 64
    assert "sampling defaults: temperature=0.2, top_p=0.9" in server.log()
