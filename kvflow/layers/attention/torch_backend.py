"""Pure-torch paged attention: the CPU path and the reference the Triton kernels match.

``paged_attention_ref`` is the plain definition (one request at a time, float32 math).
``TorchAttentionBackend`` computes the same thing faster: all decode tokens in one
batched call over their gathered contexts, then one SDPA call per prefill chunk. On CPU
(float32 models) the decodes instead run the C++ kernel ``cpu/kernels/paged_attention``,
which reads the float32/int8/fp8 blocks in place; the gather path is its fallback.

Per layer: a sliding window (reads start at the block the window starts in, its own
read plan built once per step and window), soft-capped scores (the same batched calls
with the attention math written out: SDPA has no cap) and a rotary table of the
layer's own (its cos/sin rows built once per step and table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvflow.layers.attention.kv_quant import (KVQuant, gather_blocks, read_flat,
                                             write_kv_quant)
from kvflow.layers.attention.metadata import AttentionMetadata, AttentionSpec
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary, rotary_tables
from kvflow.utils import cdiv


def kv_write_index(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots a cache write stores to and which rows they come from: (slots, None)
    when every row is written, else (kept slots, boolean mask over rows); -1 skips."""
    keep = slot_mapping >= 0  # padding rows (-1) write nothing
    if bool(keep.all()):
        return slot_mapping, None
    return slot_mapping[keep], keep


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor,
                 index: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
    """Store k, v [T, KVH, D] at flat slots of kv_cache [2, NB, BS, KVH, D]; -1 skips.

    ``index`` is ``kv_write_index(slot_mapping)`` when the caller planned it already
    (the torch backend does, once per step instead of once per layer).
    """
    _, nb, bs, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, kvh, d)
    t = slot_mapping.shape[0]  # rows of k/v beyond it are CUDA-graph padding
    slots, keep = kv_write_index(slot_mapping) if index is None else index
    if k.shape[0] != t:
        k, v = k[:t], v[:t]
    if keep is not None:
        k, v = k[keep], v[keep]
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


@torch.library.custom_op("kvflow::write_kv", mutates_args=("kv_cache",))
def write_kv_op(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """``write_kv_ref`` for slots that are all valid, as one op that declares its write:
    a compiled graph then updates the cache in place (traced as plain index_copy_ on a
    graph input, the write became a copy of the whole layer cache per step)."""
    _, nb, bs, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, kvh, d)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


