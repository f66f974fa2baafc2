"""LLM.int8 (Dettmers et al. 2022): a mixed-precision decomposition of every linear.

Per call, the input columns whose absolute maximum over the step's tokens exceeds the
threshold (default 6.0) are outliers: their part of the product runs in the model dtype
against the matching input columns of the full-precision weight; every other column is
quantized per token to int8 and multiplied through the int8 GEMM (``int8_gemm.py``) with
the per-output-channel int8 weight. The outlier columns are zeroed in the int8 operand
(not sliced out), so they do not inflate the per-token scales and the int8 weight needs
no per-step gather:

    y = x[:, O] @ W[:, O]^T  +  int8(x with O zeroed) @ int8(W)^T * scales

The float weight is kept beside the int8 one (5 bytes per weight with float32): this is
an accuracy method, not a memory one. The CPU path gathers only the outlier columns
(``nonzero`` once per call); on CUDA the split is by mask, without a host sync, so CUDA
graphs can capture it (the outlier statistics then count the eager steps only).

How many columns are outliers is counted per layer type (qkv_proj, o_proj, gate_up_proj,
down_proj): ``outlier_summary()``; the startup log and ``kvflow bench quality`` print it.
"""

from __future__ import annotations

import threading

import torch

from kvflow.layers.linear import LinearBase, set_param
from kvflow.layers.quantization.int8_gemm import Int8Weight, int8_mm, prepare_weight
from kvflow.layers.quantization.int8_gemm import quantize_int8_rows
from kvflow.layers.quantization.packed import flatten_tokens
from kvflow.layers.quantization.rtn import _QuantizeAfterLoad
from kvflow.logger import init_logger

logger = init_logger(__name__)

_lock = threading.Lock()
# layer type -> [calls, outlier columns summed over calls, max in one call, K]
_STATS: dict[str, list] = {}
_LOG_AT = {100, 10_000, 1_000_000}  # calls of the first layer type seen


def outlier_summary(reset: bool = False) -> dict[str, dict]:
    """Per layer type: calls, mean / max outlier columns per call and the input width."""
    with _lock:
        out = {}
        for kind, (calls, total, mx, k) in _STATS.items():
            total = int(total)
            mx = int(mx)
            out[kind] = {"calls": calls, "mean_outlier_columns": total / max(calls, 1),
                         "max_outlier_columns": mx, "in_features": k,
                         "mean_outlier_fraction": total / max(calls, 1) / k}
        if reset:
            _STATS.clear()
        return out


def format_summary(summary: dict[str, dict]) -> str:
    return "; ".join(f"{kind} {s['mean_outlier_columns']:.1f} of {s['in_features']} "
                     f"(max {s['max_outlier_columns']})" for kind, s in summary.items())


def _record(kind: str, n_out: torch.Tensor | int, k: int) -> None:
    with _lock:
        st = _STATS.setdefault(kind, [0, 0, 0, k])
        st[0] += 1
        st[1] = st[1] + n_out  # a device tensor on CUDA: no sync per call
        if isinstance(n_out, torch.Tensor):
            st[2] = n_out if isinstance(st[2], int) else torch.maximum(st[2], n_out)
        else:
            st[2] = max(st[2], n_out)
        calls = st[0] if kind == next(iter(_STATS)) else 0
    if calls in _LOG_AT and not isinstance(n_out, torch.Tensor):
        logger.info("llm-int8 outlier input columns per call after %d calls: %s", calls,
                    format_summary(outlier_summary()))


class LlmInt8LinearMethod(_QuantizeAfterLoad):
    """``--quantization llm-int8``: int8 per output channel plus the float weight for
    the outlier columns of each step."""

    name = "llm-int8"
    w: Int8Weight | None = None

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        wd = layer.weight.data  # [N, K], kept (the outlier columns' float weight)
        amax = wd.float().abs().amax(-1)
        if hasattr(layer, "row_max"):
            amax = layer.row_max(amax)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # [N]
        q = torch.round(wd.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        set_param(layer, "qweight", q)
        set_param(layer, "weight_scale", scale)
        self.w = prepare_weight(q, scale, layer.prefix or "a layer")
        self.kind = (layer.prefix or "linear").rsplit(".", 1)[-1]

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flatten_tokens(x)  # [M, K]
        y = llm_int8_mm(x2, layer.weight, self.w, self.threshold, self.kind)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*lead, -1)


def llm_int8_mm(x2: torch.Tensor, w_float: torch.Tensor, w: Int8Weight, threshold: float,
                kind: str | None = None) -> torch.Tensor:
    """x2 [M, K] -> [M, N] by the decomposition above (``kind``: count the outliers)."""
    col_max = x2.abs().amax(dim=0)  # [K]
    outl = col_max > threshold  # [K] bool
    k = x2.shape[1]
    if x2.device.type == "cuda":  # mask split: no host sync
        xo = x2 * outl.to(x2.dtype)  # [M, K], outlier columns only
        xq, sx = quantize_int8_rows(x2 - xo)
        y = int8_mm(xq, sx, w, x2.dtype) + torch.nn.functional.linear(xo, w_float)
        # Under CUDA-graph capture the count would be recorded once, not per replay:
        # graphed decode steps are left out of the statistics (prefill steps count).
        if kind is not None and not torch.cuda.is_current_stream_capturing():
            _record(kind, outl.sum(), k)
        return y
    idx = outl.nonzero().squeeze(1)  # [O]
    if kind is not None:
        _record(kind, int(idx.numel()), k)
    if idx.numel() == 0:
        xq, sx = quantize_int8_rows(x2)
        return int8_mm(xq, sx, w, x2.dtype)
    x_in = x2.clone()
    x_in[:, idx] = 0
    xq, sx = quantize_int8_rows(x_in)
    y = int8_mm(xq, sx, w, x2.dtype)  # [M, N]
    # [M, O] @ [O, N]: the outlier columns against the float weight's matching columns
    return y.addmm_(x2.index_select(1, idx), w_float.index_select(1, idx).t())


def llm_int8_ref(x2: torch.Tensor, w_float: torch.Tensor, threshold: float) -> torch.Tensor:
    """Pure-torch reference: the same decomposition with the int8 product in int64."""
    from kvflow.layers.quantization.int8_gemm import int8_mm_ref

    outl = x2.abs().amax(dim=0) > threshold  # [K]
    wq, sw = quantize_int8_rows(w_float)
    xq, sx = quantize_int8_rows(x2.masked_fill(outl[None, :], 0))
    y = int8_mm_ref(xq, sx, wq, sw, torch.float32)
    y += x2.float()[:, outl] @ w_float.float()[:, outl].t()
    return y.to(x2.dtype)
