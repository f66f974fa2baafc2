"""Dense (bf16/fp16) skinny GEMM for decode: ``y = x @ W^T (+ b)`` with x [M, K], M <= 16,
and the same launch with SiLU-and-multiply in its epilogue for the merged gate/up weight.

At batch 1..8 a linear layer is a weight stream: Llama-3.1-8B's o_proj is 33.5 MB of
weight for 8-64 KB of activations. cuBLAS picks 64x8 / 128x8 tiles there and reads qkv
and o_proj at about 3.3 TB/s on the H200 (of 4.8), plus a separate split-K reduce
kernel; this kernel is tuned per shape class so the whole weight streams at the HBM rate
and the split-K sum stays inside the one launch.

Algorithm (``DOT``, "swap AB"): grid ``(cdiv(N, BLOCK_N), split_k)``; a program owns
BLOCK_N weight rows and a contiguous range of K tiles. Each step loads a [BLOCK_N,
BLOCK_K] weight tile (BLOCK_K * 2 contiguous bytes per row) and the [16, BLOCK_K]
activation tile (rows >= M masked to zero) and accumulates ``tl.dot(w, x^T)`` -> [BLOCK_N,
16] float32: the weight is the MMA's wide operand, so the tensor cores take it straight
from the pipelined shared-memory stages (``num_stages`` deep) and the 16-row padding of
x costs nothing (x is read from L2). Non-``DOT`` (M = 1 only): the weight tile times
the activation vector in float32 registers, summed along K each step.

Split-K (``split_k`` > 1, when N / BLOCK_N tiles cannot fill the SMs): each program writes
its float32 partials to a workspace slice and the tile's last-arriving program adds them
in order and stores the output (``woq_config.store_output``: deterministic, no memset or
reduce kernel, so a launch captures in a CUDA graph).

``silu_and_mul`` form (``ACT``): the weight is [gate (d rows); up (d rows)] as
``MergedLinear`` loads it; program n reads gate rows n*BN.. and the matching up rows
d + n*BN.., keeps two accumulators and writes ``silu(gate) * up`` [M, d] — the [M, 2d]
intermediate and the separate ``silu_and_mul`` launch disappear. Rounding follows the
unfused path (gate and up rounded to x's dtype as the GEMM would store them, silu
rounded, product rounded).

Reference: ``gemv_ref`` / ``gemv_silu_and_mul_ref``. Configurations: ``gemv_config``.
Traffic: N K elem bytes of weight + M (K + N) elem; gate_up of Llama-3.1-8B at M = 1:
235 MB, 49 us at 4.8 TB/s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvflow.kernels.gemv_config import GemvConfig, default_config
from kvflow.kernels.woq_config import LOCK_SLOTS, split_buffers, store_output

MAX_M = 16  # activation rows of the DOT path (one MMA N-tile)


@triton.jit
def load_tiles(w_ptr, rows_w, n_ok, x_ptr, offs_m, m_ok, stride_xm, offs_k, K,
               EVEN_K: tl.constexpr):
    """One K step's [BN, BK] weight tile (streamed once: evicted first) and [BM, BK]
    activation tile, masked to the rows that exist and, unless ``EVEN_K``, to the inputs
    that exist (zeros elsewhere): the loads of every decode GEMV's K loop."""
    if EVEN_K:
        w = tl.load(w_ptr + rows_w + offs_k[None, :], mask=n_ok[:, None], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None], other=0.0)
    else:
        k_ok = offs_k < K
        w = tl.load(w_ptr + rows_w + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    return w, x


@triton.jit
def tile_rows(pid_n, N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """[BLOCK_N] output rows of program ``pid_n``: ROWS consecutive rows from pid_n * ROWS.
    With ROWS < BLOCK_N (``GemvConfig.rows``: a grid balanced over the SMs) the lanes
    past ROWS name row N, which every row mask (``offs_n < N``) treats as absent: they
    load nothing and store nothing."""
    ar = tl.arange(0, BLOCK_N)
    if ROWS < BLOCK_N:
        return tl.where(ar < ROWS, pid_n * ROWS + ar, N)
    return pid_n * BLOCK_N + ar


@triton.jit
def _partial(x_ptr, w_ptr, offs_m, offs_n, M, N, K, stride_xm, t_start, t_end,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """sum over this program's K tiles of x[offs_m] . W[offs_n] -> [BLOCK_M, BLOCK_N] f32."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_w = offs_n.to(tl.int64)[:, None] * K  # [BN, 1]
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        w, x = load_tiles(w_ptr, rows_w, n_ok, x_ptr, offs_m, m_ok, stride_xm, offs_k, K,
                          EVEN_K)  # [BN, BK], [BM, BK]
        if DOT and UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        elif DOT:
            acc += tl.dot(w, tl.trans(x))  # [BN, BK] @ [BK, BM]
        else:  # BLOCK_M == 1
            acc1 += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)
    if DOT:
        res = tl.trans(acc)  # [BM, BN]
    else:
        res = acc1[None, :]
    return res


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, stride_xm,
                 stride_om, split_k, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 SPLIT: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
                 ROWS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_rows(pid_n, N, BLOCK_N, ROWS)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    acc = _partial(x_ptr, w_ptr, offs_m, offs_n, M, N, K, stride_xm, t_start, t_end,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT, UPCAST)
    if HAS_BIAS:  # added by the first split only (the others' partials exclude it)
        b = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, 1.0, 0.0) * b[None, :]
    store_output(acc, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, N, stride_om, pid_n,
                 pid_k, split_k, SPLIT)


@triton.jit
def _gemv_silu_mul_kernel(x_ptr, w_ptr, wu_ptr, out_ptr, ws_ptr, lock_ptr, M, D, K, stride_xm,
                          stride_om, split_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
                          DOT: tl.constexpr, UPCAST: tl.constexpr, ROWS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_rows(pid_n, D, BLOCK_N, ROWS)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    t_start = pid_k * per_split
    t_end = tl.minimum(t_start + per_split, k_tiles)
    gate = _partial(x_ptr, w_ptr, offs_m, offs_n, M, D, K, stride_xm, t_start, t_end,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT, UPCAST)
    up = _partial(x_ptr, wu_ptr, offs_m, offs_n, M, D, K, stride_xm,
                  t_start, t_end, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT, UPCAST)
    store_silu_pair(gate, up, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, D, stride_om,
                    pid_n, pid_k, split_k, SPLIT)


@triton.jit
def store_silu_pair(gate, up, out_ptr, ws_ptr, lock_ptr, offs_m, offs_n, M, D, stride_om,
                    tile, pid_k, split_k, SPLIT: tl.constexpr):
    """gate, up [BM, BN] float32 partials -> silu(gate) * up in out [M, D], the epilogue of
    every SiLU-fused GEMV (this file's, ``gemv_w4.py``'s, ``gemv_w8.py``'s) for a merged
    [gate; up] weight. Split-K: each split writes its partials to a workspace
    [split_k, 2, M, D] (``silu_buffers``); the tile's last-arriving program adds them in
    order and stores (deterministic, in-launch, counters reset here)."""
    o_mask = (offs_m < M)[:, None] & (offs_n < D)[None, :]
    if SPLIT:  # workspace [split_k, 2, M, D]: this split's gate and up partials
        ws = ws_ptr + offs_m[:, None] * D + offs_n[None, :]
        tl.store(ws + pid_k * 2 * M * D, gate, mask=o_mask)
        tl.store(ws + (pid_k * 2 + 1) * M * D, up, mask=o_mask)
        tl.debug_barrier()  # every thread's partials are written before the release
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            g = tl.zeros_like(gate)
            u = tl.zeros_like(up)
            for j in range(0, split_k):  # .cg: read at L2, where the other SMs wrote
                g += tl.load(ws + j * 2 * M * D, mask=o_mask, other=0.0, cache_modifier=".cg")
                u += tl.load(ws + (j * 2 + 1) * M * D, mask=o_mask, other=0.0,
                             cache_modifier=".cg")
            _store_silu_mul(g, u, out_ptr, offs_m, offs_n, stride_om, o_mask)
            tl.atomic_xchg(lock_ptr + tile, 0)  # zero again for the next launch
    else:
        _store_silu_mul(gate, up, out_ptr, offs_m, offs_n, stride_om, o_mask)


@triton.jit
def silu_mul_rounded(gate, up, dt: tl.constexpr):
    """gate, up float32 sums -> silu(gate) * up in ``dt``, rounded where the unfused path
    rounds: gate and up as the GEMM would store them, silu as F.silu returns it."""
    g = gate.to(dt).to(tl.float32)
    u = up.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (act * u).to(dt)


@triton.jit
def _store_silu_mul(gate, up, out_ptr, offs_m, offs_n, stride_om, o_mask):
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             silu_mul_rounded(gate, up, out_ptr.dtype.element_ty), mask=o_mask)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x [M, K] @ weight[N, K]^T (+ bias) in float32 -> [M, N] in x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv_silu_and_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Reference: weight = [gate; up] [2d, K]; silu(x @ gate^T) * (x @ up^T) -> [M, d], each
    step rounded to x's dtype as the unfused GEMM + ``silu_and_mul`` round."""
    y = gemv_ref(x, weight)
    d = y.shape[-1] // 2
    return F.silu(y[:, :d]) * y[:, d:]


def _check(x: torch.Tensor, weight: torch.Tensor, cfg: GemvConfig) -> tuple[int, int, int]:
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.is_contiguous() and x.stride(1) == 1
    assert weight.dtype == x.dtype, "dense GEMV: weight and activation in one dtype"
    assert m <= (MAX_M if cfg.dot else 1), f"GEMV config {cfg} cannot take {m} rows"
    return m, n, k


def _interp(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, unit stride along K) @ weight[N, K]^T (+ bias [N]) -> [M, N]."""
    cfg = config or default_config(x.shape[0], weight.shape[0], x.shape[1], x.device)
    m, n, k = _check(x, weight, cfg)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    ws, locks = split_buffers(cfg, m, n, x.device)
    grid = (triton.cdiv(n, cfg.tile_rows), cfg.split_k)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, out,
        out if ws is None else ws, out if locks is None else locks, m, n, k, x.stride(0), n,
        cfg.split_k, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, SPLIT=ws is not None,
        DOT=cfg.dot, UPCAST=_interp(x), ROWS=cfg.tile_rows, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def silu_buffers(config, m: int, d: int, device: torch.device
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(workspace float32 [split_k, 2, m, d], arrival counters) of a split-K SiLU launch,
    or (None, None)."""
    if config.split_k == 1:
        return None, None
    tiles = triton.cdiv(d, config.tile_rows)
    assert tiles <= LOCK_SLOTS, f"{tiles} output tiles for split-K (at most {LOCK_SLOTS})"
    ws = torch.empty((config.split_k, 2, m, d), dtype=torch.float32, device=device)
    return ws, split_buffers(config, m, d, device)[1]


def gemv_outputs(x: torch.Tensor, config, n: int, silu_and_mul: bool,
                 dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out [M, N] or, for a SiLU-fused [gate; up] weight of N rows, [M, N / 2], in
    ``dtype`` (default x's); split-K workspace; arrival counters) of a low-bit GEMV launch
    (``gemv_w4``, ``gemv_w8``, ``gemv_fp8``)."""
    m = x.shape[0]
    n_out = n // 2 if silu_and_mul else n
    assert not silu_and_mul or n == 2 * n_out, "gate and up halves of one size"
    out = torch.empty((m, n_out), dtype=dtype or x.dtype, device=x.device)
    if m == 0:  # nothing to launch
        return out, None, None
    if silu_and_mul:
        return (out, *silu_buffers(config, m, n_out, x.device))
    return (out, *split_buffers(config, m, n, x.device))


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor,
                      config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] with weight = [gate; up] [2d, K] -> silu(x gate^T) * (x up^T)  # [M, d]"""
    d = weight.shape[0] // 2
    cfg = config or default_config(x.shape[0], d, x.shape[1], x.device, pairs=True)
    m, n, k = _check(x, weight, cfg)
    assert n == 2 * d, "gate and up halves of one size"
    out = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(d, cfg.tile_rows)
    ws, locks = silu_buffers(cfg, m, d, x.device)
    _gemv_silu_mul_kernel[(tiles, cfg.split_k)](
        x, weight, weight[d:], out, out if ws is None else ws,
        out if locks is None else locks, m, d, k,
        x.stride(0), d, cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, SPLIT=ws is not None,
        DOT=cfg.dot, UPCAST=_interp(x), ROWS=cfg.tile_rows, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
