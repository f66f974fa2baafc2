"""GGUF weights kept in their blocks: each linear layer (and the embedding) loads the raw
block bytes of its checkpoint tensors and repacks them once, after loading, into the
packed int4 form of ``packed.py`` (GGML 8-bit blocks as two nibbles over a doubled input).

The loader yields, per GGUF tensor, ``<module>.qweight_type`` (a 0-d int64 tensor, the
GGML type) then ``<module>.qweight`` (uint8 [rows, row_bytes]); merged layers receive one
pair per shard, so q, k and v (or gate and up) may even differ in type, as in the
Q4_K_M files, which store some v and down projections as Q6_K.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.layers.linear import LinearBase, LinearMethod, set_param
from kvflow.layers.quantization import ggml_blocks as gb
from kvflow.layers.quantization import gpu, layout_cache
from kvflow.layers.quantization.packed import (Int4Groups, PackedInt4, flatten_tokens,
                                               gemv_layout, int4_mm, q8_layout,
                                               refine_top_logits)


GEMV_ROWS = 16  # rows the C++ step's float32-activation GEMV takes (kMaxGemvRows)
REFINE_TOP = 32  # logits per row an int8-activation lm_head recomputes in float32


def _placeholders(layer: nn.Module, loader) -> None:
    """``qweight``/``qweight_type`` parameters that only record what the checkpoint sends;
    the real (packed) parameters exist after loading, when the types are known."""
    layer._gguf_shards = {}
    for name in ("qweight", "qweight_type"):
        p = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        p.weight_loader = loader
        # Raw block rows: output rows are whole rows; the input dimension is packed in
        # blocks (elements per byte fixed per type, set on ``pack_factor`` when loaded).
        p.output_dim, p.input_dim, p.packed_dim = 0, 1, 1
        layer.register_parameter(name, p)


def _record(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard) -> None:
    entry = layer._gguf_shards.setdefault(shard, {})
    if loaded.dim() == 0:
        ggml_type = int(loaded)
        elems, nbytes = gb.block_size(ggml_type)
        layer.qweight.pack_factor = Fraction(elems, nbytes)
        layer.qweight.input_block = elems  # a tensor-parallel split keeps blocks whole
        entry["type"] = ggml_type
    else:
        if loaded.dtype != torch.uint8 or loaded.dim() != 2:
            raise ModelLoadError(f"GGUF block data must be uint8 [rows, bytes], got "
                                 f"{loaded.dtype} {tuple(loaded.shape)}")
        entry["raw"] = loaded.numpy()


def _shard(layer: nn.Module, shard, rows: int, cols: int) -> tuple[int, np.ndarray]:
    entry = layer._gguf_shards.get(shard, {})
    if "type" not in entry or "raw" not in entry:
        raise ModelLoadError(f"GGUF tensor for shard {shard!r} of a {rows}x{cols} layer is "
                             f"missing its data or type")
    raw = entry["raw"]
    if raw.shape[0] != rows:
        raise ModelLoadError(f"GGUF tensor has {raw.shape[0]} rows, the layer's shard "
                             f"{shard!r} has {rows}")
    return entry["type"], raw


def _dense_raw(raw: np.ndarray, cols: int, ggml_type: int) -> torch.Tensor:
    return gb.dequantize(raw, cols, ggml_type) if ggml_type != gb.F32 else torch.from_numpy(
        np.ascontiguousarray(raw).view(np.float32).reshape(raw.shape[0], cols).copy())


def convert_shards(parts: list[tuple[int, np.ndarray]], cols: int
             ) -> tuple[Int4Groups | torch.Tensor, list[str]]:
    """Shards (type, bytes) -> one Int4Groups, or a dense float32 weight when every shard is
    stored dense; also the type names for the startup log."""
    names = [gb.type_name(t) for t, _ in parts]
    if all(t in gb.DENSE_TYPES for t, _ in parts):
        return torch.cat([_dense_raw(r, cols, t) for t, r in parts]), names
    groups = []
    for t, raw in parts:
        if t in gb.DENSE_TYPES:
            g = gb.requantize8(_dense_raw(raw, cols, t))
        else:
            g, exact = gb.to_int4_groups(raw, cols, t)
            if not exact:
                names[len(groups)] += "->8bit"
        groups.append(g)
    if len({g.doubled for g in groups}) > 1:
        # 4-bit and 8-bit shards in one layer: widen the 4-bit ones (a zero high half).
        groups = [g if g.doubled else widen(g) for g in groups]
    return Int4Groups.cat(groups), names


def widen(g: Int4Groups) -> Int4Groups:
    """A 4-bit Int4Groups as a doubled one whose first half contributes exactly zero."""
    return Int4Groups(torch.cat([torch.full_like(g.values, 8), g.values], dim=1),
                      torch.cat([torch.zeros_like(g.scale), g.scale], dim=1),
                      torch.cat([torch.zeros_like(g.zero), g.zero], dim=1), g.group, True)


class GGUFLinearMethod(LinearMethod):
    """A linear layer on GGUF blocks (or, tied, on its embedding's blocks)."""

    name = "gguf"

    def __init__(self, tied_to: nn.Module | None = None) -> None:
        self._tied = [tied_to] if tied_to is not None else []  # not a submodule

    triton: gpu.TritonWeight | None = None
    """Set after loading when the blocks went to the GPU kernels."""
    gemv: tuple[torch.Tensor, torch.Tensor] | None = None
    """(values, scale_bias) for the C++ step's GEMV (packed.gemv_layout, or q8_layout once
    ``to_int8_activations`` ran), or None."""
    gemv_kind = 0
    """0: ``gemv`` is for float32 activations; 4 or 8: for int8 ones (weights of 4 or 8
    bits, ``q8_gemv``), the ``kind`` of the C++ ``quant_gemv``."""
    run_gemv_any_rows = False
    """``run_gemv`` takes any number of rows (cpu/step.py use_step_gemv), not only 16."""
    head = False
    """Set with ``run_gemv`` on an lm_head (whose top logits are then refined)."""
    refine_gemv = None
    """The C++ ``q8_refine_top`` (x, blocks, bits, y, k), set with ``run_gemv``."""
    run_gemv = None
    """The C++ step's ``quant_gemv`` (x, values, scale_bias, group, doubled, kind) -> y,
    set on a tied head by the step after its self-check; None: the packed aten op."""

    def to_int8_activations(self) -> bool:
        """Switch ``gemv`` to the int8-activation layout (once; whether it now has it)."""
        if self.gemv is not None and self.gemv_kind == 0:
            name = None if self.layout_src is None else layout_cache.key("gguf-q8",
                                                                         self.layout_src)
            hit = None if name is None else layout_cache.get(name, ("blocks",))
            if hit is not None and hit[1].get("bits") in ("4", "8"):
                q8 = hit[0]["blocks"], int(hit[1]["bits"])
            else:
                q8 = q8_layout(*self.gemv, self.group, self.doubled)
                if q8 is not None and name is not None:
                    layout_cache.put(name, {"blocks": q8[0]}, {"bits": str(q8[1])})
            if q8 is not None:  # (blocks, unused): quant_gemv takes two tensors
                self.gemv, self.gemv_kind = (q8[0], torch.empty(0)), q8[1]
        return self.gemv_kind != 0

    layout_src: str | None = None
    """The layout cache's key of this layer's source (its GGML blocks, or the tied
    embedding's), None when its layouts are not cached (dense, GPU)."""

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.device = torch.empty(0).device  # the model is built under torch.device(...)
        if not self._tied:
            _placeholders(layer, lambda p, w, shard=None: _record(layer, p, w, shard))

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        cpu = self.device.type == "cpu"
        if self._tied:
            emb = self._tied[0]
            src = getattr(emb.quant_method, "layout_src", None)
            src = None if src is None or not cpu else layout_cache.key("gguf-tied-head", src)

            def convert():
                return emb.quant_method.source(emb)
        else:
            shards = layer.shard_ids if len(layer.output_sizes) > 1 else [None]
            parts = [_shard(layer, s, n, layer.input_size)
                     for s, n in zip(shards, layer.output_sizes)]
            cols = layer.input_size
            del layer.qweight, layer.qweight_type, layer._gguf_shards
            dense = all(t in gb.DENSE_TYPES for t, _ in parts)
            src = None if dense or not cpu else layout_cache.key(
                "gguf-linear", cols, *[x for p in parts for x in p])

            def convert():  # the blocks stay the file's mapped pages until then
                return convert_shards(parts, cols)
        if gpu.use_triton(self.device):
            src = None  # the cache holds CPU layouts; the Triton repack is another
        self.layout_src = src
        # What make_gemv_layout converts again if a CPU step asks for its layout.
        self._source = convert if cpu else None
        if src is not None and self._cached(layer, src):
            return
        weight, types = convert()
        if not self._tied:
            layer.gguf_types = types
        if isinstance(weight, torch.Tensor):
            self.packed = None
            self._source = None
            set_param(layer, "weight", weight.to(self.device, self.dtype))
            return
        if gpu.use_triton(self.device):
            self.packed = True
            self.triton = gpu.repack_groups(layer, weight, self.dtype, self.device)
            return
        packed = PackedInt4(weight)
        self.group, self.doubled = packed.group, packed.doubled
        self.packed = True
        for name, t in packed.tensors().items():
            set_param(layer, name, t)
        if src is not None:
            layout_cache.put(src, packed.tensors(), {"group": str(self.group),
                                                     "doubled": str(int(self.doubled)),
                                                     "types": ",".join(types)})

    def make_gemv_layout(self) -> bool:
        """Describe this layer to the C++ CPU step's 4-bit GEMV: make (once) ``gemv``, a
        copy of the weight in that GEMV's layout (``packed.gemv_layout``), from the
        layout cache or from the layer's GGML blocks. Whether the layer has one (none:
        dense, on the GPU, or a group the GEMV cannot read). The step asks at its
        warm-up; an engine without the step keeps no copy."""
        if self.gemv is not None:
            return True
        source, self._source = getattr(self, "_source", None), None  # asked once
        if not self.packed or self.triton is not None or source is None:
            return False
        name = None if self.layout_src is None else layout_cache.key("gguf-gemv",
                                                                     self.layout_src)
        hit = None if name is None else layout_cache.get(name, ("values", "scale_bias"))
        if hit is not None:
            self.gemv = hit[0]["values"], hit[0]["scale_bias"]
            return True
        self.gemv = gemv_layout(source()[0])
        if self.gemv is not None and name is not None:
            layout_cache.put(name, {"values": self.gemv[0], "scale_bias": self.gemv[1]})
        return self.gemv is not None

    def _cached(self, layer: LinearBase, src: str) -> bool:
        """Take the packed weights from the layout cache; whether it had them."""
        hit = layout_cache.get(src, ("qweight", "scales_and_zeros"))
        if hit is None:
            return False
        tensors, meta = hit
        try:
            self.group, self.doubled = int(meta["group"]), bool(int(meta["doubled"]))
            types = meta["types"].split(",")
        except (KeyError, ValueError):
            return False  # written by another kind of entry: repack
        self.packed = True
        if not self._tied:
            layer.gguf_types = types
        for name, t in tensors.items():
            set_param(layer, name, t)
        return True

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, layer.weight, layer.bias)
        if self.triton is not None:  # float32 sums: the logits need no refinement
            return gpu.triton_apply(layer, self.triton, x)
        x2, lead = flatten_tokens(x)
        if self.run_gemv is not None and (
                self.gemv_kind or x2.shape[0] <= GEMV_ROWS
                or self.run_gemv_any_rows):
            # float32 sums over the exact weights: no bf16 logits to refine.
            xf = x2.float().contiguous()
            y = self.run_gemv(xf, *self.gemv, self.group, self.doubled, self.gemv_kind)
            if self.head and self.gemv_kind and self.refine_gemv is not None:
                # int8 activations: the logits sampling can pick recomputed from float32
                # inputs (greedy then agrees with the float32 GEMV).
                self.refine_gemv(xf, self.gemv[0], self.gemv_kind, y, REFINE_TOP)
            y = y.to(x.dtype)
            if layer.bias is not None:
                y = y + layer.bias
            return y.view(*lead, -1)
        y = int4_mm(x2, layer.qweight, layer.scales_and_zeros, self.group, self.doubled)
        if layer.bias is not None:
            y = y + layer.bias
        if self._tied:  # a tied head: the embedding's table gives exact rows
            emb = self._tied[0]
            y = refine_top_logits(x2, y, lambda ids: emb.quant_method.rows(emb, ids))
        return y.view(*lead, -1)


