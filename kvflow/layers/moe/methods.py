"""How a ``FusedMoE`` layer stores and multiplies its experts (the quantization hook,
shaped like linear layers' methods: ``create_weights``, ``process_weights_after_loading``,
``apply``).

- dense: on CUDA the fused Triton kernel (``kernels/fused_moe.py``); elsewhere
  ``routed_experts``, which reads only the experts some token was routed to.
- int8 (weight-only, symmetric per output channel, round to nearest at load): on CUDA
  the same Triton kernel reading int8 tiles with the channel scales in its epilogue; on
  CPU ``aten._weight_int8pack_mm`` per active expert.
- int4 (weight-only, groups along the input, round to nearest at load): on CUDA the
  same kernel reading packed int4 tiles (two inputs a byte along K; scales, and offsets
  when asymmetric, [E, K / group, N] in the model dtype; ``pack_int4_experts``),
  dequantized in registers; on CPU ``aten._weight_int4pack_mm_for_cpu`` per active
  expert.
- fp8 (weight-only float8 e4m3, one scale per output channel, quantized at load;
  activations stay in the model dtype): on CUDA (compute capability 8.9+) the same
  kernel reading float8 tiles, channel scales in its epilogue; on CPU each active
  expert's weights are dequantized for its matmul (no float8 matmul there).
  A pre-quantized fp8 checkpoint's experts (``Fp8CheckpointMoEMethod``) load into the
  same layout as stored (per-tensor scales broadcast to channels); its ``input_scale``
  is ignored, the experts being weight-only.
- gguf (a GGUF file's expert blocks, kept: ``GGUFMoEMethod``): each expert converted
  from its GGML blocks to ``Int4Groups`` (exact for Q4_0/Q4_1/Q4_K; Q8_0 exact as two
  nibbles over a doubled input; other types requantized to that 8-bit form, as for
  linear layers); on CPU ``aten._weight_int4pack_mm_for_cpu`` per active expert; on
  CUDA, 4-bit experts go to the int4 layout of the fused kernel, others are dequantized
  to the model dtype.

Refused at load with the reason named: pre-quantized int experts (GPTQ/AWQ/compressed-
tensors pack-quantized), block-wise fp8 (``fp8-block``, and checkpoints with
``weight_block_size``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.logger import init_logger
from kvflow.layers.quantization.fp8 import channel_scales
from kvflow.layers.quantization.packed import (CPU_ACT_DTYPE, Int4Groups, PackedInt4, int4_mm,
                                               int8_mm, quantize_int4, quantize_int8)

ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]
logger = init_logger(__name__)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   num_experts: int, expert_mlp: ExpertMLP) -> torch.Tensor:
    """x [T, H] through only the routed experts: the (token, slot) pairs are sorted by
    expert and each active expert runs once on its gathered rows (``expert_mlp(e, rows
    [n, H]) -> [n, H]``); ids -1 (another rank's experts) are skipped. One host sync (the
    per-expert counts): this is the CPU path, not a CUDA-graph one."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts).tolist()
    skipped = int((flat < 0).sum())
    out = torch.zeros_like(x)
    start = skipped  # the -1 ids sort first
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]  # [n] flat (token, slot) indices
        start += n
        tokens = pairs // k
        y = expert_mlp(e, x[tokens])  # [n, H]
        # index_put_ over index_add_: on a busy CPU the latter's threaded kernel stalls
        # (80 ms for one row on 2 loaded cores; index_put_ 0.01 ms)
        out.index_put_((tokens,), y * weights.reshape(-1)[pairs, None].to(y.dtype),
                       accumulate=True)
    return out


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def _set(layer: nn.Module, name: str, t: torch.Tensor) -> None:
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(t, requires_grad=False))


class UnquantizedMoEMethod:
    name = "dense"

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        e, i, h = layer.num_local_experts, layer.local_intermediate, layer.hidden_size
        for pname, shape in (("w13_weight", (e, 2 * i, h)), ("w2_weight", (e, h, i))):
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            p.weight_loader = layer.weight_loader
            layer.register_parameter(pname, p)

    def process_weights_after_loading(self, layer) -> None:
        pass

    def apply(self, layer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
              ) -> torch.Tensor:
        if x.is_cuda:
            from kvflow.kernels.fused_moe import fused_moe

            return fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids,
                             may_drop=layer.expert_parallel)
        w13, w2 = layer.w13_weight, layer.w2_weight
        return routed_experts(x, weights, ids, layer.num_local_experts,
                              lambda e, r: F.linear(_silu_mul(F.linear(r, w13[e])), w2[e]))


