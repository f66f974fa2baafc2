"""Multi-LoRA deltas for a step whose rows use different adapters (Punica/S-LoRA style):
``y[t] += (x[t] A_s^T) B_s^T`` with ``s = token_slot[t]`` (-1: the base model, no delta),
in one launch for the shrink and one for the expand, whatever the mix of adapters.

References: ``lora_shrink_ref`` and ``lora_expand_add_ref`` below.

Layout (``kvflow.lora.layers.LoRAWeights``): ``a`` [S, NS * R, in] stacks the A of a
merged layer's NS slices (qkv: 3, gate_up: 2) along the rank, so one shrink serves them
all; ``b`` [S, out, R] holds every slice's B over the layer's output columns (slice i's
columns start at ``offsets[i]``). A slot of a smaller rank r is zero beyond r in A and B;
the expand also cuts at ``slot_rank[s]``, so stale values past r would not count either.

Algorithm: the rows are grouped by slot into tiles of ``block_m`` rows (``lora_tiles``,
on the host: a stable sort of the rows by slot, each slot's run padded to whole tiles
with row -1). A program owns one tile and one block of output columns: it gathers its
rows of x (or of xa), reads its slot's A (or B) block once for the whole tile and runs
one ``tl.dot``. So a prefill segment of 200 rows of one adapter is 13 tiles of 16, not
200 one-row programs, and a decode batch over 4 adapters is a few tiles, each reading
its adapter once (a BGMV would read it once per row). The grid is fixed by the step's
row count and the slot count (``max_tiles``): tiles past the step's own carry slot -1
and return at once, which is what lets a CUDA graph replay any mix of adapters from a
static tile map (``kvflow.lora.kernel_inputs``).

The shrink splits its reduction over ``in`` (``split_k`` programs per tile, fp32 atomic
adds into a zeroed xa) when the tiles alone would leave most SMs idle (a decode batch);
xa stays fp32 between the two launches. The expand reads the y tile, adds the fp32
accumulator and stores y's dtype once.

Traffic (8B, rank 16, qkv of one decode tile): A 48 x 4096 bf16 = 384 KiB read per tile,
B 6144 x 16 = 192 KiB; rows' x and y are 16 x (4096 + 6144) x 2 B. The base GEMV reads
the 48 MiB qkv weight: a few tiles add about 1-3% to the layer's bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M_SMALL = 16  # decode, verification and short prefill steps (what graphs replay)
BLOCK_M_LARGE = 64  # long prefill steps: fewer re-reads of each adapter's A and B


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Tiles a step of ``num_tokens`` rows over ``num_slots`` slots can need: each slot's
    run rounds up to whole tiles, at most one partial tile per slot in use."""
    return triton.cdiv(num_tokens, block_m) + min(num_slots, num_tokens)


@dataclass
class LoRATiles:
    """The step's rows grouped by slot: ``rows`` [n_tiles * block_m] int32 (row of x and
    y, -1: padding), ``tile_slot`` [n_tiles] int32 (-1: nothing to do), ``slot_rank``
    [S] int32 (each slot's rank: the expand cuts there), all on the kernels' device."""

    rows: torch.Tensor
    tile_slot: torch.Tensor
    slot_rank: torch.Tensor
    block_m: int


