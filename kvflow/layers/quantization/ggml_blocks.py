"""GGML block formats -> ``Int4Groups``, once at load.

Q4_0, Q4_1 and Q4_K are affine 4-bit per 32 elements, and Q8_0 is int8 per 32: all four
map onto ``Int4Groups`` exactly (the values and scales read from the bytes, no rounding).
Other block types that gguf-py can dequantize (Q6_K, Q5_K, Q5_0, ...) are dequantized
and requantized to 8 bits per 32 elements (Q8_0's form): close but not exact, and the
startup log says which tensors took that path.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.errors import ModelLoadError
from kvflow.layers.quantization.packed import Int4Groups

# GGMLQuantizationType values (stable across GGUF versions).
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 14, 30
DENSE_TYPES = (F32, F16, BF16)
EXACT_TYPES = (Q4_0, Q4_1, Q8_0, Q4_K)


def type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def block_size(ggml_type: int) -> tuple[int, int]:
    """(elements, bytes) of one block of ``ggml_type``."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        raise ModelLoadError(f"unknown GGML tensor type {ggml_type}") from None


def _blocks(raw: np.ndarray, k: int, ggml_type: int) -> np.ndarray:
    """[N, row_bytes] -> [N, blocks, block_bytes], checking the row length."""
    elems, nbytes = block_size(ggml_type)
    n, row = raw.shape
    if k % elems or row != k // elems * nbytes:
        raise ModelLoadError(f"a {type_name(ggml_type)} tensor with {k} columns needs "
                             f"{k // elems * nbytes} bytes per row, got {row} (corrupt "
                             f"or mislabelled tensor)")
    return raw.reshape(n, k // elems, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (last axis) as a float16 -> float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 values: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _groups(v: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Int4Groups:
    n = v.shape[0]
    return Int4Groups(torch.from_numpy(np.ascontiguousarray(v.reshape(n, -1), np.uint8)),
                      torch.from_numpy(np.ascontiguousarray(scale.reshape(n, -1))),
                      torch.from_numpy(np.ascontiguousarray(zero.reshape(n, -1))), 32)


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes per super-block -> 8 six-bit scales and 8 six-bit mins."""
    s = s.astype(np.uint16)
    sc = np.empty(s.shape[:-1] + (8,), np.uint16)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def to_int4_groups(raw: np.ndarray, k: int, ggml_type: int) -> tuple[Int4Groups, bool]:
    """A quantized tensor's bytes [N, row_bytes] with K columns -> (weights, exact)."""
    if ggml_type in (Q4_0, Q4_1):
        b = _blocks(raw, k, ggml_type)
        d = _f16(b[..., 0:2])  # [N, blocks]
        if ggml_type == Q4_0:
            v, zero = _nibbles32(b[..., 2:18]), np.zeros_like(d)
        else:
            v, zero = _nibbles32(b[..., 4:20]), _f16(b[..., 2:4]) + 8.0 * d
        return _groups(v, d, zero), True
    if ggml_type == Q8_0:
        b = _blocks(raw, k, ggml_type)
        d = _f16(b[..., 0:2])
        q = np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(b.shape[0], k)
        return Int4Groups.from_int8_blocks(torch.from_numpy(q.copy()), torch.from_numpy(d)), True
    if ggml_type == Q4_K:
        b = _blocks(raw, k, ggml_type)
        n, nb = b.shape[:2]
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _q4_k_scales(b[..., 4:16])  # [N, nb, 8]
        qs = b[..., 16:144].reshape(n, nb, 4, 32)
        # Each 32-byte chunk holds sub-block 2j in its low nibbles, 2j+1 in its high ones.
        v = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, nb, 8, 32)
        scale = d * sc
        zero = 8.0 * scale - dmin * mn  # w = scale * v - dmin * m
        return _groups(v, scale, zero), True
    if ggml_type in DENSE_TYPES:
        raise ModelLoadError("dense GGML tensors are not block-quantized")
    return requantize8(dequantize(raw, k, ggml_type)), False


def dequantize(raw: np.ndarray, k: int, ggml_type: int) -> torch.Tensor:
    """Any GGML tensor's bytes [N, row_bytes] -> float32 [N, K] through gguf-py."""
    import gguf

    if ggml_type not in DENSE_TYPES:
        _blocks(raw, k, ggml_type)
    try:
        out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    except Exception as e:
        raise ModelLoadError(f"cannot dequantize a {type_name(ggml_type)} tensor "
                             f"({type(e).__name__}: {e})") from None
    return torch.from_numpy(np.array(out, dtype=np.float32).reshape(raw.shape[0], k))


def requantize8(w: torch.Tensor) -> Int4Groups:
    """Float [N, K] -> int8 per 32 elements (Q8_0's scheme), as Int4Groups."""
    n, k = w.shape
    wg = w.reshape(n, k // 32, 32)
    d = (wg.abs().amax(-1) / 127.0).clamp_min(1e-12)
    q = torch.clamp(torch.round(wg / d.unsqueeze(-1)), -127, 127).to(torch.int8)
    return Int4Groups.from_int8_blocks(q.reshape(n, k), d)
