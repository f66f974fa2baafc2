"""The C++ CPU decode attention (cpu/kernels/paged_attention.cpp) against the reference
over the same quantized values: float32, int8 and fp8 caches at several head counts,
GQA ratios, head dims, block sizes, partial last blocks and scattered block tables;
through the torch backend on mixed steps; and the fallback when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from kvflow.cpu.kernels import build
from kvflow.cpu.kernels import paged_attention as pa
from kvflow.layers.attention import AttentionMetadata, AttentionSpec
from kvflow.layers.attention.kv_quant import (KVQuant, dequantize_cache, quantize_fp8,
                                             quantize_int8, storage_dtype)
from kvflow.layers.attention.torch_backend import TorchAttentionBackend, paged_attention_ref
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary_ref

needs_kernel = pytest.mark.skipif(not pa.available(), reason="no C++ compiler here")

KINDS = ["float32", "int8", "fp8"]


def _cache(kind: str, nb: int, bs: int, kvh: int, d: int, g: torch.Generator):
    """A cache of ``kind`` holding quantized random values, and its KVQuant."""
    x = torch.randn(2, nb, bs, kvh, d, generator=g) * 2
    if kind == "float32":
        return x, None
    if kind == "int8":
        q, s = quantize_int8(x.view(-1, kvh, d))
        return q.view(x.shape), KVQuant("int8", s.view(2, nb, bs, kvh))
    # Per-tensor scales that put values across E4M3's range, subnormals included.
    return quantize_fp8(x, 0.01), KVQuant("fp8", None, 0.01, 0.01)


def _run(quant, q, cache, tables, lens, scale):
    if quant is None:
        return pa.paged_decode(q, cache, tables, lens, scale)
    return pa.paged_decode(q, cache, tables, lens, scale, quant.scales, quant.k_scale,
                           quant.v_scale)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("h,kvh,d,bs", [(4, 4, 16, 1), (6, 2, 32, 4), (9, 3, 64, 16),
                                        (8, 1, 128, 32), (12, 4, 64, 5)])
def test_matches_reference_over_quantized_values(kind, h, kvh, d, bs):
    g = torch.Generator().manual_seed(h * 100 + bs)
    nb, width = 64, 8
    cache, quant = _cache(kind, nb, bs, kvh, d, g)
    b = 7
    # Lengths: one token, a partial first block, exact block multiples, partial last
    # blocks, a full table row.
    lens = torch.tensor([1, max(bs - 1, 1), bs, 2 * bs + 1, 3 * bs, 5 * bs - 1, width * bs],
                        dtype=torch.int32)
    tables = torch.randperm(nb, generator=g)[: b * width].view(b, width).to(torch.int32)
    q = torch.randn(b, h, d, generator=g)
    out = _run(quant, q, cache, tables, lens, d ** -0.5)
    ref = paged_attention_ref(q, dequantize_cache(cache, quant, torch.float32), tables,
                              list(range(b + 1)), lens.tolist(), d ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_long_context_and_large_scores_stay_stable():
    """Scores far from 0 over hundreds of blocks (the softmax subtracts the row's max)."""
    g = torch.Generator().manual_seed(1)
    h, kvh, d, bs, nb = 6, 2, 64, 16, 160
    cache, quant = _cache("int8", nb, bs, kvh, d, g)
    lens = torch.tensor([1200, 37], dtype=torch.int32)
    tables = torch.randperm(nb, generator=g)[:2 * 76].view(2, 76).to(torch.int32)
    q = torch.randn(2, h, d, generator=g) * 8
    out = _run(quant, q, cache, tables, lens, d ** -0.5)
    ref = paged_attention_ref(q, dequantize_cache(cache, quant, torch.float32), tables,
                              [0, 1, 2], lens.tolist(), d ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("d", [64, 24])  # the fixed-width path and the run-time one
def test_every_fp8_value_is_read_exactly(d):
    """Each finite E4M3 byte (subnormals, zeros of both signs, +-448) read back as V of a
    one-token context: the output is exactly that value times v_scale (the widening
    folds a power of two into the scale, which must not change a bit)."""
    values = torch.arange(256, dtype=torch.uint8)
    values = values[(values & 0x7F) != 0x7F]  # not NaN
    n_items = -(-values.numel() // d)
    v = torch.zeros(n_items * d, dtype=torch.uint8)
    v[: values.numel()] = values
    cache = torch.zeros(2, n_items, 1, 1, d, dtype=torch.uint8)
    cache[1, :, 0, 0] = v.view(n_items, d)
    cache = cache.view(torch.float8_e4m3fn)
    tables = torch.arange(n_items, dtype=torch.int32).view(n_items, 1)
    lens = torch.ones(n_items, dtype=torch.int32)
    q = torch.randn(n_items, 1, d)
    out = pa.paged_decode(q, cache, tables, lens, 1.0, None, 0.5, 0.375)
    want = cache[1, :, 0, 0].float() * 0.375  # [items, D]
    assert torch.equal(out[:, 0], want)


@needs_kernel
def test_bad_inputs_are_refused():
    cache = torch.zeros(2, 4, 4, 2, 8, dtype=torch.int8)
    q = torch.zeros(1, 4, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="scales"):
        pa.paged_decode(q, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="scales"):
        pa.paged_decode(q, cache, tables, lens, 1.0, torch.zeros(2, 4, 4, 3))
    with pytest.raises(ValueError, match="float32 queries"):
        pa.paged_decode(q.bfloat16(), cache, tables, lens, 1.0, torch.zeros(2, 4, 4, 2))
    with pytest.raises(ValueError, match="shapes"):
        pa.paged_decode(torch.zeros(1, 3, 8), cache, tables, lens, 1.0,
                        torch.zeros(2, 4, 4, 2))


def _meta(q_lens, seq_lens, num_decodes, tables, bs):
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = [int(tables[i, p // bs]) * bs + p % bs
             for i, (n, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - n, s)]
    return AttentionMetadata(
        num_actual_tokens=qsl[-1], num_reqs=len(q_lens), num_decodes=num_decodes,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))


def _mixed_steps(kind: str, decode_kernel: bool, d: int = 32):
    """A prefill step then a mixed step (three decodes and a chunk after a cached
    prefix) through the torch backend; each step's output against the reference over
    the cache's dequantized values. Returns the last step's output."""
    torch.manual_seed(0)
    h, kvh, bs, nb = 6, 2, 4, 40
    rotary = RotaryEmbedding(d, 128, 10000.0, None)
    spec = AttentionSpec(block_size=bs, num_kv_heads=kvh, dtype=torch.float32,
                         device=torch.device("cpu"), rotary=rotary)
    backend = TorchAttentionBackend()
    builder = backend.metadata_builder(spec)
    assert builder.decode_kernel == pa.available()
    builder.decode_kernel = decode_kernel
    cache = torch.zeros(2, nb, bs, kvh, d, dtype=storage_dtype(kind) if kind != "float32"
                        else torch.float32)
    quant = None if kind == "float32" else KVQuant(
        kind, torch.zeros(2, nb, bs, kvh) if kind == "int8" else None, 0.05, 0.05)
    tables = torch.randperm(nb)[:32].to(torch.int32).view(4, 8)
    out = None
    for q_lens, seq_lens, nd in (([9, 14, 6, 3], [9, 14, 6, 3], 0),
                                 ([1, 1, 1, 5], [10, 15, 7, 8], 3)):
        meta = _meta(q_lens, seq_lens, nd, tables, bs)
        t = meta.num_actual_tokens
        positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens)])
        q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d) * 2, torch.randn(t, kvh, d)
        builder.build(meta, positions)
        assert meta.backend.decode_kernel == decode_kernel
        out = backend.forward(positions, q, k, v, cache, rotary, d ** -0.5, meta,
                              kv_quant=quant)
        cos, sin = rotary.cos_sin(positions)
        ref = paged_attention_ref(apply_rotary_ref(q, cos, sin),
                                  dequantize_cache(cache, quant, torch.float32), tables,
                                  meta.query_start_loc_cpu, seq_lens, d ** -0.5)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    return out


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_backend_mixed_step_through_the_kernel_equals_the_torch_path(kind):
    got = _mixed_steps(kind, decode_kernel=True)
    want = _mixed_steps(kind, decode_kernel=False)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_head_dim_the_kernel_lacks_takes_the_torch_read():
    """A head dim that is not a multiple of 8: the plan still says kernel (it does not
    know the head dim); the forward reads those decodes the torch way."""
    _mixed_steps("int8", decode_kernel=True, d=12)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """``build.load`` starts over (nothing loaded in this process, an empty cache dir)."""
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def test_no_compiler_falls_back_to_the_torch_path(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.INFO, logger="kvflow.cpu.kernels.build"):
        assert not pa.available()
    assert "no C++ compiler found" in caplog.text
    # The backend plans the torch decode path and still matches the reference.
    _mixed_steps("int8", decode_kernel=False)
    spec = AttentionSpec(block_size=4, num_kv_heads=2, dtype=torch.float32,
                         device=torch.device("cpu"), rotary=RotaryEmbedding(8, 16, 1e4, None))
    assert not TorchAttentionBackend().metadata_builder(spec).decode_kernel


def test_switched_off_by_environment(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="kvflow.cpu.kernels.build"):
        assert not pa.available()
    assert "KVFLOW_CPU_KERNELS=0" in caplog.text


@needs_kernel
def test_failed_build_is_logged_and_falls_back(fresh_build, monkeypatch, caplog):
    monkeypatch.setattr(build, "FLAGS", [*build.FLAGS, "-fno-such-flag-kvflow"])
    with caplog.at_level(logging.INFO, logger="kvflow.cpu.kernels.build"):
        assert not pa.available()
    assert "could not be built" in caplog.text
    assert not list(fresh_build.glob("kvflow/*.so"))


@needs_kernel
def test_built_once_then_loaded_from_the_cache(fresh_build, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="kvflow.cpu.kernels.build"):
        assert pa.available()
        monkeypatch.setattr(build, "_loaded", {})  # as a new process would
        assert pa.available()
    assert "built in" in caplog.text and "loaded from" in caplog.text
    assert len(list(fresh_build.glob("kvflow/paged_attention-*.so"))) == 1