def build_tiles(token_slot: np.ndarray, num_slots: int, block_m: int,
                n_tiles: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows [n_tiles * block_m], tile_slot [n_tiles]) int32 for ``token_slot`` [T]
    (slot of each row, -1: none). ``n_tiles`` defaults to ``max_tiles``; unused tiles
    get slot -1."""
    token_slot = np.asarray(token_slot, dtype=np.int64)
    if n_tiles is None:
        n_tiles = max_tiles(len(token_slot), num_slots, block_m)
    rows = np.full(n_tiles * block_m, -1, dtype=np.int32)
    tile_slot = np.full(n_tiles, -1, dtype=np.int32)
    valid = np.flatnonzero(token_slot >= 0)
    if len(valid) == 0:
        return rows, tile_slot
    order = np.argsort(token_slot[valid], kind="stable")  # rows by slot, in order
    idx, slot = valid[order], token_slot[valid][order]
    counts = np.bincount(slot, minlength=num_slots)
    tiles = -(-counts // block_m)
    used = int(tiles.sum())
    assert used <= n_tiles, (used, n_tiles)
    tile_start = np.cumsum(tiles) - tiles  # first tile of each slot
    first = np.cumsum(counts) - counts  # first sorted row of each slot
    pos = tile_start[slot] * block_m + (np.arange(len(slot)) - first[slot])
    rows[pos] = idx
    tile_slot[:used] = np.repeat(np.arange(num_slots), tiles)
    return rows, tile_slot


def lora_tiles(token_slot: torch.Tensor, slot_rank: torch.Tensor, num_slots: int,
               block_m: int = BLOCK_M_SMALL) -> LoRATiles:
    """The tiles of ``token_slot`` [T] on its device (tests, one-off calls; the worker
    builds them in pinned memory once per step)."""
    rows, tile_slot = build_tiles(token_slot.cpu().numpy(), num_slots, block_m)
    dev = token_slot.device
    return LoRATiles(torch.from_numpy(rows).to(dev), torch.from_numpy(tile_slot).to(dev),
                     slot_rank.to(dev, torch.int32), block_m)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, rows_ptr, tile_slot_ptr, K, N,
                   stride_xm, stride_as, stride_an, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows >= 0
    rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xt = tl.load(x_ptr + rows64[:, None] * stride_xm + offs_k[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        at = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None],
                     mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 as raw uint16
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=PRECISION)
    ptrs = out_ptr + rows64[:, None] * stride_om + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, y_ptr, rows_ptr, tile_slot_ptr, slot_rank_ptr, N, R,
                   off1, off2, stride_xam, stride_xas, stride_bs, stride_bn, stride_ym,
                   NS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    pid_n = tl.program_id(1)
    rank = tl.load(slot_rank_ptr + slot)
    rows = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows >= 0
    rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
                 + offs_r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BR, BN]
    # which slice each output column belongs to (its xa columns start at slice * R; the
    # slot's own columns at slot * stride_xas when xa holds every slot's, the dense shrink)
    col_slice = (offs_n >= off1).to(tl.int32) + (offs_n >= off2).to(tl.int32)
    n1 = tl.minimum(n0 + BLOCK_N, N) - 1
    first = (n0 >= off1).to(tl.int32) + (n0 >= off2).to(tl.int32)
    last = (n1 >= off1).to(tl.int32) + (n1 >= off2).to(tl.int32)
    xa_rows = xa_ptr + rows64[:, None] * stride_xam + slot.to(tl.int64) * stride_xas
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(NS):
        if (s >= first) & (s <= last):  # only the slices this column block meets
            xat = tl.load(xa_rows + s * R + offs_r[None, :],
                          mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [BM, BR]
            bs = tl.where((col_slice == s)[None, :], bt, tl.zeros_like(bt))
            # xa rounds to the activation dtype, as the torch path's product does
            xat = xat.to(bt.dtype)
            if UPCAST:  # CPU interpreter (see the shrink)
                acc += tl.dot(xat.to(tl.float32), bs.to(tl.float32),
                              input_precision=PRECISION)
            else:
                acc += tl.dot(xat, bs, input_precision=PRECISION)
    ptrs = y_ptr + rows64[:, None] * stride_ym + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _dot_args(t: torch.Tensor) -> dict:
    cpu = t.device.type == "cpu"
    return dict(PRECISION="ieee" if cpu or t.dtype == torch.float32 else "tf32",
                UPCAST=cpu)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(n_programs: int, k: int, device: torch.device) -> int:
    """Split the reduction while the programs would not fill the SMs once (a decode
    batch: a few tiles x a few rank blocks), keeping at least 256 of ``in`` a program."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    split = 1
    while n_programs * split * 2 <= sms and k // (split * 2) >= 256 and split < 16:
        split *= 2
    return split


