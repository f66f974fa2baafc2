"""Blocks behind a sliding window go back to the pool (pure Python, exact block ids):
a request of a model whose every layer is windowed holds window-sized memory; prefix
caching, forks and preemption stay correct."""

from __future__ import annotations

from kvflow.config import (CacheConfig, EngineConfig, ModelArchConfig, ModelConfig,
                           SchedulerConfig, SpeculativeConfig)
from kvflow.core import Scheduler
from kvflow.core.kv_cache_manager import KVCacheManager, freeable_window
from kvflow.models.registry import PRESETS

from test_scheduler import req, run_step

BS, WINDOW = 4, 8


def windowed_scheduler(num_blocks=32, budget=8, caching=False) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=128)
    return Scheduler(cfg, BS, num_blocks, enable_prefix_caching=caching,
                     sliding_window=WINDOW)


def live(s: Scheduler, rid: str) -> list[int]:
    return [b.block_id for b in s.kv._blocks[rid] if b is not None]


def test_a_long_request_holds_window_sized_memory():
    s = windowed_scheduler()
    s.add_request(req("a", 40, max_tokens=40))
    peak = 0
    for _ in range(60):
        r = s.requests["a"]
        start = r.num_computed_tokens  # the first query the step schedules
        run_step(s)
        if "a" not in s.requests or r.is_finished():
            break
        # Every block at or after that query's window start is still held...
        first = max(start - WINDOW + 1, 0) // BS
        held = s.kv._blocks["a"]
        assert all(b is not None for b in held[first:])
        assert all(b is None for b in held[:first])
        # ... and nothing before it: the window, the block it starts in, one chunk.
        peak = max(peak, len(live(s, "a")))
        assert s.kv.num_free_blocks == 32 - len(live(s, "a"))
    assert peak <= WINDOW // BS + 1 + 8 // BS + 1
    assert s.kv.num_window_freed >= 15
    assert s.kv.num_free_blocks == 32  # all back once finished


def test_table_positions_are_kept_for_the_worker():
    """The request's block ids stay at their positions (stale where freed): block i
    still means positions [i * BS, (i + 1) * BS) to the worker's table."""
    s = windowed_scheduler(budget=64)
    s.add_request(req("a", 30, max_tokens=4))
    so, _ = run_step(s)
    assert so.new_reqs[0].block_ids == list(range(8))
    run_step(s)  # position 30 reads keys 23..30: blocks 5..7; 0..4 are freed
    r = s.requests["a"]
    assert r.block_ids == list(range(8))
    assert live(s, "a") == [5, 6, 7]


def test_prefix_cache_hit_brings_the_blocks_the_window_needs():
    """A cached prefix is found from its first block on, so every block a hit hands out
    is live: freed blocks keep their hash and come back while not yet reused."""
    s = windowed_scheduler(budget=64, caching=True)
    s.add_request(req("a", 30, max_tokens=2))
    run_step(s)
    run_step(s)  # a frees its first blocks, then finishes
    s.add_request(req("b", 30, max_tokens=2))
    so, _ = run_step(s)
    b = s.requests["b"]
    assert so.num_scheduled_tokens == {"b": 2}  # 28 of 30 tokens from the cache
    assert b.num_cached_tokens == 28
    # Its queries (positions 28, 29) see 21.. on: blocks 5.. are live; 0..4, handed out
    # by the hit, go straight back.
    held = s.kv._blocks["b"]
    assert all(blk is not None for blk in held[5:]) and held[:5] == [None] * 5


def test_preemption_under_window_freeing_leaks_nothing():
    """Two requests in 5 blocks (each holds up to 4 behind its window): they run out, one is preempted (recompute) and
    resumes from scratch; every block is accounted for at every step."""
    s = windowed_scheduler(num_blocks=5, budget=8)
    s.add_request(req("a", 12, max_tokens=8, t=0))  # 20 tokens: admission allows 5 blocks
    s.add_request(req("b", 12, max_tokens=8, t=1))
    for _ in range(80):
        run_step(s)
        held = sum(len(live(s, r)) for r in s.kv._blocks)
        assert held + s.kv.num_free_blocks == 5
        if all(r.is_finished() for r in s.requests.values()) or not s.requests:
            break
    assert s.num_preemptions > 0
    assert s.kv.num_free_blocks == 5


