"""Parallel layers in one process: each rank's shard is built and loaded separately, and
the collectives are done by hand (sum for all-reduce, concatenation for all-gather), so
the sharding arithmetic is checked without starting any process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.errors import ModelLoadError
from kvflow.layers.linear import LinearMethod
from kvflow.layers.parallel_linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from kvflow.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


class LocalGroup(GroupCoordinator):
    """Rank r of n without torch.distributed: collectives return the local value."""

    def __init__(self, rank: int, n: int) -> None:
        super().__init__(list(range(n)), rank, None, None, torch.device("cpu"))

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


def groups(n: int) -> list[LocalGroup]:
    return [LocalGroup(r, n) for r in range(n)]


@pytest.mark.parametrize("n,heads,kv_heads", [(2, 4, 2), (4, 4, 2), (3, 9, 3), (4, 8, 1)])
def test_qkv_split_by_heads_and_replicated_kv(n, heads, kv_heads):
    d, hidden = 8, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(heads * d, hidden, generator=g)
    k = torch.randn(kv_heads * d, hidden, generator=g)
    v = torch.randn(kv_heads * d, hidden, generator=g)
    b = {s: torch.randn(t.shape[0], generator=g) for s, t in (("q", q), ("k", k), ("v", v))}
    x = torch.randn(3, hidden, generator=g)
    for grp in groups(n):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, True, torch.float32, tp=grp)
        for shard, w in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, w, shard)
            layer.bias.weight_loader(layer.bias, b[shard], shard)
        out_q, out_k, out_v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], -1)
        r = grp.rank_in_group
        h = heads // n
        torch.testing.assert_close(out_q, x @ q[r * h * d:(r + 1) * h * d].T
                                   + b["q"][r * h * d:(r + 1) * h * d])
        kv = max(1, kv_heads // n)
        first = r * kv_heads // n  # with replication, ranks share a KV head
        rows = slice(first * d, (first + kv) * d)
        torch.testing.assert_close(out_k, x @ k[rows].T + b["k"][rows])
        torch.testing.assert_close(out_v, x @ v[rows].T + b["v"][rows])


def test_mlp_column_then_row_sums_to_the_full_product():
    n, hidden, inter = 4, 16, 32
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    down = torch.randn(hidden, inter, generator=g)
    down_bias = torch.randn(hidden, generator=g)
    x = torch.randn(5, hidden, generator=g)
    h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    expected = h @ down.T + down_bias
    total = torch.zeros_like(expected)
    for grp in groups(n):
        gu = MergedColumnParallelLinear(hidden, [inter, inter], False, torch.float32, tp=grp)
        gu.weight.weight_loader(gu.weight, gate, 0)
        gu.weight.weight_loader(gu.weight, up, 1)
        dp = RowParallelLinear(inter, hidden, True, torch.float32, tp=grp)
        dp.weight.weight_loader(dp.weight, down)
        dp.bias.weight_loader(dp.bias, down_bias)
        a, b = gu(x).chunk(2, dim=-1)
        total += dp(torch.nn.functional.silu(a) * b)  # the all-reduce, by hand
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-4)  # sum order differs


def test_vocab_parallel_embedding_and_head_with_padding():
    n, vocab, hidden = 3, 10, 4  # 10 rows over 3 ranks: 4, 4, 2 (+2 padding rows)
    g = torch.Generator().manual_seed(2)
    table = torch.randn(vocab, hidden, generator=g)
    ids = torch.tensor([0, 3, 4, 9, 7])
    hs = torch.randn(2, hidden, generator=g)
    emb_sum = torch.zeros(len(ids), hidden)
    parts = []
    for grp in groups(n):
        emb = VocabParallelEmbedding(vocab, hidden, torch.float32, tp=grp)
        emb.weight.weight_loader(emb.weight, table)
        emb_sum += emb(ids)
        head = ParallelLMHead(vocab, hidden, torch.float32, tied_to=emb, tp=grp)
        parts.append(torch.nn.functional.linear(hs, head.weight))
    torch.testing.assert_close(emb_sum, table[ids])
    logits = torch.cat(parts, dim=-1)[:, :vocab]
    torch.testing.assert_close(logits, hs @ table.T)


class PackedInt4Method(LinearMethod):
    """A stand-in quantization method: weight stored [in, out / 8] as int32 with the
    packing on the output dim, the way packed formats describe their parameters."""

    def create_weights(self, layer, dtype):
        w = nn.Parameter(torch.zeros(layer.input_size, layer.output_size // 8,
                                     dtype=torch.int32), requires_grad=False)
        w.input_dim, w.output_dim, w.packed_dim, w.pack_factor = 0, 1, 1, 8
        w.weight_loader = layer.weight_loader
        layer.register_parameter("weight", w)

    def apply(self, layer, x):
        raise NotImplementedError


def test_packed_quantized_parameters_shard_by_their_dims():
    n, hidden, inter = 2, 8, 32
    full = torch.arange(hidden * inter // 8, dtype=torch.int32).view(hidden, inter // 8)
    for grp in groups(n):
        layer = MergedColumnParallelLinear(hidden, [inter, inter], False, torch.float32,
                                           PackedInt4Method(), tp=grp)
        layer.weight.weight_loader(layer.weight, full, 0)
        layer.weight.weight_loader(layer.weight, full + 1000, 1)
        r, cols = grp.rank_in_group, inter // 8 // n  # packed columns per rank and shard
        expect = torch.cat([full[:, r * cols:(r + 1) * cols],
                            full[:, r * cols:(r + 1) * cols] + 1000], dim=1)
        assert torch.equal(layer.weight.data, expect)


def test_a_checkpoint_of_the_wrong_shape_is_refused():
    layer = RowParallelLinear(16, 8, False, torch.float32, tp=LocalGroup(0, 2))
    with pytest.raises(ModelLoadError, match="input size 16"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 12))
