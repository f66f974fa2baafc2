"""The C++ CPU decode step (kvflow/worker/cpu_step.py + cpu_step.cpp): the same greedy
tokens as eager under batching, chunked prefill (short chunks run through the C++ step
as mixed steps) and recompute preemption, in float32 and bfloat16, with quantized
linears called back; the off switches and fallbacks say why in the log."""

from __future__ import annotations

import logging

import pytest

from kvflow import LLM
from tiny_engine import greedy as _greedy
from tiny_engine import prompts as _prompts
from tiny_engine import runner as _runner
from tiny_engine import tiny as _tiny
from kvflow.worker import cpu_step

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


@pytest.mark.parametrize("scenario,model,dtype", [
    ("batched", "tiny-llama", "float32"),
    ("preempted", "tiny-llama", "float32"),
    ("batched", "tiny-llama", "bfloat16"),
    ("batched", "tiny-qwen2", "float32"),  # QKV bias, one KV head
])
def test_cpp_step_matches_eager(scenario, model, dtype):
    """Prompts of mixed lengths (contexts of 1 to many blocks; the batch changes step to
    step), prefills chunked by a 32-token budget; the 'preempted' engine has too few
    blocks for everyone, so requests are preempted and recomputed."""
    prompts = _prompts((5, 40, 100, 7, 1, 17))
    kw = dict(dtype=dtype)
    if scenario == "preempted":
        kw.update(num_gpu_blocks_override=40, max_model_len=160)
    eager = _greedy(_tiny(model, enforce_eager=True, **kw), prompts)
    llm = _tiny(model, **kw)
    step = _runner(llm).graphs
    assert isinstance(step, cpu_step.CppDecodeStep)
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


def test_long_prefill_runs_eagerly():
    """A step with a query longer than MAX_QUERY is planned and run by the torch backend;
    the decodes after it run in C++ over the cache the eager prefill wrote."""
    prompts = _prompts((cpu_step.MAX_QUERY + 30,))
    kw = dict(max_num_batched_tokens=256)
    eager = _greedy(_tiny(enforce_eager=True, **kw), prompts)
    llm = _tiny(**kw)
    calls = _count(_runner(llm).graphs)
    assert _greedy(llm, prompts) == eager
    assert calls["cpp"] == 23  # every decode step; the prefill step was eager


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
        assert _runner(_tiny("tiny-qwen3")).graphs is None  # q/k norms: not in C++
    assert "C++ CPU decode step off (q/k norms)" in caplog.text


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

    def shifted(self, runner, module):
        real(self, runner, module)
        self.step = Shifted(self.step)
    monkeypatch.setattr(cpu_step.CppDecodeStep, "__init__", shifted)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny()
    assert _runner(llm).graphs is None
    assert "disagrees with eager" in caplog.text
    assert not isinstance(_runner(llm).step_builder.attn_builder, cpu_step.CppMetadataBuilder)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def test_gguf_linears_take_the_int4_gemv(tiny_gguf, monkeypatch):
    """GGUF 4-bit (and doubled 8-bit) linears run cpu_int4.cpp's float32 GEMV inside the
    step: the same greedy tokens as the float32 model on the dequantized weights (the
    bfloat16 callback path may differ from both), and the switch turns it off."""
    prompts = _prompts((5, 9, 3))
    kw = dict(load_format="gguf", max_model_len=128, num_gpu_blocks_override=64,
              block_size=4, device="cpu", skip_tokenizer_init=True)
    dense = _greedy(LLM(tiny_gguf, quantization="none", enforce_eager=True, **kw), prompts)
    llm = LLM(tiny_gguf, **kw)
    step = _runner(llm).graphs
    assert isinstance(step, cpu_step.CppDecodeStep) and step.num_int4 == 8  # 2 layers x 4
    calls = _count(step)
    assert _greedy(llm, prompts) == dense
    assert calls["cpp"] > 0
    monkeypatch.setenv("KVFLOW_CPU_INT4_GEMV", "0")
    off = _runner(LLM(tiny_gguf, **kw)).graphs
    assert off.num_int4 == 0 and off.num_callbacks == 8