class Int8MoEMethod(UnquantizedMoEMethod):
    name = "int8"

    def process_weights_after_loading(self, layer) -> None:
        for pname in ("w13", "w2"):
            w = getattr(layer, f"{pname}_weight").data  # [E, N, K]
            q, s = quantize_int8(w.reshape(-1, w.shape[-1]))
            delattr(layer, f"{pname}_weight")
            _set(layer, f"{pname}_q", q.view(w.shape))  # int8 [E, N, K]
            # [E, N]: float32 for the Triton epilogue, bfloat16 for the CPU op
            _set(layer, f"{pname}_scale", s.view(w.shape[:2]).to(
                torch.float32 if w.is_cuda else CPU_ACT_DTYPE))

    def apply(self, layer, x, weights, ids):
        if x.is_cuda:
            from kvflow.kernels.fused_moe import fused_moe

            return fused_moe(x, layer.w13_q, layer.w2_q, weights, ids,
                             layer.w13_scale, layer.w2_scale,
                             may_drop=layer.expert_parallel)
        q13, s13, q2, s2 = layer.w13_q, layer.w13_scale, layer.w2_q, layer.w2_scale
        return routed_experts(x, weights, ids, layer.num_local_experts,
                              lambda e, r: int8_mm(_silu_mul(int8_mm(r, q13[e], s13[e])),
                                                   q2[e], s2[e]))


class Int4MoEMethod(UnquantizedMoEMethod):
    name = "int4"

    def __init__(self, group_size: int, symmetric: bool) -> None:
        self.group_size, self.symmetric = group_size, symmetric

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        for k in (layer.hidden_size, layer.local_intermediate):
            if k % self.group_size:
                raise ModelLoadError(f"{layer.prefix}: int4 group size {self.group_size} "
                                     f"does not divide the experts' {k} inputs; use "
                                     f"--quantization-group-size 32")
        super().create_weights(layer, dtype)

    def process_weights_after_loading(self, layer) -> None:
        for pname in ("w13", "w2"):
            w = getattr(layer, f"{pname}_weight").data  # [E, N, K]
            delattr(layer, f"{pname}_weight")
            groups = [quantize_int4(w[e], self.group_size, self.symmetric)
                      for e in range(w.shape[0])]
            if w.is_cuda:  # the fused kernel's layout: packed along K, scales [E, K/g, N]
                from kvflow.kernels.fused_moe import pack_int4_experts

                packed, scale, offset = pack_int4_experts(
                    torch.stack([g.values for g in groups]),
                    torch.stack([g.scale for g in groups]),
                    None if self.symmetric else torch.stack([g.zero for g in groups]),
                    w.dtype)
                _set(layer, f"{pname}_q", packed)  # uint8 [E, N, K / 2]
                _set(layer, f"{pname}_scale", scale)  # [E, K / g, N], model dtype
                if offset is not None:
                    _set(layer, f"{pname}_offset", offset)  # [E, K / g, N]
            else:
                packed = [PackedInt4(g) for g in groups]
                _set(layer, f"{pname}_q", torch.stack([p.packed for p in packed]))
                _set(layer, f"{pname}_sz", torch.stack([p.scale_zero for p in packed]))

    def apply(self, layer, x, weights, ids):
        if x.is_cuda:
            from kvflow.kernels.fused_moe import fused_moe

            return fused_moe(x, layer.w13_q, layer.w2_q, weights, ids, layer.w13_scale,
                             layer.w2_scale, may_drop=layer.expert_parallel,
                             w13_offset=getattr(layer, "w13_offset", None),
                             w2_offset=getattr(layer, "w2_offset", None),
                             w4_group=self.group_size)
        q13, sz13, q2, sz2 = layer.w13_q, layer.w13_sz, layer.w2_q, layer.w2_sz
        g = self.group_size
        return routed_experts(x, weights, ids, layer.num_local_experts,
                              lambda e, r: int4_mm(_silu_mul(int4_mm(r, q13[e], sz13[e], g,
                                                                     False)),
                                                   q2[e], sz2[e], g, False))


