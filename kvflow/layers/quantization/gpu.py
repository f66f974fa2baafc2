"""The GPU path of the weight-only methods: the seam's ``Int4Groups`` (or int8 per
channel) repacked once at load for the Triton kernels, and their ``apply``.

Every method converts its checkpoint into ``Int4Groups`` (``w = (v - 8) * s + z`` in
groups along K) for the CPU kernels already; on CUDA the same object is repacked instead:

- 4-bit (int4, GPTQ/AWQ/compressed-tensors 4-bit, GGUF Q4_0/Q4_1/Q4_K):
  ``kvflow.kernels.w4a16_gemm`` layout, ``qweight`` int32 [N, K/8], ``scales`` and
  ``offsets`` = z - 8 s [N, K/G] in the compute dtype (no offsets when every z is 0).
- 8-bit as two nibbles over a doubled input (GGUF Q8_0 and requantized K-quants, GPTQ /
  compressed-tensors 8-bit): the nibbles are put back together, ``qweight`` = u - 128
  int8 [N, K] with ``w = q * s + offset`` per group (``kvflow.kernels.w8a16_gemm``).
- int8 round-to-nearest: int8 [N, K] with a float32 scale per output channel.

Groups that repeat the same scale and offset (prequantized groups of 128 widened to
32 by ``affine_groups``) are merged back, so the kernel reads one scale per real group.
The compute dtype is the model dtype when it is bf16/fp16, else bf16 (the kernels' dot
operands); the output returns in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow import envs
from kvflow.errors import ModelLoadError
from kvflow.layers.linear import set_param
from kvflow.layers.quantization.packed import Int4Groups, flatten_tokens

MAX_GROUP = 1024  # merged groups stay powers of two up to this (the kernels' tiles nest)


def use_triton(device: torch.device) -> bool:
    """Whether weights on ``device`` take the Triton kernels (CUDA) or the CPU kernels."""
    return torch.device(device).type == "cuda"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass(frozen=True)
class TritonWeight:
    """What ``apply`` needs besides the layer's parameters."""

    bits: int
    """4 (w4a16_gemm) or 8 (w8a16_gemm)."""
    group: int | None
    """Inputs per scale; None: int8 per output channel."""
    dtype: torch.dtype
    """Compute dtype of the kernel (activations are cast to it)."""
    gemv: dict = field(default_factory=dict)
    """{M: WoqGemvConfig} for the decode row counts that take the tensor-core low-bit
    GEMV (``kvflow/kernels/gemv_w4.py`` / ``gemv_w8.py``; ``woq_gemv_config.plan``)."""
    silu: dict = field(default_factory=dict)
    """The same for the gate/up form with SiLU-and-multiply in the epilogue (merged
    [gate; up] layers without bias)."""


