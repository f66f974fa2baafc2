"""Rotary position embedding (Hugging Face's rotate-half layout), with llama3 and linear
scaling. The cos/sin table is computed once in float32 for every position."""

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


def compute_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                               / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":  # GGUF stores llama3's factors as a tensor
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported "
                         "(supported: llama3, linear)")


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
                 scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, D/2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, D]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cos_sin_cache.index_select(0, positions)  # [T, D]
        return cs.chunk(2, dim=-1)
