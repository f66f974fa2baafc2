"""FP8 (E4M3) W8A8: weights with one scale per output channel, activations quantized
dynamically with one scale per token, multiplied as FP8 with float32 accumulation.

Two sources of weights, one layer format (``weight`` float8_e4m3fn [N, K] and
``weight_scale`` float32 [N], ``w = weight * weight_scale[:, None]``):

* ``--quantization fp8`` on a float checkpoint: each dense weight is loaded as usual,
  then quantized once (``s = max|w_row| / 448``);
* a pre-quantized checkpoint: compressed-tensors ``float-quantized`` (8-bit float
  weights, channel or tensor strategy) or the ``fp8`` quantization_config layout
  (per-tensor ``weight_scale``). A per-tensor scale of a merged layer's shard (q, k, v;
  gate, up) fills that shard's rows of the per-channel scale, so merged layers need no
  re-quantization. Activations: per token, or, where the checkpoint says they are static
  (``activation_scheme: static``; compressed-tensors ``dynamic: false``, strategy
  tensor), with each layer's per-tensor ``input_scale`` (``quantize_fp8_static``).

The product: ``y = (xq @ wq^T) * sx[:, None] * sw[None, :]``. Decode rows (M <= 8) on a
GPU are weight-dequant instead: bf16 x times the FP8 weights made exact bf16 operands in
registers (``kvflow/kernels/gemv_w8.py``, ``fp8_gemv_plan``; ``KVFLOW_WOQ_GEMV=off``
keeps W8A8 there), since a decode step is a weight stream and the activation
quantization launch buys nothing. On a GPU with FP8 (compute capability 8.9+) the
other rows' activations are quantized in one Triton launch
(``kvflow/kernels/fp8_quant.py``; the torch version was five kernels) and multiplied with
``torch._scaled_mm`` (row-wise scales) at every M: the Triton FP8 GEMM
(``kernels/fp8_gemm.py``), which quantizes inside its own loop, was slower on the H200 at
every shape measured, so it serves block-wise scales only. Elsewhere ``fp8_mm_ref`` computes the same numbers in float32 (each fp8 x fp8
product is exact in float32; only the summation order differs), logged as emulated:
there is no fast FP8 matmul on CPUs. Block-wise scales are in ``fp8_block.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow import envs
from kvflow.errors import ModelLoadError
from kvflow.layers.linear import LinearBase, LinearMethod, set_param
from kvflow.layers.quantization.packed import flatten_tokens
from kvflow.layers.quantization.rtn import _QuantizeAfterLoad
from kvflow.logger import init_logger

logger = init_logger(__name__)

FP8_MAX = 448.0
_warned_emulated = False


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M]): one scale per row (a weight's
    output channel, an activation's token), saturated, round to nearest even; the same
    bytes on CPU and GPU and as the Triton kernel (``kvflow.kernels.fp8_quant``)."""
    from kvflow.kernels.fp8_quant import quantize_fp8_ref

    return quantize_fp8_ref(x)


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with a checkpoint's static per-tensor scale [] -> (float8_e4m3fn [M, K]
    of x / scale saturated to +-448, round to nearest even; float32 scales [M], all
    ``scale``): the rows' layout of ``quantize_fp8_rows``, so the product is the same."""
    xq = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, scale.reshape(1).expand(x.shape[0])


def channel_scales(t: torch.Tensor, n: int, where: str) -> torch.Tensor:
    """A checkpoint's ``weight_scale`` for ``n`` output channels as float32 [n]: one per
    channel, or one per tensor broadcast; anything else (block-wise scales) is refused,
    ``where`` naming the weight."""
    t = t.float().reshape(-1)
    if t.numel() not in (1, n):
        raise ModelLoadError(
            f"{where} weight_scale has {t.numel()} values; fp8 weights take one per output "
            f"channel ({n}) or one per tensor (block-wise scales: quantization_config "
            f"weight_block_size, not supported)")
    return t.expand(n)