def test_fork_does_not_share_freed_blocks():
    kv = KVCacheManager(32, BS, sliding_window=WINDOW)
    parent = req("p", 20, max_tokens=20)
    kv.allocate_slots(parent, 20)
    parent.num_computed_tokens = 20
    kv.allocate_slots(parent, 1)  # frees blocks 0..2 (positions 0..11)
    child = req("c", 10, max_tokens=4)  # would start at position 9: block 0 is gone
    assert kv.fork(parent, child, 20) == 0 and child.block_ids == []


def engine_config(preset: str, spec: SpeculativeConfig | None = None, **cache):
    arch = ModelArchConfig.from_hf_config(PRESETS[preset])
    model = ModelConfig(preset, None, "dummy", arch, "float32", 128)
    return EngineConfig(model, CacheConfig(**cache), speculative=spec)


def test_which_engines_free_blocks():
    assert freeable_window(engine_config("tiny-mistral-window")) == 8
    assert freeable_window(engine_config("tiny-phi3")) == 12
    # A full-attention layer needs every block: Gemma's local layers share the table.
    assert freeable_window(engine_config("tiny-gemma2")) is None
    assert freeable_window(engine_config("tiny-llama")) is None
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert freeable_window(engine_config("tiny-mistral-window", ngram)) == 8
    assert freeable_window(engine_config("tiny-mistral-window", kv_layout="contiguous",
                                         enable_prefix_caching=False)) is None


def test_plan_understands_windows():
    from kvflow.plan.gpus import get_gpu
    from kvflow.plan.planner import PlanInputs, build_plan

    def plan(name, **kw):
        arch = ModelArchConfig.from_hf_config(PRESETS[name])
        return build_plan(PlanInputs(name, arch, get_gpu("h200"), max_model_len=32768,
                                     **kw))

    # Mistral v0.1: a long request holds the window and a block, so more of them fit;
    # decode reads at most the window.
    long = dict(input_len=16384, output_len=16384)
    windowed, full = plan("mistral-7b-v0.1", **long), plan("mistral-7b", **long)
    assert windowed.model.held_tokens(32768, 16) == 4096 + 16
    assert windowed.max_batch == windowed.memory.num_blocks // (4112 // 16)
    assert windowed.max_batch > 7 * full.max_batch
    assert windowed.model.attended_context(20000) == 4096
    assert any("a request holds at most 4112 tokens" in n for n in windowed.notes)
    # Gemma 3: 40 of 48 layers local; the shared table holds everything for every layer.
    gemma = plan("gemma-3-12b", **long)
    assert gemma.model.held_tokens(32768, 16) == 32768
    assert gemma.model.attended_context(32768) == (40 * 1024 + 8 * 32768) / 48
    assert any("40 of 48 layers local (window 1024)" in n for n in gemma.notes)


def test_admission_counts_the_window_not_the_length():
    """A request longer than the whole cache is admitted when every layer is windowed (it
    holds at most its window plus one step's tokens) and runs to its end inside that
    cache; without a window, or with a step too large for the cache, it is refused."""
    import pytest

    from kvflow.core import check_request_fits
    from kvflow.errors import PromptTooLongError

    # window 8 + chunks of 8: at most 15 tokens over 5 blocks of 4; 60 tokens need 15
    assert check_request_fits(40, 20, 128, BS, 5, WINDOW, 8) == 20
    with pytest.raises(PromptTooLongError):
        check_request_fits(40, 20, 128, BS, 5)  # no window: all 15 blocks
    with pytest.raises(PromptTooLongError):
        check_request_fits(40, 20, 128, BS, 5, WINDOW, None)  # the prompt in one step
    s = windowed_scheduler(num_blocks=5, budget=8)
    s.add_request(req("a", 40, max_tokens=20))
    a = s.requests["a"]
    for _ in range(80):
        run_step(s)
        if a.is_finished():
            break
        assert len(live(s, "a")) + s.kv.num_free_blocks == 5
    assert a.is_finished() and a.num_output_tokens == 20
    assert s.num_preemptions == 0 and s.kv.num_free_blocks == 5
