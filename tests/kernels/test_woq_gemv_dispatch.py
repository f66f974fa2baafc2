"""Dispatch of the low-bit decode GEMVs from the CUDA quantized-linear paths, without a
GPU: ``woq_gemv_config.plan`` forced to answer as it does on CUDA, the kernels in the
interpreter, the layer's output against the method's own reference; KVFLOW_WOQ_GEMV."""

from __future__ import annotations

import pytest
import torch

from kvflow.errors import InvalidParameterError
from kvflow.kernels import woq_gemv_config
from kvflow.layers.linear import ReplicatedLinear
from kvflow.layers.quantization import QuantizationConfig, fp8, gpu
from kvflow.layers.quantization.packed import quantize_int4

CFG = woq_gemv_config.WoqGemvConfig(32, 128, 2, num_stages=2)
# The dispatch tests build layers on the CPU and force the CUDA plans, so the kernels run
# on CPU tensors: only in Triton's interpreter (machines without CUDA, as CI).
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="drives the kernels on CPU tensors")


@pytest.fixture
def planned(monkeypatch):
    """Every decode row count takes the new kernels (as ``plan`` answers on CUDA), and the
    weight-only layers take the GPU path on the CPU tensors (the interpreter)."""
    calls = []

    def plan(fmt, n, k, device):
        calls.append((fmt, n, k))
        return dict.fromkeys(range(1, 9), CFG)
    monkeypatch.setattr(woq_gemv_config, "plan", plan)
    monkeypatch.setattr(gpu, "use_triton", lambda device: True)
    return calls


def _layer(config: QuantizationConfig, w: torch.Tensor):
    layer = ReplicatedLinear(w.shape[1], w.shape[0], False, torch.bfloat16,
                             quant_config=config, prefix="model.layers.0.mlp.down_proj")
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _close(y, ref):
    tol = 2e-2 * float(ref.abs().max()) + 1e-3
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=2e-2)


@interpreter_only
def test_int4_and_int8_layers_take_the_gemv_for_decode_rows(planned, monkeypatch):
    from kvflow.kernels import gemv_w4, gemv_w8

    used = []
    for mod, name in ((gemv_w4, "gemv_w4"), (gemv_w8, "gemv_w8")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=fn, _n=name, **k: used.append(_n)
                            or _f(*a, **k))
    torch.manual_seed(0)
    w = (torch.randn(64, 512) * 0.05).bfloat16().float()
    layer = _layer(QuantizationConfig("int4", group_size=128), w)
    assert planned[-1] == ("w4g128", 64, 512) and set(layer.quant_method.triton.gemv) == set(
        range(1, 9))
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    _close(layer(x), x.float() @ quantize_int4(w, 128, False).dequantize().t())
    layer8 = _layer(QuantizationConfig("int8"), w)
    assert planned[-1] == ("int8", 64, 512)
    _close(layer8(x), x.float() @ (layer8.qweight.float() * layer8.scales[:, None]).t())
    assert used == ["gemv_w4", "gemv_w8"]
    # 9 rows and more keep the previous kernels
    used.clear()
    x9 = torch.randn(9, 512, dtype=torch.bfloat16)
    _close(layer(x9), x9.float() @ quantize_int4(w, 128, False).dequantize().t())
    assert used == []