def lora_shrink(x: torch.Tensor, a: torch.Tensor, tiles: LoRATiles,
                split_k: int | None = None, block_n: int | None = None,
                block_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """x [T, in] @ a[slot(t)]^T for every row with a slot -> xa [T, R_total] fp32
    (rows without a slot are left unwritten: the expand never reads them).

    ``a`` [S, R_total, in] (contiguous in ``in``). ``block_n``, ``block_k``,
    ``num_warps``: launch overrides (the micro-benchmark's sweep)."""
    assert a.stride(-1) == 1 and x.dim() == 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    n = a.shape[1]
    n_tiles = tiles.tile_slot.shape[0]
    if x.device.type == "cpu":  # the interpreter: its cost is per op, so few big programs
        block_n = block_n or min(max(16, triton.next_power_of_2(n)), 256)
        block_k = block_k or min(max(16, triton.next_power_of_2(k)), 256)
    # Measured on an H100 at the 8B shapes (benchmarks/results/gpu-lora-kernels-h100.json):
    # one column block for the whole rank (qkv's 48 in one block of 64, not two of 32,
    # which read x twice) and 128-wide K steps took a 128-row qkv shrink from 41.5 to
    # 12.0 us and an 8192-row down shrink from 124 to 99 us.
    block_n = block_n or min(64, max(16, triton.next_power_of_2(n)))
    block_k = block_k or 128
    grid_n = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = _split_k(n_tiles * grid_n, k, x.device)
    out = (torch.zeros if split_k > 1 else torch.empty)((t, n), dtype=torch.float32,
                                                         device=x.device)
    if n_tiles == 0 or t == 0:
        return out
    _shrink_kernel[(n_tiles, grid_n, split_k)](
        x, a, out, tiles.rows, tiles.tile_slot, k, n, x.stride(0), a.stride(0),
        a.stride(1), out.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, num_warps=num_warps, **_dot_args(x))
    return out


def lora_shrink_dense(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ every slot's A: xa [T, S * R_total] in x's dtype (slot s's columns at
    ``s * R_total``), one dense GEMM (cuBLAS). For steps of few rows (decode, verify: what
    CUDA graphs replay) the segmented shrink is latency-bound (12-20 us a launch on an
    H100 at 128-256 rows against a 1-4 us floor, ``gpu-lora-kernels-h100.json``), while
    the S-fold work is a few MFLOP here. ``lora_expand_add(..., dense=True)`` reads it."""
    return x @ a.view(-1, a.shape[-1]).T


DENSE_ROW_SLOTS = 8192
DENSE_MIN_IN = 8192


def use_dense_shrink(x: torch.Tensor, num_slots: int) -> bool:
    """Whether a step's shrink runs dense: CUDA steps of at most DENSE_ROW_SLOTS rows x
    slots (decode graphs; long prompts keep the segmented kernel, whose work does not
    grow with the slots) over a long input (at least DENSE_MIN_IN features). Measured on
    an H100 at the 8B shapes under CUDA graphs (``gpu-lora-kernels-h100-dense.json``, 4
    slots): down_proj (K = 14336) 6.8 / 6.9 us dense against 7.2 / 10.3 segmented at 128
    / 256 rows, while the K = 4096 shrinks (qkv, o, gate_up) are 0.4-1.6 us faster
    segmented at 128 rows, about even at 256."""
    return (x.is_cuda and x.shape[-1] >= DENSE_MIN_IN
            and x.shape[0] * num_slots <= DENSE_ROW_SLOTS)


def lora_expand_add(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                    offsets: list[int], rank: int, tiles: LoRATiles,
                    block_n: int | None = None, num_warps: int = 4,
                    dense: bool = False) -> torch.Tensor:
    """y [T, out] += xa[t, i*R:(i+1)*R] @ b[slot(t)][cols of slice i]^T for every row
    with a slot and every slice i (columns ``offsets[i]:offsets[i + 1]``), in place;
    returns y. ``b`` [S, out, R] (R = ``rank``, the slots' padded rank), ``xa`` from
    ``lora_shrink`` [T, len(offsets) * R], or with ``dense`` from ``lora_shrink_dense``
    [T, S * len(offsets) * R] (each row reads its slot's columns). At most 3 slices."""
    assert y.stride(-1) == 1 and b.stride(-1) == 1 and xa.stride(-1) == 1
    ns = len(offsets)
    assert 1 <= ns <= 3 and offsets[0] == 0
    assert xa.shape[1] == (b.shape[0] if dense else 1) * ns * rank, (xa.shape, b.shape)
    t, n = y.shape
    n_tiles = tiles.tile_slot.shape[0]
    if n_tiles == 0 or t == 0:
        return y
    bounds = list(offsets[1:]) + [n] * (3 - ns)
    # 128 output columns a program (measured as above: the 8192-row gate_up expand 414 ->
    # 376 us, against a 316 us floor of reading and writing y; decode rows about even)
    block_n = block_n or (128 if y.device.type != "cpu" else min(triton.next_power_of_2(n), 512))
    _expand_kernel[(n_tiles, triton.cdiv(n, block_n))](
        xa, b, y, tiles.rows, tiles.tile_slot, tiles.slot_rank, n, rank, bounds[0],
        bounds[1], xa.stride(0), ns * rank if dense else 0, b.stride(0), b.stride(1),
        y.stride(0), NS=ns,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=num_warps, **_dot_args(b))
    return y


# --- pure-torch references -------------------------------------------------------------
def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slot: torch.Tensor
                    ) -> torch.Tensor:
    """x [T, in], a [S, R_total, in], token_slot [T] -> xa [T, R_total] fp32 (zeros on
    rows without a slot)."""
    s = token_slot.long()
    xa = torch.einsum("tk,tnk->tn", x.float(), a[s.clamp(min=0)].float())
    return xa * (s >= 0)[:, None]


def lora_expand_add_ref(y: torch.Tensor, xa: torch.Tensor, b: list[torch.Tensor],
                        offsets: list[int], token_slot: torch.Tensor,
                        slot_rank: torch.Tensor) -> torch.Tensor:
    """y [T, out] += each row's delta (slice i: xa[:, i*R:i*R + r] @ b[i][slot, :, :r]^T,
    r the slot's rank), in y's dtype with xa rounded to b's dtype; returns y."""
    s = token_slot.long()
    rank = b[0].shape[2]
    r_ok = torch.arange(rank)[None, :] < slot_rank.long().cpu()[s.clamp(min=0).cpu()][:, None]
    r_ok = r_ok.to(y.device) & (s >= 0)[:, None]
    for i, (off, bi) in enumerate(zip(offsets, b)):
        xs = (xa[:, i * rank:(i + 1) * rank] * r_ok).to(bi.dtype).float()
        d = torch.einsum("tr,tnr->tn", xs, bi[s.clamp(min=0)].float())
        y[:, off:off + bi.shape[1]] = (y[:, off:off + bi.shape[1]].float() + d).to(y.dtype)
    return y
