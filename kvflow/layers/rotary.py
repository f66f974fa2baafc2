"""Rotary position embedding (Hugging Face's rotate-half layout) with the scalings of
``transformers.modeling_rope_utils``: llama3, linear, dynamic NTK, YaRN and longrope.
The cos/sin table is computed once in float32 for every position.

transformers picks dynamic NTK's base and longrope's factor set per forward call from the
batch's longest sequence; a paged cache keeps keys rotated when written, so kvflow fixes
both once, from the table's length (``max_position``, the engine's max_model_len): dynamic
NTK as at that length (as vLLM does), longrope's long factors when the table reaches past
``original_max_position_embeddings``, else the short ones. For sequences within the
original context (the usual case) that is exactly transformers' choice.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvflow.errors import ModelLoadError


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")


def _need(scaling: dict, key: str):
    if scaling.get(key) is None:
        raise ModelLoadError(f"rope_scaling.{key} is required for rope type "
                             f"{scaling.get('rope_type', scaling.get('type'))!r}")
    return scaling[key]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, base: float, scaling: dict, max_pos: int | None
          ) -> tuple[torch.Tensor, float]:
    """YaRN: low frequencies interpolated by ``factor``, high ones kept, a linear ramp
    between the dims that rotate beta_slow and beta_fast times over the original
    context; cos/sin scaled by the attention factor (0.1 ln(factor) + 1 by default)."""
    old_ctx = _need(scaling, "original_max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None:
        factor = (max_pos or old_ctx) / old_ctx
    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = (_yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all
                else _yarn_mscale(factor))
    fast = scaling.get("beta_fast") or 32
    slow = scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
        return (head_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attn)


def _longrope(head_dim: int, base: float, scaling: dict, max_pos: int | None,
              table_len: int) -> tuple[torch.Tensor, float]:
    """longrope (Phi-3/3.5): per-frequency divisors, the long set when the table reaches
    past the original context; cos/sin scaled by sqrt(1 + ln(f) / ln(original))."""
    old_ctx = _need(scaling, "original_max_position_embeddings")
    factors = _need(scaling, "long_factor" if table_len > old_ctx else "short_factor")
    if len(factors) != head_dim // 2:
        raise ModelLoadError(f"rope_scaling long_factor/short_factor must have head_dim / 2 "
                             f"= {head_dim // 2} entries, got {len(factors)}")
    factor = scaling.get("factor")
    if factor is None:
        factor = (max_pos or old_ctx) / old_ctx
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** shape)
    return inv_freq, float(attn)


def rope_parameters(head_dim: int, base: float, scaling: dict | None, *,
                    table_len: int, max_position_embeddings: int | None = None
                    ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] float32, factor on cos/sin) for a table of
    ``table_len`` positions. ``max_position_embeddings`` is the model config's (YaRN and
    longrope derive a missing ``factor`` from it, dynamic NTK scales from it)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                               / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "linear":
        return inv_freq / _need(scaling, "factor"), 1.0
    if kind == "freq_factors":  # GGUF stores llama3's factors as a tensor
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "dynamic":
        factor = _need(scaling, "factor")
        orig = max_position_embeddings or table_len
        seq = max(table_len, orig)
        base = base * ((factor * seq / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                               / head_dim)), 1.0
    if kind == "yarn":
        return _yarn(head_dim, base, scaling, max_position_embeddings)
    if kind == "longrope":
        return _longrope(head_dim, base, scaling, max_position_embeddings, table_len)
    raise ModelLoadError(f"rope_scaling.rope_type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")


def compute_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """The inverse frequencies alone (scalings without a cos/sin factor)."""
    return rope_parameters(head_dim, base, scaling, table_len=0)[0]


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D/2] float32 -> x rotated (rotate-half layout)."""
    d = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :d], xf[..., d:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D/2] -> full-width tables [T, 1, D] for ``apply_rotary``: (cos, cos)
    and (-sin, sin), built once per step so each layer's rotation is four ops."""
    return (torch.cat((cos, cos), dim=-1).unsqueeze(1),
            torch.cat((-sin, sin), dim=-1).unsqueeze(1))


def apply_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``apply_rotary_ref`` from ``rotary_tables``: x * cos + rotate_half(x) * sin, where
    rotate_half swaps the halves (a roll by D/2; the sign lives in the sin table). The
    same float32 products and sums as the reference, so bit for bit the same result."""
    cos, sin = tables
    xf = x if x.dtype == torch.float32 else x.float()
    out = xf * cos
    out += xf.roll(x.shape[-1] // 2, dims=-1) * sin
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None = None, max_position_embeddings: int | None = None,
                 context_len: int | None = None) -> None:
        """``context_len``: the longest sequence run (longrope and dynamic NTK choose by
        it; default ``max_position``, the table length)."""
        super().__init__()
        self.head_dim = head_dim
        inv_freq, attn = rope_parameters(head_dim, base, scaling,
                                         table_len=context_len or max_position,
                                         max_position_embeddings=max_position_embeddings)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if attn != 1.0:  # YaRN / longrope scale the rotated values, as transformers does
            cos, sin = cos * attn, sin * attn
        cache = torch.cat((cos, sin), dim=-1)  # [max_position, D]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cos_sin_cache.index_select(0, positions)  # [T, D]
        return cs.chunk(2, dim=-1)