def _gate_up(config: QuantizationConfig, w: torch.Tensor):
    from kvflow.layers.linear import MergedLinear

    d = w.shape[0] // 2
    layer = MergedLinear(w.shape[1], [d, d], False, torch.bfloat16, quant_config=config,
                         prefix="model.layers.0.mlp.gate_up_proj")
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@interpreter_only
@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_gate_up_layers_fuse_silu_for_decode_rows(planned, monkeypatch, method):
    from kvflow.layers.activation import SiluAndMul

    monkeypatch.setattr(fp8, "fp8_gemv_plan",
                        lambda layer, silu=False: dict.fromkeys(range(1, 9), CFG))
    torch.manual_seed(2)
    w = (torch.randn(128, 256) * 0.05).bfloat16().float()
    qc = QuantizationConfig(method, group_size=128) if method == "int4" else (
        QuantizationConfig(method))
    layer = _gate_up(qc, w)
    if method != "fp8":
        assert set(layer.quant_method.triton.silu) == set(range(1, 9))
    act = SiluAndMul()
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    fused = layer.forward_silu_and_mul(x, act)
    assert fused.shape == (2, 64)
    unfused = act(layer(x))  # the plain GEMV, then the activation
    torch.testing.assert_close(fused.float(), unfused.float(),
                               atol=2e-2 * float(unfused.abs().max()), rtol=2e-2)
    x9 = torch.randn(9, 256, dtype=torch.bfloat16)  # not a decode batch: unfused
    assert layer.forward_silu_and_mul(x9, act).shape == (9, 64)


@interpreter_only
def test_fp8_decode_rows_are_weight_dequant(monkeypatch):
    """At M <= 8 the FP8 layer multiplies bf16 x by the dequantized FP8 weight (no
    activation quantization); its result is the W8A8 product's up to x's quantization."""
    monkeypatch.setattr(fp8, "fp8_gemv_plan", lambda layer: dict.fromkeys(range(1, 9), CFG))
    torch.manual_seed(1)
    w = (torch.randn(64, 256) * 0.05).bfloat16().float()
    layer = _layer(QuantizationConfig("fp8"), w)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    wd = layer.weight.float() * layer.weight_scale[:, None]
    y = layer(x)
    _close(y, x.float() @ wd.t())
    # bf16 x, fp8 weights: closer to the weight-dequant product than W8A8 can be
    exact = x.float() @ wd.t()
    assert float((y.float() - exact).abs().max()) <= 2e-2 * float(exact.abs().max())


def test_plan_is_empty_off_cuda_and_when_switched_off(monkeypatch):
    monkeypatch.setenv("KVFLOW_WOQ_GEMV", "force")
    assert woq_gemv_config.plan("fp8", 64, 64, torch.device("cpu")) == {}
    monkeypatch.setenv("KVFLOW_WOQ_GEMV", "bogus")
    with pytest.raises(InvalidParameterError, match="KVFLOW_WOQ_GEMV"):
        woq_gemv_config.plan("fp8", 64, 64, torch.device("cpu"))


def _bench_table(path) -> dict:
    import json

    from kvflow.kernels import tuning

    with open(path) as f:
        parsed = tuning.parse(json.load(f))
    return woq_gemv_config.device_table(tuning.Tuning("bench", woq_gemv=parsed["woq_gemv"]))


def _device(name: str) -> dict:
    from kvflow.kernels import tuning

    return woq_gemv_config.device_table(tuning.for_device(name))


def test_h100_table_is_its_bench():
    """The H100's low-bit table is the woq-gemv stage's table as measured on it."""
    from pathlib import Path

    results = Path(__file__).parents[2] / "benchmarks/results"
    assert _bench_table(results / "woq-gemv-bench-h100.json") == _device("NVIDIA H100 80GB HBM3")


def test_auto_plan_follows_the_h200_table(monkeypatch):
    """On an H200: measured wins take the GEMV, buckets measured slower keep the previous
    path, unmeasured int4 shapes take the heuristic and unmeasured int8 ones w8a16."""
    monkeypatch.setenv("KVFLOW_WOQ_GEMV", "auto")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(woq_gemv_config, "_sms", lambda device: 132)
    cuda = torch.device("cuda")
    woq_gemv_config._device_table.cache_clear()
    try:
        qkv = woq_gemv_config.plan("w4g128", 6144, 4096, cuda)
        assert qkv[1] == _device("NVIDIA H200")[("w4g128", 6144, 4096)][1]
        assert set(qkv) == set(range(1, 9))
        assert woq_gemv_config.plan("int8", 6144, 4096, cuda) == {}  # measured slower
        assert woq_gemv_config.plan("int8", 512, 512, cuda) == {}  # unmeasured int8
        assert woq_gemv_config.plan("w4g128-silu", 14336, 4096, cuda) == {}  # unmeasured
        other = woq_gemv_config.plan("w4g128", 2048, 2048, cuda)  # unmeasured: heuristic
        assert other[1] == woq_gemv_config.default_config("w4g128", 1, 2048, 2048, cuda)
        monkeypatch.setenv("KVFLOW_WOQ_GEMV", "force")
        assert set(woq_gemv_config.plan("int8", 6144, 4096, cuda)) == set(range(1, 9))
    finally:
        woq_gemv_config._device_table.cache_clear()


