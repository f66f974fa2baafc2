"""gemv / gemv_silu_and_mul (dense decode GEMV) vs their pure-torch references, and the
dispatch from the dense linear path."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.gemv import (gemv, gemv_ref, gemv_silu_and_mul,
                                 gemv_silu_and_mul_ref)
from kvflow.kernels import tuning
from kvflow.kernels.gemv_config import (GemvConfig, balanced_rows, default_config,
                                        device_table, dispatch_configs)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within float32 summation-order noise plus one ulp of the output's dtype."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    eps = torch.finfo(x.dtype).eps
    bound = 1e-5 * (x.float().abs() @ w.float().abs().t()) + eps * ref.float().abs() + 1e-6
    err = (y.float() - ref.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def _check_silu(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The fused form rounds like the unfused path; one ulp of gate or up rounding differently
    (float32 sum order) moves the product by about two ulps of it."""
    ref = gemv_silu_and_mul_ref(x, w)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    eps = torch.finfo(x.dtype).eps
    h = gemv_ref(x, w).float().abs()
    d = h.shape[-1] // 2
    bound = 4 * eps * (h[:, :d] * h[:, d:] + ref.float().abs()) + 1e-5
    err = (y.float() - ref.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


# the last two: balanced grids (GemvConfig.rows), programs owning fewer rows than a tile
# (40 rows as 13 + 13 + 13 + 1, and as 9 * 4 + 4 split three ways)
CONFIGS = [GemvConfig(32, 32, 1), GemvConfig(16, 32, 3, num_stages=2),
           GemvConfig(32, 64, 2, dot=False, num_stages=1), GemvConfig(32, 32, 1, rows=13),
           GemvConfig(16, 32, 3, num_stages=2, rows=9)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"bn{c.block_n}k{c.block_k}s{c.split_k}"
                         f"{'dot' if c.dot else 'reg'}" + (f"r{c.rows}" if c.rows else ""))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_configs(device, cfg, m):
    if not cfg.dot and m > 1:
        pytest.skip("the register form takes one row")
    n, k = 40, 160  # N not a multiple of the tiles, K not of 64
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).to(device)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(device)
    _check(gemv(x, w, b, cfg), gemv_ref(x, w, b), x, w)
    _check(gemv(x, w, None, cfg), gemv_ref(x, w), x, w)
    _check_silu(gemv_silu_and_mul(x, w, cfg), x, w)