class GGUFEmbeddingMethod:
    """Token embedding on GGUF blocks: values two per byte, scale and zero per group in
    float32 (so looked-up rows equal gguf-py's dequantization); the rows a step needs are
    dequantized, never the table."""

    name = "gguf"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.device = torch.empty(0).device  # the model is built under torch.device(...)
        _placeholders(layer, lambda p, w, shard=None: _record(layer, p, w, shard))

    layout_src: str | None = None
    """The layout cache's key of the table's GGML blocks (CPU, quantized), else None."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # A vocabulary-parallel table holds its slice of the rows (num_rows, padded).
        rows = getattr(layer, "num_rows", layer.vocab_size)
        part = _shard(layer, None, rows, layer.hidden_size)
        del layer.qweight, layer.qweight_type, layer._gguf_shards
        if part[0] not in gb.DENSE_TYPES and self.device.type == "cpu":
            self.layout_src = layout_cache.key("gguf-embedding", layer.hidden_size, *part)
            hit = layout_cache.get(self.layout_src, ("qvalues", "qscale", "qzero"))
            if hit is not None and {"group", "doubled", "types"} <= hit[1].keys():
                tensors, meta = hit
                self.group, self.doubled = int(meta["group"]), bool(int(meta["doubled"]))
                layer.gguf_types = meta["types"].split(",")
                for name, t in tensors.items():
                    set_param(layer, name, t)
                return
        weight, layer.gguf_types = convert_shards([part], layer.hidden_size)
        if isinstance(weight, torch.Tensor):
            self.doubled = None
            set_param(layer, "weight", weight.to(self.device, self.dtype))
            return
        self.group, self.doubled = weight.group, weight.doubled
        v = weight.values  # [V, K2] -> two per byte [V, K2 / 2]
        set_param(layer, "qvalues", (v[:, 0::2] | (v[:, 1::2] << 4)).contiguous().to(
            self.device))
        set_param(layer, "qscale", weight.scale.to(self.device))
        set_param(layer, "qzero", weight.zero.to(self.device))
        if self.layout_src is not None:
            layout_cache.put(self.layout_src, {"qvalues": layer.qvalues, "qscale": layer.qscale,
                                               "qzero": layer.qzero},
                             {"group": str(self.group), "doubled": str(int(self.doubled)),
                              "types": ",".join(layer.gguf_types)})

    def _groups(self, layer: nn.Module, rows: torch.Tensor | None = None) -> Int4Groups:
        packed = layer.qvalues if rows is None else layer.qvalues[rows]
        v = torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)
        scale = layer.qscale if rows is None else layer.qscale[rows]
        zero = layer.qzero if rows is None else layer.qzero[rows]
        return Int4Groups(v, scale, zero, self.group, self.doubled)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), hidden]: the table's rows, dequantized."""
        if self.doubled is None:
            return layer.weight[ids].float()
        return self._groups(layer, ids).dequantize()

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(layer, ids.reshape(-1)).to(self.dtype)  # [T, hidden]
        return rows.view(*ids.shape, -1)

    def source(self, layer: nn.Module) -> tuple[Int4Groups | torch.Tensor, list[str]]:
        """The table for a tied lm_head: its Int4Groups (or dense weight)."""
        if self.doubled is None:
            return layer.weight.data, layer.gguf_types
        return self._groups(layer), layer.gguf_types


def type_summary(model: nn.Module) -> str:
    """'Q4_1 x210, Q8_0 x1' over the GGUF layers of a model (for the startup log)."""
    counts = Counter(t for m in model.modules() for t in getattr(m, "gguf_types", ()))
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