def test_bench_table_round_trip(tmp_path):
    import json

    cfg = woq_gemv_config.WoqGemvConfig(128, 256, 3, 4, 4, True)
    rows = [{"format": "w4g128", "n": 4096, "k": 4096, "m": 1, "config": cfg.as_dict()},
            {"format": "w4g128", "n": 4096, "k": 4096, "m": 2, "config": None}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"table": rows}))
    table = _bench_table(path)
    assert table[("w4g128", 4096, 4096)] == {1: cfg, 2: None}
    # balanced rows travel with the config; a file written before the field has none
    rows_cfg = woq_gemv_config.WoqGemvConfig(64, 256, 4, 4, 3, rows=47)
    old = {k: v for k, v in cfg.as_dict().items() if k != "rows"}
    path.write_text(json.dumps({"table": [
        {"format": "w4g128", "n": 6144, "k": 4096, "m": 1, "config": rows_cfg.as_dict()},
        {"format": "w4g128", "n": 6144, "k": 4096, "m": 2, "config": old}]}))
    table = _bench_table(path)
    assert table[("w4g128", 6144, 4096)] == {1: rows_cfg, 2: cfg}
    assert table[("w4g128", 6144, 4096)][1].tile_rows == 47


def test_fp8_chain_plan_keeps_whole_tiles_for_the_fp8_output(monkeypatch):
    """The gate/up + SiLU launch with FP8 output quantizes each program's block_n columns
    as one 128-wide group: a planned config with balanced rows (or split-K) cannot make
    those groups, so that row count keeps the unchained path; down's (xg) groups are its
    K steps, where balanced rows are fine."""
    whole = woq_gemv_config.WoqGemvConfig(128, 128, 1, promote=128)
    plans = {"fp8a8-siluq": {1: whole, 2: woq_gemv_config.WoqGemvConfig(128, 128, 1, rows=100),
                             3: woq_gemv_config.WoqGemvConfig(128, 128, 1, rows=128),
                             4: woq_gemv_config.WoqGemvConfig(128, 128, 2)},
             "fp8a8-xg": {1: woq_gemv_config.WoqGemvConfig(64, 128, 2, rows=47)}}
    monkeypatch.setattr(woq_gemv_config, "plan", lambda fmt, n, k, device: plans[fmt])
    monkeypatch.setattr(fp8, "use_fp8_kernels", lambda device: True)
    gate_up = _gate_up(QuantizationConfig("fp8"), torch.randn(256, 256) * 0.05)
    assert set(fp8.fp8a8_chain_plan(gate_up, "siluq")) == {1, 3}
    down = _layer(QuantizationConfig("fp8"), torch.randn(64, 128) * 0.05)
    assert fp8.fp8a8_chain_plan(down, "xg") == plans["fp8a8-xg"]


@pytest.fixture
def w8a8_planned(monkeypatch):
    """FP8 layers' decode rows take the W8A8 GEMV (as ``fp8a8_plan`` answers on an H200
    for qkv, gate/up and down), and the weight-dequant GEMV nowhere; the calls are
    recorded."""
    cfg = woq_gemv_config.WoqGemvConfig(32, 128, 2, num_stages=2, promote=128)
    monkeypatch.setattr(fp8, "fp8a8_plan", lambda layer, silu=False: dict.fromkeys(
        range(1, 9), cfg))
    monkeypatch.setattr(fp8, "fp8_gemv_plan", lambda layer, silu=False: {})
    from kvflow.kernels import gemv_fp8

    used = []
    fn = gemv_fp8.gemv_fp8
    monkeypatch.setattr(gemv_fp8, "gemv_fp8", lambda *a, **k: used.append(
        k.get("silu_and_mul", False)) or fn(*a, **k))
    return used


