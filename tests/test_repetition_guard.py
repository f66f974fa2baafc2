"""The repetition guard (kvflow/core/repetition.py) and the length defaults of a known
model file: exact loop detection, the scheduler ending a looping request with
stop_reason "repetition", the per-request and per-engine switches, and the registry
entry matched by the file rather than by the preset name."""

from __future__ import annotations

import os

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core import ModelRunnerOutput, Request, RequestStatus, Scheduler
from kvflow.core.repetition import CHECK_EVERY, MIN_CYCLES, loop_period
from kvflow.engine.args import EngineArgs
from kvflow.engine.processor import InputProcessor
from kvflow.errors import InvalidParameterError
from kvflow.models.registry import embedded_model_path, resolve_model
from kvflow.sampling_params import SamplingParams


def test_loop_period_finds_the_smallest_exact_period():
    prompt = [5] * 100  # a prompt that repeats itself is not the output's loop
    assert loop_period(prompt + [1, 2, 3], 100, 8) is None
    # One token 64 times: period 1 once the span reaches 64, not before.
    assert loop_period(prompt + [9] * 63, 100, 64) is None
    assert loop_period(prompt + [9] * 64, 100, 64) == 1
    # A 30-token stanza: needs MIN_CYCLES copies (90 tokens) even though 64 is less.
    stanza = list(range(100, 130))
    out = [1, 2] + stanza * (MIN_CYCLES - 1) + stanza[:-1]
    assert loop_period(out, 0, 64) is None
    assert loop_period(out + stanza[-1:], 0, 64) == 30
    # A stanza whose copies differ in one token is not an exact loop.
    varied = stanza * 3
    varied[45] = 999
    assert loop_period(varied, 0, 64) is None
    # 0 turns the guard off; a block of period 4 inside a longer text is found.
    assert loop_period([7] * 200, 0, 0) is None
    assert loop_period([3, 1] + [4, 5, 6, 7] * 20, 0, 64) == 4


def _run(sched: Scheduler, r: Request, tokens: list[int]) -> list:
    """Feed ``tokens`` one per step to a single request; the outputs of each step."""
    outs = []
    for t in tokens:
        so = sched.schedule()
        if not so.num_scheduled_tokens:
            break
        outs += sched.update_from_output(so, ModelRunnerOutput(
            req_ids=[r.request_id], sampled_token_ids=[[t]]))
        if r.is_finished():
            break
    return outs


def _sched() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                     max_model_len=512), 16, 64)


@pytest.mark.parametrize("params,stops_at", [
    (dict(repetition_guard=32), 32),  # 32 identical tokens, checked at multiples of 8
    (dict(repetition_guard=33), 40),  # caught at the next check after the span
    (dict(repetition_guard=32, min_tokens=50), 56),  # never before min_tokens
    (dict(repetition_guard=0), None),
    (dict(repetition_guard=None), None),  # unset at the scheduler: the engine fills it
    (dict(repetition_guard=32, ignore_eos=True), None),  # benches want every token
])
def test_scheduler_ends_a_looping_request(params, stops_at):
    s = _sched()
    r = Request("a", [11, 12, 13], SamplingParams(max_tokens=100, **params),
                eos_token_ids={2})
    s.add_request(r)
    outs = _run(s, r, [4] * 100)
    assert r.is_finished()
    if stops_at is None:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 100
        return
    assert r.num_output_tokens == stops_at and stops_at % CHECK_EVERY == 0
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", "repetition")


def test_sampling_params_validate_the_guard():
    for bad in (-1, 1.5, True, 1 << 20):
        with pytest.raises(InvalidParameterError, match="repetition_guard"):
            SamplingParams(repetition_guard=bad)


def test_engine_defaults_for_the_embedded_file():
    cfg = EngineArgs().create_engine_config().model
    assert (cfg.max_tokens_default, cfg.repetition_guard) == (1024, 64)
    line = cfg.generation_defaults_line()
    assert "max_tokens=1024 (from kvflow registry" in line and "repetition guard 64" in line
    # The operator's flags win; 0 means no cap / no guard.
    cfg = EngineArgs(max_tokens_default=0, repetition_guard=0).create_engine_config().model
    assert (cfg.max_tokens_default, cfg.repetition_guard) == (None, 0)
    assert "up to max_model_len; repetition guard off" in cfg.generation_defaults_line()
    assert EngineArgs(max_tokens_default=300).create_engine_config().model \
        .max_tokens_source == "--max-tokens-default"
    # Dummy weights loop by nature: no guard unless asked for.
    dummy = EngineArgs(model="tiny-llama", load_format="dummy").create_engine_config()
    assert (dummy.model.repetition_guard, dummy.model.max_tokens_default) == (0, None)
    for bad in (dict(max_tokens_default=-1), dict(repetition_guard=-1)):
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            EngineArgs(**bad).create_engine_config()


def test_processor_fills_the_guard_and_explicit_values_win():
    cfg = EngineArgs().create_engine_config()
    proc = InputProcessor(cfg, None, num_blocks=1000)
    p = proc.process("a", [1, 2], SamplingParams(max_tokens=None)).params
    assert (p.repetition_guard, p.max_tokens, p.temperature) == (64, 1024, 0.2)
    p = proc.process("b", [1], SamplingParams(max_tokens=5, repetition_guard=0)).params
    assert (p.repetition_guard, p.max_tokens) == (0, 5)


def test_registry_entry_follows_the_file_not_the_preset(tmp_path):
    real = embedded_model_path("smollm2-135m")
    by_path = resolve_model(real)
    assert by_path.generation_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert by_path.max_tokens_default == 1024
    # Renamed (a link under another name): the GGUF identity still matches.
    other = tmp_path / "my-model.gguf"
    os.symlink(real, other)
    renamed = resolve_model(str(other))
    assert renamed.generation_defaults == by_path.generation_defaults
    assert "SmolLM2" in renamed.generation_source
