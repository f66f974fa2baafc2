"""The per-batch sampling-metadata cache (worker/sampling_meta.py): reused while the same
requests sample, rebuilt when the batch changes, even under a reused request id."""

from __future__ import annotations

from kvflow import SamplingParams
from kvflow.engine.args import EngineArgs
from kvflow.engine.llm_engine import LLMEngine


def _engine() -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", load_format="dummy", device="cpu", max_model_len=128,
        num_gpu_blocks_override=64, block_size=4))


def _run(engine: LLMEngine, req_id: str, params: SamplingParams) -> list[int]:
    engine.add_request(req_id, {"prompt_token_ids": [5, 9, 11, 40, 2, 7]}, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens


def test_reused_request_id_gets_its_own_parameters():
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                            min_tokens=4, repetition_penalty=1.3)
    engine = _engine()
    first = _run(engine, "r", greedy)
    cache = engine.core.executor.runner.step_builder.sampling_cache
    assert cache.key == ("r",)  # the steady decode steps used the cache
    again = _run(engine, "r", seeded)  # same id, other parameters
    assert again == _run(_engine(), "r", seeded)
    assert again != first
    assert _run(engine, "r", greedy) == first
