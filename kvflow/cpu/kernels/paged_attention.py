"""Decode attention over the paged KV cache on CPU, reading int8 / fp8 / float32 blocks in
place (``paged_attention.cpp``).

Reference: ``kvflow.layers.attention.torch_backend.paged_attention_ref`` over the cache's
dequantized values (``kv_quant.dequantize_cache``); the torch backend's own decode path
(gather the blocks, dequantize, SDPA) computes the same and stays the fallback.
"""

from __future__ import annotations

import ctypes

import torch

from kvflow.cpu.kernels import build

_KINDS = {torch.float32: 0, torch.int8: 1}
_FP8 = getattr(torch, "float8_e4m3fn", None)
if _FP8 is not None:
    _KINDS[_FP8] = 2

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64
_f32 = ctypes.c_float


def _library() -> ctypes.CDLL | None:
    return build.load("paged_attention", {"kvflow_paged_decode": (
        [ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
         _i64, _i64, _f32, _f32, _f32, ctypes.c_int], ctypes.c_int)})


def available() -> bool:
    """Whether the kernel is built and loadable here (builds it on first call)."""
    return _library() is not None


def supports(q_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device,
             head_dim: int) -> bool:
    """Whether ``paged_decode`` handles these on this device: float32 queries; float32,
    int8 or fp8 E4M3 cache; a head dim that is a multiple of 8."""
    return (device.type == "cpu" and q_dtype == torch.float32 and cache_dtype in _KINDS
            and head_dim % 8 == 0)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, scales: torch.Tensor | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] float32 attends to the first seq_lens[b]
    positions of sequence b in kv_cache [2, NB, BS, KVH, D] through block_tables [B, W]
    int32. int8 caches pass ``scales`` [2, NB, BS, KVH] float32; fp8 caches the
    per-tensor ``k_scale``/``v_scale``. D must be a multiple of 8. Returns [B, H, D]
    float32."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the C++ CPU attention kernel is not available "
                           "(check cpu.kernels.paged_attention.available() first)")
    kind = _KINDS.get(kv_cache.dtype)
    b, h, d = q.shape
    _, nb, bs, kvh, dc = kv_cache.shape
    if kind is None or q.dtype != torch.float32 or q.device.type != "cpu":
        raise ValueError(f"paged_decode takes float32 queries on CPU and a float32, int8 "
                         f"or fp8 cache; got q {q.dtype} on {q.device}, cache "
                         f"{kv_cache.dtype}")
    if dc != d or d % 8 or h % kvh or block_tables.shape[0] < b or seq_lens.shape[0] < b:
        raise ValueError(f"paged_decode shapes disagree: q {tuple(q.shape)}, cache "
                         f"{tuple(kv_cache.shape)}, tables {tuple(block_tables.shape)}, "
                         f"lens {tuple(seq_lens.shape)}")
    if kind == 1 and (scales is None or scales.shape != kv_cache.shape[:-1]
                      or scales.dtype != torch.float32):
        raise ValueError("an int8 cache needs its float32 scales [2, NB, BS, KVH]")
    if not kv_cache.is_contiguous():
        raise ValueError("paged_decode reads a contiguous cache")
    q = q.contiguous()
    tables = block_tables[:b].to(torch.int32)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    lens = seq_lens[:b].to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    sc = scales.contiguous() if kind == 1 else None
    rc = lib.kvflow_paged_decode(
        kind, out.data_ptr(), q.data_ptr(), kv_cache.data_ptr(),
        sc.data_ptr() if sc is not None else None, tables.data_ptr(), lens.data_ptr(),
        b, h, kvh, d, nb, bs, tables.stride(0), scale, k_scale, v_scale,
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"kvflow_paged_decode failed ({rc})")
    return out
