"""Pre-quantized Hugging Face checkpoints: GPTQ (4/8 bit, with or without ``desc_act``
``g_idx``), AWQ (4-bit GEMM packing) and compressed-tensors ``pack-quantized`` (W4A16,
W8A16), unpacked once at load into ``Int4Groups``.

Both store int32 words of ``32 // bits`` values, scales [K/g, N] and packed zero points
[K/g, N/pack], with ``w = (q - z) * s``. GPTQ packs qweight along the input (rows of
[K/pack, N]), AWQ along the output ([K, N/pack]) in the interleaved order 0 2 4 6 1 3 5 7.
GPTQ's "v1" checkpoints (the common ``checkpoint_format: gptq``) store ``z - 1``.
With ``desc_act`` the groups follow ``g_idx`` rather than the input order: the columns
are sorted by group once at load and the activations are permuted the same way per call.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.layers.linear import LinearBase, LinearMethod, set_param
from kvflow.layers.quantization import gpu
from kvflow.layers.quantization.packed import (Int4Groups, PackedInt4, flatten_tokens,
                                               int4_mm)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int,
                 order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> int64 values, ``32 // bits`` per word, expanded along ``dim``."""
    pf = 32 // bits
    shifts = torch.arange(pf, dtype=torch.int64, device=packed.device) * bits
    v = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., pf]
    if order is not None:  # word nibble i holds logical element order[i]
        v = v[..., torch.argsort(torch.tensor(order, device=packed.device))]
    v = v.movedim(-1, dim + 1) if dim != packed.dim() - 1 else v
    shape = list(packed.shape)
    shape[dim] *= pf
    return v.reshape(shape)


