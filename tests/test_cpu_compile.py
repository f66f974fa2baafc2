"""The compiled CPU decode step (kvflow/cpu/compiled.py): the same greedy tokens as
eager under batching, chunked prefill and preemption; --enforce-eager and a missing C++
compiler fall back to eager with a log line. One compiled tiny engine per scenario keeps
the compile time small (the 2-layer tiny model builds in seconds; the FX graph cache
makes repeats cheaper)."""

from __future__ import annotations

import logging

import pytest

from tiny_engine import greedy as _greedy
from tiny_engine import prompts as _prompts
from tiny_engine import runner as _runner
from tiny_engine import tiny as _tiny
from kvflow.cpu import compiled as cpu_compile


@pytest.fixture
def compile_on(monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_COMPILE", "1")


def _count_compiled_calls(step: cpu_compile.CpuCompiledStep) -> list[int]:
    calls = [0]
    run = step.run

    def counted(inputs):
        calls[0] += 1
        return run(inputs)
    step.run = counted
    return calls


@pytest.mark.parametrize("scenario", ["batched", "preempted"])
def test_compiled_decode_matches_eager(compile_on, scenario):
    """Prompts of mixed lengths (contexts from 1 to many blocks, so the table width and
    the batch size change step to step), prefills chunked by a 32-token budget; the
    'preempted' engine has too few blocks for everyone, so requests are recomputed."""
    prompts = _prompts((5, 40, 100, 7, 1, 17))
    kw = dict(num_gpu_blocks_override=40, max_model_len=160) if scenario == "preempted" \
        else {}
    eager = _greedy(_tiny(enforce_eager=True, **kw), prompts)
    llm = _tiny(**kw)
    step = _runner(llm).graphs
    assert isinstance(step, cpu_compile.CpuCompiledStep)
    calls = _count_compiled_calls(step)
    assert _greedy(llm, prompts) == eager
    assert calls[0] > 10  # the decode steps really went through the compiled layers
    if scenario == "preempted":
        assert llm.engine.core.scheduler.num_preemptions > 0
    # Single stream: batch size 1 has its own graph, compiled at warm-up.
    assert _greedy(llm, prompts[:1], 40) == _greedy(_tiny(enforce_eager=True, **kw),
                                                    prompts[:1], 40)


def test_enforce_eager_and_env_turn_it_off(compile_on, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny(enforce_eager=True)
    assert _runner(llm).graphs is None
    assert "compiled CPU decode step off (--enforce-eager)" in caplog.text
    # Opt-in: off unless asked for (the default CPU step is then the C++ one).
    monkeypatch.setenv("KVFLOW_CPU_COMPILE", "0")
    assert not isinstance(_runner(_tiny()).graphs, cpu_compile.CpuCompiledStep)
    monkeypatch.delenv("KVFLOW_CPU_COMPILE")
    assert not isinstance(_runner(_tiny()).graphs, cpu_compile.CpuCompiledStep)


def test_no_cxx_compiler_falls_back_to_eager(compile_on, caplog, monkeypatch):
    monkeypatch.setattr(cpu_compile, "find_cxx", lambda: None)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny()
    assert _runner(llm).graphs is None
    assert "no C++ compiler found" in caplog.text
    prompts = _prompts((9, 3))
    assert _greedy(llm, prompts) == _greedy(_tiny(enforce_eager=True), prompts)


def test_a_failing_compile_falls_back_to_eager(compile_on, caplog, monkeypatch):
    """A toolchain that is present but broken: the warm-up compile raises; the engine
    still starts, its layers uncompiled, and says why."""
    def broken(self, kv_caches):
        raise RuntimeError("C++ compile failed: simulated")
    monkeypatch.setattr(cpu_compile.CpuCompiledStep, "warmup", broken)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = _tiny()
    runner = _runner(llm)
    assert runner.graphs is None
    assert "compiling the CPU decode step failed, decoding eagerly" in caplog.text
    assert all(layer._compiled_call_impl is None for layer in runner.model.model.layers)
    assert not isinstance(runner.step_builder.attn_builder,
                          cpu_compile.CompiledDecodeMetadataBuilder)
    assert _greedy(llm, _prompts((6,))) == _greedy(_tiny(enforce_eager=True), _prompts((6,)))