def test_gemv_default_config_fp16_strided_rows(device):
    """x may be a row-strided view (a slice of a wider activation); fp16 too."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 160, generator=g).to(torch.float16).to(device)
    x = wide[:, :128]
    w = torch.randn(40, 128, generator=g).to(torch.float16).to(device)
    _check(gemv(x, w), gemv_ref(x, w), x, w)


def test_gemv_rejects_too_many_rows(device):
    x = torch.randn(17, 64, dtype=torch.bfloat16, device=device)
    w = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(AssertionError):
        gemv(x, w, None, GemvConfig(32, 32))


def test_config_validation_and_defaults():
    with pytest.raises(ValueError):
        GemvConfig(48, 64)
    with pytest.raises(ValueError):
        GemvConfig(64, 64, split_k=0)
    with pytest.raises(ValueError):
        GemvConfig(32, 64, rows=33)  # more rows than the tile holds
    assert GemvConfig(64, 64).tile_rows == 64 and GemvConfig(64, 64, rows=47).tile_rows == 47
    assert balanced_rows(6144, 132) == 47 and -(-6144 // 47) == 131  # qkv on 132 SMs
    cfg = default_config(1, 4096, 4096, torch.device("cpu"), sms=132)
    assert cfg.dot and cfg.block_m == 16
    # 32-row tiles fill 132 SMs (128 programs) where 64-row ones leave half idle
    assert (cfg.block_n, cfg.split_k) == (32, 1)
    small = default_config(1, 1024, 4096, torch.device("cpu"), sms=132)
    assert small.split_k > 1  # 32 tiles: the K loop is split
    big = default_config(1, 128256, 4096, torch.device("cpu"), sms=132)
    assert big.split_k == 1


def test_dispatch_keeps_cublas_off_cuda_and_unmeasured():
    cpu = torch.device("cpu")
    assert dispatch_configs("linear", 4096, 4096, torch.bfloat16, cpu, "force") == {}
    assert dispatch_configs("linear", 4096, 4096, torch.float32, cpu, "auto") == {}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        table = device_table(tuning.for_device(name))  # configs or explicit Nones
        assert table
        for buckets in table.values():
            assert all(c is None or isinstance(c, GemvConfig) for c in buckets.values())


def test_envs_gemv_mode(monkeypatch):
    from kvflow import envs
    from kvflow.errors import InvalidParameterError

    monkeypatch.setenv("KVFLOW_GEMV", "Force")
    assert envs.gemv_mode() == "force"
    monkeypatch.setenv("KVFLOW_GEMV", "sometimes")
    with pytest.raises(InvalidParameterError):
        envs.gemv_mode()


def test_linear_seam_uses_configs(device):
    """The dense linear method takes the GEMV for the row counts in its plan and cuBLAS /
    F.linear otherwise; the merged gate/up layer fuses silu_and_mul the same way."""
    from kvflow.layers.activation import SiluAndMul
    from kvflow.kernels.gemv_dispatch import NO_GEMV
    from kvflow.layers.linear import MergedLinear, ReplicatedLinear

    torch.manual_seed(0)
    with torch.device(device):
        lin = ReplicatedLinear(64, 48, True, torch.bfloat16)
        mlp = MergedLinear(64, [32, 32], False, torch.bfloat16)
    for layer in (lin, mlp):
        layer.weight.data.normal_()
    if lin.bias is not None:
        lin.bias.data.normal_()
    cfg = GemvConfig(16, 32, 2)
    lin.gemv = {**NO_GEMV, "linear": {2: cfg}}
    mlp.gemv = {**NO_GEMV, "silu_mul": {2: cfg}}
    act = SiluAndMul()
    x = torch.randn(2, 64, dtype=torch.bfloat16, device=device)
    _check(lin(x), gemv_ref(x, lin.weight, lin.bias), x, lin.weight)
    _check_silu(mlp.forward_silu_and_mul(x, act), x, mlp.weight)
    x3 = x[:1]  # not in the plan: F.linear + the activation module
    torch.testing.assert_close(mlp.forward_silu_and_mul(x3, act), act(mlp(x3)))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (128256, 4096)])
def test_gemv_llama8b_gpu(m, n, k):
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    _check(gemv(x, w), gemv_ref(x, w), x, w)
    for cfg in dispatch_configs("linear", n, k, w.dtype, w.device, "auto").values():
        _check(gemv(x, w, None, cfg), gemv_ref(x, w), x, w)
    if n == 28672:
        _check_silu(gemv_silu_and_mul(x, w), x, w)
        for cfg in dispatch_configs("silu_mul", n // 2, k, w.dtype, w.device, "auto").values():
            _check_silu(gemv_silu_and_mul(x, w, cfg), x, w)


@pytest.mark.gpu
@requires_cuda
def test_gemv_cuda_graph_capture():
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    wg = torch.randn(2 * 14336, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn(2, 4096, dtype=torch.bfloat16, device="cuda")
    cfg = GemvConfig(64, 256, 4)  # split-K: the arrival counters must reset each replay
    gemv(x, w, None, cfg), gemv_silu_and_mul(x, wg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(x, w, None, cfg)
        z = gemv_silu_and_mul(x, wg, GemvConfig(64, 256, 4, num_stages=2))
    for _ in range(2):  # replays reuse the split-K counters the kernel resets
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _check(y, gemv_ref(x, w), x, w)
        _check_silu(z, x, wg)


def _check_normed(y, r, x, residual, nw, w, act: bool) -> None:
    """r exact up to the interpreter's truncating bf16 casts (one ulp); y within a few ulps
    of the float32 reference (the norm scale is applied to the sums, not the tile)."""
    from kvflow.kernels.gemv_norm import gemv_rms_norm_ref

    y_ref, r_ref = gemv_rms_norm_ref(x, residual, nw, 1e-5, w, act)
    eps = torch.finfo(x.dtype).eps
    assert r.shape == r_ref.shape and y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert ((r.float() - r_ref.float()).abs() <= eps * r_ref.float().abs()).all()
    rf = r_ref.float()
    scale = torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-5)
    h = ((rf * scale * nw.float()).abs() @ w.float().abs().t())  # |terms| of each sum
    if act:
        d = h.shape[-1] // 2
        h = h[:, :d] * (1 + h[:, d:])
    bound = 4 * eps * (h + y_ref.float().abs()) + 1e-4
    err = (y.float() - y_ref.float()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("cfg", [GemvConfig(32, 32, 3), GemvConfig(16, 64, 1),
                                 GemvConfig(32, 32, 3, rows=11), GemvConfig(16, 64, 1, rows=7)],
                         ids=["split3", "nosplit", "split3-rows11", "nosplit-rows7"])
@pytest.mark.parametrize("m,res,act", [(1, True, False), (3, False, True), (2, True, True)])
def test_gemv_rms_norm(device, cfg, m, res, act):
    from kvflow.kernels.gemv_norm import gemv_rms_norm

    n, k = 40, 160
    g = torch.Generator().manual_seed(10 * m + act)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    residual = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device) if res else None
    nw = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).to(device)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).to(device)
    y, r = gemv_rms_norm(x, residual, nw, 1e-5, w, cfg, silu_and_mul=act)
    _check_normed(y, r, x, residual, nw, w, act)
    if not res:
        assert r is x  # the first layer: the residual is the input itself


def test_normed_seam(device):
    """forward_normed: the GEMV with the norm folded in where planned (and the norm in
    kernel mode), else the norm module then the layer, with identical residuals."""
    from kvflow.layers.activation import SiluAndMul
    from kvflow.kernels.gemv_dispatch import NO_GEMV
    from kvflow.layers.linear import MergedLinear
    from kvflow.layers.norm import RMSNorm

    torch.manual_seed(1)
    with torch.device(device):
        mlp = MergedLinear(64, [32, 32], False, torch.bfloat16)
        norm = RMSNorm(64, 1e-5, torch.bfloat16)
    mlp.weight.data.normal_()
    norm.weight.data.uniform_(0.5, 1.5)
    act = SiluAndMul()
    x = torch.randn(2, 64, dtype=torch.bfloat16, device=device)
    res = torch.randn(2, 64, dtype=torch.bfloat16, device=device)
    seen = []  # the unfused path goes through the module: its hooks see the normed input
    hook = mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    plain_y, plain_r = mlp.forward_normed(x, res, norm, act)
    hook.remove()
    torch.testing.assert_close(plain_r, x + res)
    assert len(seen) == 1 and torch.equal(seen[0], norm(x, res)[0])
    mlp.gemv = {**NO_GEMV, "norm_silu_mul": {2: GemvConfig(16, 32, 2)}}
    y, r = mlp.forward_normed(x, res, norm, act)
    assert torch.equal(y, plain_y)  # the norm module is native here: no fusion
    norm.uses_kernels = True  # (its kernel forward would be the Triton RMSNorm)
    y, r = mlp.forward_normed(x, res, norm, act)
    _check_normed(y, r, x, res, norm.weight, mlp.weight, True)


def _bench_table(path) -> dict:
    """A recorded bench_gemv.py result's table, as the GEMV dispatch reads tables."""
    import json

    with open(path) as f:
        return device_table(tuning.Tuning("bench", gemv=tuning.parse(json.load(f))["gemv"]))


