"""Rotary scalings against transformers' own rope init functions
(transformers.modeling_rope_utils), and the refusal of those kvflow does not compute."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from kvflow.config import ModelArchConfig  # noqa: E402
from kvflow.errors import InvalidParameterError, ModelLoadError  # noqa: E402
from kvflow.layers.rotary import RotaryEmbedding, rope_parameters  # noqa: E402

HEAD_DIM = 64


def hf_config(rope: dict, max_pos: int = 4096, **extra):
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4,
                                    head_dim=HEAD_DIM, max_position_embeddings=max_pos,
                                    rope_parameters=dict(rope, rope_theta=10000.0), **extra)


def kvflow_scaling(rope: dict, max_pos: int = 4096) -> dict:
    """The scaling as kvflow reads it from the same config.json."""
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=HEAD_DIM * 4,
               intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
               head_dim=HEAD_DIM, max_position_embeddings=max_pos,
               rope_parameters=dict(rope, rope_theta=10000.0))
    return ModelArchConfig.from_hf_config(cfg).rope_scaling_dict


CASES = [
    ({"rope_type": "linear", "factor": 4.0}, None),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024}, None),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, None),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
      "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}, None),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512,
      "attention_factor": 1.3, "truncate": False}, None),
    ({"rope_type": "dynamic", "factor": 2.0}, 8192),  # run past max_position_embeddings
    ({"rope_type": "dynamic", "factor": 2.0}, 2048),  # within it: unscaled
]


@pytest.mark.parametrize("rope,seq_len", CASES)
def test_inv_freq_and_attention_factor_match_transformers(rope, seq_len):
    want, want_attn = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config(rope), "cpu",
                                                             seq_len=seq_len)
    got, attn = rope_parameters(HEAD_DIM, 10000.0, kvflow_scaling(rope),
                                table_len=seq_len or 4096, max_position_embeddings=4096)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(want_attn, rel=1e-9)


def phi3_config(max_pos: int):
    g = torch.Generator().manual_seed(0)
    short = (1 + torch.rand(HEAD_DIM // 2, generator=g)).tolist()
    long = (1 + 4 * torch.rand(HEAD_DIM // 2, generator=g)).tolist()
    rope = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "rope_theta": 10000.0}
    hf = transformers.Phi3Config(hidden_size=HEAD_DIM * 4, num_attention_heads=4,
                                 max_position_embeddings=max_pos,
                                 original_max_position_embeddings=4096, rope_parameters=rope)
    raw = dict(architectures=["Phi3ForCausalLM"], vocab_size=32, hidden_size=HEAD_DIM * 4,
               intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
               max_position_embeddings=max_pos, original_max_position_embeddings=4096,
               rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    return hf, ModelArchConfig.from_hf_config(raw).rope_scaling_dict


@pytest.mark.parametrize("context", [4096, 131072])
def test_longrope_matches_transformers(context):
    """Phi-3.5's layout (original_max_position_embeddings beside rope_scaling): the short
    factors for a context within the original 4096, the long ones past it; the attention
    factor from max_position_embeddings / original."""
    hf, scaling = phi3_config(131072)
    want, want_attn = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=context)
    got, attn = rope_parameters(HEAD_DIM, 10000.0, scaling, table_len=context,
                                max_position_embeddings=131072)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(want_attn, rel=1e-9) and attn > 1.0


def test_table_scales_cos_sin_by_the_attention_factor():
    """transformers multiplies cos and sin by the attention factor: so does the table."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    table = RotaryEmbedding(HEAD_DIM, 64, 10000.0, kvflow_scaling(rope), 4096)
    inv_freq, attn = ROPE_INIT_FUNCTIONS["yarn"](hf_config(rope), "cpu")
    freqs = torch.outer(torch.arange(64).float(), inv_freq.float())
    cos, sin = table.cos_sin(torch.arange(64))
    torch.testing.assert_close(cos, freqs.cos() * attn)
    torch.testing.assert_close(sin, freqs.sin() * attn)


def test_unknown_rope_type_is_refused_at_config():
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=64,
               intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
               rope_scaling={"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(InvalidParameterError, match="rope_scaling.rope_type"):
        ModelArchConfig.from_hf_config(cfg)
    with pytest.raises(ModelLoadError, match="rope_scaling.factor"):
        rope_parameters(16, 1e4, {"rope_type": "linear"}, table_len=8)