@torch.library.custom_op("kvflow::write_kv_quant", mutates_args=("kv_cache", "scales"))
def write_kv_quant_op(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      scales: torch.Tensor | None, slot_mapping: torch.Tensor, kind: str,
                      k_scale: float, v_scale: float) -> None:
    """``write_kv_op`` for a quantized cache (int8: ``scales`` [2, NB, BS, KVH] too)."""
    write_kv_quant(k, v, kv_cache, KVQuant(kind, scales, k_scale, v_scale), slot_mapping,
                   k.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """K and V of one request's first ``length`` positions: 2 x [length, KVH, D]."""
    _, _, bs, kvh, d = kv_cache.shape
    nblk = cdiv(length, bs)
    kv = kv_cache[:, block_table[:nblk].long()]  # [2, nblk, BS, KVH, D]
    kv = kv.reshape(2, nblk * bs, kvh, d)[:, :length]
    return kv[0], kv[1]


def window_start(seq_len: int, num_queries: int, window: int | None) -> int:
    """The first sequence position any of a request's last ``num_queries`` queries sees
    (0 without a window): a window of W means a query at position p sees keys
    p - W + 1 .. p (W keys, itself included), as transformers' sliding window does.
    Blocks wholly before it are never read (the cache manager may have freed them)."""
    if window is None:
        return 0
    return max(0, seq_len - num_queries - window + 1)


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: list[int], seq_lens: list[int],
                        scale: float, tree_visible: list | None = None,
                        window: int | None = None, softcap: float | None = None
                        ) -> torch.Tensor:
    """Reference paged attention (float32 math), one request at a time.

    q [T, H, D]; request i's queries are rows query_start_loc[i]:query_start_loc[i+1]
    at the last positions of its seq_lens[i]-long context. ``tree_visible[i]`` (a
    [size, size] bool array or None): request i's last ``size`` queries are a candidate
    tree, tree token a seeing tree token b only where it is True. ``window``: a query at
    position p sees keys p - window + 1 .. p (block-table entries of blocks wholly
    before every query's window are not read); ``softcap``: scores (after the scale)
    become softcap * tanh(score / softcap), before the masks. Returns [T, H, D].
    """
    out = torch.zeros_like(q)
    h = q.shape[1]
    bs = kv_cache.shape[2]
    for i, seq_len in enumerate(seq_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        n = e - s
        if n == 0:
            continue
        first = window_start(seq_len, n, window) // bs  # first block any query sees
        offset = first * bs
        k, v = gather_kv(kv_cache, block_tables[i, first:], seq_len - offset)
        group = h // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale  # [H, n, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(offset, seq_len, device=q.device)[None, :]
        hidden = k_pos > q_pos  # [n, L]
        if window is not None:
            hidden = hidden | (k_pos <= q_pos - window)
        vis = tree_visible[i] if tree_visible is not None else None
        if vis is not None:
            size = vis.shape[0]
            hidden = hidden.clone()
            hidden[n - size:, seq_len - size - offset:] |= ~torch.as_tensor(
                vis, device=q.device)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def use_cpu_decode_kernel(spec: AttentionSpec) -> bool:
    """Whether decodes on ``spec``'s cache go through the C++ CPU kernel: float32 models
    on CPU (the cache is then float32, int8 or fp8, all of which it reads) where it
    could be built; else (no compiler, KVFLOW_CPU_KERNELS=0, GPU, bf16) the torch path."""
    if spec.device.type != "cpu" or spec.dtype != torch.float32:
        return False
    from kvflow.cpu.kernels import paged_attention

    return paged_attention.available()


def _context(block_size: int, block_ids: list[int], length: int, device):
    """How to read one request's first ``length`` cached positions: a plain view when its
    blocks are consecutive (no copy), else the block ids to gather."""
    if all(b == block_ids[0] + i for i, b in enumerate(block_ids)):
        return ("view", block_ids[0] * block_size, length)
    return ("gather", torch.tensor(block_ids, device=device), length)


def _read(kv_cache: torch.Tensor, how, quant: KVQuant | None = None,
          dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, KVH, D] of one request from its plan (a quantized cache's values are
    dequantized to ``dtype``)."""
    _, nb, bs, kvh, d = kv_cache.shape
    kind, where, length = how
    if quant is not None:
        if kind == "view":
            return read_flat(kv_cache, quant, where, length, dtype)
        k, v = gather_blocks(kv_cache, quant, where, dtype)
        return k[:length], v[:length]
    if kind == "view":
        flat = kv_cache.view(2, nb * bs, kvh, d)
        return flat[0, where: where + length], flat[1, where: where + length]
    k = kv_cache[0].view(nb, -1).index_select(0, where).view(-1, kvh, d)[:length]
    v = kv_cache[1].view(nb, -1).index_select(0, where).view(-1, kvh, d)[:length]
    return k, v


@dataclass
class TorchAttentionPlan:
    """What the torch backend derives once per step and reuses in every layer."""

    rot: tuple[torch.Tensor, torch.Tensor]  # rotary_tables: [T, 1, D] float32 each
    write: tuple[torch.Tensor, torch.Tensor | None]  # kv_write_index(slot_mapping)
    # Decodes sorted by context length (None: already sorted), then grouped:
    # (rows of the sorted decodes, how to read their contexts, additive mask or None).
    decode_order: torch.Tensor | None
    decodes: list[tuple[slice, tuple, torch.Tensor | None]]
    # Prefill chunks: (start, end, how to read the cached context or None, mask, causal).
    prefills: list[tuple[int, int, tuple | None, torch.Tensor | None, bool]]
    # The decodes go through the C++ CPU kernel (cpu/kernels/paged_attention.cpp),
    # which reads the cache blocks in place; then decode_order/decodes are unused.
    decode_kernel: bool = False
    # Layers other than the plain causal one, planned on first use in the step:
    # reads(window, grouped) -> (decode_order, decodes, prefills) for a window (None:
    # none) with decode groups (the C++ kernel has no window or cap), and the cos/sin
    # rows of a rotary table other than ``rotary`` (Gemma 3's local layers).
    plan_reads: object = None  # callable (window, grouped) -> the three fields above
    rotary: RotaryEmbedding | None = None
    positions: torch.Tensor | None = None
    _reads: dict = field(default_factory=dict)
    _rots: dict = field(default_factory=dict)

    def reads(self, window: int | None, grouped: bool):
        """(decode_order, decodes, prefills) for layers with this window."""
        if window is None and grouped != self.decode_kernel:  # the step's own plan
            return self.decode_order, self.decodes, self.prefills
        key = (window, grouped)
        if key not in self._reads:
            self._reads[key] = self.plan_reads(window, grouped)
        return self._reads[key]

    def rot_of(self, rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos/sin rows for ``rotary`` (the planned ones for the model's)."""
        if rotary is self.rotary:
            return self.rot
        if id(rotary) not in self._rots:
            self._rots[id(rotary)] = (rotary, rotary_tables(*rotary.cos_sin(self.positions)))
        return self._rots[id(rotary)][1]


@dataclass
class PaddedDecodePlan:
    """An all-decode step read through whole block-table rows, made of tensors only.

    Every shape follows the batch size B and the table width W and no Python number
    depends on them, so a compiled layer (cpu/compiled.py) traces this path once
    for any batch size and context length. Same math as the grouped decode path.
    """

    rot: tuple[torch.Tensor, torch.Tensor]  # rotary_tables: [B, 1, D] float32 each
    slots: torch.Tensor  # [B] int64, all valid
    gather: torch.Tensor  # [B * W] int64 block ids, row by row
    mask: torch.Tensor  # [B, 1, 1, W * BS] additive: -inf past each context

    @classmethod
    def build(cls, spec: AttentionSpec, meta: AttentionMetadata,
              positions: torch.Tensor, min_width: int = 1) -> "PaddedDecodePlan":
        """From an all-decode ``meta``; the table is padded to ``min_width`` blocks
        (entries past a context may hold any valid block id: the mask hides them)."""
        tables = meta.block_tables  # [B, W]
        if tables.shape[1] < min_width:
            tables = torch.cat((tables, tables.new_zeros(
                tables.shape[0], min_width - tables.shape[1])), dim=1)
        length = tables.shape[1] * spec.block_size
        pad = torch.arange(length, device=positions.device)[None, :] \
            >= meta.seq_lens[:, None]  # [B, L]
        mask = torch.zeros(pad.shape[0], 1, 1, length, dtype=spec.dtype,
                           device=positions.device).masked_fill_(pad[:, None, None, :],
                                                                 float("-inf"))
        return cls(rot=rotary_tables(*spec.rotary.cos_sin(positions)), slots=meta.slot_mapping,
                   gather=tables.reshape(-1).long(), mask=mask)


class TorchMetadataBuilder:
    """Plans a step for the torch backend: what depends only on the batch (cos/sin rows,
    which slots to write, how to read each request's context, masks)."""

    # Decodes are batched in groups of similar context length, so padding each group to
    # its longest context wastes little.
    DECODE_GROUP = 4

    def __init__(self, spec: AttentionSpec) -> None:
        if spec.rotary is None:
            raise ValueError("the torch attention backend plans cos/sin rows: the spec "
                             "needs the model's rotary table")
        self.spec = spec
        # The C++ decode kernel, where it applies (built on first use: at engine start).
        self.decode_kernel = use_cpu_decode_kernel(spec)

    def build(self, meta: AttentionMetadata, positions: torch.Tensor, *,
              split_context: int | None = None) -> AttentionMetadata:
        dev = positions.device
        bs, dtype = self.spec.block_size, self.spec.dtype
        t = meta.slot_mapping.shape[0]
        rot = rotary_tables(*self.spec.rotary.cos_sin(positions[:t]))
        write = kv_write_index(meta.slot_mapping)
        tables = meta.block_tables.tolist()

        def plan_reads(window: int | None, grouped: bool):
            return self._plan_reads(meta, tables, dev, window, grouped)

        # The C++ kernel reads every decode's blocks through the block table itself:
        # no groups to plan for the plain layers.
        decode_order, decodes, prefills = plan_reads(None, not self.decode_kernel)
        meta.backend = TorchAttentionPlan(rot=rot, write=write,
                                          decode_order=decode_order, decodes=decodes,
                                          prefills=prefills,
                                          decode_kernel=self.decode_kernel,
                                          plan_reads=plan_reads, rotary=self.spec.rotary,
                                          positions=positions[:t])
        return meta

    def _plan_reads(self, meta: AttentionMetadata, tables: list[list[int]], dev,
                    window: int | None, grouped: bool):
        """How each request's context is read: (decode_order, decode groups, prefill
        chunks); with ``window``, from the block its window starts in (the entries of
        blocks wholly before it are never read), the rest of the window masked."""
        bs, dtype = self.spec.block_size, self.spec.dtype
        lens, qsl = meta.seq_lens_cpu, meta.query_start_loc_cpu
        # Decodes run in groups of similar length, sorted; the forward permutes q into
        # that order once per layer and the outputs back once.
        decodes = []
        order = sorted(range(meta.num_decodes), key=lens.__getitem__) if grouped else []
        decode_order = None if order == sorted(order) else torch.tensor(order, device=dev)
        for g in range(0, len(order), self.DECODE_GROUP):
            idx = order[g: g + self.DECODE_GROUP]
            rows = slice(g, g + len(idx))
            starts = [window_start(lens[i], 1, window) for i in idx]  # first key seen
            firsts = [w // bs for w in starts]  # first block read
            nblk = max(cdiv(lens[i], bs) - f for i, f in zip(idx, firsts))
            if len(idx) == 1:
                i, f = idx[0], firsts[0]
                how = _context(bs, tables[i][f: f + nblk], lens[i] - f * bs, dev)
                mask = None
                if starts[0] > f * bs:  # the window starts inside its first block
                    mask = torch.zeros(1, 1, 1, lens[i] - f * bs, dtype=dtype, device=dev)
                    mask[..., : starts[0] - f * bs] = float("-inf")
                decodes.append((rows, how, mask))
                continue
            blocks = []
            for i, f in zip(idx, firsts):
                row = tables[i][f: min(f + nblk, cdiv(lens[i], bs))]
                blocks += row + [row[-1]] * (nblk - len(row))  # padding: masked below
            gather = torch.tensor(blocks, device=dev)
            length = nblk * bs
            hi = torch.tensor([lens[i] - f * bs for i, f in zip(idx, firsts)], device=dev)
            lo = torch.tensor([w - f * bs for w, f in zip(starts, firsts)], device=dev)
            j = torch.arange(length, device=dev)[None, :]
            hidden = (j >= hi[:, None]) | (j < lo[:, None])  # [b, L]
            # An additive float mask: SDPA would convert a boolean one in every layer.
            mask = torch.zeros(len(idx), 1, 1, length, dtype=dtype,
                               device=dev).masked_fill_(hidden[:, None, None, :],
                                                        float("-inf"))
            decodes.append((rows, ("batch", gather, length), mask))
        prefills = []
        tree = meta.tree
        for i in range(meta.num_decodes, meta.num_reqs):
            s, e, seq_len = qsl[i], qsl[i + 1], lens[i]
            n = e - s
            size = tree.sizes_cpu[i] if tree is not None else 0
            if size and window is not None:
                raise RuntimeError("candidate trees (Medusa) are not supported on "
                                   "windowed attention layers")
            if n == seq_len and not size and (window is None or window >= n):
                prefills.append((s, e, None, None, True))
                continue
            first = window_start(seq_len, n, window) // bs
            offset = first * bs
            how = None if n == seq_len and not size else _context(
                bs, tables[i][first: cdiv(seq_len, bs)], seq_len - offset, dev)
            q_pos = torch.arange(seq_len - n, seq_len, device=dev)[:, None]
            k_pos = torch.arange(offset, seq_len, device=dev)[None, :]
            hidden = k_pos > q_pos  # [n, L]
            if window is not None:
                hidden |= k_pos <= q_pos - window
            if size:  # a candidate tree: its tokens see only their own ancestors
                tree_hidden = torch.from_numpy(~tree.visible_cpu[i]).to(dev)  # [size, size]
                hidden[n - size:, seq_len - size:] |= tree_hidden
            mask = torch.zeros(n, seq_len - offset, dtype=dtype, device=dev).masked_fill_(
                hidden, float("-inf"))
            prefills.append((s, e, how, mask, False))
        return decode_order, decodes, prefills


class TorchAttentionBackend:
    """Rotary, cache write and attention in plain torch (any device), from the step's
    TorchAttentionPlan."""

    name = "torch"

    def metadata_builder(self, spec: AttentionSpec) -> TorchMetadataBuilder:
        return TorchMetadataBuilder(spec)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, rotary: RotaryEmbedding,
                scale: float, meta: AttentionMetadata, *,
                kv_quant: KVQuant | None = None, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        plan = meta.backend
        if window is not None and window >= meta.max_seq_len:
            window = None  # every query sees its whole context
        if isinstance(plan, PaddedDecodePlan):
            if window is not None or softcap is not None:
                raise RuntimeError("the padded decode plan (compiled CPU step) has no "
                                   "sliding window or soft cap")
            return self._padded_decode(q, k, v, kv_cache, plan, scale, kv_quant)
        if not isinstance(plan, TorchAttentionPlan):
            raise RuntimeError("attention metadata was not built by the torch backend's "
                               "metadata builder")
        rot = plan.rot_of(rotary)
        q, k = apply_rotary(q, rot), apply_rotary(k, rot)
        if kv_quant is None:
            write_kv_ref(k, v, kv_cache, meta.slot_mapping, plan.write)
        else:
            k, v = self._write_quant(k, v, kv_cache, kv_quant, meta.slot_mapping, plan.write)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        # the C++ decode kernel has neither a window nor a cap: such layers read groups
        use_kernel = plan.decode_kernel and window is None and softcap is None
        decode_order, decodes, prefills = plan.reads(window, grouped=not use_kernel)
        if nd and use_kernel:
            out[:nd] = self._decode_kernel(q[:nd], kv_cache, meta, scale, kv_quant)
        elif nd:
            order = decode_order
            qd = q[:nd] if order is None else q[:nd].index_select(0, order)
            od = torch.empty_like(qd)
            for g, how, mask in decodes:
                od[g] = self._decode(qd[g], kv_cache, how, mask, scale, kv_quant, softcap)
            if order is None:
                out[:nd] = od
            else:
                out[:nd].index_copy_(0, order, od)
        for s, e, how, mask, causal in prefills:
            if how is None:  # nothing cached before this chunk: attend to it directly
                ki, vi = k[s:e], v[s:e]
            else:
                ki, vi = _read(kv_cache, how, kv_quant, q.dtype)
            # 4-D [1, heads, len, D]: with 3-D inputs the CPU takes SDPA's slow math path.
            qi, ki, vi = (x.transpose(0, 1)[None] for x in (q[s:e], ki, vi))
            if softcap is None:
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                   is_causal=causal, scale=scale,
                                                   enable_gqa=True)
            else:  # query heads grouped by KV head: [1, KVH, G, n, D]
                kvh, n = ki.shape[1], qi.shape[2]
                o = _capped_attention(qi.reshape(1, kvh, -1, n, qi.shape[-1]),
                                      ki[:, :, None], vi[:, :, None], mask, causal, scale,
                                      softcap).reshape(qi.shape)
            out[s:e] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, quant: KVQuant | None) -> torch.Tensor:
        """The step's decodes (requests 0..nd-1) through the C++ kernel, straight from
        the (quantized) cache blocks. q [nd, H, D] -> [nd, H, D]."""
        from kvflow.cpu.kernels.paged_attention import paged_decode, supports

        nd = q.shape[0]
        if not supports(q.dtype, kv_cache.dtype, q.device, q.shape[-1]):
            # A shape the kernel lacks (head dim not a multiple of 8): the torch read,
            # one request at a time (the plan has no decode groups).
            bs, tables, lens = kv_cache.shape[2], meta.block_tables, meta.seq_lens_cpu
            return torch.cat([TorchAttentionBackend._decode(
                q[i: i + 1], kv_cache, _context(bs, tables[i, :cdiv(lens[i], bs)].tolist(),
                                                lens[i], q.device), None, scale, quant)
                for i in range(nd)])
        if quant is None:
            return paged_decode(q, kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                scale)
        return paged_decode(q, kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                            quant.scales, quant.k_scale, quant.v_scale)

    @staticmethod
    def _write_quant(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     quant: KVQuant, slot_mapping: torch.Tensor, index
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized cache write; returns k, v [T', KVH, D] with the written rows replaced
        by the values the cache now holds (fresh prefill chunks attend to those)."""
        t = slot_mapping.shape[0]
        slots, keep = index
        rows_k, rows_v = k[:t], v[:t]
        if keep is not None:
            rows_k, rows_v = rows_k[keep], rows_v[keep]
        kd, vd = write_kv_quant(rows_k, rows_v, kv_cache, quant, slots, k.dtype)
        if keep is None and t == k.shape[0]:
            return kd, vd
        k, v = k.clone(), v.clone()
        if keep is None:
            k[:t], v[:t] = kd, vd
        else:
            k[:t][keep], v[:t][keep] = kd, vd
        return k, v

    @staticmethod
    def _padded_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, plan: PaddedDecodePlan,
                       scale: float, quant: KVQuant | None = None) -> torch.Tensor:
        """Rotary, cache write and attention of one new token per row, the whole batch in
        one SDPA call over full table rows. q [B, H, D] -> [B, H, D]."""
        q, k = apply_rotary(q, plan.rot), apply_rotary(k, plan.rot)
        _, nb, _, kvh, d = kv_cache.shape
        b, h = q.shape[0], q.shape[1]
        length = plan.mask.shape[-1]
        if quant is None:
            write_kv_op(k, v, kv_cache, plan.slots)
            kc = kv_cache[0].view(nb, -1).index_select(0, plan.gather).view(b, length, kvh, d)
            vc = kv_cache[1].view(nb, -1).index_select(0, plan.gather).view(b, length, kvh, d)
        else:
            write_kv_quant_op(k, v, kv_cache, quant.scales, plan.slots, quant.kind,
                              quant.k_scale, quant.v_scale)
            kc, vc = (x.view(b, length, kvh, d)
                      for x in gather_blocks(kv_cache, quant, plan.gather, q.dtype))
        o = F.scaled_dot_product_attention(
            q.reshape(b, kvh, h // kvh, d), kc.transpose(1, 2), vc.transpose(1, 2),
            attn_mask=plan.mask, scale=scale)  # [B, KVH, H / KVH, D]
        return o.reshape(b, h, d)

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, how, mask,
                scale: float, quant: KVQuant | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """One new token per request, the group in one SDPA call. q [B, H, D] -> [B, H, D].

        The query heads that share a KV head become that head's query rows
        ([B, KVH, H / KVH, D]), so K and V are read once per KV head, never repeated.
        """
        _, nb, _, kvh, d = kv_cache.shape
        b, h = q.shape[0], q.shape[1]
        if how[0] == "batch" and quant is not None:
            _, gather, length = how
            k, v = (x.view(b, length, kvh, d)
                    for x in gather_blocks(kv_cache, quant, gather, q.dtype))
        elif how[0] == "batch":  # whole blocks are rows of a [num_blocks, BS * KVH * D] view
            _, gather, length = how
            k = kv_cache[0].view(nb, -1).index_select(0, gather).view(b, length, kvh, d)
            v = kv_cache[1].view(nb, -1).index_select(0, gather).view(b, length, kvh, d)
        else:
            k, v = (x.unsqueeze(0) for x in _read(kv_cache, how, quant, q.dtype))
        if softcap is not None:
            o = _capped_attention(q.reshape(b, kvh, h // kvh, d), k.transpose(1, 2),
                                  v.transpose(1, 2), mask, False, scale, softcap)
            return o.reshape(b, h, d)
        o = F.scaled_dot_product_attention(
            q.reshape(b, kvh, h // kvh, d), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, scale=scale)  # [B, KVH, H / KVH, D]
        return o.reshape(b, h, d)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, causal: bool, scale: float,
                      softcap: float) -> torch.Tensor:
    """SDPA with soft-capped scores (softcap * tanh(score / softcap), after the scale,
    before the mask), in float32: q [..., M, D], k and v [..., L, D] (broadcast), an
    additive mask broadcast to [..., M, L]; ``causal``: M == L, no mask."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    if causal:
        m, n = scores.shape[-2], scores.shape[-1]
        future = torch.ones(m, n, dtype=torch.bool, device=q.device).triu(n - m + 1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)
