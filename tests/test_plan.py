"""kvflow plan: the capacity planner's arithmetic, its CLI, and its calibration."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from kvflow.cli import main
from kvflow.config import GiB, ModelArchConfig
from kvflow.errors import InvalidParameterError, KvflowError, ModelNotFoundError
from kvflow.models.registry import PRESETS, embedded_model_path
from kvflow.plan.gpus import GPU_PRESETS, GpuSpec, get_gpu
from kvflow.plan.memory import CUDA_GRAPH_RESERVE
from kvflow.plan.model import ShardedModel, prefill_chunks
from kvflow.plan.planner import PlanInputs, build_plan
from kvflow.plan.simulate import simulate_offline

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


def arch(name: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(PRESETS[name])


def plan(model="llama-3.1-8b", gpu="h200", **kw):
    return build_plan(PlanInputs(model, arch(model), get_gpu(gpu), **kw))


def round_gpu(**kw) -> GpuSpec:
    """A GPU with round figures, so expected values are easy to write down."""
    fields = dict(name="round", memory_bytes=100 * GiB, hbm_bytes_per_s=4e12,
                  matmul_flops_per_s=800e12, fp32_flops_per_s=50e12, link_bytes_per_s=400e9,
                  link_latency_s=10e-6, source="test")
    return GpuSpec(**{**fields, **kw})


# --- KV bytes and sharding ---------------------------------------------------------------
def test_llama31_8b_kv_is_128_kib_per_token_and_64_with_fp8():
    bf16 = ShardedModel(arch("llama-3.1-8b"), 1, "bfloat16", "bfloat16")
    fp8 = ShardedModel(arch("llama-3.1-8b"), 1, "bfloat16", "fp8")
    assert bf16.model_kv_bytes_per_token == 128 * 1024 == 2 * 32 * 8 * 128 * 2
    assert bf16.model_kv_bytes_per_token == arch("llama-3.1-8b").kv_bytes_per_token("bfloat16")
    assert fp8.model_kv_bytes_per_token == 64 * 1024
    # fp8 KV halves the cache, so about twice the tokens fit
    p16, p8 = plan(max_model_len=4096), plan(max_model_len=4096, kv_dtype="fp8")
    assert p8.memory.num_blocks == p16.memory.kv_budget_bytes // (16 * 64 * 1024)
    assert p8.memory.kv_tokens > 1.99 * p16.memory.kv_tokens


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen3-8b",
                                  "mistral-7b", "smollm2-135m"])
def test_tp1_shapes_match_the_model(name):
    m = ShardedModel(arch(name), 1, "bfloat16", "bfloat16")
    assert m.num_params == arch(name).num_params
    assert m.weight_bytes == 2 * arch(name).num_params
    assert m.kv_bytes_per_token == arch(name).kv_bytes_per_token("bfloat16")


def test_tp_shards_kv_heads_and_weights():
    a = arch("llama-3.1-8b")  # 32 heads, 8 KV heads
    one, two = (ShardedModel(a, tp, "bfloat16", "bfloat16") for tp in (1, 2))
    assert (two.q_heads, two.kv_heads, two.kv_replicas) == (16, 4, 1)
    assert two.kv_bytes_per_token == 64 * 1024
    assert two.model_kv_bytes_per_token == 128 * 1024
    # everything but the norms is split in two
    norms = a.num_hidden_layers * 2 * a.hidden_size + a.hidden_size
    assert 2 * (two.num_params - norms) == one.num_params - norms
    eight = ShardedModel(a, 8, "bfloat16", "bfloat16")
    assert (eight.kv_heads, eight.kv_replicas) == (1, 1)
    # 16 GPUs, 8 KV heads: each head lives on 2 GPUs; per-GPU KV stops shrinking
    sixteen = ShardedModel(a, 16, "bfloat16", "bfloat16")
    assert (sixteen.q_heads, sixteen.kv_heads, sixteen.kv_replicas) == (2, 1, 2)
    assert sixteen.kv_bytes_per_token == eight.kv_bytes_per_token == 16 * 1024
    # replicated k/v projections: more than 1/16 of the attention weights per GPU
    h, d = a.hidden_size, a.head_dim
    assert sixteen.layer_linear_params == h * (2 + 2) * d + 2 * d * h + 3 * h * 14336 // 16


def test_tp_all_reduce_bytes():
    p = plan(tensor_parallel_size=4, batch_sizes=(1, 64))
    a = arch("llama-3.1-8b")
    for row in p.decode:
        message = row.batch * a.hidden_size * 2
        # two per layer and one for the vocabulary-parallel embedding
        assert row.cost.allreduce_count == 2 * a.num_hidden_layers + 1
        assert row.cost.allreduce_message_bytes == message
        assert row.cost.allreduce_bytes == pytest.approx((2 * a.num_hidden_layers + 1)
                                                         * message * 2 * 3 / 4)
        assert row.cost.breakdown["allreduce"] > 2 * a.num_hidden_layers * 10e-6
    assert "allreduce" not in plan(batch_sizes=(1,)).decode[0].cost.breakdown


# --- memory and concurrency --------------------------------------------------------------
def test_memory_budget_and_concurrency_arithmetic():
    a = arch("llama-3.1-8b")
    p = build_plan(PlanInputs("llama-3.1-8b", a, round_gpu(), max_model_len=4096,
                              input_len=1000, output_len=200, max_num_batched_tokens=4096,
                              max_num_seqs=128, gpu_memory_utilization=0.8))
    mem, eff = p.memory, p.inputs.efficiency
    forward = 4096 * (4 * 4096 + 3 * 14336) * 2
    sampler = int(eff.sampler_row_copies * 128 * a.vocab_size * 4)
    buffers = 131072 * 128 * 4 + 128 * 256 * 4  # rotary table (max positions) + block table
    budget = (int(100 * GiB * 0.8) - 2 * a.num_params - buffers - max(forward, sampler)
              - eff.non_torch_bytes - CUDA_GRAPH_RESERVE)
    assert mem.kv_budget_bytes == budget
    assert mem.num_blocks == budget // (16 * 131072)
    assert mem.kv_tokens == 16 * mem.num_blocks
    assert p.concurrency_at_max_model_len == pytest.approx(mem.kv_tokens / 4096)
    assert mem.max_sequences(4096) == mem.num_blocks // 256
    assert p.max_batch == mem.num_blocks // 75  # 1200 tokens -> 75 blocks of 16


def test_graph_reserve_matches_the_engine():
    profiler = pytest.importorskip("kvflow.worker.profiler")
    assert CUDA_GRAPH_RESERVE == profiler.CUDA_GRAPH_RESERVE


def test_model_that_does_not_fit_says_which_tp_would():
    p = plan("llama-3.1-70b", gpu="h100", max_model_len=8192)
    assert p.memory.num_blocks == 0 and p.max_batch == 0
    assert not any(r.fits for r in p.decode)
    assert any("does not fit" in n and "--tensor-parallel-size 2 fits" in n for n in p.notes)
    two = plan("llama-3.1-70b", gpu="h100", max_model_len=8192, tensor_parallel_size=2)
    assert two.memory.max_sequences(8192) >= 1


# --- step costs --------------------------------------------------------------------------
def test_decode_bound_is_bytes_over_bandwidth_at_batch_1():
    a = arch("llama-3.1-8b")
    p = plan(input_len=1000, output_len=200, batch_sizes=(1,))
    row = p.decode[0]
    context = 1000 + 200 / 2
    kv = 131072
    read = ((a.num_params - a.vocab_size * a.hidden_size) * 2  # all but the input table
            + a.hidden_size * 2  # the token's embedding row
            + context * kv + kv)  # KV read, and the new token's KV written
    assert row.cost.binding == "memory"
    assert row.cost.bytes == pytest.approx(read)
    assert row.cost.bound_s == pytest.approx(read / 4.2e12)
    assert row.predicted_ms > row.bound_ms


def test_decode_becomes_compute_bound_at_large_batch():
    p = plan(gpu="h200", input_len=16, output_len=16, batch_sizes=(1, 4096))
    assert [r.cost.binding for r in p.decode] == ["memory", "compute"]


def test_total_throughput_grows_with_batch_until_the_memory_limit():
    # 4096-token requests on an H100: the KV cache holds about a hundred of them
    p = plan(gpu="h100", input_len=1024, output_len=3072, max_model_len=8192,
             batch_sizes=tuple(range(1, 600, 7)))
    limit = p.max_batch
    assert 1 < limit < 599
    fits = [r for r in p.decode if r.fits]
    assert [r.batch for r in fits] == [b for b in range(1, 600, 7) if b <= limit]
    assert all(not r.fits for r in p.decode if r.batch > limit)
    for prev, cur in zip(fits, fits[1:]):
        assert cur.total_tokens_per_s > prev.total_tokens_per_s
        assert cur.bound_total_tokens_per_s > prev.bound_total_tokens_per_s
        assert cur.stream_tokens_per_s < prev.stream_tokens_per_s


def test_prefill_is_chunked_by_the_token_budget():
    assert prefill_chunks(20000, 8192) == ((8192, 0), (8192, 8192), (3616, 16384))
    long, short = (plan(input_len=n, output_len=1, max_model_len=32768) for n in (20000, 100))
    assert len(long.prefill.steps) == 3 and long.prefill.binding == "compute"
    assert long.prefill.ttft_s >= long.prefill.gpu_s > long.prefill.bound_s
    # a short prompt is host-bound: eager launches, 32 layers x 0.54 ms
    assert short.prefill.ttft_s == pytest.approx(32 * 0.54e-3)


def test_offline_simulation_counts_steps():
    p = plan(max_model_len=4096)
    one = simulate_offline(p.model, p.inputs.gpu, p.inputs.efficiency, p.memory,
                           num_prompts=1, input_len=10, output_len=5,
                           max_num_batched_tokens=8192, max_num_seqs=256)
    assert one.steps == 5  # the prefill samples the first token, then 4 decodes
    many = simulate_offline(p.model, p.inputs.gpu, p.inputs.efficiency, p.memory,
                            num_prompts=20, input_len=1000, output_len=3,
                            max_num_batched_tokens=2048, max_num_seqs=256)
    assert many.steps >= math.ceil(20 * 1000 / 2048) + 2
    assert many.total_tokens_per_s == pytest.approx(20 * 1003 / many.elapsed_s)


# --- calibration against the H200 --------------------------------------------------------
def _load(name: str) -> dict:
    path = os.path.join(RESULTS, name)
    if not os.path.isfile(path):
        pytest.skip(f"{name} is not in benchmarks/results")
    with open(path) as f:
        return json.load(f)


def test_batch1_decode_is_within_15_percent_of_gpu_a():
    run = _load("gpu-a-h200.json")
    measured = run["kvflow"]["ms_per_output_token"]
    p = plan(input_len=run["workload"]["input_len"], output_len=run["workload"]["output_len"],
             max_model_len=run["engine_config"]["max_model_len"], batch_sizes=(1,))
    assert abs(p.decode[0].predicted_ms - measured) / measured <= 0.15
    assert p.decode[0].bound_ms < measured


def test_stored_validation_matches_the_code():
    from kvflow.plan.validate import build_report

    stored = _load("plan-validation-h200.json")
    fresh = build_report(RESULTS, stored["extra_runs"])
    assert fresh["acceptance"]["passed"]
    assert [p["name"] for p in fresh["points"]] == [p["name"] for p in stored["points"]]
    for new, old in zip(fresh["points"], stored["points"]):
        assert new["predicted"] == pytest.approx(old["predicted"], rel=1e-9), new["name"]


# --- models ------------------------------------------------------------------------------
def test_gguf_model_plans_like_its_preset(capsys):
    try:
        path = embedded_model_path("smollm2-135m")
    except ModelNotFoundError:
        pytest.skip("the embedded smollm2-135m GGUF is not installed")
    assert main(["plan", "--model", path, "--batch-sizes", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "22.5 KiB" in out  # 2 x 30 layers x 3 KV heads x 64 x 2 B
    from kvflow.plan.cli import resolve_arch

    gguf, preset = resolve_arch(path), arch("smollm2-135m")
    assert ShardedModel(gguf, 1, "bfloat16", "bfloat16").num_params == preset.num_params


def test_preset_by_name(capsys):
    assert main(["plan", "--model", "qwen3-8b", "--gpu", "a100-80g", "--batch-sizes",
                 "1,4"]) == 0
    out = capsys.readouterr().out
    assert "144.0 KiB" in out  # 2 x 36 x 8 x 128 x 2 B
    assert "A100-80G" in out and "unvalidated" in out


# --- CLI ---------------------------------------------------------------------------------
def test_cli_prints_the_table(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per token       128.0 KiB" in out
    assert "max concurrency" in out and "Prefill of one 128-token prompt" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()
            and line.startswith("  ") and "yes" in line.split()[:2]]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_cli_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--json", str(out), "-tp", "2", "--kv-dtype", "fp8",
                 "--batch-sizes", "1,16", "--num-prompts", "10"]) == 0
    data = json.loads(out.read_text())
    assert data["kv_bytes_per_token"] == 64 * 1024
    assert data["kv_bytes_per_token_per_gpu"] == 32 * 1024
    assert [r["batch"] for r in data["decode"]] == [1, 16]
    assert data["decode"][0]["allreduce_bytes_per_gpu"] > 0
    assert data["offline"]["steps"] > 0 and data["prefill"]["ttft_ms"] > 0
    assert data["inputs"]["tensor_parallel_size"] == 2


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert main(["plan", "--plot", str(out), "--batch-sizes", "1,8,64"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    out = tmp_path / "plan.png"
    assert main(["plan", "--plot", str(out), "--batch-sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'kvflow[plot]'" in err
    assert not out.exists()


@pytest.mark.parametrize("args,words", [
    (["--gpu", "b200"], ["unknown GPU 'b200'", "h100", "l40s"]),
    (["-tp", "3"], ["tensor_parallel_size=3", "does not divide", "32 attention heads"]),
    (["--model", "qwen2.5-7b", "-tp", "7"], ["cannot split 4 KV heads"]),
    (["--input-len", "-5"], ["input_len must be >= 1"]),
    (["--output-len", "0"], ["output_len must be >= 1"]),
    (["--max-model-len", "100"], ["exceeds max_model_len=100"]),
    (["--gpu-memory-gib", "80"], ["custom GPU needs --gpu-bandwidth-tbs, --gpu-tflops"]),
    (["--gpu", "h100", "--gpu-bandwidth-tbs", "-1"], ["must be > 0"]),
    (["--dtype", "fp8"], ["dtype must be bf16, fp16 or fp32"]),
    (["--kv-dtype", "int3"], ["kv_dtype must be bf16, fp16, fp32, fp8 or int8"]),
    (["--batch-sizes", "1,x"], ["--batch-sizes must be positive integers"]),
    (["--gpu-memory-utilization", "1.5"], ["gpu_memory_utilization must be in (0, 1]"]),
    (["--model", "no-such-model"], ["unknown model 'no-such-model'", "llama-3.1-8b"]),
])
def test_bad_inputs_give_clear_errors(args, words, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for w in words:
        assert w in err


def test_errors_are_kvflow_errors():
    with pytest.raises(InvalidParameterError) as e:
        get_gpu("tpu")
    assert e.value.param == "gpu"
    with pytest.raises(KvflowError):
        ShardedModel(arch("llama-3.1-8b"), 5, "bfloat16", "bfloat16")


def test_custom_gpu_and_edited_preset():
    custom = get_gpu(memory_gib=24, bandwidth_tbs=1.0, tflops=165)
    assert (custom.name, custom.memory_bytes, custom.hbm_bytes_per_s) == ("custom", 24 * GiB,
                                                                          1e12)
    edited = get_gpu("h100", memory_gib=94)
    assert edited.memory_bytes == 94 * GiB
    assert edited.hbm_bytes_per_s == GPU_PRESETS["h100"].hbm_bytes_per_s
    assert get_gpu("A100") == GPU_PRESETS["a100-80g"]


def test_planner_does_not_import_torch():
    import subprocess

    code = ("import sys, kvflow.cli, kvflow.plan.report, kvflow.plan.validate; "
            "kvflow.cli.main(['plan', '--batch-sizes', '1']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "128.0 KiB" in proc.stdout


def test_efficiency_constants_are_checked():
    from kvflow.plan.efficiency import Efficiency

    with pytest.raises(InvalidParameterError, match="gemm_bandwidth"):
        Efficiency(gemm_bandwidth=0.0)
    with pytest.raises(InvalidParameterError, match="gemm_knee"):
        Efficiency(gemm_knee=0.5)
    # p = inf is the plain roofline max() of the two GEMM limits
    p = build_plan(PlanInputs("llama-3.1-8b", arch("llama-3.1-8b"), get_gpu("h200"),
                              batch_sizes=(256,), efficiency=Efficiency(gemm_knee=math.inf)))
    gemm = p.decode[0].cost.breakdown["gemm"]
    m = p.model
    assert gemm == pytest.approx(max(m.decode_weight_read_bytes / (0.92 * 4.2e12),
                                     (2 * 256 * (32 * m.layer_linear_params
                                                 + m.vocab * 4096)) / (0.98 * 790e12)))


@pytest.mark.parametrize("seqs,batched,max_len,want", [
    (256, 8192, 4096, [4095, 4095, 2]),  # the default: the whole token budget
    (1, 8192, 4096, [4095]),  # --max-num-seqs 1 crashed the GPU start (batch full)
    (2, 8192, 1024, [1023, 1023]),
    (8, 512, 4096, [512]),
])
def test_profiling_step_fits_the_persistent_batch(seqs, batched, max_len, want):
    profiler = pytest.importorskip("kvflow.worker.profiler")
    from kvflow.engine.args import EngineArgs

    cfg = EngineArgs(model="smollm2-135m-h64", load_format="dummy", device="cpu",
                     max_num_seqs=seqs, max_num_batched_tokens=batched,
                     max_model_len=max_len).create_engine_config()
    assert profiler.profile_prompt_lengths(cfg) == want
