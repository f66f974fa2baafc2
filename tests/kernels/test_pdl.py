"""Programmatic dependent launch (kvflow/kernels/pdl.py): off the GPU and by default it is
off and the launches carry nothing extra; on an sm_90 GPU a CUDA graph of dependent
decode kernels launched with PDL (each waiting inside, weights prefetched before the
wait) gives bit-identical results to the same graph without it, replay after replay."""

from __future__ import annotations

import pytest
import torch

from kvflow import envs
from kvflow.errors import InvalidParameterError
from kvflow.kernels import pdl

requires_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability >= 9")


@pytest.fixture
def pdl_env(monkeypatch):
    """Set KVFLOW_PDL / KVFLOW_ATTN_MERGE for one test; the decisions are cached."""
    from kvflow.kernels import paged_attention

    def set_(mode: str, merge: str = "kernel") -> None:
        monkeypatch.setenv("KVFLOW_PDL", mode)
        monkeypatch.setenv("KVFLOW_ATTN_MERGE", merge)
        pdl._enabled.cache_clear()
        paged_attention.merge_mode.cache_clear()
    yield set_
    monkeypatch.delenv("KVFLOW_PDL")
    monkeypatch.delenv("KVFLOW_ATTN_MERGE")
    pdl._enabled.cache_clear()
    paged_attention.merge_mode.cache_clear()


def test_modes_and_cpu(monkeypatch, pdl_env):
    pdl_env("on")
    assert envs.pdl_mode() == "on"
    assert not pdl.pdl_enabled(torch.device("cpu"))  # never off the GPU
    assert pdl.launch_kw(False) == {} and pdl.launch_kw(True) == {"launch_pdl": True}
    monkeypatch.setenv("KVFLOW_PDL", "sometimes")
    with pytest.raises(InvalidParameterError):
        envs.pdl_mode()
    monkeypatch.setenv("KVFLOW_PDL_PREFETCH", "99")
    with pytest.raises(InvalidParameterError):
        envs.pdl_prefetch_tiles()
    monkeypatch.setenv("KVFLOW_ATTN_MERGE", "maybe")
    with pytest.raises(InvalidParameterError):
        envs.attn_merge_mode()


def test_decode_defaults_off_the_gpu(monkeypatch):
    """Unset / auto switches take decode_defaults' values; off CUDA (and on any GPU not
    in MEASURED) those are the behaviour before the switches."""
    from kvflow.kernels import decode_defaults, gemv_norm, paged_attention

    for var in ("KVFLOW_PDL", "KVFLOW_ATTN_MERGE", "KVFLOW_ATTN_SPLIT_KEYS",
                "KVFLOW_GEMV_NORM_ROW", "KVFLOW_PDL_PREFETCH"):
        monkeypatch.delenv(var, raising=False)
    assert decode_defaults.measured(torch.device("cpu")) == decode_defaults.OFF
    assert envs.pdl_mode() == "auto" and envs.attn_merge_mode() == "auto"
    assert envs.attn_split_keys() is None and envs.gemv_norm_one_row() is None
    if not torch.cuda.is_available():
        for fn in (paged_attention.merge_mode, paged_attention.split_keys, gemv_norm.one_row,
                   pdl.prefetch_tiles_default):
            fn.cache_clear()
        try:
            assert paged_attention.merge_mode() == "kernel"
            assert paged_attention.split_keys() == 0
            assert gemv_norm.one_row() is False
            assert pdl.prefetch_tiles_default() == 0
        finally:
            for fn in (paged_attention.merge_mode, paged_attention.split_keys,
                       gemv_norm.one_row, pdl.prefetch_tiles_default):
                fn.cache_clear()
    for token, values in decode_defaults.MEASURED.items():  # only known switches
        assert set(values) <= set(decode_defaults.OFF), token
    # an on / off / auto switch: as set, or (auto) the measured value; off the GPU, OFF's
    cpu = torch.device("cpu")
    for key in ("pdl", "rope_in_attn", "prefill_graphs"):
        assert decode_defaults.switch_on("on", key, cpu)
        assert not decode_defaults.switch_on("off", key, cpu)
        assert decode_defaults.switch_on("auto", key, cpu) is decode_defaults.OFF[key]


def _decode_chain(seed: int = 0):
    """One decoder layer's batch-1 kernels at small 8B-like widths, as a list of calls
    over static buffers: add+norm+qkv GEMV, rotary + cache write, split-KV attention,
    o GEMV, add+norm+gate_up+silu GEMV, down GEMV (split-K), final RMSNorm."""
    from kvflow.kernels.gemv import gemv
    from kvflow.kernels.gemv_config import GemvConfig
    from kvflow.kernels.gemv_norm import gemv_rms_norm
    from kvflow.kernels.paged_attention import paged_attention
    from kvflow.kernels.rms_norm import rms_norm
    from kvflow.kernels.rotary_kv import rotary_and_cache_write

    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    hid, h, kvh, d, inter, ctx = 1024, 8, 2, 128, 2048, 300
    rnd = lambda *s, sc=0.05: (torch.randn(*s, generator=g, device=dev) * sc).to(dt)  # noqa
    w_qkv, w_o = rnd((h + 2 * kvh) * d, hid), rnd(hid, h * d)
    w_gu, w_down = rnd(2 * inter, hid), rnd(hid, inter)
    nw1, nw2 = rnd(hid, sc=1.0).abs() + 0.5, rnd(hid, sc=1.0).abs() + 0.5
    nblk = -(-(ctx + 1) // 16)
    cache = rnd(2, nblk + 1, 16, kvh, d, sc=1.0)
    bt = torch.arange(nblk, dtype=torch.int32, device=dev)[None]
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    sl = torch.tensor([ctx + 1], dtype=torch.int32, device=dev)
    pos = torch.tensor([ctx], dtype=torch.int64, device=dev)
    slot = torch.tensor([ctx], dtype=torch.int64, device=dev)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(ctx + 8, device=dev).float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
    x = rnd(1, hid, sc=1.0)
    res = rnd(1, hid, sc=1.0)
    cfg = GemvConfig(32, 256, 1)

    def step():
        qkv, r1 = gemv_rms_norm(x, res, nw1, 1e-5, w_qkv, cfg)
        q, k, v = qkv.view(1, h + 2 * kvh, d).split([h, kvh, kvh], dim=1)
        q, _ = rotary_and_cache_write(pos, q, k, v, cos_sin, cache, slot)
        a = paged_attention(q, cache, bt, qsl, sl, d ** -0.5, num_decodes=1, max_query_len=1,
                            max_seq_len=4096, num_kv_splits=4)
        o = gemv(a.view(1, h * d), w_o, None, cfg)
        act, r2 = gemv_rms_norm(o, r1, nw2, 1e-5, w_gu, GemvConfig(32, 128, 1), True)
        y = gemv(act, w_down, None, GemvConfig(32, 256, 2))
        return rms_norm(y, nw1, 1e-5)
    return step, cache


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("merge", ["kernel", "fused"])
def test_pdl_graph_matches_plain(pdl_env, merge):
    outs = {}
    for mode in ("off", "on"):
        pdl_env(mode, merge)
        step, cache = _decode_chain()
        step()  # compile, allocate the split-K / merge counters outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        results = []
        for _ in range(3):  # the cache write is idempotent: every replay is the same
            graph.replay()
            torch.cuda.synchronize()
            results.append(out.clone())
        assert all(torch.equal(results[0], r) for r in results[1:])
        outs[mode] = results[0]
    assert torch.isfinite(outs["off"]).all()
    torch.testing.assert_close(outs["on"], outs["off"], atol=0, rtol=0)
