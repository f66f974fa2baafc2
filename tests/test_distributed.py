"""Tensor parallelism on CPU with gloo: TP N gives TP 1's tokens and logprobs, through
the public LLM API, and a rank that dies ends the engine with a clear error."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvflow import LLM
from kvflow.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvflow.errors import DistributedError, InvalidParameterError
from kvflow.sampling_params import SamplingParams

PROMPTS = [[1, 5, 7, 9, 11, 13], [3, 4, 5], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)


def tiny(model: str, **kw) -> LLM:
    kw.setdefault("distributed_timeout", 30)
    return LLM(model, load_format="dummy", device="cpu", max_model_len=256,
               num_gpu_blocks_override=64, skip_tokenizer_init=True, seed=3, **kw)


def run(llm: LLM, params: SamplingParams = GREEDY):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_same(ref, got) -> None:
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        for lr, lg in zip(r.logprobs, g.logprobs):
            assert list(lr) == list(lg)  # same top-5 ids in the same order
            for tok in lr:
                assert lg[tok].logprob == pytest.approx(lr[tok].logprob, abs=1e-4)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_tp2_equals_tp1(model):
    with tiny(model) as one:
        ref = run(one)
    with tiny(model, tensor_parallel_size=2) as two:
        assert_same(ref, run(two))
        assert len(two.engine.core.executor.procs) == 1
        procs = two.engine.core.executor.procs
    assert all(p.proc.poll() == 0 for p in procs)  # clean exit, no orphan


# CI keeps one model with replicated KV heads; 4 ranks of the other is the slow variant.
@pytest.mark.parametrize("model", ["tiny-llama",
                                   pytest.param("tiny-qwen2", marks=pytest.mark.slow)])
def test_tp4_equals_tp1(model):
    """4 ranks: the KV heads (2 and 1) are replicated over the ranks."""
    with tiny(model) as one:
        ref = run(one)
    with tiny(model, tensor_parallel_size=4) as four:
        assert_same(ref, run(four))


def test_smollm2_tp3_equals_tp1(smollm2):
    """The real model: 9 heads and 3 KV heads over 3 ranks, its GGUF weights dequantized
    and narrowed (dense, like the fixture; test_tp_quantized.py keeps the blocks)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ref = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
    with LLM("smollm2-135m", device="cpu", max_model_len=256, num_gpu_blocks_override=32,
             quantization="none", tensor_parallel_size=3) as three:
        got = [o.outputs[0].token_ids for o in three.generate(prompts, params,
                                                               use_tqdm=False)]
    assert got == ref


def test_sampling_is_shared_by_the_ranks():
    """Random sampling happens on rank 0 only; the other ranks use its tokens, so a
    seeded request gives TP 1's tokens (the next step's input depends on them), alone
    or batched."""
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=12,
                            ignore_eos=True)
    with tiny("tiny-llama") as one:
        ref = [o.token_ids for o in run(one, params)]
    with tiny("tiny-llama", tensor_parallel_size=2) as two:
        assert [o.token_ids for o in run(two, params)] == ref
        # Alone as in the batch (issue 34): each request draws from its own generator.
        alone = two.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == ref[2]


def test_tensor_parallel_size_must_split_the_model():
    with pytest.raises(InvalidParameterError, match=r"possible sizes: \[1, 2, 4\]"):
        tiny("tiny-llama", tensor_parallel_size=3)


def test_step_message_round_trip():
    from kvflow.distributed.messages import ExecuteStep, StopWorkers, decode, encode

    so = SchedulerOutput(
        new_reqs=[NewRequestData("a", [1, 2, 3], 3, SamplingParams(temperature=0.5, seed=1,
                                                                   stop=["x"]), [4, 5], 0)],
        cached_reqs=[CachedRequestData("b", [9], 17)],
        num_scheduled_tokens={"a": 3, "b": 1}, total_num_scheduled_tokens=4,
        preempted_req_ids={"c"}, finished_req_ids={"d", "e"},
        blocks_to_swap_out=[(1, 2)], blocks_to_swap_in=[(3, 4)], blocks_to_copy=[(5, 6)])
    back = decode(encode(ExecuteStep(so)))
    assert back.sched == so
    assert isinstance(decode(encode(StopWorkers())), StopWorkers)


def test_killed_rank_ends_the_engine_with_a_clear_error():
    with tiny("tiny-llama", tensor_parallel_size=2, distributed_timeout=10) as llm:
        rank1 = llm.engine.core.executor.procs[0].proc
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        threading.Timer(1.0, os.kill, (rank1.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(DistributedError, match="rank 1 .* killed by SIGKILL"):
            while True:  # keep the engine busy until the kill lands
                llm.generate([[1, 2, 3]] * 4, long, use_tqdm=False)
        assert time.monotonic() - start < 15
        # The engine stays down and says why, without waiting on anything.
        with pytest.raises(DistributedError, match="killed by SIGKILL"):
            llm.generate([[1, 2]], GREEDY, use_tqdm=False)


def test_rank_dead_while_idle_is_noticed_at_the_next_step():
    with tiny("tiny-llama", tensor_parallel_size=2) as llm:
        rank1 = llm.engine.core.executor.procs[0].proc
        os.kill(rank1.pid, signal.SIGTERM)
        rank1.wait(10)
        with pytest.raises(DistributedError, match="rank 1 .* killed by SIGTERM"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_two_nodes_on_localhost():
    """Node 1 runs its rank from ``kvflow serve --node-rank 1`` (no HTTP server); node 0
    runs the engine here; together they give TP 1's tokens, and node 1 exits 0 when the
    engine stops."""
    import subprocess
    import sys

    from kvflow.distributed.launch import free_port

    port = free_port()
    common = ["tiny-llama", "--load-format", "dummy", "--device", "cpu",
              "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "serve", *common,
                              "--node-rank", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        with tiny("tiny-llama") as one:
            ref = run(one)
        with tiny("tiny-llama", tensor_parallel_size=2, nnodes=2, node_rank=0,
                  master_port=port) as llm:
            assert llm.engine.core.executor.procs == []  # rank 1 lives on node 1
            assert_same(ref, run(llm))
        out, _ = node1.communicate(timeout=30)
        assert node1.returncode == 0, out
        assert "ranks 1-1 wait for rank 0" in out and "Uvicorn" not in out
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_pipeline_parallel_equals_tp1(tp, pp):
    """Contiguous layer ranges per stage, hidden states and residual sent stage to stage;
    the last stage samples for everyone and sends rank 0 the logprobs; two batches in
    flight (one per stage)."""
    with tiny("tiny-qwen3") as one:
        ref = run(one)
    with tiny("tiny-qwen3", tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        assert_same(ref, run(llm))