def _w8a8_ref(layer, h: torch.Tensor) -> torch.Tensor:
    """The W8A8 product of the prefill path: per-token FP8 rows times the FP8 weight."""
    xq, sx = fp8.quantize_fp8_rows(h)
    return fp8.fp8_mm_ref(xq, sx, layer.weight, layer.weight_scale, h.dtype)


@interpreter_only
def test_fp8_decode_rows_take_the_w8a8_gemv(w8a8_planned):
    """At M <= 8 the FP8 layer quantizes x per token and multiplies on the FP8 tensor
    cores: the numbers of its W8A8 path for larger M."""
    torch.manual_seed(5)
    w = (torch.randn(64, 256) * 0.05).bfloat16().float()
    layer = _layer(QuantizationConfig("fp8"), w)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = layer(x)
    assert w8a8_planned == [False]
    ref = _w8a8_ref(layer, x)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2,
                               atol=1e-2 * float(ref.abs().max()))
    x9 = torch.randn(9, 256, dtype=torch.bfloat16)  # not a decode batch
    layer(x9)
    assert w8a8_planned == [False]


@interpreter_only
@pytest.mark.parametrize("with_act", [False, True])
def test_fp8_normed_decode_rows_quantize_in_the_norm(w8a8_planned, with_act):
    """forward_normed: residual add + RMSNorm + FP8 quantization in one launch, then the
    W8A8 GEMV (SiLU-and-multiply in its epilogue for gate/up): the unfused norm and
    layer's numbers, and the same residual."""
    from kvflow.layers.activation import SiluAndMul
    from kvflow.layers.norm import RMSNorm

    torch.manual_seed(6)
    w = (torch.randn(128, 256) * 0.05).bfloat16().float()
    layer = _gate_up(QuantizationConfig("fp8"), w) if with_act else _layer(
        QuantizationConfig("fp8"), w)
    norm = RMSNorm(256, 1e-5, torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    norm.use_kernels(True)
    act = SiluAndMul() if with_act else None
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    res = torch.randn(2, 256, dtype=torch.bfloat16)
    y, r = layer.forward_normed(x, res, norm, act)
    assert w8a8_planned == [with_act]
    h, r_ref = norm(x, res)
    assert torch.equal(r, r_ref)
    ref = _w8a8_ref(layer, h)
    if with_act:
        ref = act(ref)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2,
                               atol=2e-2 * float(ref.abs().max()))
    norm.use_kernels(False)  # a norm the GEMV cannot fold: the layer's usual path
    layer.forward_normed(x, res, norm, act)
    assert len(w8a8_planned) == 2