RESULTS = __import__("pathlib").Path(__file__).parents[2] / "benchmarks/results"


def test_h200_table_is_the_recorded_benches():
    """The H200's data file (kvflow/kernels/tuning/h200.json) is exactly the tables of the
    recorded GPU runs its ``sources`` name: the sweep at M = 1..8, its M = 1 buckets
    replaced by the later M = 1 bench and then by the balanced-grid benches (no
    hand-picked or assumed configs)."""
    table = _bench_table(RESULTS / "gemv-bench-sweep-h200.json")
    later = ["gemv-bench-m1-h200.json"] + [f"gemv-rows-{s}-h200.json"
                                           for s in ("qkv", "o", "gate_up", "down")]
    for name in later:
        for key, buckets in _bench_table(RESULTS / name).items():
            table[key] = {**table[key], **buckets}
    assert table == device_table(tuning.for_device("NVIDIA H200"))
    sources = tuning._load(tuning.device_file("NVIDIA H200"))["sources"]["gemv"]
    assert {p.rsplit("/", 1)[1] for p in sources} == {"gemv-bench-sweep-h200.json", *later}


def test_h100_table_is_its_sweep(monkeypatch):
    """The H100's file is its sweep's table as measured (results/gemv-bench-sweep-h100.json),
    and a device of that name gets it (an H100 NVL or PCIe too: the token is the family);
    a GPU without a file gets no table (cuBLAS everywhere)."""
    from kvflow.kernels import gemv_config

    h100 = device_table(tuning.for_device("NVIDIA H100 80GB HBM3"))
    assert _bench_table(RESULTS / "gemv-bench-sweep-h100.json") == h100
    monkeypatch.delenv("KVFLOW_TUNING_FILE", raising=False)
    gemv_config._device_table.cache_clear()
    try:
        assert gemv_config._device_table("NVIDIA H100 PCIe") == h100
        assert gemv_config._device_table("NVIDIA A100-SXM4-80GB") == {}
    finally:
        gemv_config._device_table.cache_clear()


