"""The multi-LoRA shrink and expand kernels against their pure-torch references: rows of
several slots and of none (-1) in one launch, slots of smaller rank than the stacked
maximum (with stale values past their rank, which must not count), merged layers of 1
to 3 slices, ragged row counts, small and large row tiles, split reductions, fp32 and
bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.kernels.lora import (BLOCK_M_LARGE, BLOCK_M_SMALL, build_tiles,
                                 lora_expand_add, lora_expand_add_ref, lora_shrink,
                                 lora_shrink_dense, lora_shrink_ref, lora_tiles, max_tiles)


def test_tiles_group_rows_by_slot():
    slot = np.array([2, -1, 0, 2, 2, -1, 0, 1])
    rows, tile_slot = build_tiles(slot, 4, 2)
    assert len(tile_slot) == max_tiles(8, 4, 2) == 8
    # slot 0: rows 2, 6; slot 1: row 7 (+pad); slot 2: rows 0, 3 | 4 (+pad)
    assert tile_slot.tolist() == [0, 1, 2, 2, -1, -1, -1, -1]
    assert rows[:8].tolist() == [2, 6, 7, -1, 0, 3, 4, -1]
    rows, tile_slot = build_tiles(np.full(5, -1), 4, 16)
    assert (tile_slot == -1).all() and (rows == -1).all()


def _case(device, dtype, t, ins, outs, num_slots, rank, ranks, seed, frac_none=0.25):
    g = torch.Generator().manual_seed(seed)
    ns = len(outs)
    x = torch.randn(t, ins, generator=g).to(device, dtype)
    # stale values past each slot's rank: the expand must cut them off
    a = torch.randn(num_slots, ns * rank, ins, generator=g).to(device, dtype) / ins ** 0.5
    b = [torch.randn(num_slots, n, rank, generator=g).to(device, dtype) for n in outs]
    slot = torch.randint(0, num_slots, (t,), generator=g)
    slot[torch.rand(t, generator=g) < frac_none] = -1
    if frac_none < 1:
        slot[0] = num_slots - 1  # at least one adapter row, of the smallest rank
    slot_rank = torch.tensor(ranks, dtype=torch.int32)
    y = torch.randn(t, sum(outs), generator=g).to(device, dtype)
    return x, a, b, slot.to(device, torch.int32), slot_rank, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,outs,block_m,split_k,seed", [
    (1, [48], BLOCK_M_SMALL, 1, 0),  # one decode row
    (13, [32, 16, 16], BLOCK_M_SMALL, 1, 1),  # qkv-like, ragged
    (37, [40, 40], BLOCK_M_SMALL, 2, 2),  # gate_up-like, split reduction
    (70, [24], BLOCK_M_LARGE, 1, 3),  # a prefill step in large tiles
])
def test_shrink_expand_match_reference(device, dtype, t, outs, block_m, split_k, seed):
    rank, ranks = 8, [8, 4, 2]
    x, a, b, slot, slot_rank, y = _case(device, dtype, t, 80, outs, 3, rank, ranks, seed)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    tiles = lora_tiles(slot, slot_rank, 3, block_m)
    xa = lora_shrink(x, a, tiles, split_k=split_k)
    ref_xa = lora_shrink_ref(x, a, slot)
    has = slot >= 0
    # bf16: y's last bit (an ulp is 0.03-0.06 at |y| of 4-8)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(xa[has], ref_xa[has], **tol)
    b_all = torch.cat(b, dim=1)  # [S, out, R]: the stacked layout of LoRAWeights
    got = lora_expand_add(y.clone(), ref_xa, b_all, offsets, rank, tiles)
    want = lora_expand_add_ref(y.clone(), ref_xa, b, offsets, slot, slot_rank)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[~has], y[~has])  # base rows untouched
    # the delta is really there (the test would pass on a no-op otherwise)
    assert (want[has] - y[has]).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,outs,block_n,seed", [
    (13, [32, 16, 16], 16, 1),  # column blocks inside one slice each
    (37, [40, 40], 16, 2),  # a block across the slice boundary (32..47)
    (5, [24], None, 3),
])
def test_dense_shrink_and_slice_blocks_match_reference(device, dtype, t, outs, block_n, seed):
    """The dense shrink (every slot's A in one GEMM; the expand reads each row's slot's
    columns) and expand column blocks that meet one slice or straddle two."""
    rank, ranks = 8, [8, 4, 2]
    x, a, b, slot, slot_rank, y = _case(device, dtype, t, 80, outs, 3, rank, ranks, seed)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    tiles = lora_tiles(slot, slot_rank, 3, BLOCK_M_SMALL)
    xa = lora_shrink_dense(x, a)  # [T, S * NS * R]
    ref_xa = lora_shrink_ref(x, a, slot)
    has = slot >= 0
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    per_slot = xa.view(t, 3, -1)[torch.arange(t, device=xa.device), slot.long().clamp(min=0)]
    torch.testing.assert_close(per_slot[has].float(), ref_xa[has], **tol)
    b_all = torch.cat(b, dim=1)
    got = lora_expand_add(y.clone(), xa, b_all, offsets, rank, tiles, block_n=block_n,
                          dense=True)
    want = lora_expand_add_ref(y.clone(), ref_xa, b, offsets, slot, slot_rank)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[~has], y[~has])
    assert (want[has] - y[has]).abs().max() > 0.05
    if block_n is not None:  # the segmented xa through the same column blocks
        got = lora_expand_add(y.clone(), ref_xa, b_all, offsets, rank, tiles,
                              block_n=block_n)
        torch.testing.assert_close(got, want, **tol)


def test_no_adapter_rows_is_a_no_op(device):
    x, a, b, slot, slot_rank, y = _case(device, torch.float32, 9, 32, [16], 2, 4, [4, 4], 5,
                                        frac_none=1.1)
    tiles = lora_tiles(slot, slot_rank, 2)
    out = lora_expand_add(y.clone(), lora_shrink(x, a, tiles), b[0], [0], 4, tiles)
    assert torch.equal(out, y)


def test_static_inputs_serve_graphs_of_more_rows(device):
    """The worker's device buffers (kvflow/lora/kernel_inputs.py): a graph of 8 rows
    captured over them replays steps of 6, 8 and 1 real rows (padding rows add nothing;
    a step of fewer tiles leaves none of an earlier step's), and a step without adapter
    rows clears them."""
    from kvflow.lora.kernel_inputs import LoRAKernelInputs

    inputs = LoRAKernelInputs(num_slots=3, max_tokens=8, device=device)
    graph = inputs.views(8, BLOCK_M_SMALL)  # what the graph was captured with
    x, a, b, _, _, y = _case(device, torch.float32, 8, 32, [16, 16], 3, 4, [4, 2, 4], 6)
    ranks = torch.tensor([4, 2, 4], dtype=torch.int32)
    b_all = torch.cat(b, dim=1)
    # the last step (one row: 2 tiles) reuses the host buffer of the second (3 tiles)
    for step in ([1, 1, -1, 1, -1, 1], [0, 1, 2, 0, 1, 2, 0, 1], [1], [2]):
        slot = torch.tensor(step + [-1] * (8 - len(step)), dtype=torch.int32, device=device)
        inputs.fill(np.array(step), ranks.tolist(), BLOCK_M_SMALL)
        got = lora_expand_add(y.clone(), lora_shrink(x, a, graph), b_all, [0, 16], 4, graph)
        want = lora_expand_add_ref(y.clone(), lora_shrink_ref(x, a, slot), b, [0, 16],
                                   slot, ranks)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    inputs.clear()
    got = lora_expand_add(y.clone(), lora_shrink(x, a, graph), b_all, [0, 16], 4, graph)
    assert torch.equal(got, y)
