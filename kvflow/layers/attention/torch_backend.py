"""Pure-torch paged attention: the CPU path and the reference the Triton kernels match.

``paged_attention_ref`` is the plain definition (one request at a time, float32 math).
``TorchAttentionBackend`` computes the same thing faster: all decode tokens in one
batched call over their gathered contexts, then one SDPA call per prefill chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.rotary import RotaryEmbedding


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, KVH, D] at flat slots of kv_cache [2, NB, BS, KVH, D]; -1 skips."""
    _, nb, bs, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, kvh, d)
    t = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[:t][keep], v[:t][keep]
    flat[0].index_copy_(0, slot_mapping, k[:t])
    flat[1].index_copy_(0, slot_mapping, v[:t])


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """K and V of one request's first ``length`` positions: 2 x [length, KVH, D]."""
    _, _, bs, kvh, d = kv_cache.shape
    nblk = -(-length // bs)
    kv = kv_cache[:, block_table[:nblk].long()]  # [2, nblk, BS, KVH, D]
    kv = kv.reshape(2, nblk * bs, kvh, d)[:, :length]
    return kv[0], kv[1]


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: list[int], seq_lens: list[int],
                        scale: float) -> torch.Tensor:
    """Reference paged attention (float32 math), one request at a time.

    q [T, H, D]; request i's queries are rows query_start_loc[i]:query_start_loc[i+1]
    at the last positions of its seq_lens[i]-long context. Returns [T, H, D].
    """
    out = torch.zeros_like(q)
    h = q.shape[1]
    for i, seq_len in enumerate(seq_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        n = e - s
        if n == 0:
            continue
        k, v = gather_kv(kv_cache, block_tables[i], seq_len)
        group = h // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale  # [H, n, L]
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


class TorchAttentionBackend:
    """Rotary, cache write and attention in plain torch (any device)."""

    name = "torch"

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, rotary: RotaryEmbedding,
                scale: float, meta: AttentionMetadata) -> torch.Tensor:
        q, k = rotary(positions, q, k)
        write_kv_ref(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            self._decodes(q, out, kv_cache, meta, scale)
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(nd, meta.num_reqs):
            s, e = qsl[i], qsl[i + 1]
            n, seq_len = e - s, lens[i]
            qi = q[s:e].transpose(0, 1)  # [H, n, D]
            if n == seq_len:  # nothing cached before this chunk: attend to it directly
                ki, vi = k[s:e], v[s:e]
                mask, causal = None, True
            else:
                ki, vi = gather_kv(kv_cache, meta.block_tables[i], seq_len)
                q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos  # [n, L]
                causal = False
            o = F.scaled_dot_product_attention(
                qi, ki.transpose(0, 1), vi.transpose(0, 1), attn_mask=mask,
                is_causal=causal, scale=scale, enable_gqa=True)
            out[s:e] = o.transpose(0, 1)
        return out

    # Decodes are batched in groups of similar context length, so padding each group to
    # its longest context wastes little.
    DECODE_GROUP = 16

    def _decodes(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> None:
        lens = meta.seq_lens_cpu[: meta.num_decodes]
        order = sorted(range(len(lens)), key=lens.__getitem__)
        for g in range(0, len(order), self.DECODE_GROUP):
            idx = order[g: g + self.DECODE_GROUP]
            rows = torch.tensor(idx, device=q.device)
            max_len = lens[idx[-1]]
            out[rows] = self._decode(q[rows], kv_cache, meta.block_tables[rows],
                                     meta.seq_lens[rows], max_len, scale)

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
        """One new token per request, all in one SDPA call. q [B, H, D] -> [B, H, D]."""
        _, nb, bs, kvh, d = kv_cache.shape
        b = q.shape[0]
        nblk = -(-max_len // bs)
        length = nblk * bs
        idx = block_tables[:, :nblk].reshape(-1).long()
        # Whole blocks are contiguous rows of a [num_blocks, BS * KVH * D] view.
        k = kv_cache[0].view(nb, -1).index_select(0, idx).view(b, length, kvh, d)
        v = kv_cache[1].view(nb, -1).index_select(0, idx).view(b, length, kvh, d)
        mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None].long()
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)  # [B, H, 1, D]
        return o.squeeze(2)