def test_fp8_decode_mode_follows_the_h200_table(monkeypatch):
    """KVFLOW_FP8_DECODE: auto takes the W8A8 GEMV where the H200 table measured it
    faster (qkv, gate/up, down) and not where it did not (o) or was not measured;
    w8a8 takes it everywhere; dequant nowhere."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(woq_gemv_config, "_sms", lambda device: 132)
    cuda = torch.device("cuda")
    woq_gemv_config._device_table.cache_clear()
    try:
        monkeypatch.delenv("KVFLOW_FP8_DECODE", raising=False)
        qkv = woq_gemv_config.plan("fp8a8", 6144, 4096, cuda)
        assert set(qkv) == set(range(1, 9)) and qkv[1].promote == 128
        assert woq_gemv_config.plan("fp8a8", 4096, 4096, cuda) == {}  # o: dequant faster
        assert woq_gemv_config.plan("fp8a8", 2048, 2048, cuda) == {}  # unmeasured
        assert set(woq_gemv_config.plan("fp8a8-silu", 14336, 4096, cuda)) == set(range(1, 9))
        siluq = woq_gemv_config.plan("fp8a8-siluq", 14336, 4096, cuda)  # the MLP chain
        xg = woq_gemv_config.plan("fp8a8-xg", 4096, 14336, cuda)
        assert set(siluq) == set(xg) == set(range(1, 9))
        assert all(c.block_n == 128 and c.split_k == 1 for c in siluq.values())
        assert all(c.block_k == 128 for c in xg.values())
        monkeypatch.setenv("KVFLOW_FP8_DECODE", "w8a8")
        other = woq_gemv_config.plan("fp8a8", 2048, 2048, cuda)
        assert other[1] == woq_gemv_config.default_config("fp8a8", 1, 2048, 2048, cuda)
        assert other[1].promote == 128
        assert set(woq_gemv_config.plan("fp8a8", 4096, 4096, cuda)) == set(range(1, 9))
        monkeypatch.setenv("KVFLOW_FP8_DECODE", "dequant")
        assert woq_gemv_config.plan("fp8a8", 6144, 4096, cuda) == {}
        assert woq_gemv_config.plan("fp8", 6144, 4096, cuda)  # the weight-dequant GEMV
        monkeypatch.setenv("KVFLOW_FP8_DECODE", "bogus")
        with pytest.raises(InvalidParameterError, match="KVFLOW_FP8_DECODE"):
            woq_gemv_config.plan("fp8a8", 6144, 4096, cuda)
    finally:
        woq_gemv_config._device_table.cache_clear()


@interpreter_only
def test_fp8_mlp_decode_rows_run_as_one_fp8_chain(monkeypatch):
    """forward_mlp with both layers FP8 and the chain planned: norm + quantize, gate/up +
    SiLU writing FP8 per 128-input group, down reading those groups (three launches);
    the result is the unfused W8A8 MLP's within the activation's FP8 rounding, and
    without the chain planned the same call takes the layers' usual path."""
    from kvflow.kernels import gemv_fp8
    from kvflow.layers.activation import SiluAndMul
    from kvflow.layers.norm import RMSNorm

    cfgs = {"siluq": woq_gemv_config.WoqGemvConfig(128, 128, 1, num_stages=2, promote=128),
            "xg": woq_gemv_config.WoqGemvConfig(32, 128, 2, num_stages=2)}
    planned = {"on": True}
    monkeypatch.setattr(fp8, "fp8a8_chain_plan", lambda layer, form: dict.fromkeys(
        range(1, 9), cfgs[form]) if planned["on"] else {})
    used = []
    fn = gemv_fp8.gemv_fp8
    monkeypatch.setattr(gemv_fp8, "gemv_fp8", lambda *a, **k: used.append(
        k.get("fp8_out", False)) or fn(*a, **k))
    torch.manual_seed(7)
    gate_up = _gate_up(QuantizationConfig("fp8"), (torch.randn(256, 256) * 0.05).bfloat16()
                       .float())
    down = _layer(QuantizationConfig("fp8"), (torch.randn(64, 128) * 0.05).bfloat16().float())
    norm = RMSNorm(256, 1e-5, torch.bfloat16)
    norm.use_kernels(True)
    act = SiluAndMul()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    res = torch.randn(3, 256, dtype=torch.bfloat16)
    y, r = gate_up.forward_mlp(x, res, norm, act, down)
    assert used == [True, False]
    h, r_ref = norm(x, res)
    assert torch.equal(r, r_ref)
    ref = _w8a8_ref(down, act(_w8a8_ref(gate_up, h)))
    assert y.shape == (3, 64)
    torch.testing.assert_close(y.float(), ref.float(), rtol=5e-2,
                               atol=5e-2 * float(ref.abs().max()))
    planned["on"] = False  # no chain: norm, gate/up (+ act), down as separate layers
    y2, _ = gate_up.forward_mlp(x, res, norm, act, down)
    assert used == [True, False] and y2.shape == (3, 64)
    torch.testing.assert_close(y2.float(), ref.float(), rtol=5e-2,
                               atol=5e-2 * float(ref.abs().max()))