def _set(layer: torch.nn.Module, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        if hasattr(layer, name):
            delattr(layer, name)
        layer.register_parameter(name, None)
    else:
        set_param(layer, name, t.contiguous())


def merge_groups(scale: torch.Tensor, offset: torch.Tensor, group: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Merge neighbouring groups whose scale and offset are equal (exactly)."""
    while group < MAX_GROUP and scale.shape[1] % 2 == 0:
        s2, o2 = scale.view(scale.shape[0], -1, 2), offset.view(offset.shape[0], -1, 2)
        if not (torch.equal(s2[..., 0], s2[..., 1]) and torch.equal(o2[..., 0], o2[..., 1])):
            break
        scale, offset, group = s2[..., 0].contiguous(), o2[..., 0].contiguous(), group * 2
    return scale, offset, group


def _join_nibbles(g: Int4Groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A doubled (8-bit) Int4Groups -> int8 q [N, K], scale and offset [N, K / group] with
    w = q * scale + offset. Exact when the high half's scale is 16 times the low half's
    wherever a high nibble is not 8 (every 8-bit form the seam builds)."""
    k, kg = g.in_features, g.scale.shape[1] // 2
    hi, lo = g.values[:, :k].to(torch.int16), g.values[:, k:].to(torch.int16)
    s_hi, s_lo = g.scale[:, :kg], g.scale[:, kg:]
    z_hi, z_lo = g.zero[:, :kg], g.zero[:, kg:]
    used = (hi != 8).view(hi.shape[0], kg, -1).any(-1)  # [N, K / group]
    if bool((used & (s_hi != 16 * s_lo)).any()):
        raise ModelLoadError("8-bit weights whose two nibble halves have unrelated scales "
                             "cannot be repacked for the GPU kernels")
    q = (16 * hi + lo - 128).to(torch.int8)  # u - 128
    # (hi - 8) 16 s + z_hi + (lo - 8) s + z_lo = (u - 128) s + z_hi + z_lo - 8 s
    return q, s_lo, z_hi + z_lo - 8 * s_lo


def repack_groups(layer: torch.nn.Module, g: Int4Groups, dtype: torch.dtype,
                  device: torch.device) -> TritonWeight:
    """Register the Triton form of ``g`` on ``layer`` (``qweight``, ``scales``,
    ``offsets``) on ``device``; returns what ``apply`` needs."""
    from kvflow.kernels.int4_layout import pack_int4

    cdt = compute_dtype(dtype)
    values = g.values.to(device)
    g = Int4Groups(values, g.scale.to(device).float(), g.zero.to(device).float(), g.group,
                   g.doubled)
    if g.doubled:
        q, scale, offset = _join_nibbles(g)
        bits = 8
    else:
        q, scale, offset, bits = pack_int4(values), g.scale, g.zero - 8 * g.scale, 4
    scale, offset, group = merge_groups(scale, offset, g.group)
    symmetric_offset = torch.zeros_like(offset) if bits == 8 else -8 * scale
    keep_offset = not torch.equal(offset, symmetric_offset)
    _set(layer, "qweight", q)
    _set(layer, "scales", scale.to(cdt))
    _set(layer, "offsets", offset.to(cdt) if keep_offset else None)
    return TritonWeight(bits, group, cdt, *_plans(layer, bits, group, q.shape[0],
                                                  g.in_features, device))


def repack_int8_channel(layer: torch.nn.Module, q: torch.Tensor, scale: torch.Tensor,
                        dtype: torch.dtype) -> TritonWeight:
    """int8 [N, K] with a float32 scale per output channel."""
    _set(layer, "qweight", q)
    _set(layer, "scales", scale.float())
    _set(layer, "offsets", None)
    return TritonWeight(8, None, compute_dtype(dtype), *_plans(layer, 8, None, q.shape[0],
                                                               q.shape[1], q.device))


def gate_up_pairs(layer: torch.nn.Module, n: int) -> bool:
    """Whether ``layer`` is a merged [gate; up] projection of two equal halves without a
    bias (the SiLU-and-multiply epilogue's form)."""
    sizes = getattr(layer, "output_sizes", [])
    return (len(sizes) == 2 and sizes[0] == sizes[1] and n == 2 * sizes[0]
            and getattr(layer, "bias", None) is None)


def _plans(layer: torch.nn.Module, bits: int, group: int | None, n: int, k: int,
           device: torch.device) -> tuple[dict, dict]:
    """Decode rows that take the tensor-core GEMV (plain, and with the SiLU epilogue):
    int4 with power-of-two groups of at least 32 inputs, int8 per channel (group-wise
    int8 keeps the w8a16 kernel)."""
    from kvflow.kernels.woq_gemv_config import plan

    if bits == 4 and group is not None and group >= 32 and group & (group - 1) == 0:
        fmt = f"w4g{group}"
    elif bits == 8 and group is None:
        fmt = "int8"
    else:
        return {}, {}
    dev = torch.device(device)
    silu = plan(fmt + "-silu", n // 2, k, dev) if gate_up_pairs(layer, n) else {}
    return plan(fmt, n, k, dev), silu


def _matmul(layer: torch.nn.Module, tw: TritonWeight, x: torch.Tensor) -> torch.Tensor:
    from kvflow.kernels import w4a16_gemm as w4
    from kvflow.kernels import w8a16_gemm as w8

    args = (x, layer.qweight, layer.scales, layer.offsets, tw.group)
    if envs.disable_triton():  # the pure-torch references (debugging, A/B checks)
        return w4.w4a16_ref(*args) if tw.bits == 4 else w8.w8a16_ref(*args)
    cfg = tw.gemv.get(x.shape[0])  # decode rows: a Python-int lookup, graph-safe
    if cfg is not None:
        if tw.bits == 4:
            from kvflow.kernels.gemv_w4 import gemv_w4

            return gemv_w4(*args, cfg)
        from kvflow.kernels.gemv_w8 import gemv_w8

        return gemv_w8(x, layer.qweight, layer.scales, cfg)
    return w4.w4a16_gemm(*args) if tw.bits == 4 else w8.w8a16_gemm(*args)


def triton_silu_and_mul(layer: torch.nn.Module, tw: TritonWeight,
                        x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a merged [gate; up] layer in one low-bit GEMV launch for decode
    rows that the plan covers; None otherwise (the caller takes the unfused path)."""
    x2, lead = flatten_tokens(x)
    cfg = tw.silu.get(x2.shape[0]) if tw.silu and not envs.disable_triton() else None
    if cfg is None:
        return None
    xc = x2.to(tw.dtype)
    if xc.stride(-1) != 1:
        xc = xc.contiguous()
    if tw.bits == 4:
        from kvflow.kernels.gemv_w4 import gemv_w4

        y = gemv_w4(xc, layer.qweight, layer.scales, layer.offsets, tw.group, cfg,
                    silu_and_mul=True)
    else:
        from kvflow.kernels.gemv_w8 import gemv_w8

        y = gemv_w8(xc, layer.qweight, layer.scales, cfg, silu_and_mul=True)
    return y.to(x.dtype).view(*lead, -1)


def triton_apply(layer: torch.nn.Module, tw: TritonWeight, x: torch.Tensor,
                 perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] in the model dtype -> [..., N] through the Triton kernels; ``perm``
    reorders the inputs first (GPTQ desc_act, sorted by group at load)."""
    x2, lead = flatten_tokens(x)
    if perm is not None:
        x2 = x2.index_select(1, perm)  # [M, K] in the sorted-by-group order
    xc = x2.to(tw.dtype)
    if xc.stride(-1) != 1:
        xc = xc.contiguous()
    y = _matmul(layer, tw, xc).to(x.dtype)
    if layer.bias is not None:
        y = y + layer.bias
    return y.view(*lead, -1)