def affine_groups(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int,
                  group: int) -> Int4Groups:
    """w = (q - z) * s with q [N, K] in 0..2^bits-1, s and z [N, K/group] -> Int4Groups
    in groups of 32 (larger groups repeat their scale), exactly."""
    if group % 32:
        raise ModelLoadError(f"group size {group} is not a multiple of 32 (supported: "
                             f"multiples of 32, or -1 for one group per row)")
    s = s.float().repeat_interleave(group // 32, dim=1)
    z = z.float().repeat_interleave(group // 32, dim=1)
    if bits == 4:
        return Int4Groups(q.to(torch.uint8), s, (8.0 - z) * s, 32)
    # 8 bits as two nibbles: u = 16 hi + lo; (hi - 8) 16s + s(128 - z) + (lo - 8) s + 8s.
    hi, lo = (q >> 4).to(torch.uint8), (q & 15).to(torch.uint8)
    return Int4Groups(torch.cat([hi, lo], dim=1), torch.cat([16 * s, s], dim=1),
                      torch.cat([(128.0 - z) * s, 8 * s], dim=1), 32, True)


def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
           **attrs) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = attrs.pop("loader", layer.weight_loader)
    for k, v in attrs.items():
        setattr(p, k, v)
    layer.register_parameter(name, p)
    return p


class PrequantizedLinearMethod(LinearMethod):
    """GPTQ, AWQ or compressed-tensors weights, repacked after loading for the CPU int4
    GEMM or (on CUDA) the Triton kernels."""

    triton: gpu.TritonWeight | None = None

    def __init__(self, fmt: str, bits: int, group_size: int, zero_offset: int = 0,
                 symmetric: bool = False) -> None:
        if bits not in (4, 8) or (fmt == "awq" and bits != 4):
            supported = "4" if fmt == "awq" else "4 and 8"
            raise ModelLoadError(f"{fmt} with {bits}-bit weights is not supported "
                                 f"(supported: {supported} bits)")
        self.fmt, self.bits, self.group_size = fmt, bits, group_size
        self.zero_offset = zero_offset  # GPTQ v1 stores z - 1
        self.symmetric = symmetric

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        k, n, pf = layer.input_size, layer.output_size, 32 // self.bits
        g = k if self.group_size == -1 else self.group_size
        if k % g or k % pf or n % pf:
            raise ModelLoadError(f"{self.fmt}: a {n}x{k} layer does not split into groups "
                                 f"of {g} inputs and {pf}-value words")
        self.g = g
        self.dtype = dtype
        if self.fmt == "compressed-tensors":
            # Rows are output channels: weight_packed [N, K/pack] packed along K, the
            # scale [N, K/g], zero points (asymmetric only) [N/pack, K/g] packed along N.
            _param(layer, "weight_packed", (n, k // pf), torch.int32, output_dim=0,
                   input_dim=1, packed_dim=1, pack_factor=pf)
            _param(layer, "weight_scale", (n, k // g), torch.float32, output_dim=0,
                   input_dim=1)
            _param(layer, "weight_shape", (2,), torch.int64,
                   loader=lambda p, w, shard=None: _check_shape(layer, w, shard))
            if not self.symmetric:
                _param(layer, "weight_zero_point", (n // pf, k // g), torch.int32,
                       output_dim=0, input_dim=1, packed_dim=0, pack_factor=pf)
            return
        if self.fmt == "gptq":
            _param(layer, "qweight", (k // pf, n), torch.int32, input_dim=0, output_dim=1,
                   packed_dim=0, pack_factor=pf)
            _param(layer, "g_idx", (k,), torch.int32, input_dim=0,
                   loader=lambda p, w, shard=None: _load_g_idx(layer, p, w))
            layer._g_idx_loaded = None
        else:
            _param(layer, "qweight", (k, n // pf), torch.int32, input_dim=0, output_dim=1,
                   packed_dim=1, pack_factor=pf)
        _param(layer, "qzeros", (k // g, n // pf), torch.int32, input_dim=0, output_dim=1,
               packed_dim=1, pack_factor=pf)
        _param(layer, "scales", (k // g, n), torch.float32, input_dim=0, output_dim=1)

    def _ct_weights(self, layer: LinearBase) -> Int4Groups:
        """compressed-tensors: signed values stored with a +2^(bits-1) offset."""
        q = unpack_int32(layer.weight_packed.data, self.bits, 1)  # [N, K], offset form
        s = layer.weight_scale.data
        if self.symmetric:
            z = torch.full(s.shape, 1 << (self.bits - 1), dtype=torch.int64, device=s.device)
        else:
            z = unpack_int32(layer.weight_zero_point.data, self.bits, 0)  # [N, K/g]
        if not torch.isfinite(s).all():
            raise ModelLoadError("compressed-tensors: non-finite weight scales")
        for name in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
            if hasattr(layer, name):
                delattr(layer, name)
        return affine_groups(q, s, z, self.bits, self.g)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.fmt == "compressed-tensors":
            weights = self._ct_weights(layer)
            layer.register_buffer("perm", None)
            if gpu.use_triton(weights.values.device):
                self.triton = gpu.repack_groups(layer, weights, self.dtype,
                                                weights.values.device)
                return
            packed = PackedInt4(weights)
            self.doubled = packed.doubled
            for name, t in packed.tensors().items():
                set_param(layer, name, t)
            return
        bits, order = self.bits, (AWQ_ORDER if self.fmt == "awq" else None)
        if self.fmt == "gptq":
            q = unpack_int32(layer.qweight.data, bits, 0)  # [K, N]
        else:
            q = unpack_int32(layer.qweight.data, bits, 1, order)
        z = unpack_int32(layer.qzeros.data, bits, 1, order) + self.zero_offset  # [K/g, N]
        s = layer.scales.data  # [K/g, N]
        if q.min() < 0 or q.max() >= 1 << bits or not torch.isfinite(s).all():
            raise ModelLoadError(f"{self.fmt}: corrupt packed weights or scales")
        perm = None
        if self.fmt == "gptq" and layer._g_idx_loaded:
            g_idx = layer.g_idx.data.long()
            if g_idx.min() < 0 or g_idx.max() >= s.shape[0] or torch.bincount(
                    g_idx, minlength=s.shape[0]).ne(self.g).any():
                raise ModelLoadError("gptq: g_idx does not assign each group "
                                     f"{self.g} inputs (corrupt g_idx?)")
            if not torch.equal(g_idx, torch.arange(len(g_idx), device=g_idx.device) // self.g):
                perm = torch.argsort(g_idx, stable=True)  # inputs sorted by group
                q = q[perm]
        weights = affine_groups(q.t().contiguous(), s.t().contiguous(), z.t().contiguous(),
                                bits, self.g)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.register_buffer("perm", perm)
        if gpu.use_triton(weights.values.device):
            self.triton = gpu.repack_groups(layer, weights, self.dtype, weights.values.device)
            return
        packed = PackedInt4(weights)
        self.doubled = packed.doubled
        for name, t in packed.tensors().items():
            set_param(layer, name, t)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if self.triton is not None:
            return gpu.triton_apply(layer, self.triton, x, layer.perm)
        x2, lead = flatten_tokens(x)
        if layer.perm is not None:
            x2 = x2.index_select(1, layer.perm)  # [M, K] in the sorted-by-group order
        y = int4_mm(x2, layer.qweight, layer.scales_and_zeros, 32, self.doubled)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*lead, -1)


def _load_g_idx(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor) -> None:
    """One g_idx per layer: merged shards (q/k/v, gate/up) share their input and so their
    activation order; a shard that disagrees is refused."""
    if loaded.shape != param.shape:
        raise ModelLoadError(f"gptq: g_idx has shape {tuple(loaded.shape)}, the layer "
                             f"needs {tuple(param.shape)}")
    if getattr(layer, "full_input_size", layer.input_size) != layer.input_size:
        # A row-parallel rank's slice of an in-order g_idx names the groups of its own
        # inputs from its first one on: count them from 0, as its scales do. An
        # activation-order g_idx spreads every group over all the ranks' inputs, so the
        # rank's scales (cut by group rows) would not match its inputs: refuse, saying why.
        if loaded.numel() > 1 and bool((loaded[1:] < loaded[:-1]).any()):
            raise ModelLoadError(
                "gptq: this checkpoint was quantized with activation order (desc_act: "
                "g_idx permutes the inputs), which cannot be split along the input "
                "dimension of row-parallel layers (o_proj, down_proj) under tensor "
                "parallelism; load it with tensor_parallel_size=1 (pipeline parallelism "
                "works) or use a checkpoint quantized without desc_act")
        loaded = loaded - loaded.min()
    if layer._g_idx_loaded and not torch.equal(param.data, loaded.to(param.dtype)):
        raise ModelLoadError("gptq: merged shards have different g_idx (desc_act orders); "
                             "kvflow needs one order per merged layer")
    param.data.copy_(loaded)
    layer._g_idx_loaded = True


def _check_shape(layer: LinearBase, shape: torch.Tensor, shard) -> None:
    """compressed-tensors' ``weight_shape`` [N, K] must be the shard's own."""
    # A tensor-parallel layer holds a slice; the checkpoint describes the whole tensor.
    sizes = getattr(layer, "full_output_sizes", layer.output_sizes)
    k = getattr(layer, "full_input_size", layer.input_size)
    n = sizes[layer.shard_ids.index(shard)] if shard is not None else sum(sizes)
    if [int(v) for v in shape.reshape(-1)] != [n, k]:
        raise ModelLoadError(f"compressed-tensors: weight_shape {shape.tolist()} does not "
                             f"match the layer's {[n, k]}")