def test_tuning_file_overlays_a_bench_result(monkeypatch, tmp_path):
    import json

    from kvflow.kernels import gemv_config

    cfg = GemvConfig(32, 128, 1, num_stages=3)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"table": [
        {"kind": "silu_mul", "n": 28672, "k": 4096, "m": 1, "config": cfg.as_dict()},
        {"kind": "linear", "n": 4096, "k": 4096, "m": 1, "config": None}]}))
    monkeypatch.setenv("KVFLOW_TUNING_FILE", str(path))
    gemv_config._device_table.cache_clear()
    try:
        table = gemv_config._device_table("NVIDIA H200", str(path))
    finally:
        gemv_config._device_table.cache_clear()
    built_in = device_table(tuning.for_device("NVIDIA H200"))
    assert table[("silu_mul", 14336, 4096)][1] == cfg  # keyed by the output width d
    o_proj = table[("linear", 4096, 4096)]  # a fresh loss replaces that bucket's win only
    assert o_proj == {**built_in[("linear", 4096, 4096)], 1: None}
    assert table[("linear", 6144, 4096)] == built_in[("linear", 6144, 4096)]


def test_write_merges_a_measured_table(tmp_path):
    """--write-tuning: a new file for a new GPU, then a second bench's buckets replacing
    only theirs; the file reads back as written and names both sources."""
    path = tmp_path / "a100.json"
    cfg = GemvConfig(64, 256, 1).as_dict()
    tuning.write(str(path), "A100", "gemv", {("linear", 4096, 4096): {1: cfg, 2: None}}, "r1")
    tuning.write(str(path), "A100", "gemv", {("linear", 4096, 4096): {2: cfg}}, "r2")
    import json

    data = json.loads(path.read_text())
    assert data["match"] == "A100" and data["sources"]["gemv"] == ["r1", "r2"]
    parsed = tuning.parse(data)["gemv"]
    assert parsed == {("linear", 4096, 4096): {1: cfg, 2: cfg}}
    assert tuning.match_token("NVIDIA A100-SXM4-80GB") == "A100"
    assert tuning.match_token("NVIDIA H100 80GB HBM3") == "H100"


def test_decode_switch_defaults_come_from_the_tuning_files(caplog):
    """The decode switches measured on each GPU are its data file's; a GPU without a file
    keeps every switch off and is told how to measure it."""
    import logging

    from kvflow.kernels.decode_defaults import OFF

    assert tuning.for_device("NVIDIA H100 80GB HBM3").switches == {
        "prefill_graphs": True, "rope_in_attn": True}
    assert tuning.for_device("NVIDIA H200").switches == {"rope_in_attn": True}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        assert set(tuning.for_device(name).switches) <= set(OFF)
    tuning.for_device.cache_clear()
    with caplog.at_level(logging.INFO, logger="kvflow.kernels.tuning"):
        unknown = tuning.for_device("NVIDIA L40S")
    assert unknown.switches == {} and unknown.gemv == {} and unknown.files == ()
    assert "no measured tuning data for GPU 'NVIDIA L40S'" in caplog.text
    assert "--write-tuning" in caplog.text
