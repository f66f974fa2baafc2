"""Quantized KV cache storage (``--kv-cache-dtype int8|fp8``): the torch reference of
how values are stored and read back, used by the torch backend and matched by the
Triton cache write (``kernels/rotary_kv.py``) and paged attention.

* int8: symmetric, one float32 scale per token and KV head: ``s = max|x| / 127`` over the
  head dim, ``q = round(x / s)``, read back as ``q * s``. The scales live in their own
  tensor [2, NB, BS, KVH] (a layer's slice of [L, 2, NB, BS, KVH]) with the cache's
  block layout, so a block's scales move with it wherever blocks move (copy-on-write,
  swap, prefix sharing: same block id, same scales).
* fp8 (E4M3, ``torch.float8_e4m3fn``): one scale per layer for K and one for V (1.0
  unless the checkpoint carries ``k_scale``/``v_scale``): ``q = fp8(clamp(x / s, +-448))``
  with round-to-nearest-even, read back as ``float(q) * s``.

Both store one byte per value: a block holds half the bytes of bf16 (a quarter of fp32)
plus, for int8, 4 bytes per token and head of scales.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvflow.errors import InvalidParameterError

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(eq=False)
class KVQuant:
    """How one layer's KV cache is quantized (bound beside ``Attention.kv_cache``)."""

    kind: str  # "int8" or "fp8"
    scales: torch.Tensor | None = None  # int8: [2, NB, BS, KVH] float32, per token & head
    k_scale: float = 1.0  # fp8: per-tensor scales
    v_scale: float = 1.0


def storage_dtype(kind: str) -> torch.dtype:
    """The torch dtype a quantized cache is stored in; a clear error where it is missing."""
    if kind == "int8":
        return torch.int8
    if kind == "fp8":
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if fp8 is None:
            raise InvalidParameterError(
                f"--kv-cache-dtype fp8 needs torch.float8_e4m3fn, which torch "
                f"{torch.__version__} lacks; use int8 or upgrade torch",
                param="kv_cache_dtype")
        return fp8
    raise InvalidParameterError(f"unknown KV cache dtype {kind!r} (auto, int8, fp8)",
                                param="kv_cache_dtype")


def check_fp8_device(device: torch.device) -> None:
    """FP8 storage on a GPU needs native E4M3 conversions (compute capability 8.9+)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise InvalidParameterError(
            f"--kv-cache-dtype fp8 needs a GPU with FP8 support (compute capability 8.9 "
            f"or newer); this one is {major}.{minor}: use int8", param="kv_cache_dtype")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, KVH, D] -> (int8 [T, KVH, D], float32 scales [T, KVH])."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX  # [T, KVH]
    y = xf / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)  # all-zero head: stays 0
    # Round half away from zero, as the Triton cache write does (it has no rint).
    q = y.abs().add_(0.5).floor_().clamp_(max=INT8_MAX).copysign_(y)
    return q.to(torch.int8), scale


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x [..] -> float8_e4m3fn of x / scale, saturated (a plain cast overflows to NaN)."""
    # Times the reciprocal, as the Triton cache write does (same float32 rounding).
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype
               ) -> torch.Tensor:
    """Stored values -> ``dtype``. int8 q [..., D] with scale [...]; fp8 q with a float
    scale. (Widen, then scale in place: measured faster on CPU than one promoting mul.)"""
    if isinstance(scale, torch.Tensor):
        out = q.float().mul_(scale.unsqueeze(-1))
    else:
        out = q.float() * scale
    return out if out.dtype == dtype else out.to(dtype)


def _bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """fp8 caches are written through a uint8 view (CPU index_copy_ lacks float8)."""
    return cache.view(torch.uint8) if cache.dtype.itemsize == 1 and \
        cache.dtype != torch.int8 else cache


_writes_kept = [False]  # inside keep_cache_values(): quantized writes store nothing


@contextlib.contextmanager
def keep_cache_values():
    """Within it the quantized cache writes (``write_kv_quant``) store nothing and
    return what the cache already holds at their slots: a forward then attends to
    quantized K/V that something else wrote. The C++ step's self-check runs its eager
    reference this way over the values the step stored, so both sides read the same
    int8/fp8 values and only the rest of the step is compared (one value a rounding
    step apart, quantized, is a whole quantization step apart)."""
    old = _writes_kept[0]
    _writes_kept[0] = True
    try:
        yield
    finally:
        _writes_kept[0] = old