class Fp8MoEMethod(UnquantizedMoEMethod):
    """Weight-only float8 (e4m3) experts, one scale per output channel (``s = max|w_row|
    / 448``, quantized at load); activations stay in the model dtype."""

    name = "fp8"

    def process_weights_after_loading(self, layer) -> None:
        from kvflow.layers.quantization.fp8 import quantize_fp8_rows

        for pname in ("w13", "w2"):
            w = getattr(layer, f"{pname}_weight").data  # [E, N, K]
            _check_fp8_device(layer, w)
            delattr(layer, f"{pname}_weight")
            parts = [quantize_fp8_rows(w[e]) for e in range(w.shape[0])]  # per expert:
            # a float32 copy of one expert at a time, not of the whole stack
            _set(layer, f"{pname}_q", torch.stack([q for q, _ in parts]))  # fp8 [E, N, K]
            _set(layer, f"{pname}_scale", torch.stack([s for _, s in parts]))  # f32 [E, N]

    def apply(self, layer, x, weights, ids):
        q13, s13, q2, s2 = layer.w13_q, layer.w13_scale, layer.w2_q, layer.w2_scale
        if x.is_cuda:
            from kvflow.kernels.fused_moe import fused_moe

            return fused_moe(x, q13, q2, weights, ids, s13, s2,
                             may_drop=layer.expert_parallel)

        def deq(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return (q.float() * s[:, None]).to(dtype)  # [N, K]: exact in float32

        return routed_experts(x, weights, ids, layer.num_local_experts,
                              lambda e, r: F.linear(_silu_mul(F.linear(
                                  r, deq(q13[e], s13[e], r.dtype))), deq(q2[e], s2[e], r.dtype)))


def _local_expert(layer, shard_id: tuple[int | None, str], what: str) -> int | None:
    """This rank's index of the expert a per-expert, per-projection load is for (None:
    another rank's expert, dropped); ``what`` names the loader in its error."""
    expert, kind = shard_id
    if expert is None or kind not in ("w1", "w3", "w2"):
        raise ModelLoadError(f"{layer.prefix}: {what} load one expert and projection at "
                             f"a time (w1, w3, w2), got {kind!r}")
    return layer.local_expert(expert)


def _check_fp8_device(layer, w: torch.Tensor) -> None:
    if w.is_cuda and torch.cuda.get_device_capability(w.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(w.device)
        raise ModelLoadError(
            f"{layer.prefix}: fp8 experts need a GPU with float8 support (compute "
            f"capability 8.9 or newer); this one is {major}.{minor}: use "
            f"--quantization int8 or int4")


class Fp8CheckpointMoEMethod(Fp8MoEMethod):
    """A pre-quantized fp8 checkpoint's experts (config.json ``quantization_config``
    ``quant_method: fp8``, or compressed-tensors float-quantized), kept as stored: each
    expert's ``{gate,up,down}_proj.weight`` (float8_e4m3fn) and its ``weight_scale``, per
    output channel ([N] or [N, 1]) or per tensor (one number, broadcast to its rows), go
    into ``Fp8MoEMethod``'s layout (fp8 [E, N, K], float32 [E, N]) without re-quantizing;
    gate and up keep their own scales in their rows of w13. A checkpoint's
    ``input_scale`` (static activation scales, W8A8) is ignored: the experts are
    weight-only, their activations stay in the model dtype. Block-wise scales
    (``weight_block_size``) are refused in ``moe_method``."""

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        e, i, h = layer.num_local_experts, layer.local_intermediate, layer.hidden_size
        for pname, (n, k) in (("w13", (2 * i, h)), ("w2", (h, i))):
            w = nn.Parameter(torch.empty(e, n, k, dtype=torch.float8_e4m3fn),
                             requires_grad=False)
            w.weight_loader = lambda p, t, shard_id: self._load_weight(layer, p, t, shard_id)
            layer.register_parameter(f"{pname}_weight", w)
            # NaN until loaded: a missing scale is caught after loading
            s = nn.Parameter(torch.full((e, n), float("nan"), dtype=torch.float32),
                             requires_grad=False)
            s.weight_loader = lambda p, t, shard_id: self._load_scale(layer, p, t, shard_id)
            layer.register_parameter(f"{pname}_weight_scale", s)

    @staticmethod
    def _load_weight(layer, param, t: torch.Tensor, shard_id) -> None:
        if t.dtype != torch.float8_e4m3fn:
            raise ModelLoadError(f"{layer.prefix}: fp8 checkpoint expert weight has dtype "
                                 f"{t.dtype} (supported: float8_e4m3fn)")
        # FusedMoE's own placement (tensor-parallel slices, expert-parallel ranks) on byte
        # views: CPU copies of float8 tensors into narrowed views are not all implemented
        layer.weight_loader(nn.Parameter(param.data.view(torch.uint8), requires_grad=False),
                            t.view(torch.uint8), shard_id)

    @staticmethod
    def _load_scale(layer, param, t: torch.Tensor, shard_id) -> None:
        e = _local_expert(layer, shard_id, "fp8 expert scales")
        if e is None:
            return
        expert, kind = shard_id
        i, s, h = layer.local_intermediate, layer.inter_start, layer.hidden_size
        n = h if kind == "w2" else layer.intermediate_size  # the checkpoint's output rows
        t = channel_scales(t, n, f"{layer.prefix}: expert {expert} {kind}")
        if kind == "w2":  # output channels = hidden: whole on every rank
            param.data[e].copy_(t)
            return
        rows = slice(0, i) if kind == "w1" else slice(i, 2 * i)
        param.data[e, rows].copy_(t[s:s + i])  # this rank's slice of the intermediate rows

    def process_weights_after_loading(self, layer) -> None:
        for pname in ("w13", "w2"):
            w = getattr(layer, f"{pname}_weight").data
            s = getattr(layer, f"{pname}_weight_scale").data
            _check_fp8_device(layer, w)
            if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
                raise ModelLoadError(f"{layer.prefix}: {pname} expert weight_scale must be "
                                     f"positive and finite (missing from the checkpoint?)")
            delattr(layer, f"{pname}_weight")
            delattr(layer, f"{pname}_weight_scale")
            _set(layer, f"{pname}_q", w)  # fp8 [E, N, K]
            _set(layer, f"{pname}_scale", s)  # f32 [E, N]


FOUR_BIT = (2, 3, 12)  # GGML Q4_0, Q4_1, Q4_K: affine 4-bit per 32, exact as Int4Groups
PACK_VALUES = 1 << 24  # weight values converted before one pack call (an int32 copy: 64 MB)


def _record_gguf_expert(layer, loaded: torch.Tensor, shard_id: tuple[int | None, str]
                        ) -> None:
    """Keep what the GGUF loader sends for one expert's projection: its GGML type (0-d)
    or its block rows (uint8 [rows, row_bytes], a view of the mapped file: read when
    converted). Other ranks' experts are dropped unread."""
    e = _local_expert(layer, shard_id, "GGUF experts")
    if e is None:
        return
    entry = layer._gguf_experts.setdefault((e, shard_id[1]), {})
    if loaded.dim() == 0:
        entry["type"] = int(loaded)
    elif loaded.dtype != torch.uint8 or loaded.dim() != 2:
        raise ModelLoadError(f"{layer.prefix}: GGUF expert blocks must be uint8 [rows, "
                             f"bytes], got {loaded.dtype} {tuple(loaded.shape)}")
    else:
        entry["raw"] = loaded.numpy()


def _gguf_expert_part(layer, e: int, kind: str) -> tuple[int, np.ndarray]:
    """(GGML type, this rank's block rows) of local expert ``e``'s projection ``kind``:
    a tensor-parallel rank's slice of the intermediate dimension (w1/w3 rows, w2 whole
    blocks of columns)."""
    from kvflow.layers.quantization import ggml_blocks as gb

    entry = layer._gguf_experts.get((e, kind), {})
    if "type" not in entry or "raw" not in entry:
        raise ModelLoadError(f"{layer.prefix}: expert {layer.expert_start + e} {kind} is "
                             f"missing its GGUF data or type")
    t, raw = entry["type"], entry["raw"]
    h, full = layer.hidden_size, layer.intermediate_size
    i, s = layer.local_intermediate, layer.inter_start
    rows, cols = (h, full) if kind == "w2" else (full, h)
    elems, nbytes = gb.block_size(t)
    if cols % elems or raw.shape != (rows, cols // elems * nbytes):
        raise ModelLoadError(f"{layer.prefix}: expert {layer.expert_start + e} {kind} has "
                             f"{tuple(raw.shape)} bytes of {gb.type_name(t)}, expected "
                             f"{rows} rows of {cols} inputs")
    if kind != "w2":
        return t, raw[s:s + i]
    if s % elems or i % elems:
        raise ModelLoadError(f"{layer.prefix}: a tensor-parallel slice of {i} of the "
                             f"experts' {full} inputs splits {gb.type_name(t)} blocks of "
                             f"{elems}; use --enable-expert-parallel")
    return t, raw[:, s // elems * nbytes:(s + i) // elems * nbytes]


class GGUFMoEMethod(UnquantizedMoEMethod):
    """A GGUF file's experts kept in their blocks (``--quantization gguf``, the default
    for a GGUF file on CPU).

    The loader sends, per expert and projection (w1 gate, w3 up, w2 down), the GGML type
    then the raw block rows; after loading each expert is converted alone
    (``gguf.convert_shards``: ``Int4Groups``, exact for Q4_0/Q4_1/Q4_K, Q8_0 as two
    nibbles over a doubled input, other types requantized to that 8-bit form; gate and
    up may differ in type, the 4-bit one then widened) and packed:

    - CPU: per projection, aten's int4 pack (``PackedInt4``; doubled when any expert's
      projection is 8-bit), run per active expert by ``int4_mm``; a projection stored
      dense in the file (F32/F16/BF16) stays dense in the model dtype.
    - CUDA: when every projection is 4-bit, the fused kernel's int4 layout
      (``pack_int4_experts``: w = v * scale + (zero - 8 scale), the scales and offsets
      rounded to the model dtype); otherwise (Q8_0, K-quants other than Q4_K, dense) the
      experts are dequantized into the model dtype, as before this method existed.

    ``dense``: dequantize every expert into the model dtype whatever its type (the
    reference the tests compare the blocks with)."""

    name = "gguf"
    group = 32  # every GGML block type is read as groups of 32 inputs

    def __init__(self, dense: bool = False) -> None:
        self.dense = dense
        self.layouts: dict[str, str] = {}
        """w13 / w2 -> "dense" (model dtype), "int4" or "int8" (doubled int4 pack)."""

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.device = torch.empty(0).device  # the model is built under torch.device(...)
        layer._gguf_experts = {}  # (local expert, w1 | w3 | w2) -> {"type", "raw"}
        for pname in ("w13_weight", "w2_weight"):
            p = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            p.weight_loader = lambda _p, w, shard_id: _record_gguf_expert(layer, w, shard_id)
            layer.register_parameter(pname, p)

    def _layout(self, layer, kinds: tuple[str, ...]) -> str:
        from kvflow.layers.quantization import ggml_blocks as gb

        types = {layer._gguf_experts.get((e, k), {}).get("type")
                 for e in range(layer.num_local_experts) for k in kinds}
        if self.dense or types <= set(gb.DENSE_TYPES):
            return "dense"
        return "int4" if types <= set(FOUR_BIT) else "int8"

    def process_weights_after_loading(self, layer) -> None:
        from kvflow.layers.quantization.ggml_blocks import requantize8
        from kvflow.layers.quantization.gguf import convert_shards, widen

        projs = (("w13", ("w1", "w3"), layer.hidden_size),
                 ("w2", ("w2",), layer.local_intermediate))
        self.layouts = {p: self._layout(layer, kinds) for p, kinds, _ in projs}
        cuda = self.device.type == "cuda"
        if cuda and set(self.layouts.values()) != {"int4"}:
            if not self.dense:
                logger.info("%s: GGUF experts (%s) dequantized to %s: the fused kernel "
                            "keeps only 4-bit blocks", layer.prefix,
                            "/".join(self.layouts.values()), self.dtype)
            self.layouts = {p: "dense" for p in self.layouts}
        layer.gguf_types = []
        n = layer.num_local_experts
        for pname, kinds, cols in projs:
            layout = self.layouts[pname]
            out: dict[str, torch.Tensor] = {}
            run: list = []  # converted experts not yet packed (from expert ``start``)
            start = size = 0
            for e in range(n):
                w, names = convert_shards([_gguf_expert_part(layer, e, k) for k in kinds],
                                          cols)
                if e == 0:
                    layer.gguf_types += names  # one GGUF tensor per projection
                if layout != "dense":
                    if isinstance(w, torch.Tensor):  # a dense expert among quantized ones
                        w = requantize8(w)
                    if layout == "int8" and not w.doubled:
                        w = widen(w)
                run.append(w)
                size += w.numel() if isinstance(w, torch.Tensor) else w.values.numel()
                if size < PACK_VALUES and e < n - 1:
                    continue
                for name, t in self._pack(run, layout, cuda).items():  # [len(run), ...]
                    if name not in out:  # preallocated: no stacking copy of the layer
                        out[name] = torch.empty((n, *t.shape[1:]), dtype=t.dtype,
                                                device=self.device)
                    out[name][start:start + len(run)].copy_(t)
                start, run, size = start + len(run), [], 0
            delattr(layer, f"{pname}_weight")  # the loader's placeholder
            for name, t in out.items():
                _set(layer, f"{pname}_{name}", t)
        del layer._gguf_experts

    def _pack(self, run: list, layout: str, cuda: bool) -> dict[str, torch.Tensor]:
        """Consecutive experts' projections (``Int4Groups``, or dense float32 [N, K]) in
        the layout ``apply`` reads, stacked [len(run), ...]: one pack call for them all
        (aten's CPU pack costs ~30 ms a call whatever its size; rows pack alone)."""
        m = len(run)
        if layout == "dense":
            return {"weight": torch.stack([w if isinstance(w, torch.Tensor)
                                           else w.dequantize() for w in run]).to(self.dtype)}
        g = Int4Groups.cat(run)  # [m N, K2]
        if cuda:  # the fused kernel's layout: exact 4-bit only (checked by the layout)
            from kvflow.kernels.fused_moe import pack_int4_experts

            q, scale, offset = pack_int4_experts(g.values.view(m, -1, g.values.shape[1]),
                                                 g.scale.view(m, -1, g.scale.shape[1]),
                                                 g.zero.view(m, -1, g.zero.shape[1]),
                                                 self.dtype)
            return {"q": q, "scale": scale, "offset": offset}
        p = PackedInt4(g)
        rows = p.packed.shape[0] // m
        sz = p.scale_zero.view(p.scale_zero.shape[0], m, rows, 2).transpose(0, 1)
        return {"q": p.packed.view(m, rows, -1), "sz": sz}  # [m, N, K2/2], [m, K2/32, N, 2]

    def _matmul(self, layer, pname: str) -> Callable[[int, torch.Tensor], torch.Tensor]:
        layout = self.layouts[pname]
        if layout == "dense":
            w = getattr(layer, f"{pname}_weight")
            return lambda e, r: F.linear(r, w[e])
        q, sz = getattr(layer, f"{pname}_q"), getattr(layer, f"{pname}_sz")
        return lambda e, r: int4_mm(r, q[e], sz[e], self.group, layout == "int8")

    def apply(self, layer, x, weights, ids):
        if x.is_cuda:
            from kvflow.kernels.fused_moe import fused_moe

            if self.layouts["w13"] == "int4":
                return fused_moe(x, layer.w13_q, layer.w2_q, weights, ids, layer.w13_scale,
                                 layer.w2_scale, may_drop=layer.expert_parallel,
                                 w13_offset=layer.w13_offset, w2_offset=layer.w2_offset,
                                 w4_group=self.group)
            return fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids,
                             may_drop=layer.expert_parallel)
        mm13, mm2 = self._matmul(layer, "w13"), self._matmul(layer, "w2")
        return routed_experts(x, weights, ids, layer.num_local_experts,
                              lambda e, r: mm2(e, _silu_mul(mm13(e, r))))


def moe_method(config, prefix: str) -> UnquantizedMoEMethod:
    """The experts' method of the MoE layer named ``prefix`` from the model's one
    QuantizationConfig (None: dense)."""
    kind = "none" if config is None else config.method_for(prefix)
    if kind == "none":
        return UnquantizedMoEMethod()
    if kind == "int8":
        return Int8MoEMethod()
    if kind == "int4":
        return Int4MoEMethod(config.group_size, config.symmetric)
    if kind == "gguf":
        return GGUFMoEMethod()
    if kind == "fp8" and config.weight_block is not None:
        if config.prequantized:
            raise ModelLoadError(
                f"fp8 checkpoints with block-wise scales (quantization_config "
                f"weight_block_size {list(config.weight_block)}) are not supported for MoE "
                f"experts ({prefix}); per-tensor or per-channel fp8 checkpoints load, or "
                f"load the float checkpoint with --quantization fp8")
        raise ModelLoadError(f"quantization fp8-block (block-wise scales) is not supported "
                             f"for MoE experts ({prefix}); use --quantization fp8 "
                             f"(per-channel experts)")
    if kind == "fp8":
        return Fp8CheckpointMoEMethod() if config.prequantized else Fp8MoEMethod()
    raise ModelLoadError(f"quantization {kind!r} is not supported for MoE experts "
                         f"({prefix}); use --quantization int8, int4, fp8, gguf (GGUF "
                         f"files) or none")
