"""argmax_rows kernel vs torch.argmax(dim=-1): first index of the maximum, NaN first, all
-inf rows give 0, rows split over several chunks (BLOCK elements each) and merged."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.argmax import BLOCK, MIN_VOCAB, argmax_rows, greedy_argmax

NAN, NEG = float("nan"), float("-inf")
DTYPES = [torch.float32, torch.bfloat16]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(x: torch.Tensor) -> torch.Tensor:
    got = argmax_rows(x)
    want = x.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got.cpu(), want.cpu()), (got.tolist(), want.tolist())
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("vocab", [1000, 8192, 128256])  # one chunk, exactly 2, 32 (ragged)
def test_argmax_random(device, dtype, rows, vocab):
    torch.manual_seed(vocab + rows)
    _check(torch.randn(rows, vocab, device=device).to(dtype))


def test_argmax_max_in_last_partial_chunk(device):
    """The maximum in the ragged last chunk (past the last full BLOCK), where masked lanes
    read -inf."""
    x = torch.randn(2, 3 * BLOCK + 77, device=device)
    x[0, -1] = 100.0
    x[1, 3 * BLOCK] = 100.0
    assert _check(x).tolist() == [3 * BLOCK + 76, 3 * BLOCK]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_pick_the_first(device, dtype):
    """The maximum repeated within a chunk and across chunks: the first wins, also when it
    is not in chunk 0 and a later chunk holds more copies."""
    v = 5 * BLOCK + 123
    x = torch.randn(3, v, device=device).clamp(max=5.0)
    x[0, [BLOCK + 7, BLOCK + 900, 3 * BLOCK + 1, 5 * BLOCK + 100]] = 9.0
    x[1, [2 * BLOCK + 3000, 4 * BLOCK, 4 * BLOCK + 1, 4 * BLOCK + 2]] = 9.0
    x[2, [5 * BLOCK + 50, 5 * BLOCK + 51]] = 9.0  # only in the ragged last chunk
    x = x.to(dtype)
    assert _check(x).tolist() == [BLOCK + 7, 2 * BLOCK + 3000, 5 * BLOCK + 50]


def test_argmax_constant_row(device):
    """Every element equal: index 0 (each chunk's partial ties, the first chunk wins)."""
    _check(torch.full((2, 3 * BLOCK + 5), 0.25, device=device))
    x = torch.zeros(1, 2 * BLOCK, device=device)
    x[0, 0] = -0.0  # -0.0 == 0.0: still the first
    assert _check(x).tolist() == [0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_nan_counts_as_the_maximum(device, dtype):
    """torch returns the first NaN's index: NaN after the (finite or +inf) maximum, in a
    later chunk; several NaNs in several chunks; a NaN inside the max's own chunk."""
    v = 4 * BLOCK + 10
    x = torch.randn(4, v, device=device)
    x[0, 5] = 50.0
    x[0, 2 * BLOCK + 11] = NAN  # later chunk than the max
    x[1, 3] = float("inf")
    x[1, [3 * BLOCK + 2, BLOCK + 700, 4 * BLOCK + 9]] = NAN  # first NaN: BLOCK + 700
    x[2, [BLOCK + 20, BLOCK + 10]] = NAN  # two in one chunk, not in index-0 position
    x[2, BLOCK + 5] = 1e30
    x[3, 4 * BLOCK + 9] = NAN  # the last element of the ragged chunk
    x = x.to(dtype)
    assert _check(x).tolist() == [2 * BLOCK + 11, BLOCK + 700, BLOCK + 10, 4 * BLOCK + 9]


def test_argmax_all_nan_and_all_neg_inf_rows(device):
    v = 2 * BLOCK + 300  # ragged: masked lanes (-inf) must never win
    x = torch.randn(4, v, device=device)
    x[0] = NEG
    x[1] = NAN
    x[2] = NEG
    x[2, 2 * BLOCK + 299] = -1e38  # the only finite value, in the ragged chunk
    x[3, : BLOCK] = NEG  # chunk 0 all -inf, the rest random
    got = _check(x)
    assert got[0] == 0 and got[1] == 0 and got[2] == v - 1 and got[3] >= BLOCK


def test_argmax_small_all_neg_inf(device):
    """One ragged chunk: the masked lanes and the valid ones are all -inf -> 0."""
    assert _check(torch.full((3, 1000), NEG, device=device)).tolist() == [0, 0, 0]
    assert _check(torch.full((2, 1), NEG, device=device)).tolist() == [0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_strided_rows(device, dtype):
    """A slice of a wider tensor: row stride != V (and an odd offset into storage)."""
    torch.manual_seed(0)
    big = torch.randn(4, 3 * BLOCK + 100, device=device).to(dtype)
    x = big[1:, 3:3 * BLOCK + 50]  # [3, 3 * BLOCK + 47], row stride 3 * BLOCK + 100
    x[1, 2 * BLOCK + 1] = 20.0
    x[1, 3 * BLOCK] = 20.0
    assert x.stride(0) != x.shape[1]
    got = _check(x)
    assert got[1] == 2 * BLOCK + 1


@pytest.mark.parametrize("block", [1024, 8192])
def test_argmax_other_blocks(device, block):
    """The chunk size is a parameter (benchmarks sweep it): 1024 gives many partials."""
    torch.manual_seed(1)
    x = torch.randn(2, 3 * 8192 + 5, device=device)
    x[0, [9000, 20000]] = 10.0
    x[1, 24000] = NAN
    got = argmax_rows(x, block=block)
    assert torch.equal(got.cpu(), x.argmax(dim=-1).cpu())
    assert got.tolist() == [9000, 24000]


def test_argmax_empty_batch(device):
    assert argmax_rows(torch.randn(0, 5000, device=device)).shape == (0,)


def test_greedy_argmax_cpu_is_torch():
    """Off CUDA the dispatch is torch's argmax (the sampler's CPU path stays pure torch)."""
    x = torch.randn(3, 2 * MIN_VOCAB)
    x[1, [100, 9000]] = 50.0
    x[2, 7] = NAN
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    from kvflow.layers.sampler import greedy_argmax as sampler_greedy

    assert torch.equal(sampler_greedy(x), x.argmax(dim=-1))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_greedy_argmax_llama_vocab_gpu(rows):
    """On CUDA the dispatch takes the kernel at Llama-3's vocabulary; equal to torch, and
    capturable in a CUDA graph."""
    torch.manual_seed(0)
    x = torch.randn(rows, 128256, device="cuda")
    x[0, [70000, 90000]] = 1e4
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    out = greedy_argmax(x)  # warm (compiled) before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = greedy_argmax(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.argmax(dim=-1))


def test_greedy_argmax_switch(monkeypatch):
    """KVFLOW_GREEDY_ARGMAX: auto (the kernel on CUDA) or torch; anything else is refused."""
    from kvflow import envs
    from kvflow.errors import InvalidParameterError
    from kvflow.kernels import argmax

    monkeypatch.setenv("KVFLOW_GREEDY_ARGMAX", "torch")
    argmax._use_kernel.cache_clear()
    try:
        assert not argmax._use_kernel()
        monkeypatch.setenv("KVFLOW_GREEDY_ARGMAX", "auto")
        argmax._use_kernel.cache_clear()
        assert argmax._use_kernel() == (not envs.disable_triton())
        monkeypatch.setenv("KVFLOW_GREEDY_ARGMAX", "fast")
        with pytest.raises(InvalidParameterError, match="KVFLOW_GREEDY_ARGMAX"):
            envs.greedy_argmax_mode()
    finally:
        argmax._use_kernel.cache_clear()