def write_kv_quant(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   quant: KVQuant, slots: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize k, v [N, KVH, D] (rows already filtered to valid slots) into kv_cache
    [2, NB, BS, KVH, D] at flat ``slots`` [N]; returns what the cache now holds for
    them, dequantized to ``dtype`` (a fresh prefill attends to the same values a later
    read of the cache sees). Inside ``keep_cache_values()`` it stores nothing."""
    _, nb, bs, kvh, d = kv_cache.shape
    flat = _bytes_view(kv_cache).view(2, nb * bs, kvh, d)
    if _writes_kept[0]:
        kq, vq = flat[0].index_select(0, slots), flat[1].index_select(0, slots)
        if quant.kind == "int8":
            sflat = quant.scales.view(2, nb * bs, kvh)
            return (dequantize(kq, sflat[0].index_select(0, slots), dtype),
                    dequantize(vq, sflat[1].index_select(0, slots), dtype))
        kq, vq = kq.view(kv_cache.dtype), vq.view(kv_cache.dtype)
        return dequantize(kq, quant.k_scale, dtype), dequantize(vq, quant.v_scale, dtype)
    if quant.kind == "int8":
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
        sflat = quant.scales.view(2, nb * bs, kvh)
        sflat[0].index_copy_(0, slots, ks)
        sflat[1].index_copy_(0, slots, vs)
        kd, vd = dequantize(kq, ks, dtype), dequantize(vq, vs, dtype)
    else:
        kq, vq = quantize_fp8(k, quant.k_scale), quantize_fp8(v, quant.v_scale)
        kd, vd = dequantize(kq, quant.k_scale, dtype), dequantize(vq, quant.v_scale, dtype)
        kq, vq = kq.view(torch.uint8), vq.view(torch.uint8)
    flat[0].index_copy_(0, slots, kq)
    flat[1].index_copy_(0, slots, vq)
    return kd, vd


def read_flat(kv_cache: torch.Tensor, quant: KVQuant, start: int, length: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [length, KVH, D] of flat slots start..start+length, dequantized."""
    _, nb, bs, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, kvh, d)[:, start: start + length]
    if quant.kind == "int8":
        s = quant.scales.view(2, nb * bs, kvh)[:, start: start + length]
        return dequantize(flat[0], s[0], dtype), dequantize(flat[1], s[1], dtype)
    return (dequantize(flat[0], quant.k_scale, dtype),
            dequantize(flat[1], quant.v_scale, dtype))


def gather_blocks(kv_cache: torch.Tensor, quant: KVQuant, blocks: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole blocks ``blocks`` [N] int64, dequantized: 2 x [N * BS, KVH, D].

    Gathers the one-byte values (and int8's scales) first, so the bytes read from the
    cache are a quarter of an fp32 cache's; the dequantized copy is made per call."""
    _, nb, bs, kvh, d = kv_cache.shape
    raw = _bytes_view(kv_cache)
    kq = raw[0].view(nb, -1).index_select(0, blocks).view(-1, kvh, d)
    vq = raw[1].view(nb, -1).index_select(0, blocks).view(-1, kvh, d)
    if quant.kind == "int8":
        ks = quant.scales[0].view(nb, -1).index_select(0, blocks).view(-1, kvh)
        vs = quant.scales[1].view(nb, -1).index_select(0, blocks).view(-1, kvh)
        return dequantize(kq, ks, dtype), dequantize(vq, vs, dtype)
    kq, vq = kq.view(kv_cache.dtype), vq.view(kv_cache.dtype)
    return dequantize(kq, quant.k_scale, dtype), dequantize(vq, quant.v_scale, dtype)


def dequantize_cache(kv_cache: torch.Tensor, quant: KVQuant | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """A whole layer cache [2, NB, BS, KVH, D] in ``dtype`` (references and tests: the
    float cache whose values a quantized one stands for)."""
    if quant is None:
        return kv_cache.to(dtype)
    if quant.kind == "int8":
        return dequantize(kv_cache, quant.scales, dtype)
    return torch.stack((dequantize(kv_cache[0], quant.k_scale, dtype),
                        dequantize(kv_cache[1], quant.v_scale, dtype)))
