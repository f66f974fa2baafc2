"""Paged flash-attention for a mixed batch (decodes first, then prefill chunks), with a
split-KV (flash-decoding) path for long decode contexts.

Reference: ``kvflow.layers.attention.torch_backend.paged_attention_ref``.

Layouts: q [T, H, D]; kv_cache [2, NB, BS, KVH, D] (0 = K, 1 = V); block_tables int32
[R, max_blocks]; query_start_loc int32 [R+1]; seq_lens int32 [R] (context length after
this step). Request i's q_len_i queries sit at positions seq_len_i - q_len_i ..
seq_len_i - 1 and attend causally to keys 0..pos.

Algorithm (one kernel body, two launches):

* Each program owns one KV head and a tile of BLOCK_M = BLOCK_Q * G_PAD query rows: BLOCK_Q
  tokens x the G query heads that share the KV head (GQA packed into M, padded to a power
  of two). Row r is token ``r // G_PAD``, head ``kvh * G + r % G_PAD``. So every K/V tile
  is loaded once per KV head and used by the whole group through ``tl.dot``.
* It walks its keys in BLOCK_N tiles, gathering each key row through the block table
  (``block_tables[req, n // BS] * BS + n % BS``), so BLOCK_N is independent of the cache
  block size and each row is a contiguous D-vector (16-byte vector loads). Online softmax
  in float32 with exp2 (scale folded with log2 e); P is rounded to the KV dtype for the
  P @ V dot. Tiles entirely below the first query's position run without masks; only
  the diagonal/tail tiles apply the causal mask (and load masks).
* Decode launch: requests [0, num_decodes), BLOCK_Q = 1, G_PAD = max(16, pow2(G)) (the
  minimum M of tl.dot), grid ``(1, num_decodes, KVH * num_kv_splits)``. With
  num_kv_splits = S > 1, split s handles keys [s*c, (s+1)*c) with
  ``c = roundup(cdiv(seq_len, S), BLOCK_N)`` (computed on device per request), and
  writes a normalised partial output and its log2-sum-exp (float32) to a workspace; a
  second kernel, grid ``(num_decodes, H)``, merges the S partials. (Merging in the last
  split instead of a second launch, with per-request split counts, measured even or
  slower on the H200 and the H100 and was removed: docs/decode-gemv.md.)
  With ``split_tokens`` (``--deterministic``, docs/determinism.md) the split is fixed
  instead: split s is keys [s * split_tokens, (s + 1) * split_tokens) whatever the batch
  (programs past a request's context exit), and the merge folds the request's own
  splits in order, so a decode row's sums never depend on the other requests.
* Decode-only steps may pass ``rope`` (``DecodeRope``): q and the new token's k / v
  arrive unrotated and uncached. Every decode program rotates its q rows (rotate-half,
  cos/sin row ``seq_len - 1``); the program whose key range holds the new token rotates
  its k, stores k and v at the token's cache slot for later steps, keeps that key out of
  its K/V loop and adds it from registers after the loop (one more online-softmax
  update), so nothing reads a slot written in the same launch. This replaces the
  ``rotary_kv`` launch of such steps (measured on the H200: docs/decode-gemv.md).
* Prefill launch: requests [num_decodes, R), grid ``(cdiv(max_query_len, BLOCK_Q),
  R - num_decodes, KVH)``; q-blocks past a request's q_len exit at once. The q-block axis
  is walked from the last block (longest causal range) first, and sits on the fastest
  grid axis so blocks of one request run together and share its KV prefix in L2.

Tile configs (``default_tile_configs``; no autotune, so a decode launch is cheap and
graph-capturable after one warm-up call compiles it):
  decode  BLOCK_M=16 (G_PAD), BLOCK_N=64, 4 warps, 3 stages with >= 160 KB shared memory
          (A100/H100/H200), else 2
  prefill BLOCK_M=128 (BLOCK_Q = 128 / G_PAD: 128 tokens at GQA 1, 32 at 4, 16 at 8),
          BLOCK_N=64, 8 warps (4 for D <= 64), 3 stages (2 on ~100 KB parts)
  fp32 / D=256 halve BLOCK_N (and prefill BLOCK_M). ``TileConfig`` overrides them
  (benchmarks/kernels/bench_kernels.py --sweep times alternatives).

Expected traffic and work (elem = bytes per value, 2 for bf16):
  decode: bytes = sum_i seq_len_i * KVH * D * 2 * elem (K and V read exactly once)
          + 2 * B * H * D * elem (q, out); with splits + B*H*S*(D+1)*4*2 workspace.
          Llama-3.1-8B layer (4 KiB of K+V per token): B=256 x 4096 ctx reads 4.29 GB
          -> ~1.02 ms at 4.2 TB/s; B=1 x 4096 ctx reads 16.8 MB -> ~4 us (launch- and
          latency-bound: this is where the split-KV path matters).
  prefill: FLOPs = 4 * H * D * sum_i sum_q (keys visible to q) (QK^T and PV);
          one 8192-token causal chunk, H=32, D=128: 4*32*128*8192*8193/2 = 550 GFLOP
          -> ~0.70 ms at 790 TFLOP/s.

Per-layer options (constexprs, so a captured CUDA graph holds each layer's own):
``window`` W: a query at position p sees keys p - W + 1 .. p. A program's key loop
starts at the first key its first row's window reaches (so decode reads at most W keys
and never a block-table entry before the window: the cache manager may have freed those
blocks); tiles that some row's window cuts (a prefill q-block's first tiles) run masked,
the rest as usual. Split-KV divides [window start, seq_len) instead of [0, seq_len).
``softcap``: scores become softcap * tanh(score / softcap) after the scale, before the
masks (computed in log2 units with the cap scaled by log2 e).

Candidate trees (Medusa verification, ``tree``): a request's last tree tokens see the
keys before its tree root and, past it, only the keys whose bit is set in the query
row's 64-bit ``tree.bits``; tiles past the root run masked (prefill launch only).

Limits: "decodes" must have q_len <= 1 (speculative drafts go through the prefill
launch). A short chunk after a long cached prefix gets only cdiv(q_len, BLOCK_Q) * KVH
programs (prefill has no split-KV). Checked by compiling every default and sweep config
ahead of time for sm_90 and sm_80 with Triton 3.6 and 3.9: K/V loads compile to 16-byte
cp.async; prefill uses wgmma on sm_90, decode (M=16) uses mma.sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def _soft_cap(s, CAP: tl.constexpr):
    """CAP * tanh(s / CAP) (any units: the caller passes the cap in the scores' own),
    as 1 - 2 / (e^2x + 1), which saturates to +-1 without overflow."""
    e2x = tl.exp2(s * (2.0 * 1.4426950408889634 / CAP))
    return CAP * (1.0 - 2.0 / (e2x + 1.0))


@triton.jit
def _attn_tile(acc, l_i, m_i, q, k_base, v_base, bt_row, start, hi, pos, offs_n, offs_d,
               stride_kb, stride_kt, qk_scale, q_ptr, ks_base, vs_base, stride_sb, stride_st,
               tree_bits, tree_start,
               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               MASKED: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
               QUANT: tl.constexpr, TREE: tl.constexpr, WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """One BLOCK_N tile of keys [start, start + BLOCK_N): online-softmax update.

    QUANT 1 (int8 cache): K/V tiles are widened to the model dtype (exact) and their
    per-token scales applied to the scores (K) and to P before P @ V (V); QUANT 2
    (fp8): widened the same way, the per-tensor scales are folded into qk_scale and
    the output scale by the caller.

    TREE (a candidate tree in the batch): key n >= tree_start (the request's tree root)
    is visible to a row only if bit n - tree_start of its ``tree_bits`` [BLOCK_M] is
    set; the caller runs every tile that reaches past the root MASKED.

    WINDOW > 0: a row at position p sees keys p - WINDOW + 1 .. p (applied in MASKED
    tiles; the caller runs unmasked only tiles inside every row's window). SOFTCAP > 0:
    scores (log2 units) become SOFTCAP * tanh(s / SOFTCAP), before the masks."""
    n = start + offs_n  # [BLOCK_N] key positions
    if MASKED:
        n_ok = n < hi
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0)
    else:
        blk = tl.load(bt_row + n // BLOCK_SIZE)
    kv_off = blk.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_kt  # [BLOCK_N]
    ptr_off = kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, D_PAD]
    if MASKED:
        ld_mask = n_ok[:, None]
        if D_PAD != HEAD_DIM:
            ld_mask = ld_mask & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_base + ptr_off, mask=ld_mask, other=0.0)
        v = tl.load(v_base + ptr_off, mask=ld_mask, other=0.0)
    elif D_PAD != HEAD_DIM:
        d_mask = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_base + ptr_off, mask=d_mask, other=0.0)
        v = tl.load(v_base + ptr_off, mask=d_mask, other=0.0)
    else:
        k = tl.load(k_base + ptr_off)
        v = tl.load(v_base + ptr_off)
    if QUANT != 0 and UPCAST:  # the interpreter's int8/fp8 -> bf16 casts are wrong
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    elif QUANT != 0:  # exact: int8 and E4M3 values are all bf16/fp16 values
        k = k.to(q_ptr.dtype.element_ty)
        v = v.to(q_ptr.dtype.element_ty)

    if UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
        k = k.to(tl.float32)
        v_dot = v.to(tl.float32)
    else:
        v_dot = v
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    if QUANT == 1:
        s_off = blk.to(tl.int64) * stride_sb + (n % BLOCK_SIZE) * stride_st  # [BLOCK_N]
        if MASKED:
            ks = tl.load(ks_base + s_off, mask=n_ok, other=0.0)
            vs = tl.load(vs_base + s_off, mask=n_ok, other=0.0)
        else:
            ks = tl.load(ks_base + s_off)
            vs = tl.load(vs_base + s_off)
        s = s * ks[None, :]
    if SOFTCAP > 0:
        s = _soft_cap(s, SOFTCAP)
    if MASKED:
        visible = n_ok[None, :] & (n[None, :] <= pos[:, None])
        if WINDOW > 0:
            visible = visible & (n[None, :] > pos[:, None] - WINDOW)
        if TREE:
            rel = n - tree_start  # [BLOCK_N] key index within the tree (< 0: before it)
            shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
            bit = (tree_bits[:, None] >> shift[None, :]) & 1  # [BLOCK_M, BLOCK_N]
            visible = visible & ((rel < 0)[None, :] | (bit != 0))
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if QUANT == 1:
        p = p * vs[None, :]  # V's per-token scales, applied to its rows of P
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(v_dot.dtype), v_dot,
                                        input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _rope_row(cs_ptr, stride_cs, position, offs_d, HEAD_DIM: tl.constexpr):
    """cos and signed sin [D_PAD] (float32) of ``position`` for the rotate-half layout, and
    each element's partner: o[d] = x[d] cos + x[partner] sin_signed, with partner d + D/2
    and sin negated for the first half, d - D/2 for the second."""
    half: tl.constexpr = HEAD_DIM // 2
    first = offs_d < half
    freq = tl.where(first, offs_d, offs_d - half)
    d_ok = offs_d < HEAD_DIM
    cs_row = cs_ptr + position.to(tl.int64) * stride_cs
    cos = tl.load(cs_row + freq, mask=d_ok, other=0.0)
    sin = tl.load(cs_row + half + freq, mask=d_ok, other=0.0)
    partner = tl.where(first, offs_d + half, offs_d - half)
    partner = tl.where(d_ok, partner, offs_d)  # padding lanes read themselves (masked)
    return cos, tl.where(first, -sin, sin), partner


@triton.jit
def _rotate(x, x_pair, cos, sin_signed):
    """Rotate-half rotary in float32 (as ``rotary_kv``: one rounding, by the caller)."""
    return x.to(tl.float32) * cos + x_pair.to(tl.float32) * sin_signed


@triton.jit
def _new_kv(kn_ptr, vn_ptr, kc_ptr, vc_ptr, slot_ptr, n_slots, token, kvh, stride_knt,
            stride_knh, stride_vnt, stride_vnh, stride_kb, stride_kt, stride_kh, cos,
            sin_signed, partner, offs_d, own, BLOCK_SIZE: tl.constexpr,
            HEAD_DIM: tl.constexpr):
    """The new token's rotated key and its value for KV head ``kvh`` ([D_PAD] in the
    cache dtype), stored into the cache at its slot by the program that ``own``s it
    (slot -1, or a token past ``n_slots``, is not cached: ``rotary_kv``'s rule)."""
    d_ok = offs_d < HEAD_DIM
    kn = kn_ptr + token.to(tl.int64) * stride_knt + kvh * stride_knh
    k = tl.load(kn + offs_d, mask=d_ok, other=0.0)
    k_pair = tl.load(kn + partner, mask=d_ok, other=0.0)
    k = _rotate(k, k_pair, cos, sin_signed).to(kc_ptr.dtype.element_ty)
    v = tl.load(vn_ptr + token.to(tl.int64) * stride_vnt + kvh * stride_vnh + offs_d,
                mask=d_ok, other=0.0).to(vc_ptr.dtype.element_ty)
    slot = tl.load(slot_ptr + token, mask=token < n_slots, other=-1).to(tl.int64)
    if own & (slot >= 0):
        off = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt \
            + kvh * stride_kh + offs_d
        tl.store(kc_ptr + off, k, mask=d_ok)
        tl.store(vc_ptr + off, v, mask=d_ok)
    return k, v


@triton.jit
def _add_key(acc, l_i, m_i, q, k, v, qk_scale, rows, SOFTCAP: tl.constexpr):
    """Online-softmax update with one key held in registers (k, v [D_PAD]) for ``rows``:
    the score in float32 as the tiles' dot computes it, P rounded to the value dtype
    before P @ V as in ``_attn_tile``."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * qk_scale
    if SOFTCAP > 0:
        s = _soft_cap(s, SOFTCAP)
    s = tl.where(rows, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + p
    pv = p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
    return acc * alpha[:, None] + pv, l_i, m_new


@triton.jit(do_not_specialize=["req_offset", "num_splits"])
def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr,
        req_offset, num_splits, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_bt, stride_kb, stride_kt, stride_kh, ks_ptr, vs_ptr, out_scale,
        stride_sb, stride_st, stride_sh, tree_bits_ptr, tree_start_ptr,
        cs_ptr, stride_cs, kn_ptr, vn_ptr, stride_knt, stride_knh, stride_vnt,
        stride_vnh, slot_ptr, n_slots, split_tokens,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr, QUANT: tl.constexpr, TREE: tl.constexpr,
        ROPE: tl.constexpr = False, FIXED_SPLIT: tl.constexpr = False,
        ALL_MASKED: tl.constexpr = False, WINDOW: tl.constexpr = 0,
        SOFTCAP: tl.constexpr = 0.0):
    num_qb = tl.num_programs(0)
    qb = num_qb - 1 - tl.program_id(0)  # longest causal range first
    req = tl.program_id(1) + req_offset
    kvh = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # cached prefix before this step's queries

    offs_m = tl.arange(0, BLOCK_Q * G_PAD)  # BLOCK_M query rows
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    tok = qb * BLOCK_Q + offs_m // G_PAD  # [BLOCK_M] query index within the request
    hh = offs_m % G_PAD
    head = kvh * GROUP + hh
    row_ok = (tok < q_len) & (hh < GROUP)
    pos = ctx + tok  # absolute position of each query row
    row = (q_start + tok).to(tl.int64)
    q_mask = row_ok[:, None]
    if D_PAD != HEAD_DIM:
        q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)  # [BLOCK_M, D_PAD]
    if ROPE:  # decode launch: rotate q here, and k / v of the new token below
        # a decode's position is seq_len - 1 (already loaded: no dependent load before
        # the cos/sin rows, which the first QK dot waits for)
        cos, sin_signed, partner = _rope_row(cs_ptr, stride_cs, seq_len - 1, offs_d, HEAD_DIM)
        q_pair = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh
                         + partner[None, :], mask=q_mask, other=0.0)
        q = _rotate(q, q_pair, cos, sin_signed).to(q_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this q-block needs: [lo, hi), lo 0 without a window, else the first key its
    # first row's window reaches (keys before it, and their block-table entries, are
    # never read: the cache manager may have freed those blocks). Split s of S takes a
    # part of [lo, hi).
    hi = tl.minimum(seq_len, ctx + (qb + 1) * BLOCK_Q)
    lo = 0
    win_all = 0  # keys from here on are inside every row's window
    if WINDOW > 0:
        lo = tl.maximum(ctx + qb * BLOCK_Q - WINDOW + 1, 0)
        win_all = tl.maximum(hi - WINDOW, 0)
    if FIXED_SPLIT:  # --deterministic: split s is keys [s * T, (s + 1) * T), any batch
        s_lo = split * split_tokens
        hi = tl.minimum(hi, s_lo + split_tokens)
        lo = tl.maximum(lo, s_lo)
        if lo >= hi:  # past the context or before the window: the merge skips it
            return
    elif SPLIT:
        chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)
    if ROPE:
        # The new token's key (position seq_len - 1) arrives unrotated and not yet cached:
        # the program whose key range holds it rotates it, writes k and v to the cache
        # for later steps, and adds the key itself from registers after the loop (so no
        # program reads a cache slot written in this launch).
        own = (lo <= seq_len - 1) & (seq_len - 1 < hi)
        k_new, v_new = _new_kv(kn_ptr, vn_ptr, k_ptr, v_ptr, slot_ptr, n_slots, q_start, kvh,
                               stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kb,
                               stride_kt, stride_kh, cos, sin_signed, partner, offs_d, own,
                               BLOCK_SIZE, HEAD_DIM)
        hi = tl.where(own, hi - 1, hi)
    # Keys <= the block's first query position are visible to every row: no masks.
    full_hi = tl.minimum(hi, ctx + qb * BLOCK_Q + 1)
    tree_bits = tl.full([BLOCK_Q * G_PAD], -1, tl.int64)
    tree_start = seq_len
    if TREE:  # a tree's keys past its root are visible row by row: masked tiles
        tree_start = tl.load(tree_start_ptr + req)
        tree_bits = tl.load(tree_bits_ptr + row, mask=row_ok, other=-1)
        full_hi = tl.minimum(full_hi, tree_start + 1)
    # Tiles [lo, front_end) reach keys some row's window leaves out: masked.
    front_end = lo
    if WINDOW > 0:
        front = tl.minimum(tl.maximum(win_all - lo, 0), tl.maximum(hi - lo, 0))
        front_end = lo + tl.cdiv(front, BLOCK_N) * BLOCK_N
    full_end = front_end + tl.maximum(full_hi - front_end, 0) // BLOCK_N * BLOCK_N
    if ALL_MASKED:
        # --deterministic prefill: which tiles a row sees unmasked depends on where its
        # q-block starts (on how the prompt was chunked), and the two tile variants
        # compile to different roundings (the unmasked one may fuse the scale and the
        # max subtraction into one FMA): every tile takes the masked one.
        full_end = front_end

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh
    ks_base = ks_ptr + kvh * stride_sh
    vs_base = vs_ptr + kvh * stride_sh
    if WINDOW > 0:
        for start in range(lo, front_end, BLOCK_N):
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k_base, v_base, bt_row, start, hi,
                                       pos, offs_n, offs_d, stride_kb, stride_kt, qk_scale,
                                       q_ptr, ks_base, vs_base, stride_sb, stride_st,
                                       tree_bits, tree_start, BLOCK_SIZE, HEAD_DIM, D_PAD,
                                       True, DOT_PREC, UPCAST, QUANT, TREE, WINDOW, SOFTCAP)
    for start in range(front_end, full_end, BLOCK_N):
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k_base, v_base, bt_row, start, hi, pos,
                                   offs_n, offs_d, stride_kb, stride_kt, qk_scale, q_ptr,
                                   ks_base, vs_base, stride_sb, stride_st, tree_bits, tree_start,
                                   BLOCK_SIZE, HEAD_DIM, D_PAD, False, DOT_PREC, UPCAST, QUANT,
                                   TREE, WINDOW, SOFTCAP)
    for start in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k_base, v_base, bt_row, start, hi, pos,
                                   offs_n, offs_d, stride_kb, stride_kt, qk_scale, q_ptr,
                                   ks_base, vs_base, stride_sb, stride_st, tree_bits, tree_start,
                                   BLOCK_SIZE, HEAD_DIM, D_PAD, True, DOT_PREC, UPCAST, QUANT,
                                   TREE, WINDOW, SOFTCAP)
    if ROPE:
        acc, l_i, m_i = _add_key(acc, l_i, m_i, q, k_new, v_new, qk_scale, own & row_ok,
                                 SOFTCAP)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty split or empty context -> zeros
    o = acc * (out_scale / l_safe)[:, None]  # out_scale: fp8's V scale, else 1
    if SPLIT:
        # Partials of decode request `req`: [num_decodes, H, S, D_PAD] and [.., S].
        num_heads = tl.num_programs(2) // num_splits * GROUP
        part_row = (req.to(tl.int64) * num_heads + head) * num_splits + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        tl.store(part_o_ptr + part_row[:, None] * D_PAD + offs_d[None, :], o,
                 mask=row_ok[:, None])
    else:
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, qsl_ptr, num_splits,
                         stride_ot, stride_oh, seq_lens_ptr, split_tokens,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
                         FIXED_SPLIT: tl.constexpr = False, WINDOW: tl.constexpr = 0):
    """out[req, h] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).

    FIXED_SPLIT (--deterministic): the request's own cdiv(seq_len, split_tokens) splits,
    folded one at a time from split 0 (a running max, weight sum and weighted sum), so
    neither the grid's split count nor a reduction tree's shape enters the result; one
    split gives its partial back exactly (o * 1 / 1). With a WINDOW, the splits wholly
    before the decode's window (which wrote nothing) are skipped."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) == q_start:  # request without a query (padding)
        return
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    base = (req.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    if FIXED_SPLIT:
        seq_len = tl.load(seq_lens_ptr + req)
        n_own = tl.cdiv(seq_len, split_tokens)
        first = 0
        if WINDOW > 0:
            first = tl.maximum(seq_len - WINDOW, 0) // split_tokens
        m_run = float("-inf")
        w_sum = 0.0
        acc = tl.zeros([D_PAD], tl.float32)
        for s in range(first, n_own):  # every one of these splits holds keys: lse finite
            lse_s = tl.load(part_lse_ptr + base + s)
            o_s = tl.load(part_o_ptr + (base + s) * D_PAD + offs_d)
            m_new = tl.maximum(m_run, lse_s)
            alpha = tl.exp2(m_run - m_new)  # 0 for the first split
            w = tl.exp2(lse_s - m_new)
            acc = acc * alpha + o_s * w
            w_sum = w_sum * alpha + w
            m_run = m_new
        tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
                 (acc / w_sum).to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
        return
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * D_PAD + offs_d[None, :],
                mask=s_ok[:, None], other=0.0)  # [S_PAD, D_PAD]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits weigh 0
    denom = tl.sum(w, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    res = tl.sum(o * w[:, None], axis=0) / denom
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             res.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class DecodeRope:
    """The rotary + cache-write inputs of a decode-only step that ``paged_attention``
    applies itself (``rotary_and_cache_write``'s arguments, positions implied: a decode
    token sits at seq_len - 1, ``AttentionMetadata``'s rule): the float32 [max_pos, D] =
    [cos | sin] table, the new tokens' unrotated k and their v
    [T, KVH, D] (strided views of the qkv output are fine), slot_mapping [<= T] (-1
    skips; tokens past its length are not cached)."""

    cos_sin_cache: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one attention launch (a tuning hook for benchmarks)."""

    block_m: int  # query rows per program (BLOCK_Q tokens x G_PAD heads); decode: G_PAD
    block_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _max_shared_mem(device_index: int) -> int:
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # older drivers: guess from the architecture
        major, minor = torch.cuda.get_device_capability(device_index)
        return 227 * 1024 if (major, minor) in ((9, 0), (10, 0)) else (
            163 * 1024 if (major, minor) == (8, 0) else 99 * 1024)


def _smem(device: torch.device) -> int:
    if device.type != "cuda":
        return 227 * 1024  # interpreter: configs do not matter
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _max_shared_mem(index)


def default_tile_configs(head_dim: int, group: int, dtype: torch.dtype,
                         device: torch.device) -> tuple[TileConfig, TileConfig]:
    """(decode, prefill) launch shapes for this head dim, GQA group and dtype.

    Decode: 16 query rows (the GQA group, padded to tl.dot's minimum M), 64-key tiles,
    4 warps, 3 pipeline stages where shared memory allows (>= 160 KB per block:
    A100/H100/H200; 96 KB of K/V stages, so two programs share an H200 SM).
    Prefill: 128 query rows, 64-key tiles, 8 warps (4 for D <= 64), 3 stages.
    fp32 and D=256 halve the tiles; ~100 KB parts (sm_86/89) get 2 stages.
    """
    return _default_tile_configs(head_dim, group, dtype, _smem(device))


@functools.lru_cache(maxsize=None)
def _default_tile_configs(head_dim: int, group: int, dtype: torch.dtype,
                          smem: int) -> tuple[TileConfig, TileConfig]:
    d_pad = triton.next_power_of_2(head_dim)
    elem = dtype.itemsize
    big = elem * d_pad > 256
    block_n = 32 if big else 64
    large_smem = smem >= 160 * 1024
    kv_stage = 2 * block_n * d_pad * elem  # K and V tiles of one pipeline stage
    dec_m = max(16, triton.next_power_of_2(group))
    dec_stages = 3 if large_smem else 2
    pre_m = 64 if big else 128
    pre_stages = 3 if large_smem and pre_m * d_pad * elem + 3 * kv_stage <= 160 * 1024 else 2
    pre_n = block_n if large_smem or d_pad < 128 else 32
    return (TileConfig(dec_m, block_n, 4, dec_stages),
            TileConfig(pre_m, pre_n, 8 if d_pad > 64 else 4, pre_stages))


def choose_num_kv_splits(num_decodes: int, max_seq_len: int, num_heads_kv: int,
                         num_sms: int) -> int:
    """Split count for the decode launch: a power of two in [1, 64].

    Splits until decode programs (num_decodes * num_heads_kv * S) reach about four per
    SM (a decode program keeps one 32 KB K+V tile in flight and uses ~40 KB of shared
    memory, so four or more fit an SM and together cover HBM latency), never leaving a
    split fewer than 256 keys of the longest context. Llama-3.1-8B (KVH 8) on an H200
    (132 SMs): batch 1 -> 16 splits at 4k context, 64 at >= 16k; batch 16 -> 4;
    batch >= 66 -> 1.
    Pass the same arguments for every replay of a captured CUDA graph (e.g. max_seq_len
    = max_model_len): any S is correct for any seq_lens, only speed depends on it.
    """
    base = max(1, num_decodes * num_heads_kv)
    target = 4 * num_sms
    if base >= target:
        return 1
    want = triton.cdiv(target, base)
    cap = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(want, cap, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                    num_decodes: int, max_query_len: int, max_seq_len: int,
                    num_kv_splits: int = 1, out: torch.Tensor | None = None,
                    decode_config: TileConfig | None = None,
                    prefill_config: TileConfig | None = None, kv_quant=None,
                    tree=None, rope: "DecodeRope | None" = None,
                    split_tokens: int = 0, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each request's paged context -> [T, H, D].

    R = seq_lens.shape[0] requests; requests [0, num_decodes) have exactly one query
    (q_len 0 is allowed for padding), the rest are prefill chunks of at most
    ``max_query_len`` tokens. ``num_kv_splits`` > 1 splits the decode requests' contexts
    across programs (flash-decoding). ``max_seq_len`` does not size any grid; it is kept
    for callers' heuristics. Output rows past ``query_start_loc[R]`` are left unwritten.
    ``decode_config`` / ``prefill_config`` override the default tiles (benchmarks).
    ``kv_quant`` (a ``KVQuant``): the cache holds int8 (with per-token-and-head scales
    [2, NB, BS, KVH]) or fp8 values (per-tensor scales), dequantized in registers.
    ``tree`` (a ``TreeAttention``): candidate trees among the prefill requests (Medusa
    verification), attended with their ancestor masks.
    ``rope`` (a ``DecodeRope``; decode-only batches over an unquantized cache): q and the
    new tokens' k / v arrive unrotated and uncached; the decode launch rotates them and
    writes k / v to the cache (``rotary_and_cache_write``'s work, without its launch).
    ``split_tokens`` > 0 (``--deterministic``): the decode launch splits every context
    into fixed ranges of that many keys (a multiple of the decode BLOCK_N) whatever the
    batch, and each request's partials merge in split order; ``num_kv_splits`` is then
    only the grid's split count and must reach cdiv(seq_len, split_tokens) for every
    decode request (more is fine: those programs exit).
    ``window`` (a sliding window of W keys): a query at position p sees keys
    p - W + 1 .. p; the launches start each program's key loop at its window, so the
    block-table entries of blocks wholly before it are never read (they may be freed),
    and the decode launch splits only the window (at most W / 256 splits).
    ``softcap``: scores (after the scale) become softcap * tanh(score / softcap).
    """
    t, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.shape[0] == 2 and kv_cache.shape[-1] == head_dim
    assert num_heads % num_kv_heads == 0, "H must be a multiple of KVH"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    assert seq_lens.dtype == torch.int32 and query_start_loc.dtype == torch.int32
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty((t, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1
    del max_seq_len
    assert window is None or window >= 1, window
    win = {} if window is None else {"WINDOW": int(window)}
    if softcap is not None:  # capped in the kernel's log2 units: cap * log2(e)
        assert softcap > 0, softcap
        win["SOFTCAP"] = float(softcap) * _LOG2E

    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    d_pad = triton.next_power_of_2(head_dim)
    dec_cfg, pre_cfg = default_tile_configs(head_dim, group, q.dtype, q.device)
    dec_cfg = decode_config or dec_cfg
    pre_cfg = prefill_config or pre_cfg
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [NB, BS, KVH, D] each
    quant, scales, qk_scale, out_scale = 0, k_cache, scale * _LOG2E, 1.0
    if kv_quant is not None and kv_quant.kind == "int8":
        quant, scales = 1, kv_quant.scales  # [2, NB, BS, KVH] float32
        assert kv_cache.dtype == torch.int8 and scales.shape == kv_cache.shape[:-1]
    elif kv_quant is not None:
        quant, out_scale = 2, float(kv_quant.v_scale)
        qk_scale *= float(kv_quant.k_scale)
        assert kv_cache.dtype == torch.float8_e4m3fn
    else:
        assert kv_cache.dtype == q.dtype, "an unquantized cache holds the model dtype"
    common = (qk_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
              block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              scales[0], scales[1], out_scale,
              *((scales.stride(1), scales.stride(2), scales.stride(3)) if quant == 1
                else (0, 0, 0)))
    tree_args = (seq_lens, seq_lens) if tree is None else (tree.bits, tree.start)
    # The CPU interpreter's tl.dot is wrong for bf16 (it multiplies the raw uint16 bits):
    # there, dot operands are widened to float32 after the same roundings.
    consts = dict(GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad,
                  DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
                  UPCAST=q.device.type == "cpu" and q.dtype == torch.bfloat16, QUANT=quant)

    # (cos/sin, k, v, their strides, slots, n_slots) of the decode launch's rotary;
    # placeholders (never read) without it and in the prefill launch
    no_rope = (seq_lens, 0, q, q, 0, 0, 0, 0, seq_lens, 0)
    rope_args = no_rope
    if rope is not None:
        assert num_decodes == num_reqs and tree is None and quant == 0, (
            "rotary inside attention is for decode-only batches over an unquantized cache")
        k_new, v_new, cs = rope.k, rope.v, rope.cos_sin_cache
        assert k_new.shape == (t, num_kv_heads, head_dim) and v_new.shape == k_new.shape
        assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1 and cs.stride(-1) == 1
        assert cs.shape[-1] == head_dim and head_dim % 2 == 0
        rope_args = (cs, cs.stride(0), k_new, v_new, k_new.stride(0),
                     k_new.stride(1), v_new.stride(0), v_new.stride(1), rope.slot_mapping,
                     rope.slot_mapping.shape[0])
    if num_decodes > 0:
        splits = max(1, int(num_kv_splits))
        if window is not None and not split_tokens:
            # a decode reads at most `window` keys: no split below 256 of them
            cap = max(1, window // _MIN_TOKENS_PER_SPLIT)
            splits = min(splits, 1 << (cap.bit_length() - 1))
        if split_tokens:
            assert split_tokens % dec_cfg.block_n == 0, (split_tokens, dec_cfg.block_n)
        if splits > 1:
            part_o = torch.empty((num_decodes, num_heads, splits, d_pad), dtype=torch.float32,
                                 device=q.device)
            part_lse = torch.empty((num_decodes, num_heads, splits), dtype=torch.float32,
                                   device=q.device)
        else:
            part_o = part_lse = out  # unused
        _paged_attn_kernel[(1, num_decodes, num_kv_heads * splits)](
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
            part_o, part_lse, 0, splits, *common, seq_lens, seq_lens, *rope_args,
            split_tokens, G_PAD=max(g_pad, dec_cfg.block_m), BLOCK_Q=1,
            BLOCK_N=dec_cfg.block_n, SPLIT=splits > 1, num_warps=dec_cfg.num_warps,
            num_stages=dec_cfg.num_stages, TREE=False,
            **({"ROPE": True} if rope is not None else {}),
            **({"FIXED_SPLIT": True} if split_tokens and splits > 1 else {}), **win,
            **consts)
        if splits > 1:
            fixed = {"FIXED_SPLIT": True} if split_tokens else {}
            if split_tokens and window is not None:
                fixed["WINDOW"] = int(window)
            _merge_splits_kernel[(num_decodes, num_heads)](
                part_o, part_lse, out, query_start_loc, splits, out.stride(0), out.stride(1),
                seq_lens, split_tokens, HEAD_DIM=head_dim, D_PAD=d_pad,
                S_PAD=triton.next_power_of_2(splits),
                num_warps=4 if splits * d_pad <= 4096 else 8, **fixed)

    num_prefills = num_reqs - num_decodes
    if num_prefills > 0 and max_query_len > 0:
        block_q = max(1, pre_cfg.block_m // g_pad)
        grid = (triton.cdiv(max_query_len, block_q), num_prefills, num_kv_heads)
        _paged_attn_kernel[grid](
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
            out, out, num_decodes, 1, *common, *tree_args, *no_rope, 0,
            G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=pre_cfg.block_n, SPLIT=False,
            num_warps=pre_cfg.num_warps, num_stages=pre_cfg.num_stages,
            TREE=tree is not None, **({"ALL_MASKED": True} if split_tokens else {}),
            **win, **consts)
    return out


def attention_bytes_flops(q_lens: list[int], seq_lens: list[int], num_heads: int,
                          num_kv_heads: int, head_dim: int, elem: int) -> tuple[int, int]:
    """Ideal (bytes, FLOPs) of one call: every K/V row read once per KV head, q read and
    out written once; FLOPs of QK^T and PV over the causally visible keys."""
    kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * elem
    qo_bytes = sum(q_lens) * num_heads * head_dim * 2 * elem
    visible = sum(n * (s - n) + n * (n + 1) // 2 for n, s in zip(q_lens, seq_lens))
    return kv_bytes + qo_bytes, 4 * num_heads * head_dim * visible


__all__ = ["DecodeRope", "TileConfig", "attention_bytes_flops", "choose_num_kv_splits",
           "default_tile_configs", "paged_attention"]
