"""The C++ CPU decode step (kvflow/cpu/step.py + cpu/step.cpp): the same greedy
tokens as eager under batching, chunked prefill (short chunks run through the C++ step
as mixed steps) and recompute preemption, in float32 and bfloat16, with int8 and fp8 KV
caches, with quantized linears called back; the off switches and fallbacks say why in
the log."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvflow import LLM, SamplingParams
from tiny_engine import greedy as _greedy
from tiny_engine import prompts as _prompts
from tiny_engine import runner as _runner
from tiny_engine import tiny as _tiny
from kvflow.layers.attention import AttentionMetadata
from kvflow.models import registry
from kvflow.cpu import step as cpu_step

pytestmark = pytest.mark.skipif(cpu_step.find_compiler() is None,
                                reason="no C++ compiler to build the step with")


def _count(step: cpu_step.CppDecodeStep) -> dict[str, int]:
    """Counts the steps the C++ step ran, and those with a prefill chunk among them."""
    calls = {"cpp": 0, "mixed": 0}
    run = step.run

    def counted(inputs):
        calls["cpp"] += 1
        calls["mixed"] += inputs.meta.num_decodes != inputs.meta.num_reqs
        return run(inputs)
    step.run = counted
    return calls


# The embedded model's head layout (head dim 64, 3 query heads per KV head) at tiny
# size: the shared paged attention kernel's fixed-width path (tiny-llama's head dim 16
# takes its run-time-width one).
TINY_D64 = dict(registry.PRESETS["tiny-llama"], hidden_size=128, num_attention_heads=6,
                num_key_value_heads=2, head_dim=64)


@pytest.fixture
def tiny_d64(monkeypatch):
    monkeypatch.setitem(registry.PRESETS, "tiny-llama-d64", TINY_D64)
    return "tiny-llama-d64"


@pytest.mark.parametrize("scenario,model,dtype,kv", [
    ("batched", "tiny-llama", "float32", "auto"),
    ("preempted", "tiny-llama", "float32", "auto"),
    ("batched", "tiny-llama", "bfloat16", "auto"),
    ("batched", "tiny-qwen2", "float32", "auto"),  # QKV bias, one KV head
    ("batched", "tiny-qwen3", "float32", "auto"),  # per-head q/k norms
    # Windows past 8 tokens: the bf16 cache's own attention loop, the int8 paged kernel
    ("batched", "tiny-gemma2", "bfloat16", "auto"),
    ("batched", "tiny-mistral-window", "float32", "int8"),
    ("batched", "tiny-llama", "float32", "int8"),
    ("preempted", "tiny-llama", "float32", "int8"),
    ("batched", "tiny-llama-d64", "float32", "int8"),
    ("batched", "tiny-llama", "float32", "fp8"),
    ("preempted", "tiny-llama-d64", "float32", "fp8"),
    ("batched", "tiny-llama", "bfloat16", "int8"),
])
def test_cpp_step_matches_eager(scenario, model, dtype, kv, monkeypatch):
    """Prompts of mixed lengths (contexts of 1 to many blocks; the batch changes step to
    step), prefills chunked by a 32-token budget; the 'preempted' engine has too few
    blocks for everyone, so requests are preempted and recomputed. Quantized KV caches
    are written and read inside the C++ step."""
    monkeypatch.setitem(registry.PRESETS, "tiny-llama-d64", TINY_D64)
    prompts = _prompts((5, 40, 100, 7, 1, 17))
    kw = dict(dtype=dtype, kv_cache_dtype=kv)
    if scenario == "preempted":
        kw.update(num_gpu_blocks_override=40, max_model_len=160)
    eager = _greedy(_tiny(model, enforce_eager=True, **kw), prompts)
    llm = _tiny(model, **kw)
    step = _runner(llm).graphs
    assert isinstance(step, cpu_step.CppDecodeStep)
    assert step.kv_kind == (None if kv == "auto" else kv)
    assert step.step.kv_cache_kind == ("model" if kv == "auto" else kv)
    calls = _count(step)
    got = _greedy(llm, prompts)
    if dtype == "float32":
        assert got == eager
    else:
        # bf16 rounds every activation: where random weights make two logits nearly
        # tie, another summation order may pick the other one, and the sequences part
        # from there on. Up to then they must agree.
        assert [g[:8] for g in got] == [e[:8] for e in eager]
        assert sum(g == e for g, e in zip(got, eager)) >= len(got) // 2
    assert calls["cpp"] > 10 and calls["mixed"] > 0
    if scenario == "preempted":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_long_prefill_runs_in_cpp():
    """Every step runs in C++, a long prompt's whole prefill (300 rows: the int8 GEMV's
    rows go in pieces of 256) too: the same tokens as eager."""
    prompts = _prompts((300, 7))
    kw = dict(max_num_batched_tokens=512, max_model_len=512, num_gpu_blocks_override=128)
    eager = _greedy(_tiny(enforce_eager=True, **kw), prompts)
    llm = _tiny(**kw)
    calls = _count(_runner(llm).graphs)
    assert _greedy(llm, prompts) == eager
    assert calls["cpp"] == 24  # the prefill step and 23 decodes: every step


def test_quantized_linears_are_called_back():
    """Weight-only int8 linears stay in Python (called back from C++), dense norms and
    attention run in C++: same tokens as eager."""
    prompts = _prompts((9, 30, 3))
    eager = _greedy(_tiny(enforce_eager=True, quantization="int8"), prompts)
    llm = _tiny(quantization="int8")
    step = _runner(llm).graphs
    assert isinstance(step, cpu_step.CppDecodeStep)
    assert step.num_callbacks == 4 * step.num_layers
    assert _greedy(llm, prompts) == eager


def test_off_switches(caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="kvflow"):
        assert _runner(_tiny(enforce_eager=True)).graphs is None
    assert "compiled CPU decode step off (--enforce-eager)" in caplog.text
    monkeypatch.setenv("KVFLOW_CPU_CPP_STEP", "0")
    with caplog.at_level(logging.INFO, logger="kvflow"):
        assert _runner(_tiny()).graphs is None
    assert "C++ CPU decode step off (KVFLOW_CPU_CPP_STEP=0)" in caplog.text
    monkeypatch.delenv("KVFLOW_CPU_CPP_STEP")
    with caplog.at_level(logging.INFO, logger="kvflow"):
        assert _runner(_tiny("tiny-mixtral")).graphs is None  # routed experts: not in C++
    assert "C++ CPU decode step off (mixture-of-experts layers" in caplog.text


def test_no_compiler_falls_back_to_eager(caplog, monkeypatch):
    monkeypatch.setattr(cpu_step, "find_compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny()
    assert _runner(llm).graphs is None
    assert "C++ CPU decode step off (no C++ compiler found" in caplog.text
    prompts = _prompts((9, 3))
    assert _greedy(llm, prompts) == _greedy(_tiny(enforce_eager=True), prompts)


def test_failed_build_falls_back_to_eager(caplog, monkeypatch):
    def broken():
        raise RuntimeError("Error building extension 'kvflow_cpu_step': simulated")
    monkeypatch.setattr(cpu_step, "load_extension", broken)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny()
    runner = _runner(llm)
    assert runner.graphs is None
    assert "building the C++ CPU decode step failed, decoding eagerly" in caplog.text
    assert not isinstance(runner.step_builder.attn_builder, cpu_step.CppMetadataBuilder)
    assert _greedy(llm, _prompts((6,))) == _greedy(_tiny(enforce_eager=True), _prompts((6,)))


def test_a_wrong_step_is_caught_by_the_self_check(caplog, monkeypatch):
    """A step that computes something else (here: outputs shifted by one) fails the
    warm-up comparison with eager, and the engine decodes eagerly."""
    real = cpu_step.CppDecodeStep.__init__

    class Shifted:
        def __init__(self, step):
            self.step = step

        def forward(self, *args):
            return self.step.forward(*args) + 1

    def shifted(self, parts, module):
        real(self, parts, module)
        self.step = Shifted(self.step)
    monkeypatch.setattr(cpu_step.CppDecodeStep, "__init__", shifted)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny()
    assert _runner(llm).graphs is None
    assert "disagrees with eager" in caplog.text
    assert not isinstance(_runner(llm).step_builder.attn_builder, cpu_step.CppMetadataBuilder)


def _one_step_both_ways(llm) -> tuple[list, list]:
    """One mixed step (a decode over 2 blocks of random context, a 5-token chunk) from
    the same cache, eagerly and in C++: what each left in the layer caches (and int8
    scales) at the step's slots."""
    r = _runner(llm)
    step = r.graphs
    bs = r.block_size
    gen = torch.Generator().manual_seed(1)
    blocks = step._check_blocks(r.kv_caches)
    for b in blocks:
        if b.dtype == torch.int8:
            b.random_(-127, 128, generator=gen)
        elif b is not blocks[0]:
            b.uniform_(0.005, 0.02, generator=gen)
        else:
            b.copy_(torch.randn(b.shape, generator=gen))
    lens, qlens, table = [bs + 3, 5], [1, 5], [[0, 1], [2, 3]]
    tables = torch.tensor(table, dtype=torch.int32)
    positions, slots = [], []
    for i, (n, q) in enumerate(zip(lens, qlens)):
        for p in range(n - q, n):
            positions.append(p)
            slots.append(table[i][p // bs] * bs + p % bs)
    meta = AttentionMetadata(
        num_actual_tokens=len(slots), num_reqs=2, num_decodes=1, max_query_len=5,
        max_seq_len=max(lens), slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, 1, 6], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        query_start_loc_cpu=[0, 1, 6], seq_lens_cpu=lens)
    ids, pos = torch.randint(3, 500, (len(slots),), generator=gen), torch.tensor(positions)
    before = [b.clone() for b in blocks]
    idx = torch.tensor(slots)

    def written():
        out = []
        for b in blocks:  # [L, 2, NB', BS, ...] -> the step's slots
            flat = b.reshape(b.shape[0], 2, -1, *b.shape[4:])
            out.append(flat[:, :, idx].clone())
        return out
    step._eager_builder.build(meta, pos)
    with torch.inference_mode():
        step.model(ids, pos, meta)
    eager = written()
    for b, v in zip(blocks, before):
        b.copy_(v)
    with torch.inference_mode():
        step.step.forward(step.embed(ids), pos, meta.slot_mapping, meta.query_start_loc,
                          meta.seq_lens, tables, cpu_step._NO_TREE, cpu_step._NO_TREE,
                          cpu_step._NO_TREE, cpu_step._NO_LORA, cpu_step._NO_LORA)
    return eager, written()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_cache_write_matches_eager(kv, tiny_d64):
    """The C++ step stores what kv_quant.py stores: the same int8 values and scales, the
    same E4M3 bytes, up to the float32 rounding of the K/V rows themselves (their
    projections and norms sum in another order), which moves a value by one step at
    most and rarely; the rows are the ones attention then read."""
    eager, got = _one_step_both_ways(_tiny(tiny_d64, kv_cache_dtype=kv))
    if kv == "int8":
        (eq, es), (gq, gs) = eager, got
        diff = (eq.int() - gq.int()).abs()
        assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99
        torch.testing.assert_close(gs, es, rtol=1e-5, atol=0)
        assert (es > 0).all()
    else:
        (e,), (g,) = eager, got
        ef, gf = e.float(), g.float()
        assert (ef == gf).float().mean() > 0.99
        torch.testing.assert_close(gf, ef, rtol=0.07, atol=2 ** -9)  # one E4M3 step


def test_quantized_cache_head_dim_off_the_kernel_runs_eagerly(caplog, monkeypatch):
    """A quantized cache whose head dim the paged kernel cannot read (not a multiple of
    8) keeps the eager path, and says so."""
    monkeypatch.setitem(registry.PRESETS, "tiny-llama-d12",
                        dict(registry.PRESETS["tiny-llama"], head_dim=12))
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny("tiny-llama-d12", kv_cache_dtype="int8")
    assert _runner(llm).graphs is None
    assert "C++ CPU decode step off (int8 KV cache with head dim 12" in caplog.text
    prompts = _prompts((9, 3))
    assert _greedy(llm, prompts) == _greedy(
        _tiny("tiny-llama-d12", kv_cache_dtype="int8", enforce_eager=True), prompts)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_wrong_kv_scales_are_caught_by_the_self_check(kv, caplog, monkeypatch):
    """A step reading the quantized cache with the wrong scales (int8: another layer's;
    fp8: twice the real one) fails the warm-up comparison: the check covers the
    quantized read, and the engine decodes eagerly."""
    real = cpu_step.CppDecodeStep._set_kv_quant

    def wrong(self, quants):
        kind = real(self, quants)
        scales = [q.scales if q.scales is not None else torch.empty(0) for q in quants]
        k = [q.k_scale * (2 if kind == "fp8" else 1) for q in quants]
        v = [q.v_scale * (2 if kind == "fp8" else 1) for q in quants]
        self.step.set_kv_quant(kind, scales[1:] + scales[:1] if kind == "int8" else scales,
                               k, v)
        return kind
    monkeypatch.setattr(cpu_step.CppDecodeStep, "_set_kv_quant", wrong)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny(kv_cache_dtype=kv)
    assert _runner(llm).graphs is None
    assert "disagrees with eager" in caplog.text


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_self_check_compares_like_for_like(kv, tiny_d64):
    """With a quantized cache the self-check's eager reference reads the K/V the step
    stored (no rounding step of the cache between them), and what the step stores is
    compared with eager's own write: a step whose stored K/V are wrong (one layer's
    negated after it ran) fails that comparison."""
    llm = _tiny(tiny_d64, kv_cache_dtype=kv)
    r = _runner(llm)
    step = r.graphs
    assert isinstance(step, cpu_step.CppDecodeStep)
    assert step.write_error <= cpu_step.WRITE_TOLERANCE
    assert step.self_check(r.kv_caches, r.block_size) <= max(step.eager_error, 1e-6)
    real = step.step

    class Corrupting:
        def __getattr__(self, name):
            return getattr(real, name)

        def forward(self, hidden, pos, slots, *args):
            out = real.forward(hidden, pos, slots, *args)
            flat = r.kv_caches[1].view(torch.uint8).view(2, -1, *r.kv_caches.shape[4:])
            if kv == "int8":
                flat[:, slots] = (-flat[:, slots].view(torch.int8)).view(torch.uint8)
            else:
                flat[:, slots] ^= 0x80  # the E4M3 sign bit
            return out
    step.step = Corrupting()
    step.write_error = 0.0
    step.self_check(r.kv_caches, r.block_size)
    assert step.write_error > cpu_step.WRITE_TOLERANCE


def test_set_kv_quant_rejects_a_mismatched_cache():
    """The C++ side checks what it is handed (a float32 cache is not int8; int8 scales
    must have the cache's block layout)."""
    llm = _tiny()
    step = _runner(llm).graphs
    n = step.num_layers
    with pytest.raises(RuntimeError, match="cache is Float, not int8"):
        step.step.set_kv_quant("int8", [torch.zeros(2, 64, 4, 2)] * n, [1.0] * n, [1.0] * n)
    llm = _tiny(kv_cache_dtype="int8")
    step = _runner(llm).graphs
    with pytest.raises(RuntimeError, match="int8 KV scales of layer 0"):
        step.step.set_kv_quant("int8", [torch.zeros(2, 64, 4, 3)] * n, [1.0] * n, [1.0] * n)
    with pytest.raises(RuntimeError, match="KV cache kind int4"):
        step.step.set_kv_quant("int4", [], [1.0] * n, [1.0] * n)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def test_gguf_linears_take_the_int4_gemv(tiny_gguf, monkeypatch):
    """GGUF 4-bit (and doubled 8-bit) linears run cpu/int4.cpp's GEMV inside the step:
    on int8 activations (VNNI builds) close to, with KVFLOW_CPU_INT8_ACT=0 (float32
    activations) the same greedy tokens as the float32 model on the dequantized weights
    (the bfloat16 callback path may differ from both); the switches turn them off."""
    prompts = _prompts((5, 9, 3))
    kw = dict(load_format="gguf", max_model_len=128, num_gpu_blocks_override=64,
              block_size=4, device="cpu", skip_tokenizer_init=True)
    dense = _greedy(LLM(tiny_gguf, quantization="none", enforce_eager=True, **kw), prompts)
    llm = LLM(tiny_gguf, **kw)
    step = _runner(llm).graphs
    assert isinstance(step, cpu_step.CppDecodeStep) and step.num_int4 == 8  # 2 layers x 4
    calls = _count(step)
    got = _greedy(llm, prompts)
    assert calls["cpp"] > 0
    if step.module.q8_gemv_simd():
        # int8 activations (the 8 linears and the untied Q4_0 lm_head): rounded inputs,
        # so greedy may leave the float32 model's path at a near tie of this random
        # model, but not at once (a wrong kernel would), and mostly not at all.
        assert step.num_int8_act == 9
        same = [sum(a == b for a, b in zip(g, d)) / len(d) for g, d in zip(got, dense)]
        assert all(g[:4] == d[:4] for g, d in zip(got, dense)), (got, dense)
        assert sum(same) / len(same) >= 0.6, same
        monkeypatch.setenv("KVFLOW_CPU_INT8_ACT", "0")
        llm = LLM(tiny_gguf, **kw)
        assert _runner(llm).graphs.num_int8_act == 0
        got = _greedy(llm, prompts)
    assert got == dense  # float32 activations: the float32 model's tokens
    monkeypatch.setenv("KVFLOW_CPU_INT4_GEMV", "0")
    off = _runner(LLM(tiny_gguf, **kw)).graphs
    assert off.num_int4 == 0 and off.num_callbacks == 8

    # A GGUF layer makes its copy in the GEMV's layout only when the step asks for it.
    def copies(model):
        return sum(getattr(getattr(m, "quant_method", None), "gemv", None) is not None
                   for m in model.modules())
    assert copies(step.model) == 9 and copies(off.model) == 0


def test_int8_activation_steps_over_16_tokens_stay_in_cpp(tiny_gguf, monkeypatch):
    """With int8 activations the GGUF linears and the head take the step's GEMV for a
    whole step (up to 256 tokens), not only 16: batched decodes of 20 requests call
    nothing back into Python, and since every row's sums are its own, each request's
    greedy tokens are what it gets alone. Prompt tokens are the exception: their rows
    (and only theirs) take each linear's own method, in steps of prompts alone and in
    steps that mix them with decodes."""
    from kvflow.layers.quantization import gguf

    kw = dict(load_format="gguf", max_model_len=128, num_gpu_blocks_override=128,
              block_size=4, device="cpu", skip_tokenizer_init=True)
    llm = LLM(tiny_gguf, **kw)
    step = _runner(llm).graphs
    if not step.num_int8_act:
        pytest.skip("this build has no int8-activation kernel (AVX512-VNNI or AVX2)")
    called = []
    steps = []  # (tokens, prompt rows, rows called back during the step)

    def run(inputs, real=step.run):
        before = len(called)
        out = real(inputs)
        prompt = 0 if inputs.prompt_rows is None else len(inputs.prompt_rows)
        steps.append((inputs.meta.num_actual_tokens, prompt, called[before:]))
        return out

    step.run = run
    real = gguf.int4_mm
    monkeypatch.setattr(gguf, "int4_mm", lambda x, *a: called.append(x.shape[0]) or real(x, *a))
    prompts = _prompts([3 + i % 7 for i in range(20)])
    batched = _greedy(llm, prompts)
    decodes = [s for s in steps if s[1] == 0]
    assert max(t for t, _, _ in decodes) > 16 and not any(c for _, _, c in decodes)
    with_prompts = [s for s in steps if s[1]]
    assert with_prompts
    for _, prompt, c in with_prompts:  # the prompt rows only, for every quantized linear
        assert c and set(c) == {prompt}, (prompt, c)
    assert [_greedy(llm, [p])[0] for p in prompts[:3]] == batched[:3]
    # A step that mixes a prompt with decodes: the decode rows stay on the int8 GEMV.
    steps.clear()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.engine.add_request("a", {"prompt_token_ids": prompts[0]}, sp)
    llm.engine.step()
    llm.engine.add_request("b", {"prompt_token_ids": prompts[1]}, sp)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    mixed = [s for s in steps if 0 < s[1] < s[0]]
    assert mixed and all(set(c) == {p} for _, p, c in mixed), steps


def test_use_step_gemv_on_any_forward(tiny_gguf):
    """cpu_step.use_step_gemv (bench quality's gguf-f32act / gguf-int8act): every GGUF
    linear and the lm_head on the step's GEMV for any number of rows; float32
    activations give the float32 model's logits but for the one F32 tensor, which GGUF
    loading requantizes to 8 bits."""
    from kvflow.bench.quality import _Scorer
    from kvflow.engine.args import EngineArgs

    args = EngineArgs(model=tiny_gguf, load_format="gguf", device="cpu", max_model_len=128,
                      skip_tokenizer_init=True)
    ids = list(range(3, 40))  # 37 rows: three chunks of 16
    dense = _Scorer(dataclasses.replace(args, quantization="none"), 40).logprobs(ids)
    f32 = _Scorer(args, 40)
    assert cpu_step.use_step_gemv(f32.model, int8=False) == 9  # 8 linears + lm_head
    torch.testing.assert_close(f32.logprobs(ids), dense, rtol=0, atol=3e-2)
    q8 = _Scorer(args, 40)
    cpu_step.use_step_gemv(q8.model, int8=True)
    lp = q8.logprobs(ids)
    kl = (dense.exp() * (dense - lp)).sum(-1)  # KL(dense || int8)
    assert float(kl.mean()) < 1e-2 and (lp.argmax(-1) == dense.argmax(-1)).float().mean() > 0.8


def test_bench_compares_float32_and_int8_activations():
    from argparse import Namespace

    from kvflow import envs
    from kvflow.bench.offline import _backends

    assert _backends(Namespace(backend="f32act-vs-int8act")) == ["kvflow-f32act", "kvflow"]
    assert _backends(Namespace(backend="kvflow,llamacpp,kvflow-f32act")) == [
        "llamacpp", "kvflow-f32act", "kvflow"]
    assert envs.cpu_int8_act()
    with envs.float32_activations():
        assert not envs.cpu_int8_act()
    assert envs.cpu_int8_act()


@pytest.mark.parametrize("model,dtype,kv", [
    ("tiny-llama-d64", "float32", "auto"),  # the shared kernel's fixed-width path
    ("tiny-llama", "float32", "int8"),  # its run-time-width path, over an int8 cache
    ("tiny-llama", "bfloat16", "auto"),  # the step's own loop (bf16 cache)
])
def test_medusa_tree_steps_run_in_cpp(model, dtype, kv, tmp_path, monkeypatch):
    """Medusa verification steps run in the C++ step, their tree masks applied there: an
    oracle puts the right continuation on a random branch of the tree (every other node
    wrong), so only correctly masked attention keeps plain greedy's tokens; the output
    equals the eager engine's under the same oracle, and tree steps ran in C++."""
    from kvflow.bench.spec_oracle import install_oracle
    from kvflow.spec_decode.tree import DraftTree
    from tests.test_spec_medusa import write_heads

    monkeypatch.setitem(registry.PRESETS, "tiny-llama-d64", TINY_D64)
    write_heads(tmp_path, hidden=registry.PRESETS[model]["hidden_size"])
    prompts = _prompts((5, 9, 17, 30))
    kw = dict(dtype=dtype, kv_cache_dtype=kv)
    spec = {"method": "medusa", "model": str(tmp_path), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}
    plain = _greedy(_tiny(model, enforce_eager=True, **kw), prompts)
    refs = [p + g for p, g in zip(prompts, plain)]
    tree = DraftTree.from_choices([[0], [1], [0, 0], [1, 0], [1, 1], [1, 0, 0]])
    eager = _tiny(model, enforce_eager=True, speculative_config=spec, **kw)
    install_oracle(eager, refs, 3, tree, place="random")
    want = _greedy(eager, prompts)
    llm = _tiny(model, speculative_config=spec, **kw)
    step = _runner(llm).graphs
    assert isinstance(step, cpu_step.CppDecodeStep)
    run, trees = step.run, []

    def counted(inputs):
        tree_meta = inputs.meta.tree
        trees.append(tree_meta is not None and any(tree_meta.sizes_cpu))
        return run(inputs)
    step.run = counted
    install_oracle(llm, refs, 3, tree, place="random")
    got = _greedy(llm, prompts)
    assert sum(trees) > 5
    if dtype == "float32":
        assert got == want == plain
    else:  # bf16: near-ties may part later (see test_cpp_step_matches_eager)
        assert [g[:8] for g in got] == [w[:8] for w in want]
    assert llm.engine.core.scheduler.spec_stats.mean_accepted_length > 2.0


@pytest.mark.parametrize("n,k", [(960, 576), (37, 100), (6, 8), (5, 3)])
def test_float32_gemv_rows_are_one_row_calls(n, k):
    """The step's float32 GEMV (the dense linears' path up to 16 rows, and a dense
    lm_head's): within float32 rounding of the float64 product, and each row of an
    m-row call bit-identical to a one-row call (speculative verify rows must give a
    decode's numbers), whatever the row and column tiles and the input tail."""
    module, _ = cpu_step.load_extension()
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(16, k, generator=g)
    for bias in (b, torch.empty(0)):
        ref = x.double() @ w.double().t() + (bias.double() if bias.numel() else 0.0)
        one = torch.cat([module.linear_f32(x[i:i + 1], w, bias) for i in range(16)])
        assert float((one - ref).abs().max() / ref.abs().max()) < 1e-5
        for m in (2, 3, 4, 5, 6, 9, 16):
            assert torch.equal(module.linear_f32(x[:m], w, bias), one[:m]), m
    with pytest.raises(RuntimeError, match="linear_f32"):
        module.linear_f32(torch.randn(17, k), w, b)


def test_dense_lm_head_takes_the_float32_gemv():
    """A dense float32 model's lm_head computes up to 16 rows with the step's GEMV once
    the self-check has passed (and not during it), with the same greedy tokens."""
    ps = _prompts([5, 9, 17, 30])
    want = _greedy(_tiny(enforce_eager=True), ps)
    llm = _tiny()
    runner = _runner(llm)
    head = runner.model.lm_head
    assert head.cpu_gemv is not None
    calls = []
    real = head.cpu_gemv
    head.cpu_gemv = lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b)
    assert _greedy(llm, ps) == want
    assert calls and max(calls) <= 16
    runner.graphs.detach()
    assert head.cpu_gemv is None