def fp8_mm_ref(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """The reference W8A8 product: xq [M, K], wq [N, K] fp8, sx [M], sw [N] -> [M, N]."""
    acc = xq.float() @ wq.float().t()  # [M, N], exact products, float32 sums
    return (acc * sx[:, None] * sw[None, :]).to(out_dtype)


def has_fp8_matmul(device: torch.device) -> bool:
    """``torch._scaled_mm`` with FP8 inputs: CUDA compute capability 8.9 (Ada) or newer."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def fp8_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8_mm_ref``, on the GPU's FP8 tensor cores where there are some."""
    if has_fp8_matmul(xq.device) and xq.shape[1] % 16 == 0 and wq.shape[0] % 16 == 0:
        # Row-wise scales: scale_a [M, 1], scale_b [1, N]; b column-major (wq^T of a
        # row-major [N, K]). Row-wise scaling takes bf16 output.
        y = torch._scaled_mm(xq, wq.t(), scale_a=sx[:, None].contiguous(),
                             scale_b=sw[None, :].contiguous(), out_dtype=torch.bfloat16)
        return y if out_dtype == torch.bfloat16 else y.to(out_dtype)
    log_emulated(xq.device)
    return fp8_mm_ref(xq, sx, wq, sw, out_dtype)


def use_fp8_kernels(device: torch.device) -> bool:
    """Whether a layer on ``device`` takes the Triton FP8 kernels (an FP8 GPU, unless
    KVFLOW_DISABLE_TRITON asks for the torch paths)."""
    return has_fp8_matmul(device) and not envs.disable_triton()


def log_emulated(device: torch.device) -> None:
    global _warned_emulated
    if not _warned_emulated:
        _warned_emulated = True
        logger.info("fp8 W8A8 matmuls are emulated on %s (float32 products of the FP8 "
                    "values: the same numbers, without FP8 speed)", device)


def _check_device(layer: LinearBase, w: torch.Tensor) -> None:
    if w.device.type == "cuda" and not has_fp8_matmul(w.device):
        major, minor = torch.cuda.get_device_capability(w.device)
        raise ModelLoadError(
            f"fp8 weights ({layer.prefix or 'a layer'}) need a GPU with FP8 support (compute "
            f"capability 8.9 or newer); this one is {major}.{minor}: use --quantization "
            f"none (or int8 weight-only)")


def _gemv_weights(layer: LinearBase, w8a8: bool = False) -> bool:
    """Whether the layer's weights suit the decode GEMVs (an FP8 GPU, a contiguous [N, K]
    weight with per-channel scales); ``w8a8``: and its activations are quantized per
    token, not with a checkpoint's static scale (whose numbers those layers keep)."""
    w = layer.weight
    return (use_fp8_kernels(w.device) and w.dim() == 2 and w.is_contiguous()
            and layer.weight_scale.dim() == 1
            and not (w8a8 and getattr(layer, "input_scale", None) is not None))


def _gemv_plans(layer: LinearBase, attr: str, fmt: str, silu: bool, w8a8: bool) -> dict:
    """{M: config} of ``fmt`` (``silu``: its ``fmt-silu`` gate/up form), planned once per
    layer at its first call (the weights are final by then) and kept in ``attr``."""
    plans = getattr(layer, attr, None)
    if plans is None:
        plans = ({}, {})
        if _gemv_weights(layer, w8a8):
            from kvflow.kernels.woq_gemv_config import plan as woq_plan
            from kvflow.layers.quantization.gpu import gate_up_pairs

            n, k = layer.weight.shape
            dev = layer.weight.device
            plans = (woq_plan(fmt, n, k, dev),
                     woq_plan(f"{fmt}-silu", n // 2, k, dev) if gate_up_pairs(layer, n)
                     else {})
        setattr(layer, attr, plans)
    return plans[1] if silu else plans[0]


def fp8_gemv_plan(layer: LinearBase, silu: bool = False) -> dict:
    """{M: config} of the decode rows that take the FP8 weight-dequant GEMV
    (``kvflow/kernels/gemv_w8.py``; ``silu``: its gate/up form with SiLU-and-multiply in
    the epilogue; ``woq_gemv_config.plan``)."""
    return _gemv_plans(layer, "_fp8_gemv", "fp8", silu, w8a8=False)


def fp8a8_plan(layer: LinearBase, silu: bool = False) -> dict:
    """{M: config} of the decode rows that take the FP8 W8A8 GEMV on the FP8 tensor cores
    (``kvflow/kernels/gemv_fp8.py``: activations quantized per token, as at every other
    M; ``silu``: its gate/up form with SiLU-and-multiply in the epilogue);
    ``KVFLOW_FP8_DECODE`` and the per-GPU table decide (``woq_gemv_config.plan``). Rows
    it leaves out take ``fp8_gemv_plan``'s kernel."""
    return _gemv_plans(layer, "_fp8a8_gemv", "fp8a8", silu, w8a8=True)


def _w8a8_gemv(layer: LinearBase, xq: torch.Tensor, sx: torch.Tensor, cfg, act,
               out_dtype: torch.dtype) -> torch.Tensor:
    """The W8A8 decode GEMV on quantized rows; ``act`` (SiLU-and-multiply) in its epilogue
    where the layer has that plan for this M, else after it."""
    from kvflow.kernels.gemv_fp8 import gemv_fp8

    m = xq.shape[0]
    scfg = (fp8a8_plan(layer, silu=True).get(m) if act is not None and layer.bias is None
            else None)
    if scfg is not None:
        return gemv_fp8(xq, sx, layer.weight, layer.weight_scale, scfg, out_dtype,
                        silu_and_mul=True)
    y = gemv_fp8(xq, sx, layer.weight, layer.weight_scale, cfg, out_dtype)
    if layer.bias is not None:
        y = y + layer.bias
    return y if act is None else act(y)


def _w8a8_on_rows(layer: LinearBase, x2: torch.Tensor, cfg, act) -> torch.Tensor:
    """Rows not quantized yet: per-token FP8 quantization (one launch), then the W8A8
    GEMV (``_w8a8_gemv``)."""
    from kvflow.kernels.fp8_quant import quantize_fp8

    xq, sx = quantize_fp8(x2 if x2.stride(-1) == 1 else x2.contiguous())
    return _w8a8_gemv(layer, xq, sx, cfg, act, x2.dtype)


def _w8a8_cfg(layer: LinearBase, x2: torch.Tensor, act) -> object | None:
    """The W8A8 GEMV's config for these rows (with ``act``: the fused SiLU form's or the
    plain one's), or None."""
    if x2.dtype != torch.bfloat16:
        return None
    m = x2.shape[0]
    cfg = fp8a8_plan(layer).get(m)
    if cfg is None and act is not None and layer.bias is None:
        cfg = fp8a8_plan(layer, silu=True).get(m)
    return cfg


def _normed_rows(x: torch.Tensor, residual: torch.Tensor | None, norm) -> bool:
    """Rows the FP8-output norm kernel (``rms_norm.rms_norm_fp8``) can take in place of
    the layer's norm: 2-D, unit stride, a norm on its kernels, a residual of x's shape."""
    return (x.dim() == 2 and x.stride(-1) == 1 and getattr(norm, "uses_kernels", False)
            and (residual is None or residual.shape == x.shape))


def _apply_normed(layer: LinearBase, x: torch.Tensor, residual: torch.Tensor | None,
                  norm, act) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode rows whose layer takes the W8A8 GEMV: the residual add, RMSNorm and the
    per-token FP8 quantization in one launch (``rms_norm.rms_norm_fp8``), then the GEMV;
    None where the layer's usual norm-then-linear path applies."""
    if not _normed_rows(x, residual, norm):
        return None
    cfg = _w8a8_cfg(layer, x, act)
    if cfg is None:
        return None
    from kvflow.kernels.rms_norm import rms_norm_fp8

    xq, sx, r = rms_norm_fp8(x, residual, norm.weight, norm.eps)
    return _w8a8_gemv(layer, xq, sx, cfg, act, x.dtype), r


GROUP = 128  # inputs per activation scale between the gate/up and down GEMVs


def fp8a8_chain_plan(layer: LinearBase, form: str) -> dict:
    """{M: config} of the decode rows whose gated MLP runs as one FP8 chain: ``siluq``
    (this gate/up layer's W8A8 GEMV with SiLU and an FP8 output in 128-wide groups) or
    ``xg`` (this down layer's W8A8 GEMV reading them); planned once per layer and form
    (``woq_gemv_config.plan``: the table, ``KVFLOW_FP8_DECODE``)."""
    plans = getattr(layer, "_fp8a8_chain", None)
    if plans is None:
        plans = layer._fp8a8_chain = {}
    if form not in plans:
        plan = {}
        if (isinstance(layer.quant_method, (Fp8LinearMethod, Fp8CheckpointLinearMethod))
                and layer.bias is None and _gemv_weights(layer, w8a8=True)):
            from kvflow.kernels.woq_gemv_config import plan as woq_plan
            from kvflow.layers.quantization.gpu import gate_up_pairs

            n, k = layer.weight.shape
            if form == "xg" and k % GROUP == 0:
                plan = woq_plan("fp8a8-xg", n, k, layer.weight.device)
            elif form == "siluq" and gate_up_pairs(layer, n) and (n // 2) % GROUP == 0:
                plan = woq_plan("fp8a8-siluq", n // 2, k, layer.weight.device)
            # the group is the tile: siluq quantizes each program's whole block_n
            # columns as one group, so no split-K and no balanced rows there
            plan = {m: c for m, c in plan.items()
                    if (c.block_k if form == "xg" else c.block_n) == GROUP
                    and (form == "xg" or (c.split_k == 1 and c.tile_rows == c.block_n))}
        plans[form] = plan
    return plans[form]


def _apply_mlp(layer: LinearBase, x: torch.Tensor, residual: torch.Tensor | None, norm,
               act, down: LinearBase) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode rows of a gated MLP whose two layers are FP8 with the chain planned: the
    residual add, RMSNorm and per-token quantization (one launch), gate/up with SiLU
    writing its product in FP8 with one scale per row and 128 inputs, down reading
    those: three launches, no bf16 intermediate and no quantization launch between
    them. None where the layers' usual path applies."""
    if x.dtype != torch.bfloat16 or not _normed_rows(x, residual, norm):
        return None
    m = x.shape[0]
    gcfg = fp8a8_chain_plan(layer, "siluq").get(m)
    dcfg = fp8a8_chain_plan(down, "xg").get(m) if gcfg is not None else None
    if dcfg is None:
        return None
    from kvflow.kernels.gemv_fp8 import gemv_fp8
    from kvflow.kernels.rms_norm import rms_norm_fp8

    xq, sx, r = rms_norm_fp8(x, residual, norm.weight, norm.eps)
    hq, hs = gemv_fp8(xq, sx, layer.weight, layer.weight_scale, gcfg, silu_and_mul=True,
                      fp8_out=True)
    y = gemv_fp8(hq, hs, down.weight, down.weight_scale, dcfg, x.dtype)
    return down.reduce_output(y), r  # a row-parallel down sums its ranks' partials


def _apply_silu_and_mul(layer: LinearBase, x: torch.Tensor, act) -> torch.Tensor:
    """Decode rows of an FP8 gate/up layer: the W8A8 or the weight-dequant GEMV with SiLU
    in its epilogue; everything else unfused (W8A8, then ``act``)."""
    x2, lead = flatten_tokens(x)
    a8 = _w8a8_cfg(layer, x2, act)
    if a8 is not None:
        return _w8a8_on_rows(layer, x2, a8, act).view(*lead, -1)
    cfg = (fp8_gemv_plan(layer, silu=True).get(x2.shape[0])
           if x2.dtype == torch.bfloat16 else None)
    if cfg is None:
        return act(layer(x))
    from kvflow.kernels.gemv_w8 import gemv_w8

    y = gemv_w8(x2 if x2.stride(-1) == 1 else x2.contiguous(), layer.weight,
                layer.weight_scale, cfg, silu_and_mul=True)
    return y.view(*lead, -1)


def _apply(layer: LinearBase, x: torch.Tensor,
           input_scale: torch.Tensor | None = None) -> torch.Tensor:
    x2, lead = flatten_tokens(x)  # [M, K]
    a8 = _w8a8_cfg(layer, x2, None) if input_scale is None else None
    if a8 is not None:  # decode rows on the FP8 tensor cores: the _scaled_mm path's numbers
        return _w8a8_on_rows(layer, x2, a8, None).view(*lead, -1)
    cfg = fp8_gemv_plan(layer).get(x2.shape[0]) if x2.dtype == torch.bfloat16 else None
    if cfg is not None:
        # Decode rows (M <= 8): weight-dequant GEMV, x stays bf16 (no activation
        # quantization launch; the step is a weight stream).
        from kvflow.kernels.gemv_w8 import gemv_w8

        # (A static checkpoint input_scale is not needed: x is not quantized here.)
        y = gemv_w8(x2 if x2.stride(-1) == 1 else x2.contiguous(), layer.weight,
                    layer.weight_scale, cfg)
    elif input_scale is not None:  # the checkpoint's static per-tensor activation scale
        xq, sx = quantize_fp8_static(x2, input_scale)
        y = fp8_mm(xq, sx, layer.weight, layer.weight_scale, x.dtype)
    elif use_fp8_kernels(x2.device):
        from kvflow.kernels.fp8_quant import quantize_fp8

        # One launch for the per-token quantization, then _scaled_mm at every M: on the
        # H200 this beat the Triton FP8 GEMM (kernels/fp8_gemm.py, per-channel mode) at
        # every shape and M measured (fp8-bench-h200.json: gate_up M=1 48.5 us against
        # 87 us for its best tile; o 15.2 against 17.3).
        xq, sx = quantize_fp8(x2 if x2.stride(-1) == 1 else x2.contiguous())
        y = fp8_mm(xq, sx, layer.weight, layer.weight_scale, x.dtype)
    else:
        xq, sx = quantize_fp8_rows(x2)  # dynamic, per token
        y = fp8_mm(xq, sx, layer.weight, layer.weight_scale, x.dtype)
    if layer.bias is not None:
        y = y + layer.bias
    return y.view(*lead, -1)


class Fp8LinearMethod(_QuantizeAfterLoad):
    """``--quantization fp8``: the float weight quantized per output channel at load."""

    name = "fp8"

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w = self._take_dense(layer)  # [N, K]
        _check_device(layer, w)
        q, scale = quantize_fp8_rows(w)
        set_param(layer, "weight", q)
        set_param(layer, "weight_scale", scale)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return _apply(layer, x)

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor, act) -> torch.Tensor:
        return _apply_silu_and_mul(layer, x, act)

    def apply_normed(self, layer: LinearBase, x: torch.Tensor, residual, norm, act):
        out = _apply_normed(layer, x, residual, norm, act)
        return out if out is not None else super().apply_normed(layer, x, residual, norm, act)

    def apply_mlp(self, layer: LinearBase, x: torch.Tensor, residual, norm, act, down):
        out = _apply_mlp(layer, x, residual, norm, act, down)
        return out if out is not None else super().apply_mlp(layer, x, residual, norm, act,
                                                             down)


def shard_rows(layer: LinearBase, shard) -> tuple[int, int]:
    """(first output row, rows) of one loaded shard (q/k/v, gate/up) in a merged layer."""
    if shard is None:
        return 0, layer.output_size
    idx = layer.shard_ids.index(shard)
    return sum(layer.output_sizes[:idx]), layer.output_sizes[idx]


def load_fp8_weight(layer: LinearBase, param: nn.Parameter, t: torch.Tensor, shard) -> None:
    """Copy one shard of a pre-quantized float8_e4m3fn weight [rows, K] into its rows."""
    if t.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(f"{layer.prefix}: fp8 checkpoint weight has dtype {t.dtype} "
                             f"(supported: float8_e4m3fn)")
    start, size = shard_rows(layer, shard)
    if tuple(t.shape) != (size, layer.input_size):
        raise ModelLoadError(f"{layer.prefix}: fp8 weight shape {tuple(t.shape)} does not "
                             f"match the layer's {(size, layer.input_size)}")
    # Bytes: CPU copies of float8 tensors into a narrowed view are not all implemented.
    param.data.view(torch.uint8).narrow(0, start, size).copy_(t.view(torch.uint8))


class Fp8CheckpointLinearMethod(LinearMethod):
    """Pre-quantized FP8 weights: ``weight`` float8_e4m3fn [N, K] and ``weight_scale``
    per output channel ([N] or [N, 1]) or per tensor (one number per loaded shard).
    ``static``: the checkpoint's ``input_scale`` (one number per loaded shard) quantizes
    the activations, per tensor."""

    name = "fp8"

    def __init__(self, static: bool = False) -> None:
        self.static = static

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        if self.static:
            # One per loaded shard (q, k, v; gate, up): reduced to one after loading.
            a = nn.Parameter(torch.full((len(layer.output_sizes),), float("nan")),
                             requires_grad=False)
            a.weight_loader = lambda p, t, shard=None: self._load_input_scale(layer, p, t,
                                                                              shard)
            layer.register_parameter("input_scale", a)
        n, k = layer.output_size, layer.input_size
        w = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        w.weight_loader = lambda p, t, shard=None: load_fp8_weight(layer, p, t, shard)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("weight", w)
        s = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        s.weight_loader = lambda p, t, shard=None: self._load_scale(layer, p, t, shard)
        s.output_dim = 0
        layer.register_parameter("weight_scale", s)

    def _load_scale(self, layer, param, t: torch.Tensor, shard) -> None:
        start, size = shard_rows(layer, shard)
        param.data.narrow(0, start, size).copy_(channel_scales(t, size, f"{layer.prefix}:"))

    @staticmethod
    def _load_input_scale(layer, param, t: torch.Tensor, shard) -> None:
        if t.numel() != 1:
            raise ModelLoadError(f"{layer.prefix}: input_scale has shape {tuple(t.shape)}; "
                                 f"a static activation scale is one number (per tensor)")
        idx = 0 if shard is None else layer.shard_ids.index(shard)
        param.data[idx] = float(t)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        _check_device(layer, layer.weight)
        if not bool(torch.isfinite(layer.weight_scale).all()) or bool(
                (layer.weight_scale <= 0).any()):
            raise ModelLoadError(f"{layer.prefix}: weight_scale must be positive and finite")
        if self.static:
            a = layer.input_scale
            if not bool(torch.isfinite(a).all()) or bool((a <= 0).any()):
                raise ModelLoadError(f"{layer.prefix}: input_scale must be positive and "
                                     f"finite, got {a.tolist()}")
            # The shards of a merged layer read one input: the largest scale clips none.
            set_param(layer, "input_scale", a.max().to(layer.weight.device))

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return _apply(layer, x, layer.input_scale if self.static else None)

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor, act) -> torch.Tensor:
        return _apply_silu_and_mul(layer, x, act)

    def apply_normed(self, layer: LinearBase, x: torch.Tensor, residual, norm, act):
        out = None if self.static else _apply_normed(layer, x, residual, norm, act)
        return out if out is not None else super().apply_normed(layer, x, residual, norm, act)

    def apply_mlp(self, layer: LinearBase, x: torch.Tensor, residual, norm, act, down):
        out = None if self.static else _apply_mlp(layer, x, residual, norm, act, down)
        return out if out is not None else super().apply_mlp(layer, x, residual, norm, act,
                                                             down)
