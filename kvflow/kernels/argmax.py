"""Row-wise argmax of a [B, V] logits tensor, each row split over many programs.

Reference: ``torch.argmax(logits, dim=-1)``, exactly: the first index of the maximum;
NaN counts as the maximum (a row with NaN gives its first NaN's index); a row of all
-inf gives 0.

Why: torch reduces one row with one thread block, so at batch 1 (Llama-3.1-8B, V =
128256 fp32) the greedy sampler's argmax is one block streaming 513 KB, 27 us on an H200.
Spread over ~32 programs the same read takes a few microseconds.

Algorithm: two launches, no host sync and no data-dependent shapes (CUDA-graph safe).

1. grid ``(B, S)``, ``S = cdiv(V, BLOCK)``: program (b, s) loads the BLOCK elements of
   chunk s of row b in float32 (masked lanes read -inf) and writes the chunk's
   (maximum, first index of it) to a float32 / int32 workspace [B, S]. NaN first: if the
   chunk has a NaN, its partial is (NaN, first NaN's index).
2. grid ``(B,)``: program b loads row b's S partials (``S_PAD = next_power_of_2(S)``
   lanes) and reduces them with the same rule. The partials are in index order, so the
   lowest index among the partials that hold the maximum is the row's first maximum.

Both stages pick the index with a ``min`` over the candidate lanes, with a BIG sentinel
for the lanes that are not candidates: a masked lane (-inf) therefore never wins, even
in an all -inf row, where every valid lane is a candidate and the min is the first one.
Values are compared in float32, which holds bf16 / fp16 exactly.

Traffic: memory-bound, one read of the logits plus 8 bytes per chunk: 128256 fp32 =
513 KB per row (in L2 right after the LM head wrote it), 32 programs per row at BLOCK =
4096.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvflow import envs

BLOCK = 4096  # elements per stage-1 program (a chunk of a row)
MIN_VOCAB = 8192  # greedy_argmax: narrower rows stay on torch (one block is enough there)
# Index sentinel, larger than any valid index so min() never picks it (a constexpr: the
# kernels read it as a global).
_BIG = tl.constexpr(2**31 - 1)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _argmax_chunk_kernel(x_ptr, part_val_ptr, part_idx_ptr, V, stride_x, S,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)  # int32: V < 2^31
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    is_nan = x != x
    # The max without NaNs (how tl.max treats NaN is not specified); NaN handled below.
    m = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
    first_max = tl.min(tl.where(mask & (x == m), cols, _BIG), axis=0)
    first_nan = tl.min(tl.where(is_nan, cols, _BIG), axis=0)  # masked lanes are -inf
    has_nan = first_nan < _BIG
    out = row * S + chunk
    tl.store(part_val_ptr + out, tl.where(has_nan, float("nan"), m))
    tl.store(part_idx_ptr + out, tl.where(has_nan, first_nan, first_max))


@triton.jit
def _argmax_merge_kernel(part_val_ptr, part_idx_ptr, out_ptr, S, S_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_PAD)
    mask = s < S
    v = tl.load(part_val_ptr + row * S + s, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * S + s, mask=mask, other=_BIG)
    is_nan = v != v
    m = tl.max(tl.where(is_nan, float("-inf"), v), axis=0)
    # A padding lane has idx BIG, so it loses every min (all -inf rows included).
    first_max = tl.min(tl.where(v == m, idx, _BIG), axis=0)
    first_nan = tl.min(tl.where(is_nan, idx, _BIG), axis=0)
    best = tl.where(first_nan < _BIG, first_nan, first_max)
    tl.store(out_ptr + row, best.to(tl.int64))


def argmax_rows(logits: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """logits [B, V] (float32 / bf16 / fp16, unit stride along V) -> int64 [B], equal to
    ``logits.argmax(dim=-1)``. ``block`` (a power of two) is the chunk each program
    reads; the default suits V ~ 32k..256k (benchmarks may sweep it)."""
    assert logits.dim() == 2 and logits.dtype in _DTYPES, (logits.shape, logits.dtype)
    assert logits.stride(1) == 1 or logits.shape[1] == 1, "rows must be contiguous"
    assert block & (block - 1) == 0, block
    b, v = logits.shape
    assert v > 0, "argmax over an empty row"  # torch raises too
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    s = triton.cdiv(v, block)
    part_val, part_idx = _workspace(logits.device, b, s)
    _argmax_chunk_kernel[(b, s)](logits, part_val, part_idx, v, logits.stride(0), s,
                                 BLOCK=block, num_warps=8 if block >= 8192 else 4)
    s_pad = triton.next_power_of_2(s)
    _argmax_merge_kernel[(b,)](part_val, part_idx, out, s, S_PAD=s_pad,
                               num_warps=1 if s_pad <= 512 else 4)
    return out


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials of a [b, s] launch, kept per shape: only the two launches of one call
    touch them, in stream order, so reuse is safe (also inside CUDA graphs, where the
    first, uncaptured call allocates them) and saves two allocations of host time per
    call (the sampler runs eagerly, once per step)."""
    key = (device, b, s)
    ws = _workspaces.get(key)
    if ws is None:
        if len(_workspaces) > 64:  # many batch sizes: start over rather than grow
            _workspaces.clear()
        ws = _workspaces[key] = (torch.empty((b, s), dtype=torch.float32, device=device),
                                 torch.empty((b, s), dtype=torch.int32, device=device))
    return ws


@functools.lru_cache(maxsize=1)
def _use_kernel() -> bool:
    """``KVFLOW_GREEDY_ARGMAX`` (``kvflow.envs.greedy_argmax_mode``), read once: ``torch``
    keeps torch's argmax on the GPU too (the behaviour before this kernel)."""
    return envs.greedy_argmax_mode() != "torch" and not envs.disable_triton()


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's greedy choice, ``logits.argmax(dim=-1)`` for [B, V] logits: the Triton
    kernel on CUDA for vocabularies of at least MIN_VOCAB, torch elsewhere (CPU, Triton
    disabled by KVFLOW_DISABLE_TRITON, KVFLOW_GREEDY_ARGMAX=torch, other layouts and
    dtypes)."""
    if (logits.is_cuda and logits.dim() == 2 and logits.shape[1] >= MIN_VOCAB
            and logits.stride(1) == 1 and logits.dtype in _DTYPES and _use_kernel()):
        return argmax_rows(logits)
    return logits.argmax(dim=-1)
